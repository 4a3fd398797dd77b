"""Small real tokenizer folders, built locally, no hub.

:func:`make_tokenizer`: word-level, with a chat template; :func:`make_bpe`: a
byte-level BPE trained here, like GPT-2's (its regex pre-tokenizer, a BOS).
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [f"w{i}" for i in range(400)] + ["hello", "world", "system", "user", "assistant", ":"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def make_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "unk_token": "<unk>",
                "chat_template": TEMPLATE,
            }
        ),
        encoding="utf-8",
    )
    return folder


def make_bpe(folder: Path) -> Path:
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = Rust(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (Path(__file__).parent / "procs.py").read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}),
        encoding="utf-8",
    )
    return folder

"""kvoffload's KV-aware router: send each request to the worker with the lowest time to first token.

Layers, each saying one thing:

- :mod:`.hashing`: the engine's block hashes of a prompt, exactly as vLLM 0.33
  computes them (algorithm, NONE_HASH seed, ``cache_salt`` and LoRA extra keys).
- :mod:`.tokenize`: the engine's tokens of a request (the model's tokenizer and
  chat template, from a local path).
- :mod:`.index`: which blocks each worker can reach, per tier (GPU, CPU, node
  store, shared store), fed by KV events, the routing history and in-flight
  requests.
- :mod:`.model`: the TTFT model (queue + prefill of the missing tokens + reads
  per tier) with its online calibration.
- :mod:`.core`: the decision (modes EXACT / DEGRADED / FALLBACK, deadlines),
  free of HTTP and clocks so the simulator runs the same code.
- :mod:`.peers`: the peers' rules (SGLang, llm-d, Dynamo, Mooncake, …) for the
  simulator's comparison.
- :mod:`.config`, :mod:`.proxy`, :mod:`.cli`: the ``kvoffload router`` service.

The tenant-safety rule: a request is hashed under its own tenant's
``cache_salt`` (the router sets it; a client cannot choose another tenant's),
so it can only ever match KV that its own tenant's salt produced.
"""

from __future__ import annotations

from .core import Candidate, Decision, Mode, Router, Ticket, Topology, WorkerInfo
from .hashing import BlockHasher, external_hash
from .index import Location, PrefixIndex, SourceState, Tier, TierMatch
from .model import Estimate, Priors, TTFTModel, WorkerLoad

__all__ = [
    "BlockHasher",
    "Candidate",
    "Decision",
    "Estimate",
    "Location",
    "Mode",
    "PrefixIndex",
    "Priors",
    "Router",
    "SourceState",
    "TTFTModel",
    "Ticket",
    "Tier",
    "TierMatch",
    "Topology",
    "WorkerInfo",
    "WorkerLoad",
    "external_hash",
]

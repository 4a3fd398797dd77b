"""A request body: parsed once, forwarded as the client's bytes, the tenant's salt spliced in.

What the worker is sent must parse (with the standard library, as vLLM's
server parses it) to what the router routed on, with exactly the salt the
router hashed under, whatever the client's bytes looked like.
"""

from __future__ import annotations

import json

import pytest

from kvoffload.router.body import BadBody, forwarded, parse_body

SALT = "tenant-salt-0123"


def pairs(raw: bytes) -> list[tuple[str, object]]:
    """The object's members in order, duplicates kept (``json.loads`` keeps the last)."""
    got: list[tuple[str, object]] = json.loads(raw, object_pairs_hook=lambda kv: kv)
    return got


def test_an_unchanged_body_goes_out_as_the_bytes_that_came_in() -> None:
    raw = b'{"model":"m",  "prompt":[1,2,3], "x":"\xc3\xa9\\u00e9", "n": 1.50}'
    body = parse_body(raw)
    assert body.plain and body.data["prompt"] == [1, 2, 3]
    assert forwarded(body, None) is raw
    client_salt = parse_body(b'{"prompt":"hi","cache_salt":"own"}')
    assert forwarded(client_salt, "own") is client_salt.raw  # no tenants: the client's salt


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","prompt":[1,2]}',
        b' \r\n\t{ "prompt" : "text \xe2\x9c\x93" , "nested": {"cache_salt": "not top"} } \n',
        b'{"a":1,"a":2}',
    ],
)
def test_the_tenants_salt_is_spliced_in_as_the_only_one(raw: bytes) -> None:
    body = parse_body(raw)
    out = forwarded(body, SALT)
    members = pairs(out)
    assert [v for k, v in members if k == "cache_salt"] == [SALT]
    assert json.loads(out) == {**json.loads(raw), "cache_salt": SALT}
    assert body.data["cache_salt"] == SALT


def test_a_body_naming_its_own_salt_is_re_encoded_with_the_router_s() -> None:
    # Two members named cache_salt in the client's bytes: the router must not
    # leave either for the engine to choose between.
    raw = b'{"prompt":[1],"cache_salt":"alice","cache_salt":"alice2"}'
    body = parse_body(raw)
    out = forwarded(body, f"{SALT}:alice2")
    assert [v for k, v in pairs(out) if k == "cache_salt"] == [f"{SALT}:alice2"]
    escaped = parse_body(b'{"prompt":[1],"cache\\u005fsalt":"x"}')  # the same key, escaped
    assert escaped.salted
    assert pairs(forwarded(escaped, SALT)) == [("prompt", [1]), ("cache_salt", SALT)]


def test_an_empty_object_gets_a_member_not_a_dangling_comma() -> None:
    out = forwarded(parse_body(b"{}"), SALT)
    assert json.loads(out) == {"cache_salt": SALT}


def test_what_only_the_standard_library_reads_is_re_encoded_as_utf8() -> None:
    for raw in (
        '{"prompt": "h\u00e9"}'.encode("utf-16"),
        b'\xef\xbb\xbf{"prompt": "hi"}',
        b'{"prompt": "hi", "t": NaN}',
        b'{"prompt": "\\ud800"}',
    ):
        body = parse_body(raw)
        assert not body.plain
        out = forwarded(body, None)
        assert out == json.dumps(json.loads(raw)).encode()  # UTF-8 (ASCII-escaped) JSON


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
        (b'{"n": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    ],
)
def test_a_bad_body_is_one_line(raw: bytes, says: str) -> None:
    with pytest.raises(BadBody, match=says):
        parse_body(raw)

"""Sizes and durations, parsed and printed the one way every kvoffload setting uses.

Sizes: an integer is bytes; a string is a number and a unit, binary (``KiB``,
``MiB``, ``GiB``, ``TiB``, ``PiB``) or decimal (``KB`` … ``PB``) or ``B``:
``"512MiB"``, ``"2TB"``, ``"1.5GiB"``. Durations: a number is seconds; a
string is a number and ``ms``, ``s``, ``m``, ``h`` or ``d``: ``"500ms"``,
``"15m"``, ``"7d"``. ``"none"`` is "no limit" (None) wherever it is allowed.

``require_unit`` refuses a bare number (``quota = 10``: bytes? GiB?); the
policy file wants that. Errors are :class:`~kvoffload.errors.ConfigError`
(a ``ValueError``) whose message says what was wrong and shows examples.
Standard library only.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Final

from .errors import ConfigError


def age_cutoff_ns(now_ns: int, age_s: float) -> int:
    """``now_ns`` less ``age_s`` seconds: chunks created before it are older than
    ``age_s``. An age reaching back past the Unix epoch (1e300 s, say: any
    finite number is a valid age, protocol-v1.md §5.17) is clamped there, so
    that nothing is older and everything is newer."""
    back = age_s * 1e9
    return now_ns - int(back) if back < now_ns else 0


__all__ = [
    "DURATION_UNITS",
    "SIZE_UNITS",
    "age_cutoff_ns",
    "duration_setting",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
    "size_setting",
]

SIZE_UNITS: Final[dict[str, int]] = {
    "B": 1,
    **{f"{p}iB": 1024 ** (i + 1) for i, p in enumerate("KMGTP")},
    **{f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGTP")},
}
DURATION_UNITS: Final[dict[str, float]] = {
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_SIZE_RE: Final = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[KMGTP]i?B|B)?\s*$")
_DURATION_RE: Final = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?\s*$")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def parse_size(
    value: object,
    *,
    require_unit: bool = False,
    allow_none: bool = True,
    whole: bool = False,
    what: str = "size",
) -> int | None:
    """``"200GiB"`` → bytes; an int is bytes; ``"none"`` → None.

    ``whole``: refuse a size that is not a whole number of bytes (``"1.5B"``);
    otherwise it is rounded down."""
    if allow_none and (value is None or value == "none"):
        return None
    if not require_unit and isinstance(value, int) and _number(value):
        return int(value)
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None or (require_unit and m["unit"] is None):
        none = ' or "none"' if allow_none else ""
        raise ConfigError(
            f"bad {what} {value!r}: a number and a unit (B, KiB, MiB, GiB, TiB, PiB or "
            f'KB, MB, GB, TB, PB), e.g. "512MiB", "2TB"{none}'
            + ("" if require_unit else ", or a number of bytes")
        )
    size = Fraction(m["num"]) * SIZE_UNITS[m["unit"] or "B"]
    if whole and size.denominator != 1:
        raise ConfigError(f"{what} {value!r} is not a whole number of bytes")
    return int(size)


def parse_duration(
    value: object,
    *,
    require_unit: bool = False,
    allow_none: bool = True,
    what: str = "duration",
) -> float | None:
    """``"30s"``, ``"15m"``, ``"7d"`` → seconds; a number is seconds; ``"none"`` → None."""
    if allow_none and (value is None or value == "none"):
        return None
    if not require_unit and _number(value):
        return float(value)  # type: ignore[arg-type]
    m = _DURATION_RE.match(value) if isinstance(value, str) else None
    if m is None or (require_unit and m["unit"] is None):
        none = ' or "none"' if allow_none else ""
        raise ConfigError(
            f"bad {what} {value!r}: a number and a unit (ms, s, m, h, d), "
            f'e.g. "500ms", "30s", "15m", "7d"{none}'
            + ("" if require_unit else ", or a number of seconds")
        )
    return float(m["num"]) * DURATION_UNITS[m["unit"] or "s"]


def format_size(n: int | None) -> str:
    """Bytes for people: ``"512 B"``, ``"1.5 GiB"``; None is ``"unlimited"``."""
    if n is None:
        return "unlimited"
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if f < 1024 or unit == "TiB":
            return f"{int(f)} B" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_duration(seconds: float | None) -> str:
    """Seconds for people: ``"250 ms"``, ``"30 s"``, ``"15 m"``, ``"2.5 h"``, ``"7 d"``."""
    if seconds is None:
        return "none"
    for unit, scale in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e3:.3g} ms"


def duration_setting(seconds: float | None) -> str:
    """A duration as a config or policy file writes it, which :func:`parse_duration`
    reads back: ``"12h"``, ``"1.5h"``, ``"30s"``, ``"5ms"``; None is ``"none"``."""
    if seconds is None:
        return "none"
    if seconds == 0:
        return "0s"
    for unit in ("d", "h", "m", "s"):
        q = seconds / DURATION_UNITS[unit]
        if q >= 1 and abs(q - round(q, 3)) < 1e-9:
            return f"{_plain(q)}{unit}"
    return f"{_plain(seconds * 1e3)}ms"


def _plain(x: float) -> str:
    """At most 3 decimals, no exponent: ``1.5``, ``12``, ``1542720``."""
    return f"{x:.3f}".rstrip("0").rstrip(".")


def size_setting(n: int | None) -> str:
    """A size as a config or policy file writes it: ``"10GiB"``, ``"1.5MiB"``, ``"100B"``
    (exact: :func:`parse_size` reads back the same bytes); None is ``"none"``."""
    if n is None:
        return "none"
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        q = Fraction(n, SIZE_UNITS[unit])
        if q >= 1 and (q * 1000).denominator == 1:
            return f"{_plain(float(q))}{unit}"
    return f"{n}B"

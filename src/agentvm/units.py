"""Parsing of human units: sizes (``256M``, ``2G``) and durations (``30s``, ``5m``).

Pure and dependency-free so the CLI's fast path can use it without importing pydantic.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}

_DUR_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", re.IGNORECASE)
_DUR_MULT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: str | int) -> int:
    """``"256M"`` -> 268435456. Binary multiples (``M`` = MiB). Plain ints are bytes."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number or a string like '256M'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}: use bytes or a suffix K, M, G, T (e.g. '256M')")
    num = float(m.group(1))
    return int(num * _SIZE_MULT[m.group(2).lower()])


def parse_duration(value: str | int | float) -> float:
    """``"1m30s"`` -> 90.0 seconds. Plain numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number or a string like '30s'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    text = str(value).strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    pos = 0
    total = 0.0
    for m in _DUR_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DUR_MULT[m.group(2).lower()]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"invalid duration {value!r}: use e.g. '30s', '5m', '1h30m', '250ms'")
    return total


def parse_since(value: str | int | float, now: float | None = None) -> float:
    """A point in time as the CLI and the API take it: a Unix time (a number above 10^9), a
    duration meaning that long ago (``10m``, ``2h``, ``1d``), or an ISO 8601 date/time
    (``2026-11-23``, ``2026-11-23T14:00:00``, local time unless it carries an offset)."""
    import time as _time

    now = _time.time() if now is None else now
    text = str(value).strip()
    try:
        n = float(text)
    except ValueError:
        n = None
    if n is not None and n != n:  # NaN
        raise ValueError(f"invalid time {value!r}")
    if n is not None and n >= 1e9:
        return n
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    from datetime import datetime

    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"invalid time {value!r}: use a Unix time, a duration ago (10m, 2h, 1d) or an ISO date") from None


def format_size(n: int) -> str:
    for unit, mult in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def format_duration(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{seconds:g}s"

"""Names as policy compares them: one normal form, one glob match, one look-alike test.

Every rule that names something - a tool glob (``allow``, ``deny``, ``approve``, ``risk``,
``arguments``), a tool server, a preset - is compared with :func:`norm` of both sides, so
``ADMIN_RESET`` is the ``*admin*`` a deny rule names, and ``ｎｏｔｅｓ`` (fullwidth) is the
server ``notes``. :func:`norm` is NFKC, then Unicode case folding, then NFKC again (case
folding can leave a string that NFKC changes once more; the second pass makes it a fixed
point: ``norm(norm(x)) == norm(x)``).

Hosts are not compared here: the egress gate has its own normal form for them
(``gate.policy.normalize_host``: IDNA to A-labels, lower case, no trailing dot), which is
what DNS means by the same name; a host rule and a host asked for are both put in that form
before any comparison (see ``docs/egress.md``).

:func:`skeleton` is the confusable skeleton of Unicode Technical Standard #39 (section 4,
"Confusable Detection"): NFD, each character replaced by its prototype from the Unicode
confusables data, NFD again. Two strings with the same skeleton look alike. The data is
``_confusables.py``, generated from ``confusables.txt`` (``python -m agentvm.names generate
confusables.txt > src/agentvm/_confusables.py``; the file names the version and SHA-256 of its
source). :func:`looks_like` adds what the skeleton leaves apart but a reader does not: case,
compatibility forms, format characters, spaces, any dash, and Latin small capitals (UTS #39
keeps ``ᴀ`` apart from ``a``) - and, before all of it, every Default_Ignorable_Code_Point
(``_ignorable.py``, generated from Unicode's ``DerivedCoreProperties.txt``: variation
selectors, the combining grapheme joiner, the Hangul fillers, tags...) and U+2800 BRAILLE
PATTERN BLANK, which show nothing.

Input is bounded before any of it: NFKC can make a string 18 times longer (U+FDFA), so
:func:`norm` refuses (``ValueError``) a string over :data:`MAX_NAME` characters without
normalising it, :func:`same` and :func:`find` say no for one, and :func:`match` /
:func:`first_match` raise (every caller in the tool policy turns an exception into a deny).
No name a rule compares is anywhere near that long (a tool name is at most 128 characters).
"""

from __future__ import annotations

import sys
import unicodedata
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Iterable

_NFKC = "NFKC"
MAX_NAME = 1024  # characters: a longer string is never normalised (NFKC can expand it 18-fold)


class NameTooLong(ValueError):
    """A string over :data:`MAX_NAME` characters was given where a name is compared."""


def norm(name: str) -> str:
    """The form every name is compared in: NFKC, case folded, NFKC again. Raises
    :class:`NameTooLong` (a ValueError) for a string over :data:`MAX_NAME` characters, before
    any normalisation."""
    if len(name) > MAX_NAME:
        raise NameTooLong(f"a name of {len(name)} characters (at most {MAX_NAME})")
    return unicodedata.normalize(_NFKC, unicodedata.normalize(_NFKC, name).casefold())


def _fits(*xs) -> bool:
    return all(isinstance(x, str) and len(x) <= MAX_NAME for x in xs)


def same(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same name to a rule (never, for a string over :data:`MAX_NAME`)."""
    return _fits(a, b) and norm(a) == norm(b)


@lru_cache(maxsize=4096)
def _norm_glob(glob: str) -> str:
    return norm(glob)


def match(name: str, glob: str) -> bool:
    """``fnmatchcase`` of the normal forms (``*``, ``?``, ``[...]`` as in fnmatch)."""
    return fnmatchcase(norm(name), _norm_glob(glob))


def first_match(globs: Iterable[str], name: str) -> str | None:
    """The first of ``globs`` that matches ``name`` (normal forms), or None."""
    n = norm(name)
    for g in globs:
        if fnmatchcase(n, _norm_glob(g)):
            return g
    return None


def find(items: Iterable, name: str, key=lambda x: x.name):
    """The item whose ``key`` is ``name`` in normal form, or None."""
    if not _fits(name):
        return None
    n = norm(name)
    for it in items:
        if norm(key(it)) == n:
            return it
    return None


# ---------------------------------------------------------------------------- look-alikes
@lru_cache(maxsize=1)
def _table() -> dict[str, str]:
    from agentvm._confusables import DATA

    out = {}
    for line in DATA.split("\n"):
        if line:
            src, _, proto = line.partition(" ")
            out[chr(int(src, 16))] = "".join(chr(int(p, 16)) for p in proto.split())
    return out


def skeleton(s: str) -> str:
    """UTS #39 skeleton(X): NFD, each character replaced by its confusables prototype, NFD."""
    table = _table()
    x = unicodedata.normalize("NFD", s)
    return unicodedata.normalize("NFD", "".join(table.get(c, c) for c in x))


def _small_capital(c: str) -> str:
    name = unicodedata.name(c, "")
    if name.startswith("LATIN LETTER SMALL CAPITAL ") and len(name) == len("LATIN LETTER SMALL CAPITAL ") + 1:
        return name[-1].lower()
    return c


def _ascii_reading(c: str) -> str:
    """One character as a reader of an ASCII name takes it: its skeleton (a small capital as
    its letter), else the skeleton of its upper case (Cyrillic ``м`` reads as ``M``), whichever
    is ASCII first; else its own skeleton."""
    for cand in (skeleton(_small_capital(c)), skeleton(c.upper())):
        cand = norm(cand)
        if cand.isascii():
            return cand
    return norm(skeleton(c))


MAX_READING = 128  # a longer name (once invisible characters and spaces are gone) is no short name's look-alike


@lru_cache(maxsize=1)
def _ignorable() -> frozenset[int]:
    from agentvm._ignorable import RANGES

    out = set(_BLANKS)
    for lo, hi in RANGES:
        out.update(range(lo, hi + 1))
    return frozenset(out)


# shown as nothing, yet neither format characters nor Default_Ignorable_Code_Points
_BLANKS = (0x2800,)  # BRAILLE PATTERN BLANK (the Hangul fillers U+115F U+1160 U+3164 U+FFA0 are ignorables)


def invisible(c: str) -> bool:
    """``c`` shows nothing: a format character (Cf), a Default_Ignorable_Code_Point or U+2800."""
    return ord(c) in _ignorable() or unicodedata.category(c) == "Cf"


def _visible(s: str) -> str:
    return "".join(c for c in "".join(s.split()) if not invisible(c))


def reading(s: str) -> str | None:
    """What a reader takes ``s`` for: invisible characters (format characters - zero-width,
    bidi marks -, every Default_Ignorable_Code_Point - variation selectors, the combining
    grapheme joiner, the Hangul fillers, tags -, U+2800) and spaces dropped, compatibility
    forms and case folded (:func:`norm`), every dash a hyphen-minus, each character read as in
    :func:`_ascii_reading` - then the UTS #39 skeleton of the whole. None for a string too long
    to be a look-alike of a name: over :data:`MAX_NAME` characters as given, or over
    :data:`MAX_READING` once the invisible ones and spaces are gone - both checked BEFORE it is
    normalised (a caller that must fail closed, such as the OTLP relay, refuses the first)."""
    s = s or ""
    if len(s) > MAX_NAME:
        return None
    s = _visible(s)
    if len(s) > MAX_READING:
        return None
    s = _visible(norm(s))  # (NFKC can make spaces and ignorables: U+FFA0 -> U+1160)
    if len(s) > MAX_READING:
        return None
    s = "".join("-" if unicodedata.category(c) == "Pd" else _ascii_reading(c) for c in s)
    return norm(skeleton(s))


def looks_like(s: str, *names: str) -> bool:
    """``s`` is, to a reader, one of ``names`` (the same :func:`reading`)."""
    r = reading(s)
    return r is not None and any(r == reading(n) for n in names)


# ---------------------------------------------------------------------------- generating the table
def generate(src: str) -> str:
    """``_confusables.py`` from a ``confusables.txt`` (the Unicode security data file)."""
    import hashlib

    raw = open(src, "rb").read()
    text = raw.decode("utf-8-sig")
    version = date = "?"
    rows = []
    for line in text.splitlines():
        if line.startswith("# Version:"):
            version = line.split(":", 1)[1].strip()
        elif line.startswith("# Date:"):
            date = line.split(":", 1)[1].strip()
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        parts = [p.strip() for p in body.split(";")]
        if len(parts) < 3:
            continue
        rows.append(f"{parts[0]} {parts[1]}")
    head = (f'"""Generated by ``python -m agentvm.names generate confusables.txt``: do not edit.\n\n'
            f"Source: Unicode confusables.txt (UTS #39 security data), version {version}, dated {date},\n"
            f"https://www.unicode.org/Public/security/{version}/confusables.txt\n"
            f"SHA-256 of the source: {hashlib.sha256(raw).hexdigest()}\n"
            f"{len(rows)} mappings: SOURCE PROTOTYPE... (hexadecimal code points), one a line.\n"
            "Unicode data is (c) Unicode, Inc., under the Unicode License v3 (https://www.unicode.org/license.txt).\n"
            '"""\n\n')
    return head + 'DATA = """\\\n' + "\n".join(rows) + '\n"""\n'


def generate_ignorable(src: str) -> str:
    """``_ignorable.py`` from a ``DerivedCoreProperties.txt``: its Default_Ignorable_Code_Point ranges."""
    import hashlib

    raw = open(src, "rb").read()
    text = raw.decode("utf-8-sig")
    first = text.splitlines()[0].lstrip("# ").strip() if text else "?"
    date = "?"
    ranges = []
    for line in text.splitlines():
        if line.startswith("# Date:"):
            date = line.split(":", 1)[1].strip()
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        cps, _, prop = (p.strip() for p in body.partition(";"))
        if prop != "Default_Ignorable_Code_Point":
            continue
        lo, _, hi = cps.partition("..")
        ranges.append((int(lo, 16), int(hi or lo, 16)))
    rows = "\n".join(f"    (0x{lo:04X}, 0x{hi:04X})," for lo, hi in ranges)
    return (f'"""Generated by ``python -m agentvm.names ignorables DerivedCoreProperties.txt``: do not edit.\n\n'
            f"Source: Unicode {first}, dated {date}\n"
            "(the Unicode Character Database; Debian's unicode-data package installs it as\n"
            "/usr/share/unicode/DerivedCoreProperties.txt).\n"
            f"SHA-256 of the source: {hashlib.sha256(raw).hexdigest()}\n"
            f"{len(ranges)} ranges of Default_Ignorable_Code_Point, (first, last) inclusive.\n"
            "Unicode data is (c) Unicode, Inc., under the Unicode License v3 (https://www.unicode.org/license.txt).\n"
            '"""\n\nRANGES = (\n' + rows + "\n)\n")


if __name__ == "__main__":  # pragma: no cover - the generators
    if len(sys.argv) == 3 and sys.argv[1] == "generate":
        sys.stdout.write(generate(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "ignorables":
        sys.stdout.write(generate_ignorable(sys.argv[2]))
    else:
        sys.exit("usage: python -m agentvm.names generate confusables.txt > src/agentvm/_confusables.py\n"
                 "       python -m agentvm.names ignorables DerivedCoreProperties.txt > src/agentvm/_ignorable.py")

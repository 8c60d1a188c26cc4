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
keeps ``ᴀ`` apart from ``a``).
"""

from __future__ import annotations

import sys
import unicodedata
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Iterable

_NFKC = "NFKC"


def norm(name: str) -> str:
    """The form every name is compared in: NFKC, case folded, NFKC again."""
    return unicodedata.normalize(_NFKC, unicodedata.normalize(_NFKC, name).casefold())


def same(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same name to a rule."""
    return isinstance(a, str) and isinstance(b, str) and norm(a) == norm(b)


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
    if not isinstance(name, str):
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


MAX_READING = 128  # a longer name (once format characters and spaces are gone) is no short name's look-alike


def reading(s: str) -> str | None:
    """What a reader takes ``s`` for: format characters (zero-width, bidi marks) and spaces
    dropped, compatibility forms and case folded (:func:`norm`), every dash a hyphen-minus,
    each character read as in :func:`_ascii_reading` - then the UTS #39 skeleton of the
    whole. None for a string too long to be a look-alike of a name."""
    s = "".join(c for c in (s or "") if unicodedata.category(c) != "Cf")
    s = "".join(norm(s).split())
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


if __name__ == "__main__":  # pragma: no cover - the generator
    if len(sys.argv) == 3 and sys.argv[1] == "generate":
        sys.stdout.write(generate(sys.argv[2]))
    else:
        sys.exit("usage: python -m agentvm.names generate confusables.txt > src/agentvm/_confusables.py")

"""Compiled code for the methods ``dataclasses`` generates, kept from one run to the next.

Every ``@dataclass`` writes the source of its ``__init__``, ``__repr__``, ``__eq__``,
``__hash__`` (and, frozen, ``__setattr__``/``__delattr__``) and compiles it when its module is
imported. A run of ``agentvm run -- true`` imports 38 of them: about 15 ms of compiling, the
largest single cost of the CLI's start-up after the interpreter itself (docs/architecture.md,
"Start-up budget"). Python keeps the byte code of modules in ``.pyc`` files; nothing keeps
this code. This module does, the same way:

* ``python -c 'from agentvm import codecache; codecache.main(["build"])'``
  (``scripts/install.sh`` runs it, after ``compileall``) imports every module of the package
  and keeps the code each generated source compiles to, keyed by the module and that exact
  source text, in ``_codecache/<cache tag>.marshal`` next to this file, with the
  interpreter's byte-code magic number in front. A process unpacks only the tables of the
  modules it imports.
* ``install()`` (from ``agentvm/__init__``) gives ``dataclasses`` an ``exec`` that takes the
  kept code for a source it has seen and compiles any other, as ``exec`` would. The code is
  the same either way: it is what ``compile`` made of that very text (never inheriting this
  module's ``__future__`` flags, as ``exec`` in ``dataclasses`` does not).
* The file is code, as a ``.pyc`` is: it is read only when it is a regular file owned by
  root or by this user that neither it nor its folder lets anyone else write, and only when
  its magic number is this interpreter's. Otherwise nothing is installed and every dataclass
  compiles its methods as before: the same classes, slower. Nothing is ever written at run
  time.
"""

import builtins
import marshal
import os
import stat
import sys

from _frozen_importlib_external import MAGIC_NUMBER

HERE = os.path.dirname(os.path.abspath(__file__))
DIR = os.path.join(HERE, "_codecache")
FILE = os.path.join(DIR, f"{sys.implementation.cache_tag}.marshal")

_CODE_TYPE = type(compile("", "<string>", "exec"))
_packed: dict[str, memoryview] = {}  # module name -> its table, marshalled (unpacked on first use)
_code: dict[str | None, dict[str, object]] = {}  # module name -> {source text: its code}
_recording: dict[str, object] | None = None  # build(): every source compiled meanwhile
_installed = False


def _exec(source, globals=None, locals=None, /):
    """``exec`` as ``dataclasses`` calls it (with the globals of the class's module), with the
    kept code of a source already seen."""
    if type(source) is str:
        module = globals.get("__name__") if type(globals) is dict else None
        table = _code.get(module)
        if table is None:
            table = _code[module] = _module_table(module)
        code = table.get(source)
        if code is None:
            code = compile(source, "<string>", "exec", dont_inherit=True)
        if _recording is not None:
            _recording.setdefault(module, {})[source] = code
        source = code
    return builtins.exec(source, globals, locals)


def _module_table(module) -> dict:
    """One module's kept code, unpacked when that module first defines a dataclass (the file
    holds every module's: only those a process imports are unpacked)."""
    raw = _packed.pop(module, None) if type(module) is str else None
    if raw is None:
        return {}
    try:
        table = marshal.loads(raw)
    except (EOFError, ValueError, TypeError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if type(k) is str and type(v) is _CODE_TYPE}


def untrusted(path: str = FILE) -> str | None:
    """Why ``path`` must not be loaded as code (None: it may): a regular file, not a link, owned
    by root or this user, that neither it nor its folder lets another user write. (The rule
    for every file agent-vm runs as code: gate.accel's compiled modules too.)"""
    me = os.geteuid()
    for p, want_dir in ((os.path.dirname(path), True), (path, False)):
        try:
            st = os.lstat(p)
        except OSError as exc:
            return f"{p}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{p} is a symbolic link"
        if stat.S_ISDIR(st.st_mode) != want_dir or (not want_dir and not stat.S_ISREG(st.st_mode)):
            return f"{p} is not a {'folder' if want_dir else 'regular file'}"
        if st.st_uid not in (0, me):
            return f"{p} is owned by uid {st.st_uid}, not root or this user"
        if st.st_mode & 0o022:
            return f"{p} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def load(path: str = FILE) -> dict[str, memoryview]:
    """The kept code in ``path``, per module and still marshalled, or {} (absent, untrusted,
    another interpreter's, damaged). The file: the magic number, the length of the index, the
    index (marshalled: module name -> (offset, length) of its table), then the tables: a start
    reads it whole in one call and unpacks the index only."""
    if untrusted(path) is not None:
        return {}
    n = len(MAGIC_NUMBER)
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:n] != MAGIC_NUMBER:
            return {}
        size = int.from_bytes(data[n:n + 4], "little")
        index = marshal.loads(data[n + 4:n + 4 + size])
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    if not isinstance(index, dict):
        return {}
    view, base, out = memoryview(data), n + 4 + size, {}
    for module, span in index.items():
        if type(module) is str and type(span) is tuple and len(span) == 2:
            off, length = span
            if type(off) is int and type(length) is int and 0 <= off and 0 < length <= len(data) - base - off:
                out[module] = view[base + off:base + off + length]
    return out


def install() -> bool:
    """Give ``dataclasses`` the kept code, if there is any to trust. True if installed."""
    global _installed
    if _installed:
        return True
    if os.environ.get("AGENTVM_NO_CODECACHE"):
        return False
    packed = load()
    if not packed:
        return False
    import dataclasses

    _packed.update(packed)
    dataclasses.exec = _exec  # (module globals come before builtins: its calls of exec find this)
    _installed = True
    return True


def build(path: str = FILE) -> int:
    """Import every module of the package, keep the code of every source ``dataclasses``
    compiled meanwhile (per module), and write it to ``path`` (atomically, mode 0644).
    Returns how many sources were kept."""
    global _recording
    import dataclasses
    import importlib
    import pkgutil

    _recording = {}
    saved = dataclasses.__dict__.get("exec")
    dataclasses.exec = _exec
    try:
        for m in pkgutil.walk_packages([HERE], "agentvm."):  # (this package's folder)
            if m.name.endswith("__main__") or m.name in sys.modules:
                continue
            try:
                importlib.import_module(m.name)
            except Exception:  # noqa: BLE001 - a module that needs an optional extra: its classes are compiled at run time
                pass
        # (what the package generates now: no entry of an older build is carried over)
        tables = {m: marshal.dumps(t) for m, t in _recording.items() if type(m) is str}
        count = sum(len(t) for m, t in _recording.items() if type(m) is str)
    finally:
        _recording = None
        if saved is None and not _installed:
            del dataclasses.exec
    index, off = {}, 0
    for m, raw in tables.items():
        index[m] = (off, len(raw))
        off += len(raw)
    head = marshal.dumps(index)
    from pathlib import Path

    from agentvm.fsutil import write_atomic

    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    write_atomic(Path(path), MAGIC_NUMBER + len(head).to_bytes(4, "little") + head + b"".join(tables.values()), 0o644)
    return count


def status() -> dict:
    """For ``agentvm doctor``: whether the kept code is in use, and why not."""
    why = untrusted()
    return {"file": FILE, "installed": _installed, "modules": len(_packed) + len(_code),
            "reason": "in use" if _installed else ("AGENTVM_NO_CODECACHE is set" if os.environ.get("AGENTVM_NO_CODECACHE")
                                                   else why or "another interpreter's, or damaged: rebuild it")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["build"]:
        print("usage: python -c 'from agentvm import codecache; codecache.main([\"build\"])'", file=sys.stderr)
        return 2
    n = build()
    if "--quiet" not in argv:
        print(f"agentvm.codecache: {n} generated methods kept in {FILE}")
    return 0


"""The gate's hot path, compiled: Cython builds of its own modules, from the very same source.

Every request through the gate runs a dozen pieces of Python of 2-6 us each (the strict head
parser, ``decide()``, the exchange, the relay, the decision record); no one piece is a hot
spot, so the interpreter itself is the cost. Compiling the modules in ``COMPILED`` unchanged
with Cython (``annotation_typing`` off: a type hint is never turned into a check Python would
not make) takes about a quarter off the gate's instructions per request (``bench/README.md``).
A module's ``.pxd``, where there is one, lays its hot classes out in C for Cython (attributes
in the object, not in a dict; a ``__dict__`` and weak references kept, as in Python): it is
compiled with the ``.py`` and keyed with it.

* ``python -m agentvm.gate build`` (``scripts/install.sh`` runs it) compiles each module
  into ``_accel/`` next to it, one file per module named after the SHA-256 of the source it
  was built from and this build's settings, and after its own size (a file cut short is never
  loaded: it could crash the loader). Nothing is written into the source tree's own modules,
  and a compiled file can never stand in for a source it was not built from.
* ``agentvm.gate`` installs ``Finder`` first on ``sys.meta_path``: importing one of these
  modules loads the compiled file only when it matches the ``.py`` as it is now, is a regular
  file owned by root or by us, and neither it nor its folder is writable by anyone else (a
  shared library is code). Otherwise the ``.py`` is imported as before: the same code,
  slower. ``AGENTVM_GATE_PURE=1`` forces the ``.py`` (profiling, and the pure-Python half of
  the test suite).
* ``status()`` says, per module, which one runs and why; ``agentvm doctor`` shows it.

Speed only: the policy, the parsers and every check are the same source either way, and the
test suite runs against both (``scripts/test.sh``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import stat
import sys
from pathlib import Path

# The request path's modules: pure Python with no import-time tricks (frozen.py generates code
# at run time and is left alone; the rest of the package is off the per-request path).
COMPILED = ("streams", "server", "relay", "exchange", "h1", "framing", "policy", "endpoint",
            "tls", "credentials", "encoding", "tunnel")
PACKAGE = __name__.rpartition(".")[0]
HERE = Path(__file__).resolve().parent
OUT = HERE / "_accel"
# Cython directives: Python's semantics exactly (no checks from type hints, functions that
# introspect like Python's); part of every build's key, so changing them rebuilds everything.
DIRECTIVES = {"language_level": 3, "binding": True, "annotation_typing": False, "embedsignature": False}
BUILD = "1:" + ",".join(f"{k}={v}" for k, v in sorted(DIRECTIVES.items()))
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so


def _sources(mod: str) -> tuple[bytes, bytes | None]:
    """``mod``'s ``.py`` and, when it has one, its augmenting ``.pxd`` (C types for a class's
    attributes, read by Cython only; the ``.py`` alone is what runs pure). Raises OSError."""
    py = (HERE / f"{mod}.py").read_bytes()
    try:
        pxd = (HERE / f"{mod}.pxd").read_bytes()
    except FileNotFoundError:
        pxd = None
    return py, pxd


def _keyed(py: bytes, pxd: bytes | None) -> bytes:
    """What a build is keyed on: the ``.py``, and the ``.pxd`` when there is one."""
    return py if pxd is None else py + b"\0pxd\0" + pxd


def _source(mod: str) -> bytes:
    """What a build of ``mod`` as it is now is keyed on (:func:`_keyed`)."""
    return _keyed(*_sources(mod))


def _key(source: bytes) -> str:
    return hashlib.sha256(BUILD.encode() + b"\0" + source).hexdigest()[:24]


def _prefix(mod: str, source: bytes) -> str:
    """A build's name is ``<prefix><its size in bytes><SUFFIX>``: a file cut short never loads."""
    return f"{mod}-{_key(source)}-"


def _find(mod: str, source: bytes) -> Path | None:
    """The build of exactly this source - a whole one when there is one - or None."""
    pre = _prefix(mod, source)
    try:
        names = os.listdir(OUT)
    except OSError:
        return None
    found = None
    for n in sorted(names):
        size = n[len(pre):-len(SUFFIX)] if n.startswith(pre) and n.endswith(SUFFIX) else ""
        if size and size.isascii() and size.isdigit():
            p = OUT / n
            if _trusted(p) is None and _cut_short(p, mod, source) is None:
                return p
            found = found or p
    return found


def _cut_short(p: Path, mod: str, source: bytes) -> str | None:
    """Why the build at ``p`` is not whole (its size differs from the one in its name), or None."""
    want = int(p.name[len(_prefix(mod, source)):-len(SUFFIX)])
    try:
        have = os.lstat(p).st_size
    except OSError as exc:
        return f"{p.name}: {exc.strerror}"
    return None if have == want else f"{p.name} is cut short or grown ({have} bytes, built as {want})"


def _usable(p: Path | None, mod: str, source: bytes) -> str | None:
    """Why the build at ``p`` is not to be loaded (or is missing), or None."""
    if p is None:
        return "no build of this source (python -m agentvm.gate build)"
    why = _trusted(p) or _cut_short(p, mod, source)  # (a library cut short can crash the loader: SIGBUS)
    return None if why is None else f"not loading {p.name}: {why}"


def _pure() -> bool:
    return os.environ.get("AGENTVM_GATE_PURE", "") not in ("", "0")


def _trusted(p: Path) -> str | None:
    """Why ``p`` (or its folder) may not be loaded as code, or None when it may: the same rule
    as the kept dataclass code's (agentvm.codecache.untrusted)."""
    from agentvm.codecache import untrusted

    return untrusted(str(p))


def compiled_for(mod: str) -> tuple[Path | None, str]:
    """(the compiled file to load for ``mod``, or None; what was decided and why)."""
    if _pure():
        return None, "pure Python: AGENTVM_GATE_PURE is set"
    try:
        source = _source(mod)
    except OSError as exc:
        return None, f"pure Python: cannot read {exc.filename or mod} ({exc.strerror})"
    p = _find(mod, source)
    why = _usable(p, mod, source)
    if why is not None:
        return None, f"pure Python: {why}"
    return p, f"compiled ({p.name})"


# modules whose compiled build was found but did not load in this process: module -> why
FAILED: dict[str, str] = {}


class _Loader(importlib.machinery.ExtensionFileLoader):
    """The compiled build - or, when it does not load (a damaged file that still has its size,
    say), the ``.py``: it costs speed, not the gate (``status()`` says why)."""

    def __init__(self, name: str, path: str, source: str) -> None:
        super().__init__(name, path)
        self._source = source
        self._fallback = None

    def create_module(self, spec):
        try:
            return super().create_module(spec)
        except (ImportError, OSError) as exc:
            FAILED[spec.name.rpartition(".")[2]] = f"pure Python: {Path(self.path).name} did not load ({exc})"
            self._fallback = importlib.machinery.SourceFileLoader(self.name, self._source)
            spec.origin = self._source  # __file__ is the .py that runs
            return None  # a plain module, executed from the source below

    def exec_module(self, module) -> None:
        if self._fallback is not None:
            module.__loader__ = self._fallback
            return self._fallback.exec_module(module)
        return super().exec_module(module)


class Finder:
    """Loads ``agentvm.gate.<mod>`` from its matching compiled build, when there is one (a
    meta path finder; not derived from ``importlib.abc``, whose import alone costs the CLI
    ~30 ms)."""

    def find_spec(self, name, path=None, target=None):
        pkg, _, mod = name.rpartition(".")
        if pkg != PACKAGE or mod not in COMPILED:
            return None
        p, _why = compiled_for(mod)
        if p is None:
            return None  # the regular finders import the .py
        spec = importlib.machinery.ModuleSpec(name, _Loader(name, str(p), str(HERE / f"{mod}.py")), origin=str(p))
        spec.has_location = True  # __file__ is the compiled file
        return spec


def install() -> None:
    """Put ``Finder`` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, Finder())


def status() -> dict[str, str]:
    """module -> how it runs in this process: ``compiled (...)`` or ``pure Python: why``."""
    out = {}
    for mod in COMPILED:
        m = sys.modules.get(f"{PACKAGE}.{mod}")
        f = (getattr(m, "__file__", None) or "") if m is not None else None
        if f is not None and f.endswith(SUFFIX):
            out[mod] = f"compiled ({Path(f).name})"
            continue
        why = compiled_for(mod)[1]
        if f is not None and why.startswith("compiled"):
            why = FAILED.get(mod, "pure Python: imported before its build existed (a new process will load it)")
        out[mod] = why
    return out


def summary() -> tuple[bool, str]:
    """(every module compiled?, one line for people)."""
    st = status()
    pure = {m: why for m, why in st.items() if not why.startswith("compiled")}
    if not pure:
        return True, f"compiled: {len(st)} modules (Cython)"
    reasons = sorted(set(w.removeprefix("pure Python: ") for w in pure.values()))
    return False, f"pure Python for {', '.join(sorted(pure))}: {'; '.join(reasons)}"


# -- build ------------------------------------------------------------------------------------

def _compile_one(mod: str, work: Path) -> str | None:
    """Compile ``mod`` into OUT; None when done, else what failed."""
    import subprocess
    import sysconfig

    py, pxd = _sources(mod)
    source = _keyed(py, pxd)  # (read once: the build is of exactly these bytes)
    old = _find(mod, source)
    if _usable(old, mod, source) is None:
        return None
    c = work / f"{mod}.c"
    so = work / f"{mod}{SUFFIX}"
    # compile from a copy of exactly the bytes the key was taken from
    src = work / f"{mod}.py"
    src.write_bytes(py)
    inc = []
    if pxd is not None:  # found by Cython under the include folder, as the module's full name
        d = work / f"{mod}.inc" / PACKAGE.replace(".", "/")
        d.mkdir(parents=True)
        (d / f"{mod}.pxd").write_bytes(pxd)
        inc = ["-I", str(work / f"{mod}.inc")]
    args = [sys.executable, "-I", "-m", "cython", f"--module-name={PACKAGE}.{mod}", *inc, "-o", str(c), str(src)]
    for k, v in DIRECTIVES.items():
        args += ["-X", f"{k}={v}"] if k != "language_level" else [f"-{v}"]
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return f"{mod}: cython failed: {(r.stderr or r.stdout).strip()[-600:]}"
    pyinc = sysconfig.get_paths()["include"]
    cc = os.environ.get("CC", "gcc")
    try:
        r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-fwrapv", "-fno-strict-aliasing", "-DNDEBUG", "-w",
                            f"-I{pyinc}", "-o", str(so), str(c)], capture_output=True, text=True)
    except OSError as exc:
        return f"{mod}: cannot run the C compiler {cc!r}: {exc.strerror} (apt-get install gcc python3-dev)"
    if r.returncode != 0:
        return f"{mod}: {cc} failed: {(r.stderr or r.stdout).strip()[-600:]}"
    os.chmod(so, 0o644)
    fd = os.open(so, os.O_RDONLY)
    try:
        os.fsync(fd)  # whole on disk before its name appears (a crash must not leave a file cut short)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    new = OUT / f"{_prefix(mod, source)}{size}{SUFFIX}"
    try:
        os.replace(so, new)  # work is inside OUT: the file appears whole or not at all (over one of its name)
    except OSError as exc:
        return f"{mod}: cannot put the build in place as {new.name}: {exc.strerror}"
    if old is not None and old.name != new.name:  # a build of this source that was not usable
        try:
            old.unlink()
        except OSError:
            pass
    return None


def unbuilt() -> list[str]:
    """The modules whose current source has no build yet."""
    out = []
    for m in COMPILED:
        source = _source(m)
        if _usable(_find(m, source), m, source) is not None:
            out.append(m)
    return out


def build(jobs: int = 2) -> list[str]:
    """Compile every module whose current source has no build; remove builds of old sources.
    Returns what failed (empty: all compiled)."""
    try:
        import Cython  # noqa: F401
    except ImportError:
        return ["Cython is not installed (pip install 'cython>=3.0'; scripts/install.sh installs it)"]
    try:
        OUT.mkdir(mode=0o755, exist_ok=True)
    except FileExistsError:
        pass  # a symbolic link to nowhere: refused below
    st = os.lstat(OUT)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return [f"{OUT} is not a folder of this user's (a symbolic link?): not building into it"]
    os.chmod(OUT, 0o755)
    import fcntl

    lock = os.open(OUT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time: each removes what the others would keep
        return _build_locked(jobs)
    finally:
        os.close(lock)


def _build_locked(jobs: int) -> list[str]:
    import concurrent.futures
    import shutil
    import tempfile
    import time

    for old in OUT.glob(".build-*"):  # left by a build that was killed (a running one is younger)
        try:
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    # built in a private folder inside OUT (same filesystem: the final rename is atomic)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=OUT))
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
            errors = [e for e in ex.map(lambda m: _compile_one(m, work), COMPILED) if e]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keep = {p.name for p in (_find(m, _source(m)) for m in COMPILED) if p is not None}
    dfd = os.open(OUT, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the new names, durable
    finally:
        os.close(dfd)
    for f in OUT.iterdir():
        # builds of older sources, for this interpreter (another one's builds are its own)
        if f.name.endswith(SUFFIX) and f.name not in keep and not f.name.startswith(".build-"):
            try:
                f.unlink()
            except OSError:
                pass
    return errors

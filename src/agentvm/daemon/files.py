"""Copying files into and out of a workspace without ever following a link out of it.

Every path component is opened relative to its parent with ``O_NOFOLLOW``; ``..``, absolute
paths, NUL and empty components are refused. A symlink the agent planted anywhere on the
path (or as the file itself) makes the copy fail instead of escaping the workspace.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from agentvm.errors import PolicyDenied

MAX_FILE = 64 * 1024 * 1024


def _parts(rel: str) -> list[str]:
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise PolicyDenied("a relative path inside the workspace is required", code="files.bad-path")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts) or rel.startswith("/"):
        raise PolicyDenied(f"path {rel!r} must stay inside the workspace (relative, no '..')", code="files.bad-path")
    return parts


def _open_dir_beneath(root: Path, parts: list[str], *, create: bool, uid: int | None) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for p in parts:
            try:
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(p, 0o755, dir_fd=fd)
                if uid is not None:
                    os.chown(p, uid, uid, dir_fd=fd, follow_symlinks=False)
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise PolicyDenied(f"{p!r} on the path is a symlink or not a directory: refused",
                                       code="files.symlink") from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_beneath(root: Path, rel: str, data: bytes, uid: int | None) -> int:
    parts = _parts(rel)
    if len(data) > MAX_FILE:
        raise PolicyDenied("file too large", code="files.too-large")
    dfd = _open_dir_beneath(root, parts[:-1], create=True, uid=uid)
    try:
        try:
            # no O_TRUNC before we know it is a regular file; O_NONBLOCK so a FIFO the agent
            # planted cannot park this thread forever
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644,
                         dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PolicyDenied(f"{rel!r} is a symlink: refused", code="files.symlink") from None
            if exc.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK)
                raise PolicyDenied(f"{rel!r} is not a regular file", code="files.not-regular") from None
            raise
        try:
            st = os.fstat(fd)
            import stat as _st

            if not _st.S_ISREG(st.st_mode):
                raise PolicyDenied(f"{rel!r} is not a regular file", code="files.not-regular")
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if uid is not None:
                os.fchown(fd, uid, uid)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    return len(data)


def read_beneath(root: Path, rel: str) -> bytes:
    parts = _parts(rel)
    dfd = _open_dir_beneath(root, parts[:-1], create=False, uid=None)
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PolicyDenied(f"{rel!r} is a symlink: refused", code="files.symlink") from None
            raise
        try:
            import stat as _st

            st = os.fstat(fd)
            if not _st.S_ISREG(st.st_mode):
                raise PolicyDenied(f"{rel!r} is not a regular file", code="files.not-regular")
            if st.st_size > MAX_FILE:
                raise PolicyDenied("file too large", code="files.too-large")
            chunks, total = [], 0
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                total += len(b)
                if total > MAX_FILE:  # it grew while we read: the cap holds anyway
                    raise PolicyDenied("file too large", code="files.too-large")
                chunks.append(b)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)

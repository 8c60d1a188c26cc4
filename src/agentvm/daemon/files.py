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
    """Write ``data`` to ``rel`` all or nothing: into a temporary file owned by the agent, then
    renamed over the target, so a copy that fails (a full workspace) leaves no partial file -
    and no root-owned one the agent could not change."""
    import secrets
    import stat as _st

    parts = _parts(rel)
    if len(data) > MAX_FILE:
        raise PolicyDenied("file too large", code="files.too-large")
    dfd = _open_dir_beneath(root, parts[:-1], create=True, uid=uid)
    tmp = f".agentvm-cp-{secrets.token_hex(6)}"
    try:
        mode = 0o644
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            if _st.S_ISLNK(st.st_mode):
                raise PolicyDenied(f"{rel!r} is a symlink: refused", code="files.symlink")
            if not _st.S_ISREG(st.st_mode):
                raise PolicyDenied(f"{rel!r} is not a regular file", code="files.not-regular")
            mode = _st.S_IMODE(st.st_mode) & 0o1777  # the file it replaces keeps its mode (never setuid)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
        try:
            if uid is not None:
                os.fchown(fd, uid, uid)
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.close(fd)
        try:
            os.rename(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)  # the rename itself is durable too
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            from agentvm.errors import BackendError

            raise BackendError(f"the workspace is full: {rel!r} was not written (nothing partial was left)",
                               hint="free space in the workspace, or give the agent a larger limits.disk",
                               code="files.no-space") from None
        if exc.errno == errno.EISDIR:
            raise PolicyDenied(f"{rel!r} is a directory", code="files.not-regular") from None
        raise
    finally:
        os.close(dfd)
    return len(data)


def read_beneath(root: Path, rel: str) -> bytes:
    parts = _parts(rel)
    try:
        dfd = _open_dir_beneath(root, parts[:-1], create=False, uid=None)
    except FileNotFoundError:
        raise _not_found(rel) from None
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            raise _not_found(rel) from None
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


def _not_found(rel: str):
    from agentvm.errors import ConfigError

    return ConfigError(f"{rel!r} does not exist in the workspace", code="files.not-found")

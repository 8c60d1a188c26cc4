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


# -- folders, as tar streams ---------------------------------------------------------------
# `agentvm cp DIR NAME:PATH` and `cp NAME:DIR DST`: a folder travels as a tar stream (ustar/pax,
# built and read by the stdlib's tarfile). Only folders and regular files are copied; every
# member's path goes through the same checks as one file's (relative, no '..', every component
# opened with O_NOFOLLOW beneath the workspace), so an archive cannot reach out of it either.

MAX_MEMBERS = 100_000


def write_tree_beneath(root: Path, rel: str, tar_bytes: bytes, uid: int | None) -> dict:
    """Unpack the tar stream ``tar_bytes`` into the folder ``rel`` of the workspace (created if
    absent): folders and regular files only - a link, device or FIFO member is refused before
    anything is written. Returns ``{"files", "dirs", "bytes"}``."""
    import io
    import tarfile

    base = _parts(rel)
    try:
        tf = tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:")
        members = tf.getmembers()
    except (tarfile.TarError, EOFError, ValueError) as exc:
        from agentvm.errors import ConfigError

        raise ConfigError(f"not a tar stream: {exc}", code="config.invalid") from None
    if len(members) > MAX_MEMBERS:
        raise PolicyDenied(f"over {MAX_MEMBERS} entries in one copy", code="files.too-large")
    plan = []
    for m in members:
        if not (m.isdir() or m.isreg()):
            raise PolicyDenied(f"{m.name!r} is a {'link' if m.issym() or m.islnk() else 'special file'}: only "
                               "folders and regular files are copied (nothing was written)", code="files.not-regular")
        parts = _parts(m.name)  # relative, no '..' (refused before anything is written)
        plan.append((m, parts))
    files = dirs = total = 0
    _open_dir_beneath_close(root, base, uid)
    for m, parts in plan:
        if m.isdir():
            _open_dir_beneath_close(root, base + parts, uid)
            dirs += 1
            continue
        f = tf.extractfile(m)
        data = f.read() if f is not None else b""
        total += write_beneath(root, "/".join(base + parts), data, uid)
        files += 1
    return {"files": files, "dirs": dirs, "bytes": total}


def _open_dir_beneath_close(root: Path, parts: list[str], uid: int | None) -> None:
    os.close(_open_dir_beneath(root, parts, create=True, uid=uid))


def read_tree_beneath(root: Path, rel: str) -> tuple[bytes, dict]:
    """The folder ``rel`` of the workspace as a tar stream (folders and regular files; a
    symlink or special file inside is left out and counted, never followed). Capped at
    MAX_FILE bytes of content."""
    import io
    import stat as _st
    import tarfile

    parts = _parts(rel)
    try:
        top = _open_dir_beneath(root, parts, create=False, uid=None)
    except FileNotFoundError:
        raise _not_found(rel) from None
    buf = io.BytesIO()
    counts = {"files": 0, "dirs": 0, "bytes": 0, "skipped": 0}
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tf:
        def walk(dfd: int, prefix: str) -> None:
            for name in sorted(os.listdir(dfd)):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                arc = f"{prefix}/{name}" if prefix else name
                if _st.S_ISDIR(st.st_mode):
                    ti = tarfile.TarInfo(arc)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, _st.S_IMODE(st.st_mode) & 0o777, int(st.st_mtime)
                    tf.addfile(ti)
                    counts["dirs"] += 1
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    try:
                        walk(sub, arc)
                    finally:
                        os.close(sub)
                elif _st.S_ISREG(st.st_mode):
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
                    try:
                        fst = os.fstat(fd)
                        if not _st.S_ISREG(fst.st_mode):
                            counts["skipped"] += 1
                            continue
                        if counts["bytes"] + fst.st_size > MAX_FILE:
                            raise PolicyDenied(f"{rel!r} holds over {MAX_FILE >> 20} MiB: copy it in parts",
                                               code="files.too-large")
                        with os.fdopen(os.dup(fd), "rb") as fh:
                            data = fh.read(MAX_FILE + 1 - counts["bytes"])
                        ti = tarfile.TarInfo(arc)
                        ti.size, ti.mode, ti.mtime = len(data), _st.S_IMODE(fst.st_mode) & 0o777, int(fst.st_mtime)
                        tf.addfile(ti, io.BytesIO(data))
                        counts["files"] += 1
                        counts["bytes"] += len(data)
                    finally:
                        os.close(fd)
                else:  # a symlink, FIFO, socket or device: left out, never followed
                    counts["skipped"] += 1

        try:
            walk(top, "")
        finally:
            os.close(top)
    return buf.getvalue(), counts


def is_dir_beneath(root: Path, rel: str) -> bool:
    """Whether ``rel`` is a folder of the workspace (reached without following a link)."""
    import stat as _st

    parts = _parts(rel)
    try:
        dfd = _open_dir_beneath(root, parts[:-1], create=False, uid=None)
    except (FileNotFoundError, PolicyDenied):
        return False
    try:
        return _st.S_ISDIR(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)

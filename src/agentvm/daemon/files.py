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


def check_path(rel: str) -> None:
    """Refuse (files.bad-path) a path that is not relative or leaves the workspace."""
    _parts(rel)


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


def write_beneath(root: Path, rel: str, data, uid: int | None) -> int:
    """Write ``data`` to ``rel`` all or nothing: into a temporary file owned by the agent, then
    renamed over the target, so a copy that fails (a full workspace) leaves no partial file -
    and no root-owned one the agent could not change.

    ``data`` is bytes (held in memory: at most MAX_FILE), a file descriptor (a staged upload:
    copied by the kernel from its current offset) or a readable binary file (a tar member:
    COPY_CHUNK at a time). A staged copy's size is bounded by whoever staged it, not here."""
    import secrets
    import stat as _st

    parts = _parts(rel)
    if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > MAX_FILE:
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
            written = _copy_into(fd, data)
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
        if exc.errno == errno.EFBIG:
            raise PolicyDenied(f"{rel!r} is over the workspace's file size limit", code="files.too-large") from None
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
    return written


COPY_CHUNK = 1 << 20  # bytes per read/write when a copy is not done by the kernel


def _copy_into(fd: int, data) -> int:
    """Write all of ``data`` (bytes, a file descriptor or a readable binary file, from its current position) to
    ``fd``; returns the bytes written. Never more than COPY_CHUNK in memory for a file."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        n = len(view)
        while view:
            view = view[os.write(fd, view):]
        return n
    total = 0
    if isinstance(data, int):  # a file descriptor (a staged upload): the kernel copies, from its offset
        while True:
            n = os.sendfile(fd, data, None, 1 << 30)
            if n == 0:
                return total
            total += n
    while True:
        b = data.read(COPY_CHUNK)
        if not b:
            return total
        view = memoryview(b)
        while view:
            view = view[os.write(fd, view):]
        total += len(b)


def open_beneath(root: Path, rel: str) -> tuple[int, int]:
    """Open the regular file ``rel`` of the workspace for reading (every component O_NOFOLLOW,
    relative to its parent): ``(fd, size)``. The caller closes ``fd``; a download streams it
    (no size cap here: nothing is held in memory)."""
    import stat as _st

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
        st = os.fstat(fd)
        if not _st.S_ISREG(st.st_mode):
            os.close(fd)
            raise PolicyDenied(f"{rel!r} is not a regular file", code="files.not-regular")
        return fd, st.st_size
    finally:
        os.close(dfd)


# -- staging: an upload (or a folder's tar) on the state disk, never in memory ------------------
# The file has no name (O_TMPFILE; where the filesystem has none, it is unlinked as it is
# created) in a root-only folder of the daemon's state disk that no sandbox mounts: nothing can
# reach it while it is written, and it is gone when its descriptor closes (a crash included).

STAGING_DIR = ".staging"
STAGING_KEEP = 64 * 1024 * 1024  # bytes of the state disk a staged copy leaves free (with its reserve)


def staging_dir(home: Path) -> Path:
    d = Path(home) / STAGING_DIR
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    import stat as _st

    if not _st.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PolicyDenied(f"{d} is not the daemon's own folder: refused to stage a copy there", code="files.bad-path")
    if _st.S_IMODE(st.st_mode) != 0o700:
        os.chmod(d, 0o700)
    return d


def staging_open(home: Path) -> int:
    """A nameless read-write file in the staging folder (mode 0600, close-on-exec)."""
    d = staging_dir(home)
    try:
        return os.open(d, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    import secrets

    p = d / f"cp-{secrets.token_hex(8)}"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.unlink(p)
    return fd


def staging_room(home: Path, reserve: int) -> int:
    """Bytes a staged copy may take on the state disk: its free space less the daemon's reserve
    (agentvm.daemon.events.RESERVE: its state and audit chain must still be written) and
    :func:`staging_keep` more."""
    v = os.statvfs(staging_dir(home))
    return max(0, v.f_bavail * v.f_frsize - reserve - staging_keep(v.f_blocks * v.f_frsize))


def staging_keep(fs_size: int) -> int:
    """What a staged copy leaves free on a state disk of ``fs_size`` bytes besides the reserve:
    STAGING_KEEP, or a twentieth of a small disk."""
    return min(STAGING_KEEP, fs_size // 20)


def read_beneath(root: Path, rel: str) -> bytes:
    """The regular file ``rel`` of the workspace (opened as :func:`open_beneath` does), whole:
    at most MAX_FILE bytes."""
    fd, size = open_beneath(root, rel)
    try:
        if size > MAX_FILE:
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


def _not_found(rel: str):
    from agentvm.errors import ConfigError

    return ConfigError(f"{rel!r} does not exist in the workspace", code="files.not-found")


# -- folders, as tar streams ---------------------------------------------------------------
# `agentvm cp DIR NAME:PATH` and `cp NAME:DIR DST`: a folder travels as a tar stream (ustar/pax,
# built and read by the stdlib's tarfile). Only folders and regular files are copied; every
# member's path goes through the same checks as one file's (relative, no '..', every component
# opened with O_NOFOLLOW beneath the workspace), so an archive cannot reach out of it either.

MAX_MEMBERS = 100_000
MAX_DEPTH = 512  # folder levels a cp-out walks (one open fd each)


def write_tree_beneath(root: Path, rel: str, tar_bytes, uid: int | None) -> dict:
    """Unpack the tar stream ``tar_bytes`` (bytes, or a seekable binary file: a staged upload)
    into the folder ``rel`` of the workspace (created if absent): folders and regular files
    only - a link, device or FIFO member is refused before anything is written. Each member is
    copied COPY_CHUNK at a time. Returns ``{"files", "dirs", "bytes"}``."""
    import io
    import tarfile

    base = _parts(rel)
    src = io.BytesIO(tar_bytes) if isinstance(tar_bytes, (bytes, bytearray, memoryview)) else tar_bytes
    try:
        tf = tarfile.open(fileobj=src, mode="r:")
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
        total += write_beneath(root, "/".join(base + parts), f if f is not None else b"", uid)
        files += 1
    return {"files": files, "dirs": dirs, "bytes": total}


def _open_dir_beneath_close(root: Path, parts: list[str], uid: int | None) -> None:
    os.close(_open_dir_beneath(root, parts, create=True, uid=uid))


def read_tree_beneath(root: Path, rel: str) -> tuple[bytes, dict]:
    """The folder ``rel`` of the workspace as a tar stream in memory (folders and regular
    files; a symlink or special file inside is left out and counted, never followed). Capped at
    MAX_FILE bytes of content: a larger folder is streamed (:func:`tar_tree_beneath`)."""
    import io

    buf = io.BytesIO()
    counts = tar_tree_beneath(root, rel, buf, MAX_FILE)
    return buf.getvalue(), counts


def tar_tree_beneath(root: Path, rel: str, out, limit: int) -> dict:
    """Write the folder ``rel`` of the workspace as a tar stream to the binary file ``out``
    (a staged download), each file copied COPY_CHUNK at a time. The tar itself - headers (pax
    ones for long names), padding and the end blocks too, not just the files' content - stays
    within ``limit`` bytes, with at most MAX_MEMBERS members (over either: files.too-large,
    with the numbers), and folders at most MAX_DEPTH deep (files.too-deep). Returns
    ``{"files", "dirs", "bytes", "skipped"}`` (``bytes``: the files' content)."""
    import stat as _st
    import tarfile

    parts = _parts(rel)
    try:
        top = _open_dir_beneath(root, parts, create=False, uid=None)
    except FileNotFoundError:
        raise _not_found(rel) from None
    counts = {"files": 0, "dirs": 0, "bytes": 0, "skipped": 0}

    def too_large(why: str) -> PolicyDenied:
        return PolicyDenied(f"{rel!r} {why}", code="files.too-large",
                            hint="free space on the daemon's state disk, or copy the folder in parts")

    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT, copybufsize=COPY_CHUNK) as tf:
        def room_for(ti: tarfile.TarInfo, arc: str) -> None:
            """Refuse before a member that would take the tar past ``limit`` or MAX_MEMBERS."""
            if counts["files"] + counts["dirs"] >= MAX_MEMBERS:
                raise too_large(f"holds over {MAX_MEMBERS} entries, the most one copy takes")
            head = len(ti.tobuf(tf.format, tf.encoding, tf.errors))
            body = -(-ti.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            end = tf.offset + head + body + 2 * tarfile.BLOCKSIZE  # the tar were it the last member:
            end = -(-end // tarfile.RECORDSIZE) * tarfile.RECORDSIZE  # its end blocks, padded to a record
            if end > limit:
                raise too_large(f"makes a tar of over {limit} bytes, the most this copy may take ({tf.offset} "
                                f"bytes of tar before {arc!r}; {counts['files']} files of {counts['bytes']} "
                                f"content bytes, {counts['dirs']} folders)")

        def add_file(dfd: int, name: str, arc: str) -> None:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            try:
                fst = os.fstat(fd)
                if not _st.S_ISREG(fst.st_mode):
                    counts["skipped"] += 1
                    return
                ti = tarfile.TarInfo(arc)
                ti.size, ti.mode, ti.mtime = fst.st_size, _st.S_IMODE(fst.st_mode) & 0o777, int(fst.st_mtime)
                room_for(ti, arc)
                with os.fdopen(os.dup(fd), "rb", buffering=0) as fh:
                    try:
                        tf.addfile(ti, fh)  # exactly ti.size bytes
                    except OSError as exc:
                        if "unexpected end of data" not in str(exc):
                            raise
                        from agentvm.errors import BackendError

                        raise BackendError(f"{arc!r} shrank while it was copied: nothing usable was sent",
                                           hint="copy it again once the agent has stopped writing it",
                                           code="backend.error") from None
                counts["files"] += 1
                counts["bytes"] += fst.st_size
            finally:
                os.close(fd)

        # depth-first, names sorted, a folder's header before its entries; iterative (one open
        # fd per level, no Python frame per level): a deep folder is a clear refusal
        stack: list[tuple[int, str, list[str]]] = [(top, "", [])]
        try:
            stack[0] = (top, "", sorted(os.listdir(top), reverse=True))
            while stack:
                dfd, prefix, names = stack[-1]
                if not names:
                    os.close(dfd)
                    stack.pop()
                    continue
                name = names.pop()  # (sorted backwards: the first name last)
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # gone while we walked (the agent may be running)
                arc = f"{prefix}/{name}" if prefix else name
                if _st.S_ISDIR(st.st_mode):
                    if len(stack) >= MAX_DEPTH:
                        raise PolicyDenied(f"{rel!r} holds folders nested over {MAX_DEPTH} deep ({arc[:200]!r}...): "
                                           "more than a copy walks", code="files.too-deep",
                                           hint="copy a deeper folder on its own (agentvm cp NAME:PATH/DEEPER DST)")
                    ti = tarfile.TarInfo(arc)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, _st.S_IMODE(st.st_mode) & 0o777, int(st.st_mtime)
                    room_for(ti, arc)
                    tf.addfile(ti)
                    counts["dirs"] += 1
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    try:
                        subnames = sorted(os.listdir(sub), reverse=True)
                    except BaseException:
                        os.close(sub)
                        raise
                    stack.append((sub, arc, subnames))
                elif _st.S_ISREG(st.st_mode):
                    add_file(dfd, name, arc)
                else:  # a symlink, FIFO, socket or device: left out, never followed
                    counts["skipped"] += 1
        finally:
            for dfd, _, _ in stack:
                os.close(dfd)
    return counts


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

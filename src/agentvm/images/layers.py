"""Layers into a tree, refusing whatever could reach outside it; OCI layouts and
``docker save`` tarballs as sources.

Each tar entry is written by this code, never by ``tarfile.extract``: a path with ``..``, a
path through a symlink (one written by an earlier entry or layer), a device node, a hard
link to something that is not a regular file of the tree, a relative symlink that climbs
out of the root, a file over ``max_file`` bytes, a layer that inflates past ``max_total``
bytes or has more than ``max_entries`` entries: each is refused with the entry's name, and
the caller removes the half-written tree. Whiteouts (``.wh.NAME``, ``.wh..wh..opq``) remove
what lower layers wrote. Setuid and setgid bits are removed unless ``allow_setuid`` (inside
a sandbox they never raise privileges anyway: no_new_privs; the image should not carry them).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

from agentvm.images import ImageError

MAX_HEADER = 1024 * 1024  # a pax or GNU long-name header (tarfile reads it whole into memory)
MAX_ARCHIVE_MEMBERS = 100_000  # members of an outer docker-save / OCI archive


class _SafeTarInfo(tarfile.TarInfo):
    """Refuses a pax or GNU long-name/long-link header before ``tarfile`` reads its payload
    into memory (a 500 KB gzip layer can otherwise claim gigabytes there)."""

    def _proc_member(self, tarfile_):  # noqa: D401 - tarfile's own hook
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                         tarfile.GNUTYPE_LONGLINK) and self.size > MAX_HEADER:
            raise tarfile.HeaderError(f"an extended header of {self.size} bytes (over {MAX_HEADER})")
        return super()._proc_member(tarfile_)


MAX_FILE = 4 * 1024**3
MAX_TOTAL = 16 * 1024**3
MAX_ENTRIES = 1_000_000


@dataclass
class Limits:
    max_file: int = MAX_FILE
    max_total: int = MAX_TOTAL
    max_entries: int = MAX_ENTRIES
    allow_setuid: bool = False


@dataclass
class Stats:
    entries: int = 0
    bytes: int = 0
    setuid_removed: list[str] = field(default_factory=list)
    whiteouts: int = 0


class _Counting(io.RawIOBase):
    """A read-only stream that hashes and counts what passes, and stops at ``limit``."""

    def __init__(self, raw: BinaryIO, limit: int, what: str) -> None:
        self.raw, self.limit, self.what = raw, limit, what
        self.n = 0
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.raw.read(len(b))
        self.n += len(data)
        if self.n > self.limit:
            raise ImageError(f"{self.what} is over {self.limit} bytes (a decompression bomb?): refused",
                             code="image.too-large")
        self.sha.update(data)
        b[:len(data)] = data
        return len(data)


def _refuse(name: str, why: str) -> ImageError:
    return ImageError(f"refused entry {name!r}: {why}", code="image.hostile")


def _parts(name: str, what: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise _refuse(name, f"{what} with '..' (path traversal)")
    return parts


def _ensure_parents(root: Path, parts: list[str], name: str) -> Path:
    """The entry's parent directory, created as needed; never through a symlink."""
    d = root
    for p in parts[:-1]:
        d = d / p
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            os.mkdir(d, 0o755)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise _refuse(name, f"its path goes through the symlink {d.relative_to(root)}")
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(name, f"{d.relative_to(root)} is not a directory")
    return d


def _remove(p: Path) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(p)
    else:
        os.unlink(p)


def apply_layer(stream: BinaryIO, root: Path, limits: Limits, stats: Stats, what: str = "a layer") -> str:
    """Apply one (uncompressed or gzip) tar layer to ``root``; -> the SHA-256 of the
    uncompressed tar (an OCI diff id, ``sha256:...``)."""
    head = stream.read(2) if hasattr(stream, "read") else b""
    raw: BinaryIO = io.BufferedReader(_Prefixed(head, stream))
    if head == b"\x1f\x8b":
        raw = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
    elif head == b"\x28\xb5":
        raise ImageError(f"{what} is zstd-compressed: not supported", code="image.unsupported",
                         hint="re-export the image with gzip layers (skopeo copy --dest-compress-format gzip)")
    counting = _Counting(raw, limits.max_total - stats.bytes + 64 * 1024**2, what)
    buffered = io.BufferedReader(counting, 1 << 16)
    written_here: set[str] = set()
    dir_modes: list[tuple[list[str], int, int]] = []  # (path parts, mode, inode) of directories made
    try:
        tar = tarfile.open(fileobj=buffered, mode="r|", tarinfo=_SafeTarInfo)
        for m in tar:
            stats.entries += 1
            if stats.entries > limits.max_entries:
                raise ImageError(f"{what} has over {limits.max_entries} entries: refused", code="image.too-large")
            _entry(tar, m, root, limits, stats, written_here, dir_modes)
        while buffered.read(1 << 16):  # the rest (tar padding) counts toward the digest
            pass
    except ImageError:
        raise
    except tarfile.TarError as exc:
        raise ImageError(f"{what} is not a valid tar archive ({exc})", code="image.bad-archive") from None
    except (EOFError, gzip.BadGzipFile, OSError, ValueError) as exc:
        raise ImageError(f"{what} could not be read ({type(exc).__name__}: {exc})", code="image.bad-archive") from None
    for parts, mode, ino in reversed(dir_modes):  # last: a read-only directory is still written into first
        _chmod_dir(root, parts, mode, ino)
    return "sha256:" + counting.sha.hexdigest()


def _chmod_dir(root: Path, parts: list[str], mode: int, ino: int) -> None:
    """A directory's final mode, set through file descriptors opened with O_NOFOLLOW from the
    root down: a later entry that replaced it (or a parent) with a symlink is never followed -
    the mode of whatever it points at, on the host, is never touched."""
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)]
    try:
        for part in parts:
            try:
                fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
            except OSError:
                return  # gone, or no longer a directory (a whiteout, a later entry): nothing to set
        if os.fstat(fds[-1]).st_ino == ino:
            os.fchmod(fds[-1], mode)
    finally:
        for fd in fds:
            os.close(fd)


class _Prefixed(io.RawIOBase):
    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.head:
            n = min(len(b), len(self.head))
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.rest.read(len(b))
        b[:len(data)] = data
        return len(data)


def _entry(tar, m: tarfile.TarInfo, root: Path, limits: Limits, stats: Stats, written: set, dir_modes: list) -> None:
    name = m.name
    parts = _parts(name, "a path")
    if not parts:
        return  # the root itself
    base = parts[-1]
    if base.startswith(".wh."):
        parent = _ensure_parents(root, parts, name)
        stats.whiteouts += 1
        rel_parent = "/".join(parts[:-1])
        if base == ".wh..wh..opq":  # opaque: what lower layers put in this directory is gone
            with os.scandir(parent) as it:
                for e in list(it):
                    rel = f"{rel_parent}/{e.name}" if rel_parent else e.name
                    if rel not in written:
                        _remove(parent / e.name)
        else:
            target = base[len(".wh."):]
            if not target or target in (".", ".."):
                raise _refuse(name, "a whiteout of nothing")
            _remove(parent / target)
        return
    parent = _ensure_parents(root, parts, name)
    dest = parent / base
    rel = "/".join(parts)
    # nothing group- or world-writable (the tree is reachable by path on the host; the sandbox
    # binds it read-only anyway); setuid and setgid only when asked for, never on a directory
    mode = m.mode & 0o7755
    if m.isdir():
        mode &= ~(stat.S_ISUID | stat.S_ISGID)
    elif mode & (stat.S_ISUID | stat.S_ISGID) and not limits.allow_setuid:
        stats.setuid_removed.append(rel)
        mode &= ~(stat.S_ISUID | stat.S_ISGID)
    if m.ischr() or m.isblk():
        raise _refuse(name, "a device node (an image never carries devices; /dev is the sandbox's own)")
    try:
        existing = os.lstat(dest)
    except FileNotFoundError:
        existing = None
    if m.isdir():
        if existing is not None and not stat.S_ISDIR(existing.st_mode):
            _remove(dest)
            existing = None
        if existing is None:
            os.mkdir(dest, 0o700)
        dir_modes.append((parts, mode, os.lstat(dest).st_ino))
        written.add(rel)
        return
    if existing is not None:
        _remove(dest)  # a later layer replaces the entry
    if m.isreg():
        if m.size > limits.max_file:
            raise _refuse(name, f"a file of {m.size} bytes, over the limit of {limits.max_file}")
        stats.bytes += m.size
        if stats.bytes > limits.max_total:
            raise ImageError(f"the image is over {limits.max_total} bytes (at {name!r}): refused", code="image.too-large")
        src = tar.extractfile(m)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            left = m.size
            while left > 0:
                chunk = src.read(min(left, 1 << 20))
                if not chunk:
                    raise _refuse(name, "the archive ends inside this file")
                out.write(chunk)
                left -= len(chunk)
            os.fchmod(out.fileno(), mode)
    elif m.issym():
        target = m.linkname
        if not target or "\0" in target:
            raise _refuse(name, "an empty symlink")
        if not target.startswith("/"):
            # resolved where it lies: climbing above the root would point at the host's files
            # wherever the tree is looked at from outside
            depth = len(parts) - 1
            for p in target.split("/"):
                if p == "..":
                    depth -= 1
                    if depth < 0:
                        raise _refuse(name, f"a symlink to {target!r}, outside the image")
                elif p not in ("", "."):
                    depth += 1
        os.symlink(target, dest)
    elif m.islnk():
        tparts = _parts(m.linkname, "a hard link target")
        src = root.joinpath(*tparts) if tparts else root
        try:
            d = root
            for p in tparts[:-1]:  # the target's path, too, never through a symlink
                d = d / p
                if not stat.S_ISDIR(os.lstat(d).st_mode):
                    raise _refuse(name, f"a hard link through {d.relative_to(root)}, which is not a directory")
            st = os.lstat(src)
        except FileNotFoundError:
            raise _refuse(name, f"a hard link to {m.linkname!r}, which the image does not have") from None
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(name, f"a hard link to {m.linkname!r}, which is not a regular file")
        os.link(src, dest, follow_symlinks=False)
    elif m.isfifo():
        os.mkfifo(dest, mode & 0o777)
    else:
        raise _refuse(name, f"an unsupported entry type {m.type!r}")
    written.add(rel)


# ---------------------------------------------------------------------- sources


class _Source:
    """An OCI layout or a ``docker save`` tarball, as a directory or a tar file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tar = None
        if self.path.is_dir():
            self.members = None
        elif self.path.is_file():
            try:
                self.tar = tarfile.open(self.path, "r:*", tarinfo=_SafeTarInfo)
                self.members = {}
                for i, m in enumerate(self.tar):
                    if i >= MAX_ARCHIVE_MEMBERS:
                        raise ImageError(f"{path} has over {MAX_ARCHIVE_MEMBERS} members", code="image.too-large")
                    n = "/".join(_parts(m.name, "an archive path"))
                    if m.isreg():
                        self.members[n] = m
            except (tarfile.TarError, ValueError, EOFError, OSError) as exc:
                raise ImageError(f"{path} is not a readable tar archive ({exc})", code="image.bad-archive") from None
        else:
            raise ImageError(f"{path} does not exist", code="image.missing")

    def has(self, rel: str) -> bool:
        if self.members is None:
            try:
                self.open(rel).close()
                return True
            except ImageError:
                return False
        return rel in self.members

    def open(self, rel: str) -> BinaryIO:
        if self.members is None:
            parts = _parts(rel, "a path in the layout")
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for i, part in enumerate(parts):  # never through a symlink, checked and opened at once
                    flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if i < len(parts) - 1 else 0)
                    nxt = os.open(part, flags, dir_fd=fd)
                    os.close(fd)
                    fd = nxt
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ImageError(f"{rel} in {self.path} is not a regular file", code="image.bad-archive")
                return os.fdopen(fd, "rb")
            except FileNotFoundError:
                os.close(fd)
                raise ImageError(f"{rel} is missing from {self.path}", code="image.bad-archive") from None
            except OSError as exc:
                os.close(fd)
                raise ImageError(f"{rel} in {self.path} cannot be opened without following a link ({exc.strerror})",
                                 code="image.hostile") from None
        m = self.members.get("/".join(_parts(rel, "a path in the archive")))
        if m is None:
            raise ImageError(f"{rel} is missing from {self.path}", code="image.bad-archive")
        return self.tar.extractfile(m)

    def json(self, rel: str, limit: int = 4 * 1024**2):
        with self.open(rel) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ImageError(f"{rel} is over {limit} bytes", code="image.bad-archive")
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ImageError(f"{rel} is not JSON ({exc})", code="image.bad-archive") from None


def import_layers(src_path: Path, root: Path, limits: Limits, *, ref: str | None = None,
                  progress: Callable[[str], None] = lambda s: None) -> tuple[Stats, dict]:
    """Apply every layer of the image at ``src_path`` (OCI layout or docker save; a directory
    or a tar file) to ``root``; -> (stats, a description of the source for the metadata)."""
    try:
        return _import_layers(src_path, root, limits, ref, progress)
    except (AttributeError, TypeError, KeyError, IndexError) as exc:  # a manifest of the wrong shape
        raise ImageError(f"{src_path}: the image's manifest or index is malformed ({type(exc).__name__}: {exc})",
                         code="image.bad-archive") from None


def _import_layers(src_path: Path, root: Path, limits: Limits, ref: str | None,
                   progress: Callable[[str], None]) -> tuple[Stats, dict]:
    src = _Source(src_path)
    stats = Stats()
    if src.has("index.json") and src.has("oci-layout"):
        layers, desc = _oci_layers(src, ref)
        for i, (digest, media) in enumerate(layers, 1):
            progress(f"layer {i}/{len(layers)} {digest[:19]}")
            alg, _, hx = digest.partition(":")
            if alg != "sha256" or len(hx) != 64:
                raise ImageError(f"layer digest {digest!r} is not sha256", code="image.bad-archive")
            with src.open(f"blobs/sha256/{hx}") as f:
                blob = _Hashing(f)
                apply_layer(blob, root, limits, stats, f"layer {digest[:19]}")
                while blob.read(1 << 16):
                    pass
            if blob.hexdigest() != hx:
                raise ImageError(f"layer {digest[:19]} does not match its digest (got sha256:{blob.hexdigest()[:12]})",
                                 code="image.digest-mismatch")
        return stats, desc
    if src.has("manifest.json"):
        manifest = src.json("manifest.json")
        if not isinstance(manifest, list) or not manifest:
            raise ImageError("manifest.json of a docker save archive is not a list of images", code="image.bad-archive")
        pick = manifest[0]
        if ref is not None:
            pick = next((m for m in manifest if ref in (m.get("RepoTags") or [])), None)
            if pick is None:
                tags = [t for m in manifest for t in (m.get("RepoTags") or [])]
                raise ImageError(f"the archive has no image tagged {ref!r}", code="image.missing",
                                 hint="tags in it: " + (", ".join(tags) or "none"))
        elif len(manifest) > 1:
            raise ImageError("the archive holds several images", code="image.ambiguous",
                             hint="pick one with --ref TAG")
        config = src.json(pick["Config"]) if pick.get("Config") else {}
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        layers = pick.get("Layers") or []
        if len(diff_ids) != len(layers):  # every layer is checked against its digest, or none is taken
            raise ImageError("the image's config does not list a diff id for each layer", code="image.bad-archive")
        for i, layer in enumerate(layers):
            progress(f"layer {i + 1}/{len(layers)} {layer[:40]}")
            with src.open(layer) as f:
                got = apply_layer(f, root, limits, stats, f"layer {layer}")
            if got != diff_ids[i]:
                raise ImageError(f"layer {layer} does not match the config's diff id", code="image.digest-mismatch")
        return stats, {"format": "docker-save", "tags": pick.get("RepoTags") or []}
    raise ImageError(f"{src_path} is neither an OCI image layout (index.json, oci-layout) nor a docker save "
                     "archive (manifest.json)", code="image.bad-archive",
                     hint="make one with `skopeo copy docker://IMAGE oci:DIR` or `docker save IMAGE -o FILE`")


class _Hashing(io.RawIOBase):
    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        data = self.raw.read(n)
        self.sha.update(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


_INDEX = "application/vnd.oci.image.index.v1+json"


def _oci_layers(src: _Source, ref: str | None) -> tuple[list[tuple[str, str]], dict]:
    index = src.json("index.json")
    mans = index.get("manifests") or []
    if ref is not None:
        mans = [m for m in mans if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == ref]
        if not mans:
            raise ImageError(f"the layout has no image named {ref!r}", code="image.missing")
    if len(mans) != 1:
        names = [(m.get("annotations") or {}).get("org.opencontainers.image.ref.name", "?")
                 for m in index.get("manifests") or []]
        raise ImageError(f"the layout holds {len(mans)} images", code="image.ambiguous",
                         hint="pick one with --ref NAME (" + ", ".join(names) + ")")
    desc = mans[0]
    for _ in range(4):  # an index of indexes: the linux/amd64 entry
        media = desc.get("mediaType", "")
        hx = str(desc.get("digest", "")).partition(":")[2]
        if len(hx) != 64:
            raise ImageError(f"manifest digest {desc.get('digest')!r} is not sha256", code="image.bad-archive")
        _check_blob(src, hx)
        doc = src.json(f"blobs/sha256/{hx}")
        if media == _INDEX or "manifests" in doc:
            cands = [m for m in doc.get("manifests") or []
                     if (m.get("platform") or {}).get("os", "linux") == "linux"
                     and (m.get("platform") or {}).get("architecture", "amd64") in ("amd64", os.uname().machine)]
            if not cands:
                raise ImageError("the image index has no linux/amd64 image", code="image.unsupported")
            desc = cands[0]
            continue
        layers = [(str(l.get("digest", "")), str(l.get("mediaType", ""))) for l in doc.get("layers") or []]
        return layers, {"format": "oci", "manifest": desc.get("digest"),
                        "ref": (mans[0].get("annotations") or {}).get("org.opencontainers.image.ref.name")}
    raise ImageError("image indexes nested too deep", code="image.bad-archive")


def _check_blob(src: _Source, hx: str) -> None:
    h = hashlib.sha256()
    with src.open(f"blobs/sha256/{hx}") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != hx:
        raise ImageError(f"blob sha256:{hx[:12]} does not match its digest", code="image.digest-mismatch")


def copy_in(root: Path, src: Path, dest: str, mode: int | None) -> None:
    """A build file's ``files`` entry: ``src`` on the host to ``dest`` in the tree."""
    parts = _parts(dest, "a destination")
    if not dest.startswith("/") or not parts:
        raise ImageError(f"files: dest {dest!r} must be an absolute path in the image", code="image.bad-build")
    parent = _ensure_parents(root, parts, dest)
    out = parent / parts[-1]
    _remove(out)
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, out, symlinks=True)  # links are copied as links, never followed
    elif src.is_file() and not src.is_symlink():
        shutil.copyfile(src, out)
        os.chmod(out, mode if mode is not None else (0o755 if os.access(src, os.X_OK) else 0o644))
    else:
        raise ImageError(f"files: {src} is not a regular file or directory", code="image.bad-build")

"""Agent images: read-only root trees, content-addressed, named, signed.

An image is a directory tree (the root filesystem an agent sees instead of the host's
``/usr`` and ``/etc``), stored under ``<home>/images``::

    trees/<hex>/          the tree itself (owned by root, never written after it is stored)
    meta/<hex>.json       how it was made (build file or import source), counts, sizes
    names/<name>          "sha256:<hex>": a local name (``python-3.11``) for a digest
    sigs/<hex>/*.sig      SSH signatures of "agentvm-image:sha256:<hex>" (``image sign``)
    staging/              trees being built or imported (removed on failure and by ``gc``)

Why a plain tree, not a squashfs or erofs file: bubblewrap binds a directory with no
privileged mount and no loop device (this host's kernel is a VM guest where loop devices
and FUSE are not a given), gVisor takes a directory as its OCI root, and a tree can be
verified file by file with nothing mounted. The price is disk (no compression) and that the
tree's integrity rests on it being root-owned; ``agentvm image verify`` recomputes every
digest.

The digest is the SHA-256 of a canonical listing of the tree: each entry's path (sorted),
type, permission bits, and the SHA-256 of a file's bytes or a symlink's target. Owners and
times are not part of it (every entry is stored root-owned; times do not change what runs),
so the same content gives the same digest wherever and whenever it is built.

The host never follows a symlink inside an image: trees are walked with ``lstat``, a path
through a symlinked directory is refused on import, and the runtime binds ``<tree>/usr`` only
if it is a real directory. An absolute symlink inside (``/etc/alternatives/...``) means what
it says inside the sandbox, whose root is the image.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import AgentVMError, ConfigError

DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
SIGN_NAMESPACE = "agentvm-image"


class ImageError(AgentVMError):
    """An image could not be built, imported, stored or used."""

    code = "image.error"
    exit_code = 78


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name or ""):
        raise ConfigError(f"invalid image name {name!r}",
                          hint="lower-case letters, digits, '.', '_' and '-', starting with a letter or digit "
                               "(at most 63)")
    return name


@dataclass(frozen=True)
class Image:
    digest: str
    root: Path
    meta: dict
    names: tuple[str, ...]

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


def tree_digest(root: Path) -> tuple[str, int, int]:
    """-> (digest, entries, bytes) of the tree at ``root`` (symlinks never followed)."""
    root = Path(root)
    paths: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                path = f"{rel}/{e.name}" if rel else e.name
                paths.append(path)
                if e.is_dir(follow_symlinks=False):
                    stack.append(path)
    paths.sort()
    h = hashlib.sha256(b"agentvm-tree-v2\n")
    size = 0
    for path in paths:
        st = os.lstat(root / path)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            rec = ["d", mode, "", path]
        elif stat.S_ISREG(st.st_mode):
            rec = ["f", mode, _file_sha(root / path), path]
            size += st.st_size
        elif stat.S_ISLNK(st.st_mode):
            rec = ["l", 0, os.readlink(root / path), path]
        elif stat.S_ISFIFO(st.st_mode):
            rec = ["p", mode, "", path]
        else:
            raise ImageError(f"{path} in the image is a device or socket", code="image.corrupt")
        if not stat.S_ISLNK(st.st_mode) and os.listxattr(root / path, follow_symlinks=False):
            raise ImageError(f"{path} in the image has extended attributes (file capabilities?)", code="image.corrupt")
        # one JSON array a record: no field can run into the next (a name with spaces, a link target)
        h.update(json.dumps(rec, ensure_ascii=True).encode("ascii", "surrogateescape") + b"\n")
    return "sha256:" + h.hexdigest(), len(paths), size


def sanitize(root: Path, allow_setuid: bool = False) -> list[str]:
    """Before a tree is stored (after a build's files and commands, too): no group- or world-
    writable entry, no setuid or setgid file (unless ``allow_setuid``), no extended attribute
    (file capabilities), nothing but directories, files, symlinks and FIFOs. Symlinks are never
    followed (directories are walked with lstat, modes set through O_NOFOLLOW descriptors).
    -> the paths whose setuid/setgid bits were removed."""
    removed = []
    stack = [Path(root)]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            entries = list(it)
        for e in [None, *entries]:
            p = d if e is None else Path(e.path)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            if e is not None and stat.S_ISDIR(st.st_mode):
                stack.append(p)
                continue
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
                raise ImageError(f"{p.relative_to(root)} is a device or socket: refused", code="image.hostile")
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_DIRECTORY if stat.S_ISDIR(st.st_mode) else 0)
            fd = os.open(p, flags)
            try:
                for name in os.listxattr(fd):
                    os.removexattr(fd, name)
                mode = stat.S_IMODE(os.fstat(fd).st_mode)
                new = mode & ~0o022
                if stat.S_ISDIR(st.st_mode):
                    new &= ~(stat.S_ISUID | stat.S_ISGID)
                elif not allow_setuid and new & (stat.S_ISUID | stat.S_ISGID):
                    new &= ~(stat.S_ISUID | stat.S_ISGID)
                    removed.append(str(p.relative_to(root)))
                if new != mode:
                    os.fchmod(fd, new)
                if os.geteuid() == 0 and (os.fstat(fd).st_uid or os.fstat(fd).st_gid):
                    os.fchown(fd, 0, 0)  # root-owned: nobody else can change the tree
            finally:
                os.close(fd)
    return removed


def _file_sha(p: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Store:
    """The images under ``<home>/images``."""

    def __init__(self, home: Path) -> None:
        self.dir = Path(home) / "images"

    # -- layout -----------------------------------------------------------------------------
    def _mk(self) -> None:
        for sub in ("trees", "meta", "names", "sigs", "staging"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        # the sandbox's uid reaches the tree by path: search (x) for others on the way
        for d in (self.dir, self.dir / "trees"):
            os.chmod(d, 0o755)
        for d in ("meta", "names", "sigs", "staging"):
            os.chmod(self.dir / d, 0o700)

    def staging(self) -> Path:
        self._mk()
        d = self.dir / "staging" / f"{os.getpid()}-{os.urandom(6).hex()}"
        d.mkdir(mode=0o700)
        return d

    def tree(self, digest: str) -> Path:
        return self.dir / "trees" / digest.split(":", 1)[1]

    # -- adding -----------------------------------------------------------------------------
    def commit(self, staged_root: Path, meta: dict, name: str | None = None, *, allow_setuid: bool = False) -> Image:
        """Move a finished tree into the store (sanitized, its digest computed here), name it."""
        stripped = sanitize(staged_root, allow_setuid)
        if stripped:
            meta = {**meta, "setuid_removed": sorted(set(meta.get("setuid_removed", [])) | set(stripped))[:100]}
        digest, entries, size = tree_digest(staged_root)
        dest = self.tree(digest)
        os.chmod(staged_root, 0o755)
        if dest.exists():
            shutil.rmtree(staged_root, ignore_errors=True)  # the same content is already stored
        else:
            os.rename(staged_root, dest)
        meta = {**meta, "digest": digest, "entries": entries, "bytes": size, "stored": time.time()}
        _atomic_write(self.dir / "meta" / f"{digest.split(':', 1)[1]}.json", json.dumps(meta, indent=1, sort_keys=True))
        if name:
            self.set_name(name, digest)
        return self.get(digest)

    def set_name(self, name: str, digest: str) -> None:
        check_name(name)
        _atomic_write(self.dir / "names" / name, digest + "\n")

    # -- reading ----------------------------------------------------------------------------
    def names(self) -> dict[str, str]:
        out = {}
        d = self.dir / "names"
        if d.is_dir():
            for p in sorted(d.iterdir()):
                v = p.read_text().strip()
                if DIGEST_RE.fullmatch(v):
                    out[p.name] = v
        return out

    def digests(self) -> list[str]:
        d = self.dir / "trees"
        if not d.is_dir():
            return []
        return sorted("sha256:" + p.name for p in d.iterdir() if re.fullmatch(r"[0-9a-f]{64}", p.name))

    def resolve(self, ref: str) -> str:
        """A name or ``sha256:...`` -> the digest of an image in the store (or a clear error)."""
        if DIGEST_RE.fullmatch(ref or ""):
            if not self.tree(ref).is_dir():
                raise ImageError(f"image {ref} is not in the store ({self.dir})", code="image.missing",
                                 hint="build or import it (`agentvm image build|import`), or check `agentvm image ls`")
            return ref
        if (ref or "").startswith("sha256:"):
            raise ConfigError(f"invalid image digest {ref!r}", hint="sha256: followed by 64 lower-case hex digits")
        check_name(ref)
        digest = self.names().get(ref)
        if digest is None:
            raise ImageError(f"no image named {ref!r}", code="image.missing",
                             hint="`agentvm image ls` lists the names; `agentvm image build FILE` makes one")
        if not self.tree(digest).is_dir():
            raise ImageError(f"image {ref!r} names {digest}, which is not in the store", code="image.corrupt",
                             hint=f"rebuild or re-import it; `agentvm image gc` cleans up")
        return digest

    def get(self, ref: str) -> Image:
        digest = self.resolve(ref)
        hx = digest.split(":", 1)[1]
        try:
            meta = json.loads((self.dir / "meta" / f"{hx}.json").read_text())
        except (OSError, ValueError):
            meta = {}
        names = tuple(n for n, d in self.names().items() if d == digest)
        return Image(digest, self.tree(digest), meta, names)

    def root_for_run(self, ref: str) -> tuple[str, Path]:
        """(digest, tree) for a sandbox: refuses a tree whose /usr or /etc is not a real
        directory (the host binds them: it must never follow a symlink out of the image)."""
        digest = self.resolve(ref)
        root = self.tree(digest)
        for sub in ("usr", "etc"):
            try:
                st = os.lstat(root / sub)
            except FileNotFoundError:
                raise ImageError(f"image {digest} has no /{sub}", code="image.unusable",
                                 hint="an image is a whole root filesystem (Debian's essential set at least)") from None
            if not stat.S_ISDIR(st.st_mode):
                raise ImageError(f"/{sub} of image {digest} is not a directory (a symlink?): refused", code="image.unusable")
        if os.lstat(root).st_uid != 0 and os.geteuid() == 0:
            raise ImageError(f"the tree of image {digest} is not root-owned: refused", code="image.corrupt",
                             hint="`agentvm image verify` checks it; re-import the image")
        return digest, root

    # -- checking and removing --------------------------------------------------------------
    def verify(self, ref: str) -> tuple[bool, str]:
        img = self.get(ref)
        got, _, _ = tree_digest(img.root)
        if got != img.digest:
            return False, f"content hashes to {got}, not {img.digest}: the tree was changed"
        if img.meta.get("digest") not in (None, img.digest):
            return False, "its metadata names another digest"
        return True, "content matches its digest"

    def remove(self, ref: str) -> list[str]:
        """Remove a name (and the tree when no other name points at it) or a digest."""
        removed = []
        if DIGEST_RE.fullmatch(ref):
            digest = self.resolve(ref)
            for n, d in self.names().items():
                if d == digest:
                    (self.dir / "names" / n).unlink()
                    removed.append(n)
        else:
            digest = self.resolve(ref)
            (self.dir / "names" / ref).unlink()
            removed.append(ref)
        if digest not in self.names().values():
            self._drop(digest)
            removed.append(digest)
        return removed

    def _drop(self, digest: str) -> None:
        hx = digest.split(":", 1)[1]
        shutil.rmtree(self.tree(digest), ignore_errors=True)
        shutil.rmtree(self.dir / "sigs" / hx, ignore_errors=True)
        try:
            (self.dir / "meta" / f"{hx}.json").unlink()
        except FileNotFoundError:
            pass

    def gc(self, keep: set[str] = frozenset()) -> list[str]:
        """Remove trees no name points at (except ``keep``: digests agents use) and stale staging."""
        named = set(self.names().values()) | set(keep)
        now = time.time()
        # a tree stored in the last 10 minutes may be a build about to be named: kept
        out = [d for d in self.digests() if d not in named and now - os.lstat(self.tree(d)).st_mtime > 600]
        for d in out:
            self._drop(d)
        staging = self.dir / "staging"
        if staging.is_dir():
            for p in staging.iterdir():
                pid = p.name.split("-", 1)[0]
                if not (pid.isdigit() and _alive(int(pid))):
                    shutil.rmtree(p, ignore_errors=True)
                    out.append(f"staging/{p.name}")
        return out

    # -- signatures -------------------------------------------------------------------------
    def sig_dir(self, digest: str) -> Path:
        return self.dir / "sigs" / digest.split(":", 1)[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _atomic_write(path: Path, text: str) -> None:
    from agentvm.fsutil import write_atomic

    write_atomic(path, text.encode(), 0o644)

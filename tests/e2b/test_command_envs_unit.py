"""A command's ``envs`` (envd Process.Start) get the same name checks as ``envVars`` at create
(templates.check_envs): a credential's placeholder variable, the proxy/CA variables,
``AGENTVM_*`` and ``LD_*`` are refused before anything runs. The real envd service object over a
fake backend that records what it would have run."""

from __future__ import annotations

import asyncio
import textwrap
import types

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from agentvm.e2b import templates as tpls
from agentvm.e2b._gen import process_pb as ppb
from agentvm.e2b.envd import ProcessService
from agentvm.e2b.model import Box
from agentvm.errors import PolicyDenied

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
      credentials:
        - {name: gh, env: GITHUB_TOKEN, ref: "vault:gh", hosts: [api.github.com], inject: {header: Authorization, format: "Bearer {}"}}
      riskTier: L3
    """)


class _Ran(Exception):
    pass


def _start(home, template: str, envs: dict):
    ran = []

    async def exec_(name, spec):
        ran.append(spec)
        raise _Ran()

    box = Box("i1", "a", template, "e2b-i1", {}, {}, 0.0, 1e12, "tok")
    svc = types.SimpleNamespace(home=home, envd_box=lambda sid, tok: box, backend=types.SimpleNamespace(exec=exec_),
                                record=lambda *a, **k: None)
    ctx = types.SimpleNamespace(request_headers={"e2b-sandbox-id": "i1", "x-access-token": "tok"})
    req = ppb.StartRequest(process=ppb.ProcessConfig(cmd="/bin/true", envs=envs))

    async def go():
        agen = ProcessService(svc).start(req, ctx)
        await agen.__anext__()

    return asyncio.run(go()), ran


@pytest.fixture
def home(tmp_path):
    tpls.templates_dir(tmp_path).mkdir(parents=True, exist_ok=True)
    (tpls.templates_dir(tmp_path) / "gh.yaml").write_text(GITHUB)
    assert tpls.get("gh", tmp_path) is not None, "the test template is registered"
    return tmp_path


@pytest.mark.parametrize("name", ["GITHUB_TOKEN", "HTTPS_PROXY", "no_proxy", "SSL_CERT_FILE", "AGENTVM_GATE",
                                  "agentvm_x", "LD_PRELOAD", "LD_AUDIT"])
def test_a_commands_envs_cannot_set_what_the_policy_owns(home, name):
    with pytest.raises(ConnectError) as e:
        _start(home, "gh", {name: "real-value"})
    assert e.value.code == Code.PERMISSION_DENIED and name in str(e.value)


def test_plain_envs_reach_the_backend(home):
    with pytest.raises(_Ran):
        _start(home, "gh", {"MY_VAR": "1"})


def test_an_unreadable_template_refuses_every_variable(home):
    with pytest.raises(ConnectError) as e:
        _start(home, "gone", {"MY_VAR": "1"})
    assert e.value.code == Code.PERMISSION_DENIED
    with pytest.raises(_Ran):
        _start(home, "gone", {})  # no envs: nothing to check


def test_one_check_for_create_and_commands():
    spec = {"credentials": [{"env": "GITHUB_TOKEN"}, {"sigv4": {"accessKeyIdEnv": "AWS_ACCESS_KEY_ID"}}]}
    for k in ("GITHUB_TOKEN", "AWS_ACCESS_KEY_ID", "LD_BIND_NOW", "AGENTVM_X", "HTTP_PROXY"):
        with pytest.raises(PolicyDenied):
            tpls.check_envs({k: "v"}, spec, "t")
    tpls.check_envs({"PATH_EXTRA": "1"}, spec, "t")

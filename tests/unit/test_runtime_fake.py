"""The runtime's decisions, tested against the fake backend (no process is started)."""

import json
from pathlib import Path

import pytest

from agentvm.backends.fake import FakeBackend
from agentvm.errors import ConfigError, PolicyDenied, PrimitiveMissing
from agentvm.paths import Paths
from agentvm.policy import MountGrant, Policy
from agentvm.runtime import Runtime, get_backend


@pytest.fixture
def paths(tmp_path):
    return Paths(home=tmp_path / "home", runtime=tmp_path / "run")


def rt(paths, **kw):
    return Runtime(paths, FakeBackend(**kw))


POL = Policy(name="t", command=("work",))


def test_runs_and_propagates_exit_code(paths):
    fb = FakeBackend(lambda argv, env: 7)
    res = Runtime(paths, fb).run(POL, tty=False)
    assert res.exit_code == 7 and res.teardown["verified"] is True
    assert [c[0] for c in fb.calls] == ["launch", "wait", "destroy"]


def test_refuses_when_a_required_primitive_is_missing(paths):
    fb = FakeBackend(0, missing=("landlock",))
    with pytest.raises(PrimitiveMissing) as ei:
        Runtime(paths, fb).run(POL, tty=False)
    assert "landlock" in ei.value.message and ei.value.exit_code == 77
    assert "--degrade" in ei.value.hint
    assert fb.calls == [], "nothing may be launched when refusing"


def test_degrade_is_explicit_and_recorded(paths):
    fb = FakeBackend(0, missing=("landlock",))
    res = Runtime(paths, fb).run(POL, degrade=("landlock",), tty=False)
    assert res.exit_code == 0 and res.degraded == ["landlock"]
    from agentvm.audit import AuditLog

    log = AuditLog(paths.audit_dir / "audit.db")
    started = [r for r in log.records() if r.kind == "run.started"]
    assert started[-1].data["degraded"] == ["landlock"] and started[-1].sandbox == res.sandbox_id
    assert [r.kind for r in log.records(sandbox=res.sandbox_id)] == ["run.started", "run.exited"]
    assert log.verify().ok


def test_degrading_one_primitive_does_not_waive_another(paths):
    fb = FakeBackend(0, missing=("landlock", "seccomp"))
    with pytest.raises(PrimitiveMissing) as ei:
        Runtime(paths, fb).run(POL, degrade=("landlock",), tty=False)
    assert "seccomp" in ei.value.message and "landlock:" not in ei.value.message


def test_unknown_degrade_name_is_a_config_error(paths):
    with pytest.raises(ConfigError):
        rt(paths).run(POL, degrade=("everything",), tty=False)


def test_unenforceable_sections_are_refused(paths):
    fb = FakeBackend(0)
    with pytest.raises(PolicyDenied) as ei:
        Runtime(paths, fb).run(Policy(name="t", command=("x",), pending_features=("egress", "credentials")), tty=False)
    assert "egress" in ei.value.message and ei.value.code == "policy.unenforceable"
    assert fb.calls == []


def test_unverified_teardown_turns_success_into_backend_error(paths):
    res = rt(paths, teardown_ok=False).run(POL, tty=False)
    assert res.teardown["verified"] is False and res.exit_code == 125


def test_timeout_reported(paths):
    res = rt(paths, duration=10.0).run(Policy(name="t", command=("x",), limits=POL.limits.__class__(timeout=1.0)), tty=False)
    assert res.timed_out and res.exit_code == 124 and res.limits_hit == ["timeout"]


@pytest.mark.parametrize("host", ["/", "/proc", "/sys", "/dev"])
def test_grants_that_expose_the_host_are_refused(paths, host):
    with pytest.raises(PolicyDenied):
        rt(paths).run(Policy(name="t", command=("x",), mounts=(MountGrant(host, "/data", False),)), tty=False)


def test_grant_covering_agentvm_state_is_refused(paths):
    paths.ensure()
    for host in (str(paths.home), str(paths.home.parent), str(paths.home / "workspaces")):
        with pytest.raises(PolicyDenied) as ei:
            rt(paths).run(Policy(name="t", command=("x",), mounts=(MountGrant(host, "/data", False),)), tty=False)
        assert ei.value.code == "policy.grant-forbidden"


def test_missing_grant_path_is_a_config_error(paths):
    with pytest.raises(ConfigError):
        rt(paths).run(Policy(name="t", command=("x",), mounts=(MountGrant("/nonexistent/x", "/d", False),)), tty=False)


def test_fake_substrate_is_refused_outside_tests(paths, monkeypatch):
    monkeypatch.delenv("AGENTVM_ALLOW_FAKE", raising=False)
    with pytest.raises(PolicyDenied):
        get_backend("fake", paths)
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")
    assert get_backend("fake", paths).name == "fake"
    with pytest.raises(ConfigError):
        get_backend("vmware", paths)


def test_result_json_shape(paths):
    d = rt(paths).run(POL, tty=False).to_dict()
    for k in ("exit_code", "duration", "timed_out", "oom_killed", "pids_limit_hit", "limits_hit", "teardown",
              "teardown_verified", "sandbox_id", "degraded", "policy_digest"):
        assert k in d
    assert d["sandbox_id"].startswith("t-")


def test_backends_implement_the_protocol(paths):
    """Every backend is a Backend (the ABC: instantiating one that lacks a method fails) and
    declares what callers rely on instead of being asked for it by name."""
    from agentvm.backends.bwrap import BwrapBackend
    from agentvm.backends.gvisor import GvisorBackend
    from agentvm.backends.protocol import Backend

    tools = {"helper": "/x/helper", "bwrap": "/x/bwrap", "runsc": "/x/runsc", "compat": "/x/compat.so"}
    backends = [FakeBackend(), BwrapBackend(Paths(Path("/nonexistent"), Path("/nonexistent/run")), tools=tools),
                GvisorBackend(Paths(Path("/nonexistent"), Path("/nonexistent/run")), tools=tools)]
    for b in backends:
        assert isinstance(b, Backend)
        assert b.name and b.primitives and b.gate_kinds == ("unix",)
        assert set(b.required_primitives(POL)) <= set(b.primitives), b.name
    assert [b.strength for b in backends] == [0, 1, 2]
    assert [b.host_local for b in backends] == [False, True, True]

    class Incomplete(Backend):
        name = "incomplete"

    with pytest.raises(TypeError):
        Incomplete()


def test_min_substrate_refuses_a_weaker_substrate(paths):
    import dataclasses

    pol = dataclasses.replace(POL, min_substrate="gvisor")
    with pytest.raises(PolicyDenied) as ei:
        rt(paths).run(pol, tty=False)
    assert ei.value.code == "policy.min-substrate" and "gvisor" in ei.value.message and ei.value.exit_code == 77
    assert "--substrate gvisor" in ei.value.hint


def test_min_substrate_comes_from_the_agent_file():
    from agentvm.policy import compile_policy, with_overrides
    from agentvm.spec.loader import load_agent_text

    spec = ("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: hi}\nspec:\n  command: [x]\n  riskTier: L4\n"
            "  security: {minSubstrate: gvisor}\n")
    pol = compile_policy(load_agent_text(spec, "a.yaml").spec)
    assert pol.min_substrate == "gvisor" and pol.substrate == "bwrap"
    assert with_overrides(pol, substrate="gvisor").substrate == "gvisor"
    with pytest.raises(ConfigError):
        with_overrides(pol, substrate="fake")  # never from the command line


def test_a_section_this_version_cannot_enforce_is_refused_not_ignored(paths):
    import dataclasses

    launched = []
    fb = FakeBackend()
    real = fb.launch
    fb.launch = lambda *a, **kw: launched.append(a) or real(*a, **kw)
    with pytest.raises(PolicyDenied) as e:
        Runtime(paths, fb).run(dataclasses.replace(POL, pending_features=("some.section",)), tty=False)
    assert e.value.code == "policy.unenforceable" and "some.section" in e.value.message
    assert not launched

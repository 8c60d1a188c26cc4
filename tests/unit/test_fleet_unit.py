"""The fleet's pure parts on real git repositories (no daemon): loading from git objects (not
the work tree), symbolic links and hostile YAML refused, widening, the plan's digest, and
the replay's verdicts."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from agentvm import fleet as fl
from agentvm.errors import ConfigError


def git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                       env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def agent(name: str, extra: str = "") -> str:
    return textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          command: [/bin/true]
        """) + textwrap.indent(textwrap.dedent(extra), "  ")


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "fleet"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    git(r, "config", "user.email", "t@example.test")
    git(r, "config", "user.name", "t")
    return r


def commit(repo: Path, files: dict, msg="c") -> str:
    for rel, text in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", msg)
    return git(repo, "rev-parse", "HEAD")


def test_loads_from_git_objects_not_the_work_tree(repo):
    c1 = commit(repo, {"a.yaml": agent("a"), "presets/fleet-env.yaml": textwrap.dedent("""\
        apiVersion: agentvm/v1
        kind: Preset
        metadata: {name: fleet-env}
        spec:
          env: {FROM_PRESET: "1"}
        """), "b/b.yaml": agent("b", "presets: [fleet-env]\n"), "notes.yaml": "just: data\n"})
    (repo / "a.yaml").write_text(agent("a", "riskTier: L5\n"))  # an edit not committed
    f = fl.load(repo, c1)
    assert set(f.agents) == {"a", "b"} and f.agents["a"].policy.risk_tier != "L5"
    assert dict(f.agents["b"].policy.env)["FROM_PRESET"] == "1", "the commit's own presets"
    assert "presets: []" in f.agents["b"].spec_text and "FROM_PRESET" in f.agents["b"].spec_text, "stored resolved"
    assert fl.resolve(repo, "main") == c1 == fl.resolve(repo, c1[:8])
    with pytest.raises(ConfigError):
        fl.resolve(repo, "--output=/tmp/x")
    with pytest.raises(ConfigError):
        fl.resolve(repo, "no-such-branch")
    assert fl.is_full_id(c1) and not fl.is_full_id("main") and not fl.is_full_id(c1[:12])


def test_links_hostile_yaml_and_duplicates_are_refused_with_their_files(repo):
    os.symlink("/etc/shadow", repo / "evil.yaml")
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}]*9\n"
                                                   for i in range(8)) + "kind: Agent\n"
    c = commit(repo, {"bomb.yaml": bomb, "x.yaml": agent("dup"), "y.yaml": agent("dup")})
    with pytest.raises(ConfigError) as e:
        fl.load(repo, c)
    msg = e.value.message
    assert "evil.yaml: a symbolic link" in msg and "also declared in x.yaml" in msg and "bomb.yaml" in msg
    assert "root:" not in msg, "nothing of the link's target is read"


def test_widening_and_plan_digest(repo):
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    def pol(extra=""):
        return compile_policy(load_agent_text(agent("w", extra), "w.yaml", preset_dirs=[]).spec)

    old = pol("riskTier: L3\negress:\n  allow: [{host: a.test, ports: [443]}]\n")
    new = pol(textwrap.dedent("""\
        riskTier: L4
        egress:
          allow: [{host: a.test, ports: [443]}, {host: b.test, ports: [443]}]
        mounts: [{host: /usr/share/doc, path: /docs}]
        """))
    w = fl.widening(old, new)
    assert "new egress b.test:443" in w and any(x.startswith("new grant /usr/share/doc") for x in w)
    assert any("risk tier L3 -> L4" in x for x in w)
    assert fl.widening(new, old) == [], "narrowing is not widening"
    c = commit(repo, {"w.yaml": agent("w")})
    f = fl.load(repo, c)
    p1 = fl.make_plan(f, {}, None)
    p2 = fl.make_plan(f, {}, None)
    assert p1.digest() == p2.digest() and p1.actions[0].kind == "create"
    same = fl.make_plan(f, {"w": {"policy": f.agents["w"].policy, "digest": f.agents["w"].digest, "fleet": True,
                                  "running": True}}, c)
    assert [a.kind for a in same.actions] == ["unchanged"] and same.digest() != p1.digest()
    gone = fl.make_plan(f, {"x": {"policy": old, "digest": "d", "fleet": True, "running": False},
                            "y": {"policy": old, "digest": "d", "fleet": False, "running": True}}, c)
    assert [(a.kind, a.name) for a in gone.actions] == [("create", "w"), ("remove", "x")] and gone.unmanaged == ["y"]


def test_replay_verdicts():
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    def pol(hosts):
        rules = ", ".join(f"{{host: {h}, ports: [443]}}" for h in hosts)
        return compile_policy(load_agent_text(agent("r", f"riskTier: L3\negress:\n  allow: [{rules}]\n"), "r.yaml",
                                              preset_dirs=[]).spec)

    recs = [{"host": "a.test", "port": 443, "method": "CONNECT", "phase": "connect", "verdict": "allow", "rule": "allow[0]"},
            {"host": "b.test", "port": 443, "method": "CONNECT", "phase": "connect", "verdict": "deny", "rule": "default-deny"},
            {"host": "b.test", "port": 443, "method": "CONNECT", "phase": "connect", "verdict": "deny",
             "rule": "limit:rate"},  # not a policy decision: skipped
            {"host": "", "phase": "log", "verdict": "deny", "rule": "log:suppressed"}]
    r = fl.replay(recs, pol(["a.test"]), pol(["b.test"]))
    assert r == {"replayed": 2, "breakage": [{"request": "CONNECT a.test:443", "count": 1}],
                 "widening": [{"request": "CONNECT b.test:443", "count": 1}]}
    assert fl.replay(recs, None, pol(["a.test"]))["breakage"] == []

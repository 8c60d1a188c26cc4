"""Promotion on real git repositories made here: plan as data, apply of an exact commit (a
ref needs --yes, a changed plan is refused), drift after a live change, rollback to the exact
previous config, an invalid commit that applies nothing, a canary that fails and is rolled
back, signed commits (an SSH key made with ssh-keygen, git's own verify-commit), the replay
of a real sandbox's recorded decisions, and a daemon killed with -9 in the middle of an
apply."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import av, needs_root

pytestmark = [pytest.mark.integration, needs_root]


def git(repo: Path, *args: str, env: dict | None = None) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def agent_yaml(name: str, command: str = "exec sleep 600", extra: str = "") -> str:
    return textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          lifecycle: persistent
          command: ["/bin/sh", "-c", {json.dumps(command)}]
          limits: {{disk: 16M}}
        """) + textwrap.indent(textwrap.dedent(extra), "  ")


class Repo:
    def __init__(self, path: Path):
        self.path = path
        path.mkdir()
        git(path, "init", "-q", "-b", "main")
        git(path, "config", "user.email", "op@example.test")
        git(path, "config", "user.name", "op")

    def commit(self, files: dict[str, str | None], msg: str, *sign: str) -> str:
        for rel, text in files.items():
            f = self.path / rel
            if text is None:
                f.unlink()
                continue
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        git(self.path, "add", "-A")
        git(self.path, *sign, "commit", "-q", "--allow-empty", "-m", msg)
        return git(self.path, "rev-parse", "HEAD")


def plan(repo: Repo, ref: str, *extra: str, check=True) -> dict:
    r = av("plan", "--repo", str(repo.path), "--commit", ref, "--json", *extra, check=check)
    return json.loads(r.stdout) if r.stdout.strip() else {"rc": r.returncode, "stderr": r.stderr.decode()}


def status() -> tuple[int, dict]:
    r = av("status", "--json", check=False)
    return r.returncode, json.loads(r.stdout)


def agents(st: dict) -> dict:
    return {a["name"]: a for a in st["agents"]}


@pytest.fixture
def daemon(fresh_home):
    """A daemon of its own per test: a fleet's state (promotions, desired commit) is per installation."""
    av("up")
    yield fresh_home
    av("down", check=False)


@pytest.fixture
def cleanup():
    names: list[str] = []
    yield names
    for n in names:
        av("rm", n, check=False)


def test_plan_apply_drift_rollback(daemon, tmp_path, cleanup):
    cleanup += ["pf-a", "pf-b"]
    repo = Repo(tmp_path / "fleet")
    c1 = repo.commit({"agents/a.yaml": agent_yaml("pf-a"), "README.md": "fleet\n"}, "one")
    p = plan(repo, "main")
    assert p["commit"] == c1 and p["previous"] is None and p["changes"] == 1
    assert [(a["kind"], a["name"], a["path"]) for a in p["actions"]] == [("create", "pf-a", "agents/a.yaml")]
    # a ref is refused without --yes (after showing what it resolves to); the full id is applied
    r = av("apply", "--repo", str(repo.path), "--commit", "main", check=False)
    assert r.returncode != 0 and c1.encode() in r.stderr and b"full commit id" in r.stderr
    assert json.loads(av("ps", "--json").stdout) == [], "nothing was applied"
    out = json.loads(av("apply", "--repo", str(repo.path), "--commit", c1, "--json").stdout)
    assert out["result"] == "applied" and out["done"] == ["pf-a"]
    rc, st = status()
    assert rc == 0 and st["desired"] == c1 and agents(st)["pf-a"]["commit"] == c1 and agents(st)["pf-a"]["state"] == "running"
    digest1 = agents(st)["pf-a"]["config_digest"]
    # commit two: a new egress host and a new agent (a branch, merged), an unrelated file change
    git(repo.path, "checkout", "-q", "-b", "feature")
    c2 = repo.commit({"agents/a.yaml": agent_yaml("pf-a", extra="""\
        riskTier: L3
        egress:
          allow: [{host: api.example.test, ports: [443]}]
        """), "more/b.yaml": agent_yaml("pf-b")}, "two")
    git(repo.path, "checkout", "-q", "main")
    git(repo.path, "merge", "-q", "--ff-only", "feature")
    p2 = plan(repo, c2)
    kinds = {a["name"]: a for a in p2["actions"]}
    assert kinds["pf-b"]["kind"] == "create" and kinds["pf-a"]["kind"] == "update" and kinds["pf-a"]["restart"]
    assert "new egress api.example.test:443" in kinds["pf-a"]["widening"]
    assert any("risk tier" in w for w in kinds["pf-a"]["widening"]) and p2["previous"] == c1
    # the plan changed since it was shown: refused
    r = av("apply", "--repo", str(repo.path), "--commit", c2, "--plan-digest", "sha256:" + "0" * 64, check=False)
    assert r.returncode != 0 and b"plan changed" in r.stderr
    av("apply", "--repo", str(repo.path), "--commit", c2, "--plan-digest", p2["digest"])
    rc, st = status()
    assert rc == 0 and {n: a["commit"] for n, a in agents(st).items()} == {"pf-a": c2, "pf-b": c2}
    # a live change is drift, shown as such; exit 1
    av("policy", "pf-a", "allow", "other.example.test:443")
    rc, st = status()
    assert rc == 1 and any("live policy changes" in d for d in agents(st)["pf-a"]["drift"])
    # a hand-made sandbox running beside the fleet: plan and status agree - not from a fleet,
    # left alone, never drift
    f = tmp_path / "loose.yaml"
    f.write_text(agent_yaml("pf-loose"))
    cleanup.append("pf-loose")
    av("create", "-f", str(f), "--start")
    rc, st = status()
    loose = agents(st)["pf-loose"]
    assert loose["unmanaged"] is True and loose["drift"] == [] and st["unmanaged"] == ["pf-loose"]
    assert plan(repo, c2)["unmanaged"] == ["pf-loose"]
    assert b"pf-loose" in av("status", check=False).stdout and b"not from a fleet (left alone)" in av("status", check=False).stdout
    # rollback: the previous commit, exactly (pf-b removed, pf-a's config back to its digest)
    out = json.loads(av("rollback", "--json").stdout)
    assert out["result"] == "rolled-back" and out["commit"] == c1
    av("rm", "pf-loose")
    rc, st = status()
    a = agents(st)
    assert rc == 0, st
    assert set(a) == {"pf-a"} and a["pf-a"]["commit"] == c1 and a["pf-a"]["config_digest"] == digest1
    recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.splitlines()]
    kinds = [r["kind"] for r in recs]
    for k in ("fleet.planned", "fleet.apply-started", "fleet.applied", "fleet.drift", "fleet.rollback-started",
              "fleet.rolled-back", "fleet.live-changes-dropped"):
        assert k in kinds, k
    assert b"intact" in av("audit", "verify").stdout


def test_an_invalid_commit_applies_nothing_and_says_where(daemon, tmp_path, cleanup):
    cleanup += ["pf-ok"]
    repo = Repo(tmp_path / "fleet")
    bad = agent_yaml("pf-bad").replace("limits: {disk: 16M}", "limits: {disk: 16M, memroy: 1G}")
    c = repo.commit({"a/ok.yaml": agent_yaml("pf-ok"), "a/bad.yaml": bad,
                     "a/dup.yaml": agent_yaml("pf-ok")}, "broken")
    r = av("plan", "--repo", str(repo.path), "--commit", c, check=False)
    err = r.stderr.decode()
    assert r.returncode == 78 and "nothing was applied" in err
    assert "a/bad.yaml:7" in err and "memroy" in err, err
    assert "also declared in" in err
    r = av("apply", "--repo", str(repo.path), "--commit", c, check=False)
    assert r.returncode == 78
    assert json.loads(av("ps", "--json").stdout) == []


def test_a_failing_canary_is_rolled_back_and_stops_the_apply(daemon, tmp_path, cleanup):
    cleanup += ["pf-c1", "pf-c2"]
    repo = Repo(tmp_path / "fleet")
    cfg = "canary:\n  agents: ['pf-*']\n  seconds: 2\n  healthchecks:\n    pf-c1: [/bin/sh, -c, 'test -e /tmp/ok']\n"
    c1 = repo.commit({"agentvm-fleet.yaml": cfg, "c1.yaml": agent_yaml("pf-c1"), "c2.yaml": agent_yaml("pf-c2")}, "one")
    av("apply", "--repo", str(repo.path), "--commit", c1)
    first_seq = max(json.loads(x)["seq"] for x in av("audit", "show", "--json").stdout.splitlines())
    # pf-c1's new version starts but fails its health check (no /tmp/ok); pf-c2 comes after it
    c2 = repo.commit({"c1.yaml": agent_yaml("pf-c1", command="echo v2; exec sleep 600"),
                      "c2.yaml": agent_yaml("pf-c2", command="echo v2; exec sleep 600")}, "two")
    r = av("apply", "--repo", str(repo.path), "--commit", c2, "--json", check=False)
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["result"] == "failed" and out["failure"]["agent"] == "pf-c1"
    assert "health check" in out["failure"]["message"]
    rc, st = status()
    a = agents(st)
    assert a["pf-c1"]["commit"] == c1 and a["pf-c1"]["state"] == "running", "back on the old version, running"
    assert a["pf-c2"]["commit"] == c1, "the apply stopped: nothing after the failed agent changed"
    # a version that does not even stay up fails the same way
    c3 = repo.commit({"c1.yaml": agent_yaml("pf-c1", command="touch /tmp/ok; sleep 1; exit 3")}, "three")
    out = json.loads(av("apply", "--repo", str(repo.path), "--commit", c3, "--json", check=False).stdout)
    assert out["result"] == "failed" and "stay up" in out["failure"]["message"]
    recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "pf-c1").stdout.splitlines()]
    # the canaries ran beside the old version, which was never stopped: nothing to roll back
    assert sum(r["kind"] == "fleet.canary-failed" for r in recs) == 2
    assert not any(r["kind"] in ("fleet.agent-rolled-back", "lifecycle.stopped") for r in recs
                   if r["seq"] > first_seq), [r["kind"] for r in recs]
    assert agents(status()[1])["pf-c1"]["state"] == "running"
    assert "pf-c1-canary" not in {r["name"] for r in json.loads(av("ps", "--json").stdout)}, "the canary is gone"
    # a version that passes: applied
    c4 = repo.commit({"c1.yaml": agent_yaml("pf-c1", command="touch /tmp/ok; exec sleep 600")}, "four")
    out = json.loads(av("apply", "--repo", str(repo.path), "--commit", c4, "--json").stdout)
    assert out["result"] == "applied", out
    assert any(r["kind"] == "fleet.canary-passed" for r in
               (json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "pf-c1").stdout.splitlines()))


def test_signed_commits_only(daemon, tmp_path, cleanup):
    cleanup += ["pf-s"]
    keys = tmp_path / "keys"
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "op", "-f", str(keys / "op")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "eve", "-f", str(keys / "eve")], check=True)
    (keys / "allowed").write_text(f"op@example.test {(keys / 'op.pub').read_text()}")
    (daemon / "fleet.yaml").write_text(f"requireSigned: true\nallowedSigners: {keys / 'allowed'}\n")
    repo = Repo(tmp_path / "fleet")
    sign = lambda key: ("-c", "gpg.format=ssh", "-c", f"user.signingkey={keys / key}")  # noqa: E731
    unsigned = repo.commit({"s.yaml": agent_yaml("pf-s")}, "unsigned")
    r = av("apply", "--repo", str(repo.path), "--commit", unsigned, check=False)
    assert r.returncode == 78 and b"is not signed" in r.stderr
    eve = repo.commit({}, "by eve", *sign("eve"), "-c", "commit.gpgsign=true")
    r = av("apply", "--repo", str(repo.path), "--commit", eve, check=False)
    assert r.returncode == 78 and b"not signed by a configured signer" in r.stderr, "a key not in the list"
    good = repo.commit({}, "by op", *sign("op"), "-c", "commit.gpgsign=true")
    p = plan(repo, good)
    assert p["signed"] == "op@example.test"
    assert json.loads(av("apply", "--repo", str(repo.path), "--commit", good, "--json").stdout)["result"] == "applied"
    # a pin in the fleet's config: a file whose content differs refuses the commit
    (daemon / "fleet.yaml").unlink()
    c = repo.commit({"agentvm-fleet.yaml": "pins:\n  tools/server.py: sha256:" + "0" * 64 + "\n",
                     "tools/server.py": "print('hi')\n"}, "pinned")
    r = av("plan", "--repo", str(repo.path), "--commit", c, check=False)
    assert r.returncode == 78 and b"does not match its pin" in r.stderr


def test_replay_reports_breakage_and_widening_from_real_decisions(daemon, tmp_path, cleanup):
    from tests.integration.gate_upstreams import Upstream

    cleanup += ["pf-r"]
    up = Upstream()
    try:
        repo = Repo(tmp_path / "fleet")
        base = f"""\
            egress:
              hosts: {{keep.test: 127.0.0.1, old.test: 127.0.0.1, new.test: 127.0.0.1}}
              allow: [{{host: keep.test, ports: [{up.port}]}}, {{host: old.test, ports: [{up.port}]}}]
            """
        c1 = repo.commit({"r.yaml": agent_yaml("pf-r", extra=base)}, "one")
        av("apply", "--repo", str(repo.path), "--commit", c1)
        for host in ("keep.test", "old.test", "old.test", "new.test"):
            av("exec", "pf-r", "--", "curl", "-s", "-o", "/dev/null", f"http://{host}:{up.port}/x?id=1", check=False)
        c2 = repo.commit({"r.yaml": agent_yaml("pf-r", extra=base.replace("{host: old.test", "{host: new.test"))}, "two")
        p = plan(repo, c2, "--replay")
        a = next(x for x in p["actions"] if x["name"] == "pf-r")
        assert a["replay"]["replayed"] >= 4
        assert a["replay"]["breakage"] == [{"request": f"GET old.test:{up.port}/x", "count": 2}]
        assert a["replay"]["widening"] == [{"request": f"GET new.test:{up.port}/x", "count": 1}]
        r = av("plan", "--repo", str(repo.path), "--commit", c2, "--fail-on-breakage", check=False)
        assert r.returncode == 1 and b"BREAKS: GET old.test" in r.stdout and b"ALLOWS: GET new.test" in r.stdout
        assert av("plan", "--repo", str(repo.path), "--commit", c1, "--fail-on-breakage").returncode == 0
    finally:
        up.close()


def test_a_daemon_killed_mid_apply_leaves_each_agent_on_one_version(fresh_home, tmp_path, cleanup):
    cleanup += ["pf-k1", "pf-k2"]
    av("up")
    try:
        repo = Repo(tmp_path / "fleet")
        cfg = "canary:\n  agents: ['pf-k*']\n  seconds: 4\n"
        c1 = repo.commit({"agentvm-fleet.yaml": cfg, "k1.yaml": agent_yaml("pf-k1"), "k2.yaml": agent_yaml("pf-k2")}, "1")
        av("apply", "--repo", str(repo.path), "--commit", c1)
        c2 = repo.commit({"k1.yaml": agent_yaml("pf-k1", command="exec sleep 601"),
                          "k2.yaml": agent_yaml("pf-k2", command="exec sleep 601")}, "2")
        from tests.helpers import agentvm_cmd

        applying = subprocess.Popen(agentvm_cmd() + ["apply", "--repo", str(repo.path), "--commit", c2, "--canary"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # kill the daemon while pf-k1's canary runs (after its new version is the state)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "pf-k1").stdout.splitlines()]
            if any(r["kind"] == "fleet.agent-updated" and r["data"]["commit"] == c2 for r in recs):
                break
            time.sleep(0.1)
        pid = int((fresh_home / "run" / "daemon.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        applying.communicate(timeout=60)
        assert applying.returncode != 0
        av("up")
        rc, st = status()
        a = agents(st)
        assert a["pf-k1"]["commit"] == c2 and a["pf-k2"]["commit"] == c1, a
        assert a["pf-k1"]["state"] == "running" and a["pf-k2"]["state"] == "running"
        assert st["promotions"][0]["result"] == "interrupted"
        # apply can be run again: it finishes the job
        out = json.loads(av("apply", "--repo", str(repo.path), "--commit", c2, "--json").stdout)
        assert out["result"] == "applied" and out["done"] == ["pf-k2"]
        rc, st = status()
        assert rc == 0 and {a["commit"] for a in st["agents"]} == {c2}
    finally:
        av("down", check=False)

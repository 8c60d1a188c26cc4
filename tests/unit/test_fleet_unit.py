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


# ---------------------------------------------------------------------------- a hostile repository
def _keys(tmp_path: Path):
    keys = tmp_path / "keys"
    keys.mkdir()
    for who in ("op", "eve"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", who, "-f", str(keys / who)], check=True)
    (keys / "allowed").write_text(f"op@example.test {(keys / 'op.pub').read_text()}")
    return keys


def _signed_commit(repo: Path, keys: Path, who: str, files: dict) -> str:
    git(repo, "config", "gpg.format", "ssh")
    git(repo, "config", "user.signingkey", str(keys / who))
    for rel, text in files.items():
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-S", "-m", "signed")
    return git(repo, "rev-parse", "HEAD")


def test_the_repositorys_own_git_config_never_runs_and_cannot_vouch(repo, tmp_path):
    """A gpg.ssh.program in the fleet's .git/config would run as the daemon's user and could
    print "Good signature": agent-vm checks signatures itself, in a scratch repository."""
    keys = _keys(tmp_path)
    c = _signed_commit(repo, keys, "eve", {"a.yaml": agent("a")})
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {marker}\necho 'Good \"git\" signature for op@example.test'\nexit 0\n")
    evil.chmod(0o755)
    git(repo, "config", "gpg.ssh.program", str(evil))
    git(repo, "config", "core.pager", str(evil))
    trust = {"requireSigned": True, "allowedSigners": str(keys / "allowed")}
    with pytest.raises(ConfigError) as e:
        fl.load(repo, c, trust=trust)
    assert e.value.code == "fleet.unsigned" and not marker.exists()
    git(repo, "config", "--unset", "gpg.ssh.program")  # (git itself would sign with it)
    good = _signed_commit(repo, keys, "op", {"a.yaml": agent("a", "env: {X: '1'}\n")})
    git(repo, "config", "gpg.ssh.program", str(evil))
    assert fl.load(repo, good, trust=trust).signed == "op@example.test" and not marker.exists()
    with pytest.raises(ConfigError) as e:  # the signers file is the operator's: an absolute path
        fl.load(repo, good, trust={"requireSigned": True, "allowedSigners": "allowed"})
    assert "absolute" in e.value.message


def test_replace_refs_cannot_swap_content_under_a_verified_commit(repo, tmp_path):
    keys = _keys(tmp_path)
    good = _signed_commit(repo, keys, "op", {"a.yaml": agent("a")})
    blob = git(repo, "rev-parse", f"{good}:a.yaml")
    (tmp_path / "evil.yaml").write_text(agent("a", "riskTier: L5\n"))
    evil_blob = git(repo, "hash-object", "-w", str(tmp_path / "evil.yaml"))
    git(repo, "replace", blob, evil_blob)
    assert "L5" in git(repo, "show", f"{good}:a.yaml"), "git itself now shows the replacement"
    f = fl.load(repo, good, trust={"requireSigned": True, "allowedSigners": str(keys / "allowed")})
    assert f.agents["a"].policy.risk_tier != "L5", "agent-vm reads the signed commit's own objects"


def test_a_gpg_signature_is_not_checked_against_a_keyring(repo, tmp_path):
    keys = _keys(tmp_path)
    c = commit(repo, {"a.yaml": agent("a")})
    raw = subprocess.run(["git", "-C", str(repo), "cat-file", "commit", c], capture_output=True).stdout
    head, _, msg = raw.partition(b"\n\n")
    forged = head + b"\ngpgsig -----BEGIN PGP SIGNATURE-----\n \n iQEz\n -----END PGP SIGNATURE-----\n\n" + msg
    p = tmp_path / "forged"
    p.write_bytes(forged)
    sha = git(repo, "hash-object", "-t", "commit", "-w", str(p))
    with pytest.raises(ConfigError) as e:
        fl.load(repo, sha, trust={"requireSigned": True, "allowedSigners": str(keys / "allowed")})
    assert "only SSH signatures" in e.value.message


def test_a_lazy_fetch_from_a_promisor_remote_never_runs(repo, tmp_path):
    c = commit(repo, {"a.yaml": agent("a")})
    blob = git(repo, "rev-parse", f"{c}:a.yaml")
    marker = tmp_path / "fetched"
    git(repo, "config", "extensions.partialClone", "origin")
    git(repo, "config", "remote.origin.promisor", "true")
    git(repo, "config", "remote.origin.url", str(tmp_path / "nowhere"))
    git(repo, "config", "remote.origin.uploadpack", f"sh -c 'touch {marker}'")
    obj = repo / ".git" / "objects" / blob[:2] / blob[2:]
    obj.unlink()  # the blob is now "missing" (as in a partial clone)
    with pytest.raises(ConfigError) as e:
        fl.load(repo, c)
    assert "missing" in e.value.message and not marker.exists()


def test_the_stored_spec_means_what_the_commit_says(repo):
    """A deny rule without ports denies every port; the stored (resolved) spec keeps it so."""
    c = commit(repo, {"a.yaml": agent("a", """\
        egress:
          allow: [{host: "*.corp.test", ports: [8080, 443]}]
          deny: [{host: admin.corp.test}]
        """)})
    fa = fl.load(repo, c).agents["a"]
    from agentvm.gate.policy import RequestMeta, decide
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    stored = compile_policy(load_agent_text(fa.spec_text, "stored.yaml").spec)
    assert stored.digest() == fa.digest
    meta = RequestMeta(host="admin.corp.test", port=8080, scheme="http", method="GET", path="/", body_size=None,
                       websocket=False, phase="request", sni=None)
    assert not decide(meta, stored.egress).allowed


def test_fleet_config_is_bounded_and_typed(repo):
    bomb = "pins: &a {x: y}\ncanary: {agents: [*a]}\n"
    c = commit(repo, {"a.yaml": agent("a"), "agentvm-fleet.yaml": bomb})
    with pytest.raises(ConfigError) as e:
        fl.load(repo, c)
    assert "aliases" in e.value.message
    for bad, why in (("canary: {seconds: .inf}", "canary.seconds"), ("canary: {seconds: soon}", "canary.seconds"),
                     ("canary: {healthchecks: {a: 5}}", "healthchecks"), ("requireSigned: yes please", "true or false"),
                     ("whatever: 1", "unknown keys")):
        c = commit(repo, {"agentvm-fleet.yaml": bad + "\n"})
        with pytest.raises(ConfigError) as e:
            fl.load(repo, c)
        assert why in e.value.message, (bad, e.value.message)


def test_widening_beyond_new_hosts_is_called_out(repo):
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    def pol(extra=""):
        return compile_policy(load_agent_text(agent("w", extra), "w.yaml", preset_dirs=[]).spec)

    base = pol("riskTier: L3\negress:\n  allow: [{host: a.test, ports: [443], paths: ['/v1/**']}]\n"
               "  deny: [{host: a.test, paths: ['/v1/admin/**']}]\n")
    for extra, word in [
        ("riskTier: L3\negress:\n  allow: [{host: a.test, ports: [443], paths: ['/v1/**']}]\n", "egress rules"),
        ("riskTier: L3\negress:\n  allow: [{host: a.test, ports: [443], paths: ['/**']}]\n"
         "  deny: [{host: a.test, paths: ['/v1/admin/**']}]\n", "egress rules"),
        ("riskTier: L3\negress:\n  allow: [{host: a.test, ports: [443], paths: ['/v1/**']}]\n"
         "  deny: [{host: a.test, paths: ['/v1/admin/**']}]\n  hosts: {a.test: 10.0.0.9}\n", "egress rules"),
        ("riskTier: L4\nsecurity: {allowPtrace: true}\negress:\n  allow: [{host: a.test, ports: [443], "
         "paths: ['/v1/**']}]\n  deny: [{host: a.test, paths: ['/v1/admin/**']}]\n", "ptrace"),
    ]:
        assert any(word in w for w in fl.widening(base, pol(extra))), extra
    narrower = pol("riskTier: L3\negress:\n  allow: []\n  deny: [{host: a.test, paths: ['/v1/admin/**']}]\n")
    assert fl.widening(base, narrower) == []


def test_the_operators_pins_hold_whatever_the_commit_says(repo):
    import hashlib

    good = "print('v1')\n"
    c = commit(repo, {"a.yaml": agent("a"), "tools/server.py": good})
    pin = {"tools/server.py": "sha256:" + hashlib.sha256(good.encode()).hexdigest()}
    assert fl.load(repo, c, trust={"pins": pin}).agents
    c2 = commit(repo, {"tools/server.py": "print('evil')\n",
                       "agentvm-fleet.yaml": "pins: {}\n"})  # the commit drops its own pins: not the operator's
    with pytest.raises(ConfigError) as e:
        fl.load(repo, c2, trust={"pins": pin})
    assert "tools/server.py: content" in e.value.message and "does not match its pin" in e.value.message


def test_replay_of_recorded_tool_calls_by_name(repo):
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    def pol(tools):
        return compile_policy(load_agent_text(agent("w", "riskTier: L3\ntools:\n" + textwrap.indent(
            textwrap.dedent(tools), "  ")), "w.yaml", preset_dirs=[]).spec)

    old = pol("""\
        - name: gh
          command: [/bin/true]
          allow: [get_issue, list_prs]
        """)
    new = pol("""\
        - name: gh
          command: [/bin/true]
          allow: [list_prs, search]
          approve: [get_issue]
        """)
    recs = [{"phase": "tool", "tool": "gh__get_issue", "verdict": "allow", "rule": "tools:allow:gh:get_issue"},
            {"phase": "tool", "tool": "gh__list_prs", "verdict": "allow", "rule": "tools:allow:gh:list_prs"},
            {"phase": "tool", "tool": "gh__search", "verdict": "deny", "rule": "tools:not-allowed"},
            {"phase": "tool", "tool": "gh__x", "verdict": "deny", "rule": "tools:rate"}]  # a limit: not replayed
    out = fl.replay(recs, old, new)
    assert out["replayed"] == 3
    assert out["breakage"] == [{"request": "tool gh__get_issue (now needs a human)", "count": 1}]
    assert out["widening"] == [{"request": "tool gh__search", "count": 1}]

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


# ---------------------------------------------------------------------------- widening, field by field
RICH = """\
riskTier: L3
mounts: [{host: /usr/share/doc, path: /docs}]
security: {localPorts: [8080]}
limits:
  memory: 1G
  timeout: 1h
  budget:
    tokens: 1000
    requests: 10
    cost: 5
    hosts: [api.openai.com, api.anthropic.com]
    prices: {"gpt-4o*": {input: 2.5, output: 10}, "*": {input: 5, output: 15}}
egress:
  allow:
    - {host: api.openai.com, ports: [443]}
    - {host: api.anthropic.com, ports: [443]}
    - {id: pay, host: a.test, ports: [443], methods: [GET], paths: ['/v1/**'], maxBody: 1K, action: ask}
  deny: [{host: a.test, paths: ['/v1/admin/**']}]
  hosts: {a.test: 192.0.2.10}
credentials:
  - {name: key, env: KEY, ref: 'vault:key', hosts: [a.test], inject: {header: Authorization, format: "Bearer {}"}}
approvals: {timeout: 60s}
tools:
  - name: notes
    command: [notes-mcp]
    allow: [read_note, list_notes]
    approve: [write_note]
    deny: ["*admin*"]
    risk: {read_note: read, write_note: write, rm_note: destructive}
    arguments: {read_note: {path: {path: /srv/notes, required: true}}}
    resources: ["file:///srv/notes/*"]
    prompts: [summary]
    limits: {callsPerMinute: 10, timeout: 5s, maxArguments: 1K, maxResult: 1K}
"""


def _rich():
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import load_agent_text

    return compile_policy(load_agent_text(agent("w", RICH), "w.yaml", preset_dirs=[]).spec)


def _on(path: str, value=None, fn=None):
    """A change of one field, by its place in the policy: Policy.x, Limits.x, BudgetSpec.x,
    EgressPolicy.x, EgressLimits.x, Rule.x (the a.test allow rule), MountGrant.x,
    CredentialBinding.x, ToolPolicy.x, ServerPolicy.x (the notes server)."""
    from dataclasses import replace as r

    cls, name = path.split(".")

    def change(p):
        def new(old):
            return fn(old) if fn is not None else value
        if cls == "Policy":
            return r(p, **{name: new(getattr(p, name))})
        if cls == "Limits":
            return r(p, limits=r(p.limits, **{name: new(getattr(p.limits, name))}))
        if cls == "BudgetSpec":
            b = p.limits.budget
            return r(p, limits=r(p.limits, budget=r(b, **{name: new(getattr(b, name))})))
        if cls == "EgressPolicy":
            return r(p, egress=r(p.egress, **{name: new(getattr(p.egress, name))}))
        if cls == "EgressLimits":
            lim = p.egress.limits
            return r(p, egress=r(p.egress, limits=r(lim, **{name: new(getattr(lim, name))})))
        if cls == "Rule":
            allow = tuple(r(x, **{name: new(getattr(x, name))}) if x.host == "a.test" else x for x in p.egress.allow)
            return r(p, egress=r(p.egress, allow=allow))
        if cls == "MountGrant":
            return r(p, mounts=tuple(r(m, **{name: new(getattr(m, name))}) for m in p.mounts))
        if cls == "CredentialBinding":
            return r(p, credentials=tuple(r(c, **{name: new(getattr(c, name))}) for c in p.credentials))
        if cls == "ToolPolicy":
            return r(p, tools=r(p.tools, **{name: new(getattr(p.tools, name))}))
        if cls == "ServerPolicy":
            servers = tuple(r(s, **{name: new(getattr(s, name))}) for s in p.tools.servers)
            return r(p, tools=r(p.tools, servers=servers))
        raise AssertionError(path)
    return change


#: (field, the change, a word of the widening line it must produce - or None: it never widens)
WIDENS = [
    ("Policy.name", _on("Policy.name", "other"), None),
    ("Policy.command", _on("Policy.command", ("/bin/false",)), None),
    ("Policy.agent", _on("Policy.agent", True), None),
    ("Policy.lifecycle", _on("Policy.lifecycle", "persistent"), "lifecycle"),
    ("Policy.substrate", _on("Policy.substrate", "fake"), "weaker isolation"),
    ("Policy.min_substrate", _on("Policy.min_substrate", None), None),
    ("Policy.image", _on("Policy.image", "sha256:" + "0" * 64), "image"),
    ("Policy.image_signers", _on("Policy.image_signers", ("mallory",)), "image signer mallory"),
    ("Policy.risk_tier", _on("Policy.risk_tier", "L4"), "risk tier L3 -> L4"),
    ("Policy.workdir", _on("Policy.workdir", "/tmp"), None),
    ("Policy.extra_ro", _on("Policy.extra_ro", ("/opt/x",)), "read-only host path /opt/x"),
    ("Policy.mounts", _on("Policy.mounts", ()), None),
    ("Policy.workspace", _on("Policy.workspace", None), None),
    ("Policy.env", _on("Policy.env", (("A", "b"),)), None),
    ("Policy.limits", _on("Policy.limits", fn=lambda lim: __import__("dataclasses").replace(lim, memory=lim.memory * 2)),
     "limits.memory"),
    ("Policy.allow_ptrace", _on("Policy.allow_ptrace", True), "ptrace"),
    ("Policy.on_escape_probe", _on("Policy.on_escape_probe", "stop"), None),
    ("Policy.local_ports", _on("Policy.local_ports", ()), "localPorts restriction removed"),
    ("Policy.local_ports", _on("Policy.local_ports", (8080, 9090)), "new local port 9090"),
    ("Policy.network", _on("Policy.network", "gate"), None),
    ("Policy.egress", _on("Policy.egress", fn=lambda e: __import__("dataclasses").replace(e, deny=())),
     "deny rule"),
    ("Policy.credentials", _on("Policy.credentials", ()), None),
    ("Policy.tools", _on("Policy.tools", None), None),
    ("Policy.approval_timeout", _on("Policy.approval_timeout", 600.0), "approval timeout"),
    ("Policy.approval_webhook", _on("Policy.approval_webhook", "https://hook.test/x"), "webhook"),
    ("Policy.pending_features", _on("Policy.pending_features", ("x",)), None),
    ("Policy.version", _on("Policy.version", 99), None),
    ("Limits.memory", _on("Limits.memory", fn=lambda v: v * 2), "limits.memory"),
    ("Limits.cpus", _on("Limits.cpus", fn=lambda v: v * 2), "limits.cpus"),
    ("Limits.pids", _on("Limits.pids", fn=lambda v: v * 2), "limits.pids"),
    ("Limits.disk", _on("Limits.disk", fn=lambda v: v * 2), "limits.disk"),
    ("Limits.timeout", _on("Limits.timeout", 0), "limits.timeout"),
    ("Limits.tmp", _on("Limits.tmp", fn=lambda v: v * 2), "limits.tmp"),
    ("Limits.shm", _on("Limits.shm", fn=lambda v: v * 2), "limits.shm"),
    ("Limits.nofile", _on("Limits.nofile", fn=lambda v: v * 2), "limits.nofile"),
    ("Limits.budget", _on("Limits.budget", None), "no LLM budget"),
    ("BudgetSpec.tokens", _on("BudgetSpec.tokens", None), "LLM budget tokens"),
    ("BudgetSpec.requests", _on("BudgetSpec.requests", 11), "LLM budget requests"),
    ("BudgetSpec.cost", _on("BudgetSpec.cost", 50.0), "LLM budget cost"),
    ("BudgetSpec.hosts", _on("BudgetSpec.hosts", ("api.openai.com",)), "LLM host api.anthropic.com no longer metered"),
    ("BudgetSpec.prices", _on("BudgetSpec.prices", (("gpt-4o*", 0.1, 10.0), ("*", 5.0, 15.0))), "LLM price of gpt-4o*"),
    ("BudgetSpec.prices", _on("BudgetSpec.prices", (("gpt-4o*", 2.5, 10.0),)), "LLM price of *: 5.0/15.0 -> none"),
    ("EgressPolicy.allow", _on("EgressPolicy.allow", fn=lambda a: a + (__import__("dataclasses").replace(
        a[0], id="x", host="b.test"),)), "new egress b.test:443"),
    ("EgressPolicy.deny", _on("EgressPolicy.deny", fn=lambda d: tuple(x for x in d if x.host != "a.test")), "deny rule"),
    ("EgressPolicy.hosts", _on("EgressPolicy.hosts", (("a.test", "10.0.0.9"),)), "hosts maps a.test to 10.0.0.9"),
    ("EgressPolicy.upstream_ca", _on("EgressPolicy.upstream_ca", "/etc/evil-ca.pem"), "upstreamCa"),
    ("EgressPolicy.limits", _on("EgressPolicy.limits", fn=lambda lim: __import__("dataclasses").replace(
        lim, bytes_out=lim.bytes_out * 2)), "bytesOut"),
    ("EgressLimits.connections", _on("EgressLimits.connections", fn=lambda v: v * 2), "connections"),
    ("EgressLimits.requests_per_second", _on("EgressLimits.requests_per_second", fn=lambda v: v * 2),
     "requestsPerSecond"),
    ("EgressLimits.burst", _on("EgressLimits.burst", fn=lambda v: v * 2), "burst"),
    ("EgressLimits.bytes_out", _on("EgressLimits.bytes_out", fn=lambda v: v * 2), "bytesOut"),
    ("Rule.id", _on("Rule.id", "renamed"), None),
    ("Rule.host", _on("Rule.host", "c.test"), "new egress c.test:443"),
    ("Rule.ports", _on("Rule.ports", (443, 8443)), "new egress a.test:8443"),
    ("Rule.methods", _on("Rule.methods", ("GET", "POST")), "more methods"),
    ("Rule.paths", _on("Rule.paths", ()), "more paths"),
    ("Rule.max_body", _on("Rule.max_body", None), "maxBody"),
    ("Rule.websocket", _on("Rule.websocket", True), "WebSockets"),
    ("Rule.ask", _on("Rule.ask", False), "no human approval"),
    ("MountGrant.host", _on("MountGrant.host", "/usr/share/man"), "new grant /usr/share/man"),
    ("MountGrant.path", _on("MountGrant.path", "/man"), "new grant"),
    ("MountGrant.writable", _on("MountGrant.writable", True), "ro -> rw"),
    ("MountGrant.review", _on("MountGrant.review", True), "ro -> review"),
    ("MountGrant.writable_trusted", _on("MountGrant.writable_trusted", (".git",)), "change .git"),
    ("CredentialBinding.name", _on("CredentialBinding.name", "other"), "new credential other"),
    ("CredentialBinding.hosts", _on("CredentialBinding.hosts", ("a.test", "b.test")), "also for b.test"),
    ("CredentialBinding.hosts", _on("CredentialBinding.hosts", ()), None),
] + [(f"CredentialBinding.{k}", _on(f"CredentialBinding.{k}", v), "credential key changed") for k, v in (
    ("env", "OTHER"), ("ref", "vault:other"), ("header", "x-api-key"), ("format", "{}"), ("basic", "user"),
    ("query", "key"), ("file", "/tmp/k"), ("prefix", "sk-"), ("length", 99), ("charset", "hex"),
    ("sigv4_access_key_id", "AKIDX"), ("sigv4_key_env", "OTHER"), ("hmac", (("a", "b"),)), ("inspect", "lenient"),
    ("broker", __import__("agentvm.gate.brokers", fromlist=["BrokerSpec"]).BrokerSpec(kind="oauth2-refresh")),
    ("ssh_known_hosts", ("git.test ssh-ed25519 AAAA",)))] + [
    ("ToolPolicy.servers", _on("ToolPolicy.servers", fn=lambda s: s + (__import__("dataclasses").replace(
        s[0], name="more"),)), "new tool server more"),
    ("ToolPolicy.tier_approval", _on("ToolPolicy.tier_approval", ()), "destructive tools no longer always need"),
    ("ToolPolicy.approval_timeout", _on("ToolPolicy.approval_timeout", 1.0), None),
    ("ToolPolicy.webhook", _on("ToolPolicy.webhook", "https://hook.test/x"), None),
    ("ToolPolicy.tier", _on("ToolPolicy.tier", "L5"), None),
    ("ServerPolicy.name", lambda p: p, None),
    ("ServerPolicy.kind", _on("ServerPolicy.kind", "remote"), "kind changed"),
    ("ServerPolicy.command", _on("ServerPolicy.command", ("evil-mcp",)), "command changed"),
    ("ServerPolicy.url", _on("ServerPolicy.url", "https://evil.test/mcp"), "url changed"),
    ("ServerPolicy.allow", _on("ServerPolicy.allow", ("read_note", "list_notes", "rm_note")), "allows rm_note"),
    ("ServerPolicy.deny", _on("ServerPolicy.deny", ()), "no longer denies *admin*"),
    ("ServerPolicy.approve", _on("ServerPolicy.approve", ()), "no longer needs a human for write_note"),
    ("ServerPolicy.risk", _on("ServerPolicy.risk", (("read_note", "read"), ("write_note", "read"))),
     "risk of write_note: write -> read"),
    ("ServerPolicy.arguments", _on("ServerPolicy.arguments", ()), "argument constraints of read_note"),
    ("ServerPolicy.resources", _on("ServerPolicy.resources", ("file:///srv/notes/*", "file:///etc/*")),
     "shows resources file:///etc/*"),
    ("ServerPolicy.prompts", _on("ServerPolicy.prompts", ("summary", "*")), "shows prompts *"),
    ("ServerPolicy.calls_per_minute", _on("ServerPolicy.calls_per_minute", 1000), "callsPerMinute"),
    ("ServerPolicy.timeout", _on("ServerPolicy.timeout", 500.0), "timeout"),
    ("ServerPolicy.max_arguments", _on("ServerPolicy.max_arguments", 1 << 30), "maxArguments"),
    ("ServerPolicy.max_result", _on("ServerPolicy.max_result", 1 << 30), "maxResult"),
    ("ServerPolicy.sandbox_spec", _on("ServerPolicy.sandbox_spec", "{}"), "sandbox"),
    ("ServerPolicy.remote_egress", _on("ServerPolicy.remote_egress", object()), "egress endpoint"),
    ("ServerPolicy.remote_credentials", _on("ServerPolicy.remote_credentials", ("x",)), "credentials changed"),
]


def test_every_policy_field_has_a_widening_rule():
    """A new field of the compiled policy (or of a part of it) without a rule in fleet.JUDGED
    fails here: nothing an agent may do or spend goes unjudged by `agentvm plan`."""
    from dataclasses import fields

    from agentvm.gate.budget import BudgetSpec
    from agentvm.gate.credentials import CredentialBinding
    from agentvm.gate.policy import EgressLimits, EgressPolicy, Rule
    from agentvm.policy import Limits, MountGrant, Policy
    from agentvm.tools.policy import ServerPolicy, ToolPolicy

    for cls in (Policy, Limits, BudgetSpec, EgressPolicy, EgressLimits, Rule, MountGrant, CredentialBinding,
                ToolPolicy, ServerPolicy):
        assert {f.name for f in fields(cls)} == set(fl.JUDGED[cls.__name__]), cls.__name__
        for f in fields(cls):
            assert any(case[0] == f"{cls.__name__}.{f.name}" for case in WIDENS), \
                f"no widening case for {cls.__name__}.{f.name} in WIDENS"


@pytest.mark.parametrize("field, change, word", WIDENS, ids=[c[0] for c in WIDENS])
def test_widening_field_by_field(field, change, word):
    base = _rich()
    got = fl.widening(base, change(base))
    if word is None:
        assert got == [], got
    else:
        assert any(word in w for w in got), (word, got)


#: (old risk map, new risk map, a word of the widening line it must produce - or None: no lowering)
RISK_LOWERED = [
    ({"[d]elete_repo": "destructive"}, {}, "risk of [d]elete_repo: destructive -> write"),  # a glob not matching its text
    ({"[d]elete_repo": "destructive"}, {"[d]elete_repo": "read"}, "risk of [d]elete_repo: destructive -> read"),
    ({"[d]elete_*": "destructive", "*": "read"}, {"*": "read"}, "risk of [d]elete_*: destructive -> write"),
    ({"rm_note": "destructive"}, {}, "risk of rm_note: destructive -> write"),
    ({"rm_*": "destructive"}, {"rm_*": "write"}, "risk of rm_*: destructive -> write"),
    ({"get_[a-z]*": "write"}, {"get_[a-z]*": "read"}, "risk of get_[a-z]*: write -> read"),
    ({"[d]elete_repo": "destructive"}, {"[d]elete_repo": "destructive", "x": "destructive"}, None),
    ({"rm_note": "destructive"}, {"rm_*": "destructive"}, None),  # a plain name: still destructive
    ({"read_[a-z]*": "read"}, {}, None),  # read -> write is narrower
]


@pytest.mark.parametrize("old, new, word", RISK_LOWERED, ids=[str(c[:2]) for c in RISK_LOWERED])
def test_a_lowered_risk_class_is_seen_whatever_glob_names_it(old, new, word):
    """`plan` probed each risk glob as a tool name: ``[d]elete_repo`` does not match its own
    text, so dropping it (delete_repo: destructive -> write, which can drop the tier's forced
    approval) was not a widening. Entries are also compared by their exact key."""
    base = _rich()
    was = _on("ServerPolicy.risk", tuple(sorted(old.items())))(base)
    was = _on("ServerPolicy.allow", ("*",))(was)
    now = _on("ServerPolicy.risk", tuple(sorted(new.items())))(was)
    got = [w for w in fl.widening(was, now) if "risk of" in w]
    if word is None:
        assert got == [], got
    else:
        assert any(word in w for w in got), (word, got)


def test_budget_hosts_removed_but_no_longer_reachable_and_lowered_prices_without_a_cost_budget_do_not_widen():
    from dataclasses import replace

    base = _rich()
    b = base.limits.budget
    gone = replace(base, limits=replace(base.limits, budget=replace(b, hosts=("api.openai.com",))),
                   egress=replace(base.egress, allow=tuple(r for r in base.egress.allow if r.host != "api.anthropic.com")))
    assert fl.widening(base, gone) == []
    nocost = replace(base, limits=replace(base.limits, budget=replace(b, cost=None)))
    cheaper = replace(nocost, limits=replace(nocost.limits, budget=replace(nocost.limits.budget,
                                                                           prices=(("*", 0.1, 0.1),))))
    assert fl.widening(nocost, cheaper) == []


def test_plan_json_lists_the_widening_of_a_budget_host_removed(repo):
    """Issue 35: `plan --json` said "widening": [] when an LLM host left limits.budget.hosts
    while egress to it stayed allowed - CI gating on it missed the unmetered host."""
    c1 = commit(repo, {"w.yaml": agent("w", RICH)})
    f1 = fl.load(repo, c1)
    c2 = commit(repo, {"w.yaml": agent("w", RICH.replace("hosts: [api.openai.com, api.anthropic.com]",
                                                           "hosts: [api.openai.com]"))})
    f2 = fl.load(repo, c2)
    cur = {"w": {"policy": f1.agents["w"].policy, "digest": f1.agents["w"].digest, "fleet": True, "running": True}}
    doc = fl.make_plan(f2, cur, c1).to_dict()
    action = [a for a in doc["actions"] if a["name"] == "w"][0]
    assert doc["widening"] == 1 and any("api.anthropic.com no longer metered" in w for w in action["widening"])


def test_a_route_where_there_was_none_lists_every_rule_once():
    from dataclasses import replace

    base = _rich()
    none = replace(base, network="none", egress=None, credentials=(), tools=None)
    w = fl.widening(none, replace(none, network="gate", egress=base.egress))
    assert w.count("network: none -> gate") == 1 and "new egress a.test:443" in w


@pytest.mark.parametrize("extra", [
    'limits:\n  budget:\n    cost: 5\n    prices: {"gpt-4o*": {input: 2.5, output: 10}, "gpt-4*": {input: 30, output: 60}, '
    '"*": {input: 5, output: 15}}\n',
    "riskTier: L3\ntools:\n  - {name: n, command: [x], allow: ['*'], risk: {'*': read, rm_note: destructive}}\n",
])
def test_a_map_whose_order_means_something_is_stored_with_its_meaning(repo, extra):
    """The stored (resolved) spec must compile to the file's policy whatever the order of its
    maps: such an agent was refused ("its resolved form compiles to another policy")."""
    c = commit(repo, {"w.yaml": agent("w", extra)})
    f = fl.load(repo, c)
    assert f.agents["w"].digest == f.agents["w"].policy.digest()


def test_a_repo_path_the_kernel_refuses_is_the_operators_error_not_a_crash(tmp_path):
    # found by the API fuzzer: a 5000-character --repo raised OSError (ENAMETOOLONG) -> a 500
    from agentvm import fleet as fl

    for repo in ("0" * 5000, str(tmp_path / ("x" * 300))):
        with pytest.raises(fl.FleetError) as e:
            fl.resolve(repo, "HEAD")
        assert e.value.exit_code == 78


def test_grant_and_probe_levels_judge_both_directions():
    from agentvm.policy import MountGrant

    ro, review, rw = (MountGrant("/h", "/g", False), MountGrant("/h", "/g", True, review=True),
                      MountGrant("/h", "/g", True))
    assert fl._mounts((review,), (rw,)) == ["grant /h -> /g: review -> rw"]  # writes now reach the host
    assert fl._mounts((ro,), (review,)) == ["grant /h -> /g: ro -> review"]
    assert fl._mounts((rw,), (review,)) == [] and fl._mounts((review,), (ro,)) == []
    judge = fl.JUDGED["Policy"]["on_escape_probe"]
    assert judge("stop", "log") == ["escape probes: stop -> log (a weaker response)"]
    assert judge("log", "pause") == [] and judge("alert", "alert") == []

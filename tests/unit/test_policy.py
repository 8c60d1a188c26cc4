import pytest

from agentvm.errors import ConfigError, PolicyDenied
from agentvm.policy import MountGrant, Policy, check_tier, compile_policy, parse_mount_arg, with_overrides
from agentvm.spec.loader import load_agent_text

AGENT = """
apiVersion: agentvm/v1
kind: Agent
metadata: {name: builder}
spec:
  command: [make, test]
  riskTier: L1
  mounts:
    - {host: /srv/src, path: /src, mode: rw}
    - {host: /srv/ref, path: /ref}
  env: {B: "2", A: "1"}
  limits: {memory: 256M, timeout: 5m, pids: 64}
"""


def test_compile_policy_is_pure_and_stable():
    spec = load_agent_text(AGENT, "builder.yaml").spec
    p1, p2 = compile_policy(spec), compile_policy(spec)
    assert p1 == p2 and p1.digest() == p2.digest()
    assert p1.name == "builder" and p1.agent is True
    assert p1.command == ("make", "test")
    assert p1.mounts == (MountGrant("/srv/src", "/src", True), MountGrant("/srv/ref", "/ref", False))
    assert p1.env == (("A", "1"), ("B", "2"))  # sorted: the digest does not depend on YAML order
    assert p1.limits.memory == 256 * 1024**2 and p1.limits.timeout == 300 and p1.limits.pids == 64
    assert p1.cwd == "/workspace"
    assert p1.pending_features == ()


def test_digest_changes_with_any_field():
    p = Policy(name="x", command=("true",))
    assert p.digest() != Policy(name="x", command=("false",)).digest()
    assert p.digest().startswith("sha256:")


def test_tool_servers_compile_local_and_remote():
    # a remote server's own egress is its url (host, port, path) and nothing else
    text = AGENT.replace("riskTier: L1", "riskTier: L3") + "  tools:\n    - {name: fs, url: 'https://mcp.example.com:8443/v1/mcp', allow: [x]}\n"
    p = compile_policy(load_agent_text(text, "a.yaml").spec)
    assert p.pending_features == ()
    eg = p.tools.servers[0].remote_egress
    assert [(r.host, r.ports, r.paths) for r in eg.allow] == [("mcp.example.com", (8443,), ("/v1/mcp",))]
    assert p.egress.allow == ()  # the agent gains no egress from it
    local = AGENT.replace("riskTier: L1", "riskTier: L3") + "  tools:\n    - {name: fs, command: [fs-mcp], allow: [x]}\n"
    p = compile_policy(load_agent_text(local, "a.yaml").spec)
    assert p.pending_features == () and p.tools.servers[0].name == "fs"


CRED = """  egress:
    allow:
      - {host: api.example.com}
  credentials:
    - {name: k, env: API_KEY, ref: 'vault:k', hosts: [api.example.com], inject: {header: Authorization, format: 'Bearer {}'}}
"""


def test_credentials_compile_to_bindings_without_values():
    p = compile_policy(load_agent_text(AGENT.replace("riskTier: L1", "riskTier: L3") + CRED, "a.yaml").spec)
    (b,) = p.credentials
    assert (b.name, b.env, b.ref, b.hosts, b.header, b.format, b.mode) == (
        "k", "API_KEY", "vault:k", ("api.example.com",), "authorization", "Bearer {}", "header")
    assert p.pending_features == ()


def test_credential_hosts_must_be_allowed_by_egress():
    bad = CRED.replace("- {host: api.example.com}", "- {host: other.example.com}")
    with pytest.raises(ConfigError) as ei:
        compile_policy(load_agent_text(AGENT.replace("riskTier: L1", "riskTier: L3") + bad, "a.yaml").spec)
    assert "api.example.com" in ei.value.message


def test_egress_compiles_with_the_default_doh_denies():
    text = AGENT.replace("riskTier: L1", "riskTier: L2") + "  egress:\n    allow:\n      - {host: example.com}\n"
    p = compile_policy(load_agent_text(text, "a.yaml").spec)
    assert p.pending_features == ()
    assert [r.host for r in p.egress.allow] == ["example.com"]
    ids = {r.id for r in p.egress.deny}
    assert "doh:dns.google" in ids and "doh:cloudflare-dns.com" in ids
    cli = with_overrides(Policy(name="x", command=("true",)), allow=("pypi.org",))
    assert "doh:dns.google" in {r.id for r in cli.egress.deny}
    assert cli.egress.allow[0].ports == (80, 443)


@pytest.mark.parametrize(
    "arg,expected",
    [
        ("/a:/b", MountGrant("/a", "/b", False)),
        ("/a:/b:ro", MountGrant("/a", "/b", False)),
        ("/a:/b:rw", MountGrant("/a", "/b", True)),
        ("/a//x/:/data/", MountGrant("/a/x", "/data", False)),
    ],
)
def test_parse_mount_arg(arg, expected):
    assert parse_mount_arg(arg) == expected


@pytest.mark.parametrize(
    "bad", ["/a", "a:/b", "/a:b", "/a:/b:rx", "/a:/proc", "/a:/usr/lib", "/a:/", "/a/../etc:/b", "/a:/b/../c", ":/b"]
)
def test_parse_mount_arg_rejects(bad):
    with pytest.raises(ConfigError):
        parse_mount_arg(bad)


def test_overrides_merge_and_recheck_tier():
    base = Policy(name="x", command=("true",), risk_tier="L0")
    with pytest.raises(PolicyDenied):
        with_overrides(base, mounts=(MountGrant("/a", "/b", True),))
    ok = with_overrides(base, mounts=(MountGrant("/a", "/b", False),), env={"K": "v"}, timeout=3.0, memory=64 * 1024**2)
    assert ok.mounts == (MountGrant("/a", "/b", False),)
    assert dict(ok.env) == {"K": "v"}
    assert ok.limits.timeout == 3.0 and ok.limits.memory == 64 * 1024**2
    with pytest.raises(ConfigError):
        with_overrides(base, env={"BAD-NAME": "x"})
    with pytest.raises(ConfigError):
        with_overrides(base, memory=1024)
    with pytest.raises(ConfigError):
        with_overrides(Policy(name="x"), mounts=(MountGrant("/a", "/workspace", False),))


def test_tier_ceiling_for_ptrace():
    with pytest.raises(PolicyDenied):
        check_tier(Policy(name="x", allow_ptrace=True, risk_tier="L3"))
    check_tier(Policy(name="x", allow_ptrace=True, risk_tier="L4"))


def _old_to_dict(p: Policy) -> dict:
    """Policy.to_dict as it was (asdict of everything, then egress replaced): digests that were
    stored (fleet commits, audit records) must keep meaning the same policy."""
    from dataclasses import asdict

    d = asdict(p)
    if p.egress is not None:
        d["egress"] = p.egress.to_dict()
    if p.limits.budget is None:
        d["limits"].pop("budget", None)
    for m in d["mounts"]:  # MountGrant.review (added later): left out when unset
        if not m.get("review"):
            m.pop("review", None)
    if p.image is None:
        d.pop("image", None)
    if not p.image_signers:
        d.pop("image_signers", None)
    if p.on_escape_probe == "log":  # added later: left out at its default
        d.pop("on_escape_probe", None)
    return d


def test_to_dict_is_exactly_what_asdict_made_and_digests_are_unchanged():
    import json
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    policies = [Policy(name="x", command=("true",)), Policy(name="n", network="none"),
                compile_policy(load_agent_text(AGENT, "builder.yaml").spec),
                compile_policy(load_agent_text(AGENT.replace("riskTier: L1", "riskTier: L3") + CRED, "c.yaml").spec),
                compile_policy(load_agent_text(AGENT.replace("riskTier: L1", "riskTier: L3")
                                               + "  tools:\n    - {name: fs, command: [fs-mcp], allow: [x]}\n",
                                               "t.yaml").spec)]
    for f in sorted(examples.rglob("*.yaml")):
        try:
            policies.append(compile_policy(load_agent_text(f.read_text(), str(f)).spec))
        except Exception:  # noqa: BLE001 - presets and other kinds in examples/
            continue
    assert len(policies) >= 7
    for p in policies:
        new, old = p.to_dict(), _old_to_dict(p)
        assert list(new) == list(old)
        assert json.dumps(new, sort_keys=True, default=str) == json.dumps(old, sort_keys=True, default=str)

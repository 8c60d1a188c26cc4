"""The tool policy and its one decision function (pure; no I/O, never raises).

``decide(server, tool, arguments, policy)`` is to a tool call what ``gate.policy.decide`` is
to an egress request: deny rules first (deny wins), then the allowlist (no match: denied -
and hidden from ``tools/list``), then the argument constraints, then whether a human must
answer first (``approve`` globs, or a risk class the tier always puts before a human). An
exception is a deny. The risk class of a tool comes only from the agent file (``risk``);
what a server says about its own tools (``destructiveHint``...) is never consulted.

Names are folded only where folding narrows. ``deny``, ``approve`` (as "a human first"),
``risk`` and ``arguments`` globs, and server names, are compared in one normal form
(:func:`agentvm.names.norm`: NFKC + case folding): ``deny: ["*admin*"]`` denies
``ADMIN_RESET``, whatever case the agent or the server spells it in. What a glob *lets
through* - ``allow``, ``approve`` as the only rule naming a tool, ``prompts`` - is compared
exactly (``fnmatchcase``): ``allow: ["get_*"]`` never allows ``GET_ADMIN_TOKEN``, which a
case-sensitive server may well have as another tool. The gateway also forwards a call only
under a name its server lists, exactly (``tools/list``).

A name is refused before it is compared (:func:`valid_exposed`, :data:`TOOL_NAME_RE`): tool
names are ASCII (letters, digits, ``_ . - /``), 1-128 characters, so nothing an agent sends
is normalised at any length (NFKC can make a string 18 times longer).
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from agentvm import names

SEP = "__"  # the agent sees SERVER__TOOL
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_.\-/]{1,128}")
MAX_EXPOSED = 2 * 128 + len(SEP)  # SERVER__TOOL: a longer name is refused unread
MAX_SERVER_PART = 64  # characters of the SERVER part (declared server names are 1-32 of [a-z0-9-])
_EXPOSED_RE = re.compile(r"[A-Za-z0-9_.\-/]+")
REQUEST_ACCESS = "agentvm__request_access"  # the tool the gateway itself always offers


@dataclass(frozen=True)
class ArgRule:
    name: str
    path: str | None = None
    pattern: str | None = None
    enum: tuple = ()
    has_enum: bool = False
    max_length: int | None = None
    required: bool = False


@dataclass(frozen=True)
class ServerPolicy:
    name: str
    kind: str  # "local" | "remote"
    command: tuple[str, ...] = ()
    url: str | None = None
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    approve: tuple[str, ...] = ()
    risk: tuple[tuple[str, str], ...] = ()  # (glob, class), sorted: the most severe matching class wins
    arguments: tuple[tuple[str, tuple[ArgRule, ...]], ...] = ()  # (tool glob, rules), sorted: every matching glob applies
    resources: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()
    calls_per_minute: int = 60
    timeout: float = 60.0
    max_arguments: int = 256 * 1024
    max_result: int = 1024 * 1024
    sandbox_spec: str = ""  # local: the agent file (JSON) of the server's own sandbox
    remote_egress: object = None  # remote: the EgressPolicy of its gate endpoint (the url's host and path only)
    remote_credentials: tuple = ()  # remote: CredentialBindings swapped in at that endpoint (header injection)


@dataclass(frozen=True)
class ToolPolicy:
    servers: tuple[ServerPolicy, ...] = ()
    tier_approval: tuple[str, ...] = ()  # risk classes that always need a human at this tier
    approval_timeout: float = 300.0
    webhook: str | None = None
    tier: str = "L2"  # the agent's risk tier: the ceiling of what agentvm__request_access can be granted

    def server(self, name: str) -> ServerPolicy | None:
        return names.find(self.servers, name)


@dataclass(frozen=True)
class ToolDecision:
    verdict: str  # "allow" | "deny" | "ask"
    rule_id: str
    reason: str
    risk: str = "write"
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def allowed(self) -> bool:
        return self.verdict == "allow"


def _deny(rule: str, reason: str) -> ToolDecision:
    return ToolDecision("deny", rule, reason)


def valid_exposed(name) -> bool:
    """``name`` may be a tool's name as the agent sees it (``SERVER__TOOL``, or the gateway's
    own): a string of at most :data:`MAX_EXPOSED` characters whose TOOL part is of the
    tool-name alphabet (ASCII). The SERVER part (at most :data:`MAX_SERVER_PART` printable
    characters) may be another spelling of a declared server - ``ｔ`` or ``T`` is the server
    ``t``: it only routes (the call goes to the server as declared) and every rule that
    narrows still applies. Checked before anything compares it (length first: nothing long
    is ever normalised or matched)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_EXPOSED:
        return False
    server, sep, tool = name.partition(SEP)
    if not sep:
        return _EXPOSED_RE.fullmatch(name) is not None
    return (0 < len(server) <= MAX_SERVER_PART and server.isprintable() and not server.isspace()
            and _EXPOSED_RE.fullmatch(tool) is not None)


def _match(globs, name: str) -> str | None:
    """The first glob naming ``name`` in normal form: for the rules that narrow (deny, approve
    as "a human first", risk, arguments) - case and compatibility forms never get a name past
    them."""
    return names.first_match(globs, name)


def _exact(globs, name: str) -> str | None:
    """The first glob naming ``name`` exactly (``fnmatchcase``): for the rules that let a name
    through (allow, approve as the only rule, prompts) - folding would widen them."""
    for g in globs:
        if fnmatchcase(name, g):
            return g
    return None


def split_name(exposed: str) -> tuple[str, str] | None:
    """``SERVER__TOOL`` -> (server, tool); None if it has no server part."""
    if not isinstance(exposed, str):
        return None
    server, sep, tool = exposed.partition(SEP)
    if not sep or not server or not tool:
        return None
    return server, tool


def visible(sp: ServerPolicy, tool: str) -> bool:
    """Whether the agent may see ``tool`` of ``sp`` in ``tools/list`` (the same rules as a call,
    minus arguments: a hidden tool is also denied)."""
    try:
        return (isinstance(tool, str) and TOOL_NAME_RE.fullmatch(tool) is not None and _match(sp.deny, tool) is None
                and (_exact(sp.allow, tool) is not None or _exact(sp.approve, tool) is not None))
    except Exception:  # noqa: BLE001 - fail closed
        return False


RISK_ORDER = ("read", "write", "destructive")


def risk_of(sp: ServerPolicy, tool: str) -> str:
    """The tool's risk class: the most severe of the classes whose globs match it (the order of
    the agent file's map does not matter: a stored, key-sorted copy means the same), ``write``
    when none does."""
    found = [cls for g, cls in sp.risk if names.match(tool, g)]
    if not found:
        return "write"
    return max(found, key=lambda c: RISK_ORDER.index(c) if c in RISK_ORDER else len(RISK_ORDER))


def _check_arg(rule: ArgRule, present: bool, value: Any) -> str | None:
    if not present:
        return "is required" if rule.required else None
    if rule.has_enum and not any(type(value) is type(e) and value == e for e in rule.enum):
        return "is not one of the allowed values"
    if rule.max_length is not None:
        if not isinstance(value, str):
            return "must be a string"
        if len(value) > rule.max_length:
            return f"is longer than {rule.max_length} characters"
    if rule.pattern is not None:
        if not isinstance(value, str) or re.fullmatch(rule.pattern, value) is None:
            return "does not match the allowed pattern"
    if rule.path is not None:
        if not isinstance(value, str) or "\x00" in value or not value.startswith("/"):
            return f"must be an absolute path inside {rule.path}"
        norm = posixpath.normpath(value)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        root = rule.path.rstrip("/") or "/"
        if not (norm == root or norm.startswith(root + "/") or root == "/"):
            return f"is outside {rule.path}"
    return None


def _decide(sp: ServerPolicy, tool: str, arguments: Any, policy: ToolPolicy) -> ToolDecision:
    if not isinstance(tool, str) or not TOOL_NAME_RE.fullmatch(tool):
        return _deny("tools:invalid-name", "the tool name is not a valid tool name")
    target = f"{sp.name}{SEP}{tool}"
    g = _match(sp.deny, tool)
    if g is not None:
        return _deny(f"tools:deny:{sp.name}:{g}", f"{target} is denied by the rule {g!r} of server {sp.name}")
    allow_g = _exact(sp.allow, tool)  # what lets a name through: exactly
    approve_g = _match(sp.approve, tool)  # a human first: in any spelling
    if allow_g is None and _exact(sp.approve, tool) is None:
        return _deny("tools:not-allowed", f"{target} is not allowed (no allow or approve rule of server "
                     f"{sp.name} names it)")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return _deny("tools:bad-arguments", f"the arguments of {target} are not an object")
    size = len(json.dumps(arguments, separators=(",", ":"), ensure_ascii=False, default=str).encode())
    if size > sp.max_arguments:
        return _deny("tools:arguments-too-large", f"the arguments of {target} are {size} bytes, over "
                     f"{sp.max_arguments}")
    for glob, rules in sp.arguments:
        if not names.match(tool, glob):
            continue
        for r in rules:
            why = _check_arg(r, r.name in arguments, arguments.get(r.name))
            if why is not None:
                return _deny(f"tools:argument:{r.name}", f"argument {r.name!r} of {target} {why}")
    cls = risk_of(sp, tool)
    if approve_g is not None:
        return ToolDecision("ask", f"tools:approve:{sp.name}:{approve_g}",
                            f"{target} needs a human approval (rule {approve_g!r})", cls)
    if cls in policy.tier_approval:
        return ToolDecision("ask", f"tools:tier:{cls}", f"{target} is a {cls} tool: every call needs a human "
                            "approval at this risk tier", cls)
    return ToolDecision("allow", f"tools:allow:{sp.name}:{allow_g}", f"{target} allowed by rule {allow_g!r}", cls)


def decide(server: str, tool: str, arguments: Any, policy: ToolPolicy) -> ToolDecision:
    """The single place tool policy is evaluated. Never raises: an exception denies."""
    try:
        sp = policy.server(server) if isinstance(server, str) else None
        if sp is None:
            return _deny("tools:unknown-server", "no tool server of that name is declared")
        return _decide(sp, tool, arguments, policy)
    except Exception as exc:  # noqa: BLE001 - fail closed
        return _deny("tools:internal-error", f"tool policy evaluation failed ({type(exc).__name__})")


_URI_TRICKS = re.compile(r"(^|/)\.\.?(/|$)|%2e|%2f|%5c|%00|\\", re.IGNORECASE)


def resource_allowed(sp: ServerPolicy, uri: str) -> bool:
    """Whether ``uri`` matches the server's ``resources`` globs. A URI with dot segments (raw
    or percent-encoded), an encoded slash or backslash, a backslash or a control character is
    refused before matching: a glob like ``file:///srv/notes/*`` must not reach ``../..``."""
    try:
        # a URI is a path, not a name: compared exactly (file:///SRV is not file:///srv on a
        # case-sensitive file system - folding it would widen the glob)
        return (isinstance(uri, str) and len(uri) <= 4096 and uri.isprintable() and _URI_TRICKS.search(uri) is None
                and any(fnmatchcase(uri, g) for g in sp.resources))
    except Exception:  # noqa: BLE001
        return False


def prompt_allowed(sp: ServerPolicy, name: str) -> bool:
    try:
        return isinstance(name, str) and TOOL_NAME_RE.fullmatch(name) is not None and _exact(sp.prompts, name) is not None
    except Exception:  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------- compile

def _sandbox_spec(agent: str, tier: str, srv, substrate: str = "bwrap") -> str:
    """The agent file of a local server's own sandbox: its command, grants, environment, egress
    and credentials - nothing of the agent's (no workspace, no grants, no credentials)."""
    # unique per (agent, server): a tool server's sandbox gets a uid of its own, never one shared
    # with another agent's server whose agent name starts the same
    import hashlib

    tag = hashlib.sha256(agent.encode()).hexdigest()[:6]
    name = f"{agent[:18].rstrip('-')}-{tag}-tool-{srv.name}"[:63].rstrip("-")
    spec: dict = {
        "command": list(srv.command),
        "riskTier": tier,
        "substrate": substrate,  # the agent's: a server is never on a weaker boundary than its agent
        "workspace": {"enabled": False},
        "limits": {"memory": srv.memory, "timeout": 0},
    }
    if srv.mounts:
        spec["mounts"] = [m.model_dump(by_alias=True, exclude_defaults=True) | {"host": m.host, "path": m.path}
                          for m in srv.mounts]
    if srv.env:
        spec["env"] = dict(srv.env)
    if srv.egress.allow or srv.egress.deny or srv.egress.hosts:
        spec["egress"] = srv.egress.model_dump(by_alias=True, exclude_defaults=True)
    if srv.credentials:
        spec["credentials"] = [c.model_dump(by_alias=True, exclude_defaults=True) for c in srv.credentials]
    doc = {"apiVersion": "agentvm/v1", "kind": "Agent", "metadata": {"name": name}, "spec": spec}
    return json.dumps(doc, sort_keys=True)


def _remote(srv):
    """A remote server's own egress (its url's host, port and path, nothing else) and credentials."""
    from types import SimpleNamespace
    from urllib.parse import urlsplit

    from agentvm.gate.credentials import compile_credentials
    from agentvm.gate.policy import compile_egress

    u = urlsplit(srv.url)
    try:
        port = u.port or 443
    except ValueError:
        raise ValueError(f"tools[{srv.name}].url: invalid port") from None
    path = u.path or "/"
    rule = SimpleNamespace(host=u.hostname, ports=[port], methods=["GET", "POST", "DELETE"], paths=[path],
                           max_body=None, websocket=False, id=f"tool:{srv.name}")
    egress = compile_egress(SimpleNamespace(allow=[rule], deny=[], hosts=dict(srv.egress.hosts),
                                            upstream_ca=srv.egress.upstream_ca, limits=None))
    creds = compile_credentials(srv.credentials) if srv.credentials else ()
    from agentvm.egress_defaults import check_credential_hosts, with_default_denies

    egress = with_default_denies(egress)
    check_credential_hosts(creds, egress)
    return egress, creds


def compile_tools(body, agent: str) -> ToolPolicy:
    """``spec.tools`` + ``spec.approvals`` (validated models) -> :class:`ToolPolicy`."""
    from agentvm.spec.models import TIER_TOOL_APPROVAL

    tier = body.risk_tier.value
    seen = set()
    servers = []
    for srv in body.tools:
        if names.norm(srv.name) in seen:  # (two names one normal form apart are one server to every rule)
            raise ValueError(f"spec.tools: two servers are named {srv.name!r}")
        seen.add(names.norm(srv.name))
        args = tuple(
            (glob, tuple(ArgRule(name=a, path=r.path, pattern=r.pattern, enum=tuple(r.enum or ()),
                                 has_enum=r.enum is not None, max_length=r.max_length, required=r.required)
                         for a, r in sorted(rules.items())))
            for glob, rules in sorted(srv.arguments.items()))
        lim = srv.limits
        remote_egress, remote_creds = _remote(srv) if srv.url else (None, ())
        servers.append(ServerPolicy(
            name=srv.name, kind="local" if srv.command else "remote", command=tuple(srv.command), url=srv.url,
            allow=tuple(srv.allow), deny=tuple(srv.deny), approve=tuple(srv.approve),
            risk=tuple(sorted(srv.risk.items())), arguments=args, resources=tuple(srv.resources), prompts=tuple(srv.prompts),
            calls_per_minute=lim.calls_per_minute, timeout=lim.timeout, max_arguments=lim.max_arguments,
            max_result=lim.max_result,
            sandbox_spec=_sandbox_spec(agent, tier, srv, body.substrate) if srv.command else "",
            remote_egress=remote_egress, remote_credentials=remote_creds))
    return ToolPolicy(servers=tuple(servers), tier_approval=tuple(sorted(TIER_TOOL_APPROVAL[tier])),
                      approval_timeout=body.approvals.timeout, webhook=body.approvals.webhook, tier=tier)


LIVE_ACTIONS = ("allow", "deny", "approve")
GRANT = "grant"  # an approved request_access: adds to allow only (never lifts a deny or an approve)


def apply_live(policy: ToolPolicy, changes: list, *, grants: bool = False) -> ToolPolicy:
    """Live changes (``agentvm policy NAME tools allow|deny|approve SERVER__TOOL``) over the
    agent file's tool policy, in order. ``deny`` wins over everything and ``approve`` over
    ``allow`` (as in :func:`decide`), so narrowing is immediate; ``allow`` also lifts a live
    ``deny`` of the same name. Raises ValueError on a change that names nothing declared."""
    from dataclasses import replace

    servers = {s.name: s for s in policy.servers}
    for ch in changes:
        action, server, tool = ch.get("action"), ch.get("server"), ch.get("tool")
        if action not in LIVE_ACTIONS and not (grants and action == GRANT):
            raise ValueError(f"tools action is one of {', '.join(LIVE_ACTIONS)}")
        found = names.find(servers, server, key=lambda n: n)
        if found is None:
            raise ValueError(f"no tool server {str(server)[:64]!r} (declared: {', '.join(servers) or 'none'})")
        server = found
        if not isinstance(tool, str) or not re.fullmatch(r"[A-Za-z0-9_.*?/-]{1,128}", tool):
            raise ValueError("the tool is a name or glob (letters, digits, _ . - / and * ?)")
        sp = servers[server]
        if action == GRANT:
            sp = replace(sp, allow=sp.allow + (tool,))
        elif action == "allow":
            sp = replace(sp, allow=sp.allow + (tool,), deny=tuple(g for g in sp.deny if not names.same(g, tool)),
                         approve=tuple(g for g in sp.approve if not names.same(g, tool)))
        elif action == "deny":
            sp = replace(sp, deny=sp.deny + (tool,))
        else:
            sp = replace(sp, approve=sp.approve + (tool,))
        servers[server] = sp
    return replace(policy, servers=tuple(servers[s.name] for s in policy.servers))

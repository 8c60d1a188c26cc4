"""The gate's exchange core, sans-IO: what happens to one request, in order, with no socket.

A *flow* is a generator. It reads the endpoint's state (policy, credentials, pause, rate
bucket) and yields **commands**; the server carries each out and sends the result back in as
an **event**. The ordering every request goes through lives here and nowhere else:

    admission (pause, rate) -> decide() -> credentials -> resolve (a Lookup command when DNS
    is needed) -> every candidate address checked -> Forward (the server connects and relays)

and for ``CONNECT``:

    admission -> credentials (host) -> decide(connect) -> resolve -> Accept (the server answers
    200 and peeks the first bytes) -> Hello / PlainHTTP / NotTLS event -> credentials (SNI) ->
    decide(clienthello) -> OpenTunnel(splice | terminate | plain)

A tunnel keeps the address resolved at ``CONNECT`` (:class:`Tunnel`): requests inside it are
not resolved again, but the address is re-checked against the live policy each time.

A flow ends with a terminal command: :class:`Deny` (log it, answer it when ``respond``),
:class:`Forward` or :class:`OpenTunnel`. Tests drive flows with a script of events and
compare the commands (``tests/unit/test_gate_exchange.py``) - no sockets, no event loop.
The server's side of the bargain: ``gate/server.py`` executes commands and moves bytes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from typing import Any, Generator

from agentvm.gate import h1
from agentvm.gate.frozen import evolve, quick_init
from agentvm.gate.policy import Decision, RequestMeta, check_address, decide, decide_request, how_to_allow, normalize_host

# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class Deny:
    """Terminal: log one deny record and, when ``respond``, answer the client.

    ``answer`` is ``"denied"`` (403/429 JSON ``egress-denied`` body with ``X-Agentvm-Denied``),
    ``"error"`` (the gate's own error body, e.g. 400 for a request the proxy cannot take) or
    ``"budget"`` (429 in the error shape of LLM APIs, for a spent budget)."""

    rule_id: str
    reason: str
    phase: str
    host: str
    port: int | None
    method: str | None = None
    path: str | None = None
    status: int = 403
    respond: bool = True
    answer: str = "denied"
    how_to_allow: str | None = None
    credential: str | None = None
    alert: bool = False
    sni: str | None = None

    def as_http1(self) -> bytes:
        """The HTTP/1.1 answer: the gate's error body, or the 403/429 ``egress-denied`` one."""
        if self.answer == "error":
            return h1.error_response(self.status, self.rule_id, self.reason)
        if self.answer == "budget":
            return h1.budget_response(self.rule_id, self.reason)
        return h1.deny_response(self.rule_id, self.reason, host=self.host, port=self.port or 0, status=self.status,
                                allow=self.how_to_allow)

    def log_fields(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.credential is not None:
            extra["credential"] = self.credential
            extra["alert"] = self.alert
        elif self.alert:
            extra["alert"] = True
        if self.how_to_allow:
            extra["how_to_allow"] = self.how_to_allow
        if self.sni is not None:
            extra["sni"] = self.sni
        return dict(verdict="deny", rule_id=self.rule_id, reason=self.reason, host=self.host, port=self.port,
                    method=self.method, path=self.path, phase=self.phase, **extra)


@dataclass(frozen=True, slots=True)
class Lookup:
    """Resolve ``name`` by DNS. Answer with :class:`Resolved` or :class:`LookupFailed`; the
    flow checks every address itself (the server never decides which address is fine)."""

    name: str
    port: int


@quick_init
@dataclass(frozen=True)
class Forward:
    """Terminal: connect to ``addr`` (``scheme`` https: TLS with ``sni``) - or reuse a pooled
    connection to it - and relay ``req`` (credentials already swapped into it)."""

    req: h1.ProxyRequest
    decision: Decision
    addr: str
    scheme: str
    sni: str | None
    swap: Any = None  # credentials.Swap, or None when the sandbox holds no credentials
    max_body: int | None = None
    #: the request as the sandbox sent it (placeholders, not values): what is logged. ``req``
    #: carries swapped-in real values (a query-string credential is in its path) and only
    #: ever goes on the wire.
    shown: h1.ProxyRequest | None = None
    #: the LLM budget holding a reservation for this request (gate.budget.Budget): whoever
    #: relays it settles the reservation with the response's usage, or releases it
    budget: Any = None

    @property
    def logged(self) -> h1.ProxyRequest:
        return self.shown if self.shown is not None else self.req


_make_forward = Forward.make


@dataclass(frozen=True, slots=True)
class Accept:
    """``CONNECT`` is allowed so far: answer 200 and read the tunnel's first bytes. Answer with
    :class:`Hello`, :class:`PlainHTTP`, :class:`NotTLS`, :class:`SshBanner` or ``None`` (the client went away)."""


@dataclass(frozen=True, slots=True)
class OpenTunnel:
    """Terminal: ``kind`` is ``splice`` (opaque, decided once: ``meta`` is re-decided when the
    policy changes; ``ssh``: the same, for an SSH session to host:22), ``terminate`` (TLS ended by the gate, each request decided) or ``plain``
    (plain HTTP inside the tunnel, each request decided)."""

    kind: str
    tunnel: "Tunnel"
    decision: Decision
    meta: RequestMeta | None = None


@dataclass(frozen=True, slots=True)
class Hold:
    """The request matched an allow rule with ``action: ask``: put it before a human and answer
    with :class:`Answered` (approved, denied, timed out - or no one to ask: denied)."""

    req: h1.ProxyRequest
    decision: Decision
    #: what the decision was asked: (host, port, scheme, method, path, body size, sni,
    #: websocket) - a gate worker sends it to the daemon, which decides it again before it holds
    asked: tuple = ()


@dataclass(frozen=True, slots=True)
class Admit:
    """Reserve one request of an LLM budget whose counters live in another process (a gate
    worker's budget: the daemon holds the agent's ledger). Answer with None (reserved) or
    (rule id, reason) - a budget that cannot answer is a refusal."""

    budget: Any


@dataclass(frozen=True, slots=True)
class ToTelemetry:
    """Terminal: an origin-form ``POST /otlp/v1/<signal>`` on the proxy port is the agent's own
    OpenTelemetry export, relayed to the daemon's collector (no egress rule involved: the
    destination is the operator's, not the agent's, choice)."""

    req: h1.ProxyRequest
    signal: str  # traces | metrics | logs


@dataclass(frozen=True, slots=True)
class ToTools:
    """Terminal: an origin-form request for ``/mcp`` on the proxy port is for this sandbox's
    tool gateway (the sandbox's identity is the socket it came in on, as for egress)."""

    req: h1.ProxyRequest


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Answered:
    """A human's (or the timeout's) answer to :class:`Hold`. Denied: ``rule_id`` says why
    (``approval:denied``, ``approval:timeout``, ``approval:unavailable``)."""

    approved: bool
    rule_id: str
    reason: str
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class Resolved:
    addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LookupFailed:
    message: str


@dataclass(frozen=True, slots=True)
class Hello:
    sni: str | None


@dataclass(frozen=True, slots=True)
class PlainHTTP:
    """The tunnel starts with an HTTP request line, not a TLS record."""


@dataclass(frozen=True, slots=True)
class NotTLS:
    message: str


@dataclass(frozen=True, slots=True)
class SshBanner:
    """The tunnel starts with an SSH identification string (``SSH-2.0-``, RFC 4253 4.2): the
    sandbox's ssh through ``nc -X connect`` (docs/credentials.md, "SSH keys")."""


#: the port an SSH tunnel may go to (the egress rule must allow host:22)
SSH_PORT = 22


@dataclass(frozen=True, slots=True)
class Tunnel:
    """A decided ``CONNECT``: the requests inside must name this host; ``addr`` is the address
    resolved and checked at ``CONNECT`` time."""

    host: str
    port: int
    addr: str
    sni: str | None = None


Command = Deny | Lookup | Forward | Accept | OpenTunnel
Flow = Generator[Command, Any, None]


# ---------------------------------------------------------------------------- flows


def _method(req: h1.ProxyRequest) -> str:
    return "CONNECT" if req.scheme == "connect" else req.method


def deny(req: h1.ProxyRequest, rule_id: str, reason: str, *, phase: str = "request", status: int = 403,
         explain: bool = True, **kw) -> Deny:
    """A deny of ``req``; ``explain`` adds the operator action that would allow it, if any."""
    allow = how_to_allow(rule_id, reason, req.host, req.port) if explain else None
    return Deny(rule_id=rule_id, reason=reason, phase=phase, host=req.host, port=req.port, method=_method(req),
                path=req.path or None, status=status, how_to_allow=allow, **kw)


def bad_request(exc: h1.ProtocolError, host: str = "", port: int | None = None) -> Deny:
    """A head the gate refuses to interpret (smuggling-prone, malformed): 400, never forwarded."""
    return Deny(rule_id=f"bad-request:{exc.code}", reason=str(exc), phase="request", host=host, port=port,
                status=400, answer="error")


def refuse(cmd: Deny) -> Flow:
    """A flow that is only this denial (a head that could not be parsed has no flow of its own)."""
    yield cmd


def cred_deny(req: h1.ProxyRequest, err, *, phase: str = "request", respond: bool = True) -> Deny:
    """A request that breaks a credential rule (``credentials.CredentialError``): never explained
    with a way to allow it; an alert when the error says so."""
    # (a real value the sandbox sent may be in the path or the host: those are never written)
    real = err.rule_id.startswith("credential:leak-real:")
    path = None if real else (req.path or None)
    host = WITHHELD if real else req.host
    return Deny(rule_id=err.rule_id, reason=err.reason, phase=phase, host=host, port=req.port, method=_method(req),
                path=path, respond=respond, credential=err.name, alert=err.alert)


WITHHELD = "(withheld: a real credential value was in this request)"


def _admission(ep, req: h1.ProxyRequest) -> Deny | None:
    """Every request, on a plain connection or inside a tunnel: not while paused, and within
    the rate limit (a token is taken here)."""
    if ep.paused:
        return deny(req, "paused", "egress is paused by the operator")
    if not ep.bucket.take():
        return deny(req, "limit:rate", "request rate limit", status=429)
    return None


TOOLS_PATH = "/mcp"


TELEMETRY_PATH = "/otlp"


def is_telemetry_path(path: str) -> bool:
    """``/otlp/...`` on the proxy port: the relay of the agent's OpenTelemetry export."""
    return path == TELEMETRY_PATH or path.startswith((TELEMETRY_PATH + "/", TELEMETRY_PATH + "?"))


def is_tools_path(path: str) -> bool:
    """``/mcp`` (with a query, or a sub-path) on the proxy port: the tool gateway's endpoint."""
    return path == TOOLS_PATH or path.startswith((TOOLS_PATH + "?", TOOLS_PATH + "/"))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def resolve(policy, host: str, port: int) -> Generator[Command, Any, tuple[str | None, str, str]]:
    """-> (address, "", "") or (None, rule_id, reason). Yields a :class:`Lookup` only when the
    name is neither an IP literal nor in the operator's static ``hosts`` mapping."""
    try:
        name = normalize_host(host)
    except ValueError as exc:
        return None, "invalid-host", str(exc)
    static = policy.static_address(name)
    if static is not None:
        cands: list[str] = [static]
    elif _is_ip(name):
        cands = [name]
    else:
        answer = yield Lookup(name, port)
        if isinstance(answer, LookupFailed):
            return None, "dns-failure", f"cannot resolve {name}: {answer.message}"
        cands = list(dict.fromkeys(answer.addresses))
    last = None
    for addr in cands:
        d = check_address(name, addr, policy)
        if d is None:
            return addr, "", ""
        last = d
    if last is not None:
        return None, last.rule_id, last.reason
    return None, "dns-failure", f"no address for {name}"


def _real_first(ep, req: h1.ProxyRequest, phase: str) -> Deny | None:
    """A real credential value in the request's host, target or headers is refused before
    anything else looks at it (review 9): a policy denial, a hold for approval or a rate limit
    that came first wrote it into the log, the run report and the approvals queue."""
    creds = ep.creds
    if creds is None:
        return None
    from agentvm.gate.credentials import CredentialError

    try:
        creds.check_request(req.host, req.path, req.headers)
    except CredentialError as err:
        return cred_deny(req, err, phase=phase)
    return None


def request(ep, req: h1.ProxyRequest, *, scheme: str, tunnel: Tunnel | None = None) -> Flow:
    """One request on a plain proxy connection (``scheme`` http) or inside a tunnel (``scheme``
    https when the gate terminated TLS, http for plain HTTP in a CONNECT tunnel)."""
    leaked = _real_first(ep, req, "request")
    if leaked is not None:
        yield leaked
        return
    denied = _admission(ep, req)
    if denied is not None:
        yield denied
        return
    if tunnel is None and req.scheme == "origin" and is_tools_path(req.path):
        if ep.tools is None:
            yield deny(req, "tools:none", "this sandbox declares no tools (spec.tools)", status=404,
                       answer="error", explain=False)
            return
        yield ToTools(req)
        return
    if tunnel is None and req.scheme == "origin" and is_telemetry_path(req.path):
        relay = getattr(getattr(ep, "gate", None), "telemetry", None)
        signal = req.path.split("?", 1)[0][len(TELEMETRY_PATH) + len("/v1/"):]
        if relay is None:
            yield deny(req, "telemetry:not-configured", "the daemon exports no traces: there is no collector to "
                       "relay to", status=404, answer="error", explain=False)
        elif req.method != "POST" or signal not in ("traces", "metrics", "logs") or \
                not req.path.startswith(TELEMETRY_PATH + "/v1/"):
            yield deny(req, "telemetry:bad-request", "only POST /otlp/v1/traces, /otlp/v1/metrics and /otlp/v1/logs",
                       status=404, answer="error", explain=False)
        else:
            yield ToTelemetry(req, signal)
        return
    if tunnel is None and req.scheme != "http":
        yield deny(req, "bad-request:not-a-proxy-request", "origin-form request to the proxy", status=400,
                   answer="error", explain=False)
        return
    if tunnel is not None:
        # inside a tunnel: origin-form only, and Host must be the tunnel's host
        if req.scheme != "origin":
            yield deny(req, "bad-request:absolute-form-in-tunnel", "absolute-form inside a tunnel")
            return
        try:
            # a Host without a port means the tunnel's port (curl sends "Host: api.x" for :443)
            same = normalize_host(req.host) == normalize_host(tunnel.host) and (
                req.port == tunnel.port or not req.explicit_port)
        except ValueError:
            same = False
        if not same:
            yield deny(req, "host-mismatch", f"Host {req.host!r} does not match the TLS server name (domain fronting)")
            return
        req = evolve(req, host=tunnel.host, port=tunnel.port)
    # decide(RequestMeta(host, port, scheme, method, path, body_size, sni, websocket, "request")),
    # the RequestMeta only built when the policy's memo does not hold the decision
    asked = (req.host, req.port, scheme, req.method, req.path, req.content_length,
             tunnel.host if tunnel is not None and scheme == "https" else None, req.upgrade_websocket)
    d = decide_request(ep.policy, *asked)
    if d.verdict == "ask":
        answer = yield Hold(req=req, decision=d, asked=asked)
        if not isinstance(answer, Answered) or not answer.approved:
            rid = answer.rule_id if isinstance(answer, Answered) else "approval:unavailable"
            why = answer.reason if isinstance(answer, Answered) else "no answer"
            yield deny(req, rid, why, explain=False)
            return
        # decided again under the policy in force now: a deny made while it waited wins
        again = decide_request(ep.policy, *asked)
        if not again.allowed and again.verdict != "ask":
            yield deny(req, again.rule_id, f"{again.reason} (the policy changed while the request waited for its "
                       "approval)")
            return
        base = again if again.verdict == "allow" else d  # the rule in force now (its maxBody too)
        d = replace(base, verdict="allow", reason=f"{d.reason}: approved ({answer.request_id})")
    if not d.allowed:
        yield deny(req, d.rule_id, d.reason)
        return
    budget = ep.budget  # (EndpointHandle.budget: None without one)
    if budget is None or not budget.covers(req.host):
        budget = None
    elif req.upgrade_websocket:
        # frames after a 101 carry no usage the gate can read: a metered API gets no WebSocket
        yield deny(req, "budget:websocket", "WebSockets to an LLM API under a budget are refused: the gate cannot "
                   "meter their usage", explain=False)
        return
    else:
        spent = budget.refusal_now()  # spent: refused before anything else is done
        if spent is not None:
            yield deny(req, spent[0], spent[1], status=429, explain=False, alert=spent[0] == "budget:exceeded",
                       answer="budget")
            return
    swap = None
    shown = req  # what the log, the audit chain and the console see: never a swapped value
    creds = ep.creds
    if creds is not None:
        from agentvm.gate.credentials import CredentialError

        try:
            creds.check_target(req.host)
            swap = creds.apply(host=req.host, scheme=scheme, target=req.path, headers=list(req.headers))
        except CredentialError as err:
            yield cred_deny(req, err)
            return
        except Exception as exc:  # the vault could not give a value: fail closed
            yield deny(req, "credential:unavailable", f"a credential value is unavailable ({type(exc).__name__})",
                       explain=False)
            return
        if req.upgrade_websocket and any(b.bound_to(req.host) for b in creds.bindings.values()):
            # after a 101 the gate relays opaque frames it cannot scrub: a host that holds a
            # real value (it is bound to a credential) gets no WebSocket (fail closed)
            yield deny(req, "credential:uninspectable-websocket",
                       "WebSockets to hosts a credential is bound to are refused: the gate cannot scrub "
                       "echoes of the real value from WebSocket frames")
            return
        if swap.used or swap.target != req.path:
            req = evolve(req, headers=tuple(swap.headers), path=swap.target)
    max_body = d.max_body
    if req.content_length is not None and max_body is not None and req.content_length > max_body:
        yield deny(shown, d.rule_id + ":max-body", f"body of {req.content_length} bytes over {max_body}")
        return
    if tunnel is not None:
        # the address resolved at CONNECT time, checked again under the policy in force now
        try:
            bad = check_address(normalize_host(tunnel.host), tunnel.addr, ep.policy)
        except ValueError as exc:
            yield deny(shown, "invalid-host", str(exc))
            return
        if bad is not None:
            yield deny(shown, bad.rule_id, bad.reason)
            return
        addr = tunnel.addr
    else:
        addr, rid, reason = yield from resolve(ep.policy, req.host, req.port)
        if addr is None:
            yield deny(shown, rid, reason)
            return
    if budget is not None:
        # the last check: a reservation is only taken for a request that is forwarded (the
        # relay settles it with the response's usage, or releases it)
        why = (yield Admit(budget)) if getattr(budget, "remote", False) else budget.admit()
        if why is not None:
            yield deny(shown, why[0], why[1], status=429, explain=False, alert=why[0] == "budget:exceeded",
                       answer="budget")
            return
    # Forward(req, decision, addr, scheme, sni, swap, max_body, shown, budget)
    yield _make_forward(req, d, addr, scheme, normalize_host(req.host) if scheme == "https" else None, swap, max_body,
                        shown if shown is not req else None, budget)


def connect(ep, req: h1.ProxyRequest) -> Flow:
    """A ``CONNECT``: decided before any TLS, then again on the ClientHello's SNI."""
    leaked = _real_first(ep, req, "connect")
    if leaked is not None:
        yield leaked
        return
    denied = _admission(ep, req)
    if denied is not None:
        yield denied
        return
    creds = ep.creds
    if creds is not None:
        from agentvm.gate.credentials import CredentialError

        try:
            creds.check_target(req.host)
        except CredentialError as err:
            yield cred_deny(req, err, phase="connect")
            return
    meta = RequestMeta(host=req.host, port=req.port, scheme="connect", phase="connect")
    d = decide(meta, ep.policy)
    if not d.allowed:
        yield deny(req, d.rule_id, d.reason, phase="connect")
        return
    addr, rid, reason = yield from resolve(ep.policy, req.host, req.port)
    if addr is None:
        yield deny(req, rid, reason, phase="connect")
        return
    first = yield Accept()
    if first is None:
        return
    tunnel = Tunnel(host=req.host, port=req.port, addr=addr)
    if isinstance(first, PlainHTTP):
        # plain HTTP inside the tunnel (undici, some SDKs tunnel http:// too): every request is
        # parsed and decided like a forward-proxy request, Host pinned to the CONNECT target
        yield OpenTunnel(kind="plain", tunnel=tunnel, decision=d)
        return
    if isinstance(first, SshBanner):
        # SSH: opaque (the gate cannot look inside; its ssh-agent decides every signature), so
        # only where the rule allowed host:22 and asks for nothing the gate must see (a rule to
        # terminate, an LLM budget to meter)
        budget = ep.budget
        why = ("the SSH port is 22" if req.port != SSH_PORT else
               "the rule that allowed it terminates TLS to inspect requests" if d.terminate else
               "the host is metered by an LLM budget" if budget is not None and budget.covers(req.host) else None)
        if why is not None:
            yield Deny(rule_id="ssh:refused", reason=f"an SSH tunnel to {req.host}:{req.port} is refused: {why}",
                       phase="ssh", host=req.host, port=req.port, method="CONNECT", respond=False)
            return
        yield OpenTunnel(kind="ssh", tunnel=tunnel, decision=d, meta=meta)
        return
    if isinstance(first, NotTLS):
        yield Deny(rule_id="not-tls", reason=f"tunnel does not start with a TLS ClientHello: {first.message}",
                   phase="clienthello", host=req.host, port=req.port, method="CONNECT", respond=False)
        return
    sni = first.sni
    if creds is not None:
        from agentvm.gate.credentials import CredentialError

        try:
            creds.check_target(req.host, sni)
        except CredentialError as err:
            yield cred_deny(req, err, phase="clienthello", respond=False)
            return
    meta2 = RequestMeta(host=req.host, port=req.port, scheme="connect", phase="clienthello", sni=sni)
    d2 = decide(meta2, ep.policy)
    if not d2.allowed:
        yield Deny(rule_id=d2.rule_id, reason=d2.reason, phase="clienthello", host=req.host, port=req.port,
                   method="CONNECT", respond=False, sni=sni)
        return
    tunnel = replace(tunnel, sni=sni)
    budget = ep.budget
    if d.terminate or d2.terminate or creds is not None or (budget is not None and budget.covers(req.host)):
        # a sandbox holding placeholders gets every tunnel terminated: a placeholder must be
        # seen wherever it travels (and swapped only where it is bound)
        yield OpenTunnel(kind="terminate", tunnel=tunnel, decision=d2)
        return
    yield OpenTunnel(kind="splice", tunnel=tunnel, decision=d2, meta=meta2)

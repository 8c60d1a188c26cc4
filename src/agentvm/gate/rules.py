"""Every rule id the gate can put in a decision record, a 403/400 body or ``X-Agentvm-Denied``.

An allowed request carries the id of the operator's rule that allowed it (``egress.allow[].id``,
else ``allow[i]``; ``cli[i]`` for ``--allow``). Everything else is a fixed id from this
registry. ``tests/unit/test_gate_rules.py`` checks that every id the gate's code can produce is
here and that every id here is documented in ``docs/egress.md`` - a new id without both fails CI.

Families end in ``:`` and take a suffix: ``bad-request:<code>`` (the codes of ``h1``),
``credential:leak:<name>``, ``credential:revoked:<name>``, ``credential:sigv4:<code>``,
``credential:hmac:<code>``; ``<rule>:max-body`` is an operator rule's body cap.
"""

from __future__ import annotations

# id -> what it means (one line; the docs table says the same)
RULES: dict[str, str] = {
    # policy (decide(), check_address())
    "default-deny": "no allow rule matches the request (nothing leaves unless a rule allows it)",
    "invalid-host": "the host is not a canonical name or IP literal (127.1, 0x7f.1, percent-encoding, NUL...)",
    "ip-literal": "CONNECT or a request to an IP address that no allow rule names literally",
    "address-class": "the host resolved to an address the sandbox must not reach (loopback, private, metadata...)",
    "dns-failure": "the host's name did not resolve (or resolved to no address)",
    "sni-mismatch": "the TLS ClientHello names another host than CONNECT",
    "no-sni": "the TLS ClientHello carries no server name",
    "not-tls": "a CONNECT tunnel that starts with neither a TLS ClientHello nor an HTTP request",
    "ssh:refused": "a CONNECT tunnel that starts with SSH-2.0- refused: not to port 22, not allowed as host:22, or under rules that inspect requests or meter an LLM budget",
    "clienthello-timeout": "a CONNECT tunnel that sent neither a whole TLS ClientHello nor a first byte of plain HTTP within 10 s: closed",
    "host-mismatch": "a request inside a tunnel names another host than the tunnel (domain fronting)",
    "path-normalization": "an ambiguous path (encoded slashes, dot segments) where a rule matches on paths",
    "invalid-request": "a request the policy cannot evaluate (bad method, port or body size)",
    "internal-error": "a bug in the gate: the request is denied (fail closed) - please report it",
    # protocol (h1): the request is not interpreted, answered 400
    "bad-request:": "a request head the gate refuses to interpret (smuggling-prone or malformed); the suffix says why",
    "bad-request:not-a-proxy-request": "an origin-form request sent to the proxy (send absolute-form http:// or CONNECT)",
    "bad-request:absolute-form-in-tunnel": "an absolute-form request inside a CONNECT tunnel",
    "bad-request:bad-body": "a request body whose chunked framing is broken",
    # approvals (an allow rule with action: ask) and the tool gateway's door
    "approval:pending": "not a denial: the request waits for a human (`agentvm approvals`); logged with verdict \"ask\"",
    "approval:approved": "not a denial: a human approved the held request (its allow record follows)",
    "approval:denied": "a human denied the held request",
    "approval:timeout": "nobody answered the held request before approvals.timeout (or its requester died)",
    "approval:h2-unsupported": "a request that needs an approval arrived on an HTTP/2 stream (refused; HTTP/1.1 is held)",
    "approval:unavailable": "the held request could not be queued or watched (the approvals queue failed): denied",
    "approval:unshowable": "the request's target is too long to show a human whole (over 64 KiB): refused, not held",
    "tools:none": "a request for /mcp from a sandbox that declares no tools (404)",
    "tools:unavailable": "the sandbox's tool gateway could not start (503): no tool calls",
    "tools:internal-error": "a bug in the tool gateway: the request is refused (fail closed)",
    "tools:request-too-large": "a request to /mcp over 4 MiB (413), or whose params nest past 48 levels, hold over 2^18 values or 8 MiB of text",
    # the agent's own OpenTelemetry export, relayed to the daemon's collector (POST /otlp/v1/...)
    "telemetry:relay": "not a denial: the agent's OTLP export was relayed to the operator's collector",
    "telemetry:not-configured": "a request for /otlp while the daemon exports no traces (404): no collector to relay to",
    "telemetry:bad-request": "a request for /otlp that is not a POST of OTLP (protobuf or JSON) to /otlp/v1/traces, "
                             "/metrics or /logs, or is over 4 MiB",
    "telemetry:unreachable": "the collector did not take the relayed export (502): the agent's SDK retries",
    # LLM budgets (limits.budget)
    "budget:exceeded": "the agent's LLM budget (tokens, requests or cost) is spent (429, alerted); "
                       "`agentvm policy NAME budget` raises it",
    "budget:reserved": "the rest of the agent's LLM budget is reserved by requests in flight (429, retryable): "
                       "the request limit is exact, token and cost limits count in-flight requests at their average",
    "budget:websocket": "a WebSocket to an LLM API under a budget: refused, its usage cannot be metered",
    "budget:unmetered-connection": "a connection opened before an LLM budget was set live (a tunnel is cut, an "
                                   "HTTP/2 stream refused): the client reconnects and is metered",
    "budget:unavailable": "a gate worker could not get an answer from the daemon, which keeps the agent's LLM "
                          "budget (429, retryable): nothing is forwarded unmetered",
    # operator and limits
    "paused": "egress of the sandbox is paused by the operator (connections open at the time are cut)",
    "endpoint:closed": "the sandbox's gate endpoint was closed while a connection was open (a gate worker "
                       "stopping, an endpoint opened again): the connection is cut",
    "limit:connections": "too many concurrent connections from the sandbox (429)",
    "handoff:refused": "a hand-off hello without the sandbox's bridge key (an alert: only the agent sends one), "
                       "or a message on the bridge's channel that is not one connected TCP socket: closed, nothing served",
    "limit:rate": "over the sandbox's request rate (429)",
    "limit:bytes-out": "over the sandbox's bytes-out budget (the connection is cut)",
    "limit:resign-memory": "too many signed request bytes buffered for re-signing at once (503)",
    "limit:upstream-streams": "an HTTP/2 stream refused (REFUSED_STREAM, retryable): the upstream connection takes no more",
    "limit:resign-body": "a signed request body too large to buffer for re-signing (413)",
    "log:suppressed": "not a decision: how many denials (or, marked as an alert, alerts) were counted but not logged "
                      "one by one (the deny-log and alert-log rate limits)",
    "client-gone": "the sandbox closed the connection before its request was forwarded (never sent late)",
    "client-reset": "not a denial: the sandbox reset an HTTP/2 stream before its response ended (in \"error\")",
    "client-left": "not a denial: the sandbox closed its connection while the gate waited for the answer; the upstream connection is closed too (in \"error\")",
    "tls-handshake": "the sandbox's TLS handshake with the gate failed (does it trust the installation's CA?)",
    # credentials by reference
    "credential:leak:": "a placeholder outside its declared place or bound hosts; the suffix names the credential",
    "credential:revoked:": "a placeholder of a revoked credential; the suffix names it",
    "credential:leak-real:": "a credential's real value (any form of 8 bytes or more) in a request from the sandbox, which only ever holds its placeholder: it has the value through a leak; blocked, an alert, the path not logged; the suffix names the credential",
    "credential:unavailable": "the real value of a credential could not be read (vault locked or missing): fail closed",
    "credential:uninspectable-websocket": "a WebSocket to a host a credential is bound to (frames cannot be scrubbed)",
    "credential:uninspectable-encoding": "a response in a content coding the gate cannot decode, to a sandbox holding credentials",
    "credential:uninspectable-body": "a response to a request carrying a swapped credential whose body is compressed without a Content-Encoding that says so (inspect: strict)",
    "credential:uninspectable-stream": "a streamed response to a request carrying a swapped credential that would need over 1 MiB held back to look for a value split across its events",
    "credential:echo-split": "a credential's real value arrived split across the events of a streamed response (SSE data, JSON deltas): the stream is cut",
    "credential:resign-failed": "re-signing a SigV4/HMAC request failed (502)",
    "credential:resign-h2": "a SigV4/HMAC-signed request on an HTTP/2 stream (re-signing needs HTTP/1.1 for now)",
    "credential:sigv4:": "a SigV4 request the gate refuses to re-sign; the suffix is the reason (bad-signature, expired...)",
    "credential:hmac:": "an HMAC-signed request the gate refuses to re-sign; the suffix is the reason",
    # upstream (the request was allowed; the upstream failed it) - logged with phase upstream,
    # the allowing rule in "rule" and the failure in "error"
    "upstream:unreachable": "the upstream could not be connected to (502)",
    "upstream:reset": "the upstream connection failed mid-exchange (502 when no answer had started)",
    "upstream:timeout": "the upstream sent nothing for 15 minutes while its answer was awaited (504 when no answer had started)",
    "upstream:protocol-error": "the upstream broke HTTP/1.1 or closed mid-message (502 when no answer had started)",
    "upstream:bad-encoding": "an upstream body that does not decode in its declared content coding",
    ":max-body": "suffix of an operator rule id: the request body went over the rule's maxBody",
}

FAMILIES = tuple(k for k in RULES if k.endswith(":"))


def max_body(decision) -> str:
    """The id of a body cut by a rule's maxBody: the rule that set the cap, ``:max-body``."""
    return (decision.body_rule_id or decision.rule_id) + ":max-body"


def describe(rule_id: str) -> str | None:
    """What ``rule_id`` means, or None for an operator rule's own id (or an unknown id)."""
    if rule_id in RULES:
        return RULES[rule_id]
    for fam in FAMILIES:
        if rule_id.startswith(fam) and len(rule_id) > len(fam):
            return RULES[fam]
    if rule_id.endswith(":max-body"):
        return RULES[":max-body"]
    return None


def known(rule_id: str) -> bool:
    return describe(rule_id) is not None


def shown(rule_id: str) -> str:
    """How the docs write a registered id (families with their suffix spelled out)."""
    if rule_id == ":max-body":
        return "<rule>:max-body"
    if rule_id.endswith(":"):
        return rule_id + {"credential:leak:": "<name>", "credential:leak-real:": "<name>", "credential:revoked:": "<name>"}.get(rule_id, "<code>")
    return rule_id


def markdown_table() -> str:
    """The table of ``docs/egress.md`` (between its rule-ids markers; a test keeps them equal)."""
    rows = ["| rule id | meaning |", "| --- | --- |"]
    rows += [f"| `{shown(k)}` | {v} |" for k, v in RULES.items()]
    return "\n".join(rows)

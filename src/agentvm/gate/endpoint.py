"""One sandbox's endpoint on the gate: its listener, policy, limits, upstream pool and
decision log. No request logic here (that is ``exchange``) and no byte moving (``server``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from time import monotonic  # (bound once: the request path takes the time several times)
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from agentvm.gate.policy import EgressPolicy, RequestMeta, _safe, decide

if TYPE_CHECKING:
    from agentvm.gate.server import Gate
    from agentvm.gate.streams import PlainStream

# idle upstream connections kept per (upstream, sandbox): at least a busy agent's concurrency,
# or every request beyond it pays a new connection (and a TLS handshake); dropped after
# POOL_IDLE_SECONDS unused
POOL_IDLE = 32
POOL_IDLE_SECONDS = 30.0
POOL_IDLE_TOTAL = 128  # idle upstream connections one sandbox may hold in all


class Cut(Exception):
    """A limit stopped a connection mid-stream; carries where the bytes were going."""

    def __init__(self, rule_id: str, host: str = "", port: int | None = None):
        super().__init__(rule_id)
        self.rule_id, self.host, self.port = rule_id, host, port



# deny records per second (and burst) an endpoint writes one by one; beyond, they are counted
DENY_LOG_RATE = 50.0
DENY_LOG_BURST = 200.0
# alerts are rate-limited too, on a bucket of their own (a flood of denials never costs an alert
# its place): what an agent can make by the thousand per second - refused hand-off hellos,
# credential-leak attempts - must not grow the log and the daemon's append-only audit chain
# without bound. The excess is counted in one summary record that is itself an alert.
ALERT_LOG_RATE = 20.0
ALERT_LOG_BURST = 100.0
MAX_DENIAL_KEYS = 1024  # distinct (rule, target) pairs kept in a run's summary

LOG_BATCH = 1 << 16  # decision-log bytes held before they are written at once (else: end of the loop turn)


def _ends_torn(fd: int) -> bool:
    """True when the file is not empty and its last byte is not a newline."""
    try:
        size = os.fstat(fd).st_size
        return size > 0 and os.pread(fd, 1, size - 1) not in (b"\n", b"")
    except OSError:
        return False


def _line_encoder():
    """A decision record -> one line of JSON: keys sorted, ASCII only - exactly what
    ``json.dumps(rec, sort_keys=True, ensure_ascii=True)`` gives (a test checks), without the
    encoder, closure and C iterator json builds per call. Records are dicts of plain values."""
    enc = json.JSONEncoder(sort_keys=True, ensure_ascii=True, check_circular=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has the C accelerator
        return enc.encode
    it = make(None, enc.default, json.encoder.encode_basestring_ascii, None, enc.key_separator,
              enc.item_separator, True, False, True)
    return lambda rec: "".join(it(rec, 0))


_encode = _line_encoder()
_esc = json.encoder.encode_basestring_ascii  # a str -> its JSON string, ASCII only (json's own, in C)
_ESCAPED: dict[str, str] = {}  # str -> _esc(str) for the few strings every relayed record repeats
ESCAPED_MAX = 4096  # (emptied when full: a sandbox minting hosts cannot grow it)


def _escaped(s: str) -> str:
    """_esc(s), remembered in _ESCAPED."""
    if len(_ESCAPED) >= ESCAPED_MAX:
        _ESCAPED.clear()
    e = _ESCAPED[s] = _esc(s)
    return e


def _relayed_format(sandbox_id: str, agent: str) -> str:
    """The line of a relayed request's record (Endpoint.log_relayed) as a %-format: the keys
    sorted, as _encode orders them; this endpoint's sandbox and agent in place; the %s after
    "bytes_out" is the "credentials" member (with its ", ") or nothing."""
    return ('{"agent": ' + _esc(agent).replace("%", "%%") + ', "bytes_in": %d, "bytes_out": %d, %s"host": %s, '
            '"method": %s, "path": %s, "phase": "request", "port": %d, "reason": %s, "rule": %s, "sandbox": '
            + _esc(sandbox_id).replace("%", "%%") + ', "time": %s, "upstream_ms": %s, "verdict": "allow"}\n')


# integers below this, divided by 10**k (k = 3, 6), are written exactly by _millis/_micros: the double
# nearest such a value is closer to it than to any other k-decimal value while it is under 2**32
_MAX_DECIMAL = 4_000_000_000_000_000
_MIN_TIME_US = 10**10  # (repr writes n / 10**6 under 10**-4 with an exponent; times are far above)


# the digits of r / 1000 (0 <= r < 1000) after the point, trailing zeros dropped but one: ".0",
# ".001", ..., ".5", ..., ".999"; and r as three digits, with and without its trailing zeros
_MILLI = tuple("." + (("%03d" % r).rstrip("0") or "0") for r in range(1000))
_THREE = tuple("%03d" % r for r in range(1000))
_THREE_TRIM = tuple(("%03d" % r).rstrip("0") for r in range(1000))


def _millis(n: int) -> str:
    """repr(n / 1000) for 0 <= n < _MAX_DECIMAL, from the integer: ``n / 1000`` is the double
    nearest the decimal, and the shortest string that reads back as that double is the decimal
    without its trailing zeros (a test compares them). Digits from tables, no formatting."""
    return str(n // 1000) + _MILLI[n % 1000]


def _micros(n: int) -> str:
    """repr(n / 10**6) for _MIN_TIME_US <= n < _MAX_DECIMAL (see _millis)."""
    q, r = divmod(n, 1000000)
    hi, lo = divmod(r, 1000)
    return str(q) + ("." + _THREE[hi] + _THREE_TRIM[lo] if lo else _MILLI[hi])


class TokenBucket:
    """``rate`` tokens a second, up to ``capacity``; full at first use."""

    def __init__(self, rate: float, capacity: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = -1.0
        self.stamp = monotonic()

    def take(self) -> bool:
        now = monotonic()
        if self.tokens < 0:
            self.tokens = self.capacity
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def _requester_gone(gone) -> bool:
    """``gone()``, where a check that fails counts as gone (nothing is forwarded for nobody)."""
    try:
        return bool(gone())
    except Exception:  # noqa: BLE001
        return True


@runtime_checkable
class EndpointHandle(Protocol):
    """A sandbox's endpoint as its owner (the daemon, the lifecycle driver) uses it, wherever it
    is served: :class:`Endpoint` on the gate of this process, or
    ``agentvm.gate.workers.RemoteEndpoint`` on a gate worker. The owner never asks which."""

    sandbox_id: str
    agent: str
    budget: object  # agentvm.gate.budget.Budget, or None (no budget, or it cannot meter one)
    creds: object  # its CredentialSet (``local_revoked``: revocations), or None
    tools: object  # its tool gateway slot, or None
    counts_lost: bool  # some of its counters were lost (a gate worker died)
    # counters, for the run's result (agentvm.lifecycle.egress_summary) and /metrics
    allowed: int
    bytes_out: int
    bytes_in: int
    alerts: int
    denials: dict
    denial_reasons: dict

    @property
    def placement(self) -> str:
        """Which gate serves it: ``daemon`` (this process's gate) or ``worker N``."""

    @property
    def can_meter(self) -> bool:
        """Whether its gate can meter an LLM budget (counters shared by an agent's sandboxes
        live in the daemon: a gate worker cannot)."""

    paused: bool

    def set_policy(self, policy: EgressPolicy) -> None:
        """The next request is decided under ``policy``."""

    def set_budget(self, budget) -> None:
        """Meter an LLM budget from the next request on (refused where it cannot meter)."""

    def revoke(self, names, revoked: bool = True) -> None:
        """Revoke (or restore) this session's credentials by name: the next request sees it."""

    async def synced(self) -> None:
        """Return once every change made so far is what serves the next request."""


class Endpoint:
    """One sandbox's listener, policy, limits and decision log (an :class:`EndpointHandle`)."""

    placement = "daemon"  # served by this process's gate
    can_meter = True
    counts_lost = False

    def __init__(self, gate: "Gate", sandbox_id: str, agent: str, policy: EgressPolicy, sock_path: Path, log_path: Path):
        self.budget = None  # agentvm.gate.budget.Budget when limits.budget is set (EndpointExtras)
        self.gate = gate
        self.sandbox_id = sandbox_id
        self.agent = agent
        self.policy = policy
        self.sock_path = sock_path
        self.log_path = log_path
        # an O_APPEND descriptor, written with os.write (no text-layer buffer between the gate
        # and the file): the lines of a loop turn go in one write, each line whole (_write)
        try:  # read too: its last byte says whether a killed gate left a line unfinished
            self._log_fd = os.open(log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError:  # append-only for us (a policy, a mode): still a log, unchecked
            self._log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(self._log_fd, 0o600)
        self._log_pending: list[bytes] | None = None  # lines waiting for the end of the loop's turn
        self._log_pending_len = 0
        self._log_torn = _ends_torn(self._log_fd)  # a file left mid-line (a gate killed while writing)
        self._relayed_fmt = _relayed_format(sandbox_id, agent)
        self.server: asyncio.AbstractServer | None = None
        self.active = 0
        self.bucket = TokenBucket(policy.limits.requests_per_second, float(policy.limits.burst))
        self.bytes_out = 0
        self.bytes_in = 0
        self.denials: dict[tuple[str, str], int] = {}
        self.denial_reasons: dict[tuple[str, str], tuple[str, str | None]] = {}  # first reason, how to allow
        # deny records are rate-limited (a sandbox must not be able to flood the log, the
        # audit chain and the daemon's loop by hammering the gate); the excess is counted and
        # logged as one summary record, so every decision is still accounted for
        self.deny_log_bucket = TokenBucket(DENY_LOG_RATE, DENY_LOG_BURST)
        self.deny_suppressed = 0
        self.alert_log_bucket = TokenBucket(ALERT_LOG_RATE, ALERT_LOG_BURST)
        self.alerts_suppressed = 0
        self.resign_buffered = 0  # bytes of signed request bodies held for re-signing right now
        self.allowed = 0
        self._paused = False
        # live connections, so a pause or a narrowed policy reaches those already open
        self.conns: set[asyncio.Task] = set()
        self.splices: dict[asyncio.Task, RequestMeta] = {}  # opaque tunnels: decided once, at setup
        self.cut: dict[asyncio.Task, tuple[str, str]] = {}  # task -> (rule, reason) it was cut for
        self.creds = None  # CredentialSet of this session (credentials by reference), or None
        self.creds_ready: asyncio.Task | None = None  # its brokered credentials being minted (prepare_credentials)
        self.tools = None  # agentvm.tools.slot.ToolsSlot: this sandbox's tool gateway, or None (no tools)
        self.approval_timeout = 300.0  # how long a held (action: ask) request waits for a human
        self.approval_webhook = None  # where pending requests are POSTed (approvals.webhook)
        self.policy_digest = ""  # the sandbox policy's digest, recorded with each held request
        self.alerts = 0
        # idle upstream connections: per sandbox, never shared across sandboxes
        self.pool: dict[tuple, list[tuple[PlainStream, float]]] = {}
        self._pool_idle = 0
        self.decoders: set = set()  # HTTP/2 streams decoding a compressed body now (h2relay)
        self.decoder_waiters: set = set()
        self._pool_timer: asyncio.TimerHandle | None = None  # the prune that expires idle connections
        self.closing = False  # Gate.close_endpoint under way: nothing more is served
        self.bridge_key = ""  # the sandbox's bridge's key (hex): it alone may hand connections over (Gate._hello)

    # -- brokered credentials: minted at attach, revoked at close ------------------------------
    def prepare_credentials(self) -> None:
        """Session start: mint this session's brokered credentials in a thread (a mint may take
        seconds: never on the gate's event loop), so the first request finds them cached. The
        gate holds each connection's first request until it is done (:meth:`credentials_ready`)."""
        creds = self.creds
        if creds is None or not getattr(creds, "brokers", None):
            return
        self.creds_ready = asyncio.get_running_loop().create_task(asyncio.to_thread(creds.prepare))

    async def credentials_ready(self, timeout: float = 15.0) -> None:
        """Wait (bounded) for the mint begun at attach: a request meanwhile would block the loop on
        the token cache's lock. A failed or slow mint is left for the request to report."""
        t = self.creds_ready
        if t is not None and not t.done():
            await asyncio.wait({t}, timeout=timeout)

    async def close_credentials(self, timeout: float = 4.0) -> None:
        """Session end: what was minted for it is forgotten and revoked upstream where the kind
        can (RFC 7009, GitHub's installation-token DELETE), waited for in a thread - at most
        ``timeout`` (a gate worker's close must answer the daemon within its call timeout, 10 s;
        a slower revocation goes on in its thread, and the minted value expires anyway)."""
        creds = self.creds
        if self.creds_ready is not None:
            self.creds_ready.cancel()  # (the thread finishes; its mint is dropped below)
            self.creds_ready = None
        if creds is None or not getattr(creds, "brokers", None):
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(creds.close, wait=True), timeout)
        except Exception:  # (a revocation that failed or hangs: the minted value still expires)
            logging.getLogger("agentvm.gate").warning("sandbox %s: revoking its minted credentials did not finish",
                                                      self.sandbox_id)

    def pool_get(self, key: tuple, *, retry_ok: bool = True):
        """An idle connection to ``key`` - only one the upstream has not closed and has sent
        nothing on since (a response sent ahead of its request must never answer one), looked
        for in the socket too (PlainStream.idle): one the upstream closed a moment ago is not
        reused, as a request that must not be retried would fail on it. For such a request
        (``retry_ok`` false) a TLS connection with anything unread is passed over too (it may be
        the upstream's close_notify: PlainStream.idle(strict))."""
        idle = self.pool.get(key)
        now = monotonic()
        while idle:
            stream, stamp = idle.pop()
            self._pool_idle -= 1
            if now - stamp < POOL_IDLE_SECONDS and stream.idle(not retry_ok):
                return stream
            stream.close()
        return None

    def pool_put(self, key: tuple, stream: "PlainStream") -> None:
        idle = self.pool.setdefault(key, [])
        if len(idle) >= POOL_IDLE or self._pool_idle >= POOL_IDLE_TOTAL or not stream.reusable:
            stream.close()
            return
        idle.append((stream, monotonic()))
        self._pool_idle += 1
        if self._pool_timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # pragma: no cover - the gate always runs in its loop
                return
            self._pool_timer = loop.call_later(POOL_IDLE_SECONDS / 2, self._pool_tick)

    def _pool_tick(self) -> None:
        self._pool_timer = None
        self.pool_prune(monotonic())
        if self._pool_idle:
            self._pool_timer = asyncio.get_running_loop().call_later(POOL_IDLE_SECONDS / 2, self._pool_tick)

    def pool_prune(self, now: float) -> None:
        """Close the idle connections unused for POOL_IDLE_SECONDS, or closed by the upstream
        meanwhile (every key): a connection's descriptor is not kept past its use."""
        for key, idle in list(self.pool.items()):
            keep = []
            for stream, stamp in idle:
                if now - stamp < POOL_IDLE_SECONDS and stream.reusable:
                    keep.append((stream, stamp))
                else:
                    stream.close()
                    self._pool_idle -= 1
            if keep:
                self.pool[key] = keep
            else:
                del self.pool[key]

    def pool_close(self) -> None:
        if self._pool_timer is not None:
            self._pool_timer.cancel()
            self._pool_timer = None
        for idle in self.pool.values():
            for stream, _ in idle:
                stream.close()
        self.pool.clear()
        self._pool_idle = 0

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = bool(value)
        if self._paused:  # all egress stops: requests and tunnels already under way included
            for t in list(self.conns):
                self._cut(t, "paused", "egress paused by the operator: connection cut")

    async def quiesce(self, timeout: float) -> int:
        """Before a checkpoint (issue 37: ``agentvm suspend``): no new connection is served
        (each is closed at once, as while the endpoint closes), an idle keep-alive connection
        (between requests) is closed, and one with a request under way is given up to
        ``timeout`` seconds to finish (then closed as it goes idle). Returns how many still
        have a request under way (0: none left); :meth:`unquiesce` serves again."""
        self.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waits, expired = self.gate._head_waits, self.gate._head_expired
        while True:
            for t in list(self.conns):
                if t in waits and not t.done():  # idle between requests: closed quietly
                    expired.add(t)
                    t.cancel()
            left = [t for t in self.conns if not t.done()]
            busy = [t for t in left if t not in waits]
            if not left or loop.time() >= deadline:
                return len(busy)
            await asyncio.wait(left, timeout=min(0.1, max(0.0, deadline - loop.time())))

    def unquiesce(self) -> None:
        """Serve again after :meth:`quiesce` (a suspend refused or failed)."""
        self.closing = False

    def _cut(self, task: asyncio.Task, rule: str, reason: str) -> None:
        if task not in self.cut and not task.done():
            self.cut[task] = (rule, reason)
            task.cancel()

    async def hold(self, cmd, gone=None) -> "object":
        """An egress request that needs a human (``action: ask``): queued, then the answer.
        ``gone()``: the requester has left (its connection cut) - the request expires at once;
        checked again once a human approves (an approval in the instant it left is refused,
        ``client-gone``: nothing is forwarded for nobody)."""
        from agentvm.gate import exchange as ex

        req = cmd.req
        store = self.gate.approval_store()
        if store is None:
            return ex.Answered(False, "approval:unavailable", "no approvals queue is available to ask a human")
        from agentvm.held import SHOW_MAX

        if len(req.path) > SHOW_MAX:  # a human approves only what a human can see, whole
            return ex.Answered(False, "approval:unshowable", f"the request target ({len(req.path)} bytes) is too long "
                               f"to show a human for approval (at most {SHOW_MAX})")
        path = req.path if len(req.path) <= 512 else req.path[:509] + "..."
        target = f"{req.method} {req.host}:{req.port}{path}"
        body = ("none" if not req.content_length and not req.chunked else
                f"{req.content_length if req.content_length is not None else 'chunked, unknown'} bytes, NOT shown: the "
                "gate has not read it (approve only if the target alone tells you enough)")
        summary = {"method": req.method, "host": req.host, "port": req.port, "path": req.path,
                   "rule": cmd.decision.rule_id, "body": body, "body_bytes": req.content_length, "preview": target[:200],
                   "keys": ["method", "host", "port", "path"]}
        try:
            from agentvm.held import digest

            queued = store.submit(kind="egress", sandbox=self.sandbox_id, agent=self.agent, target=target,
                                  summary=summary, arg_digest=digest([req.method, req.host, req.port, req.path]),
                                  policy=self.policy_digest, timeout=self.approval_timeout,
                                  webhook=self.approval_webhook)
        except Exception as exc:  # noqa: BLE001 - not recorded, not held: denied
            return ex.Answered(False, "approval:unavailable", f"the request could not be queued ({type(exc).__name__})")
        self.log(verdict="ask", rule_id="approval:pending", reason=f"waiting for a human ({queued.id})", host=req.host,
                 port=req.port, method=req.method, path=req.path, phase="request", approval=queued.id)
        try:
            done = await store.wait(queued.id, gone=gone)
        except Exception as exc:  # noqa: BLE001
            return ex.Answered(False, "approval:unavailable", f"the approvals queue failed ({type(exc).__name__})")
        if done.state == "approved" and gone is not None and _requester_gone(gone):
            # approved in the instant its requester left: nothing is forwarded for nobody, as the
            # tool gateway does after an approval (the flow logs this deny)
            return ex.Answered(False, "client-gone", f"{done.id} was approved after its requester left: not "
                               "forwarded", done.id)
        if done.state == "approved":
            return ex.Answered(True, "approval:approved", f"approved by {done.by}", done.id)
        if done.state == "expired":
            return ex.Answered(False, "approval:timeout", f"no human answered {done.id} in time "
                               f"({done.note or 'expired'})", done.id)
        return ex.Answered(False, "approval:denied", f"{done.id} was denied by {done.by}", done.id)

    def set_policy(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self.bucket.rate = policy.limits.requests_per_second
        self.bucket.capacity = float(policy.limits.burst)
        # terminated and plain connections decide every request under the new policy; an
        # opaque tunnel was decided once, so one the new policy denies is cut now
        for t, meta in list(self.splices.items()):
            d = decide(meta, policy)
            if not d.allowed:
                self._cut(t, d.rule_id, f"policy changed: {d.reason}; tunnel cut")

    async def synced(self) -> None:
        """Every change is in force at once here (one process, one loop)."""

    def revoke(self, names, revoked: bool = True) -> None:
        """Revoke (or restore) this session's credentials by name: the next request sees it."""
        if self.creds is not None:
            for n in names:
                (self.creds.local_revoked.add if revoked else self.creds.local_revoked.discard)(n)

    def set_budget(self, budget) -> None:
        """An LLM budget set live: every later request to its hosts is metered, and an opaque
        tunnel to one of them (opened before, never metered) is cut; the client reconnects
        through a terminated, metered one."""
        self.budget = budget
        for t, meta in list(self.splices.items()):
            if budget.covers(meta.host):
                self._cut(t, "budget:unmetered-connection", "an LLM budget was set: this tunnel, opened before it, "
                          "is cut so that every request is metered")

    def log(self, *, verdict: str, rule_id: str, reason: str, host: str, port: int | None, method: str | None = None,
            path: str | None = None, phase: str, bytes_out: int = 0, bytes_in: int = 0, **extra) -> None:
        if path is not None and len(path) > 2048:
            path = path[:2048] + "...(truncated)"
        rec = {
            "time": round(time.time(), 6),
            "sandbox": self.sandbox_id,
            "agent": self.agent,
            "phase": phase,
            "host": host,
            "port": port,
            "method": method,
            "path": path,
            "rule": rule_id,
            "verdict": verdict,
            "reason": reason,
            "bytes_out": bytes_out,
            "bytes_in": bytes_in,
        }
        rec.update(extra)
        if extra.get("alert"):
            self.alerts += 1
        if verdict == "deny":
            # printable ASCII only: the target reaches the operator's terminal in the run summary
            target = (f"{_safe(host, 255).lower()}:{port}" if host else
                      f"tool {_safe(extra['tool'], 200)}" if extra.get("tool") else
                      "(an open connection)" if phase == "cut" else "(malformed request)")
            key = (rule_id[:128], target)
            if key not in self.denials and len(self.denials) >= MAX_DENIAL_KEYS:
                key = ("(other)", "(too many distinct denials to list)")
            seen = self.denials.get(key, 0)
            self.denials[key] = seen + 1
            if key not in self.denial_reasons and key[0] != "(other)":
                self.denial_reasons[key] = (reason[:300], extra.get("how_to_allow"))
            if extra.get("alert"):
                # the first alert of each (rule, target) is always written: a flood of one cheap
                # kind (refused hand-off hellos) must not hide another (a credential leak)
                if seen and not self.alert_log_bucket.take():
                    self.alerts_suppressed += 1
                    return
            elif not self.deny_log_bucket.take():
                self.deny_suppressed += 1
                return
        elif verdict == "allow":
            self.allowed += 1
        self.flush_suppressed()
        self._write(rec)

    def log_relayed(self, rule_id: str, reason: str, host: str, port: int, method: str, path: str, bytes_out: int,
                    bytes_in: int, upstream_us: int, credentials: list[str] | None = None) -> None:
        """``log(verdict="allow", phase="request", ..., upstream_ms=upstream_us / 1000[,
        credentials=...])`` with no other field: the record every relayed request ends with
        (``credentials``: the names swapped in). The same record and the same line (a test
        compares them), without keyword parsing, the generic encoder or float formatting: the
        time and the latency are written from integers (_micros, _millis)."""
        if not (type(port) is int and type(bytes_out) is int and type(bytes_in) is int and type(upstream_us) is int
                and 0 <= upstream_us < _MAX_DECIMAL
                and type(host) is str and type(method) is str and type(path) is str and type(rule_id) is str
                and type(reason) is str
                and (credentials is None or (type(credentials) is list and all(type(c) is str for c in credentials)))):
            extra = {} if credentials is None else {"credentials": credentials}
            self.log(verdict="allow", rule_id=rule_id, reason=reason, host=host, port=port, method=method, path=path,
                     phase="request", bytes_out=bytes_out, bytes_in=bytes_in, upstream_ms=upstream_us / 1000, **extra)
            return
        if len(path) > 2048:
            path = path[:2048] + "...(truncated)"
        now_us = (time.time_ns() + 500) // 1000
        # (a clock set far off: the float's own repr)
        t_text = _micros(now_us) if _MIN_TIME_US <= now_us < _MAX_DECIMAL else repr(now_us / 1e6)
        rec = None
        if self.gate.subscribers:  # the record as a dict only for those who take it (the daemon)
            # now_us / 1e6: the double nearest the 6-decimal value, as round(time.time(), 6) gives
            rec = {"time": now_us / 1e6, "sandbox": self.sandbox_id, "agent": self.agent, "phase": "request",
                   "host": host, "port": port, "method": method, "path": path, "rule": rule_id, "verdict": "allow",
                   "reason": reason, "bytes_out": bytes_out, "bytes_in": bytes_in, "upstream_ms": upstream_us / 1000}
            if credentials is not None:
                rec["credentials"] = credentials
        self.allowed += 1
        if self.deny_suppressed or self.alerts_suppressed:
            self.flush_suppressed()
        # a rule's id and reason, a host and a method recur request after request: escaped once
        # (an escaped string is never empty: at least its quotes)
        cache = _ESCAPED
        e_host = cache.get(host) or _escaped(host)
        e_method = cache.get(method) or _escaped(method)
        e_reason = cache.get(reason) or _escaped(reason)
        e_rule = cache.get(rule_id) or _escaped(rule_id)
        creds = "" if credentials is None else '"credentials": [' + ", ".join([_esc(c) for c in credentials]) + "], "
        line = self._relayed_fmt % (bytes_in, bytes_out, creds, e_host, e_method, _esc(path), port, e_reason, e_rule,
                                    t_text, _millis(upstream_us))
        self._put(line.encode("ascii"), rec)

    def _write(self, rec: dict) -> None:
        # the encoder escapes every control character (and non-ASCII): one record, one line
        self._put((_encode(rec) + "\n").encode("ascii"), rec)

    def _put(self, line: bytes, rec: dict | None) -> None:
        # Lines are written at the end of the loop's turn (or past LOG_BATCH), all of them in
        # one os.write: a busy gate pays one system call per turn, not one per request
        if self._log_pending is None:
            try:
                asyncio.get_running_loop().call_soon(self.flush_log)
                self._log_pending, self._log_pending_len = [], 0
            except RuntimeError:  # no loop running (a caller outside the gate): written now
                self._log_out(line)
        if self._log_pending is not None:
            self._log_pending.append(line)
            self._log_pending_len += len(line)
            if self._log_pending_len >= LOG_BATCH:
                self.flush_log()
        if rec is not None:
            self.gate.emit(rec)

    def flush_log(self) -> None:
        """Write the decision records held since the loop's last turn (one os.write)."""
        pending, self._log_pending = self._log_pending, None
        if pending:
            self._log_out(b"".join(pending))

    def _log_out(self, data: bytes) -> None:
        if self._log_torn:  # a write that failed part-way left a line without its end: end it first
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._log_fd, view):]
        except OSError:  # the disk is full, the file gone: said on the gate's own log, once per batch
            logging.getLogger("agentvm.gate").exception("cannot write the decision log of sandbox %s (%d bytes lost)",
                                                        self.sandbox_id, len(view))
        written = len(data) - len(view)
        if written:  # what reached the file decides (a write of nothing leaves the file as it was)
            self._log_torn = data[written - 1] != 0x0A

    def flush_suppressed(self) -> None:
        """One record for the denials not logged one by one, one (an alert) for the alerts (none
        were lost: they were counted)."""
        if self.deny_suppressed:
            n, self.deny_suppressed = self.deny_suppressed, 0
            self._write_suppressed(n, "denials", "deny-log")
        if self.alerts_suppressed:
            n, self.alerts_suppressed = self.alerts_suppressed, 0
            self._write_suppressed(n, "alerts", "alert-log", alert="security")

    def _write_suppressed(self, n: int, what: str, limit: str, **extra) -> None:
        self._write({"time": round(time.time(), 6), "sandbox": self.sandbox_id, "agent": self.agent,
                     "phase": "log", "host": "", "port": None, "method": None, "path": None,
                     "rule": "log:suppressed", "verdict": "deny", "suppressed": n, **extra,
                     "reason": f"{n} further {what} were counted but not logged one by one ({limit} rate limit)",
                     "bytes_out": 0, "bytes_in": 0})

    def count_out(self, n: int, host: str = "", port: int | None = None) -> None:
        self.bytes_out += n
        if self.bytes_out > self.policy.limits.bytes_out:
            raise Cut("limit:bytes-out", host, port)

    def close_log(self) -> None:
        try:
            self.flush_suppressed()
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
        try:
            self.flush_log()
        except Exception:  # noqa: BLE001 - closing must not fail
            pass
        fd, self._log_fd = self._log_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

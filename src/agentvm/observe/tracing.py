"""OpenTelemetry traces: one trace per sandbox session, exported over OTLP/HTTP.

Only when the daemon is given a collector (``agentvm up --otlp-endpoint URL`` or
``AGENTVM_OTLP_ENDPOINT``); without one nothing here is imported and nothing is exported.

A session's trace
    ``agentvm.session <agent>`` (the root, from prepare to the recorded exit) with children
    ``launch`` (preflight, compile, gate attach, launch), ``exec`` (each ``agentvm exec``),
    ``egress <METHOD> <host>`` (each gate decision: verdict, rule id, path *template*,
    bytes, upstream latency; a denial has status ERROR), under it ``credential <name>``
    (each credential swapped in or blocked: its name and bound hosts, never a value),
    ``tool <name>`` (each tool call decided), ``approval <what>`` (request to answer), and
    ``teardown`` (verified destroy).

The agent joins its trace
    The sandbox gets ``TRACEPARENT`` (W3C trace context: the session's trace id, the root
    span as parent), and ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at the gate's ``/otlp``
    door on the proxy port: an instrumented agent exports its own spans there, and the gate
    relays them to the same collector (``gate/telemetry.py``) with no egress rule to write.

Spans are built from the events the daemon already has (gate decisions, records), after
the fact, with their real start and end times, on a worker thread: the gate's loop pays one
append to a bounded queue per decision; a slow or dead collector costs the daemon bounded
queues (this one and the SDK's batch processor drop what does not fit, counted and logged),
never a blocked sandbox.
"""

from __future__ import annotations

import collections
import json
import random
import re
import threading
import time
from typing import Any

from agentvm import __version__

_ID = re.compile(r"^(?:\d+|[0-9a-fA-F]{16,}|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
                 r"|[A-Za-z0-9_-]{24,})$")
MAX_SESSIONS = 4096
MAX_QUEUE = 50000  # events waiting to become spans


def path_template(path: str | None) -> str:
    """``/v1/users/1234/files/9f86d081884c7d65?x=1`` -> ``/v1/users/{id}/files/{id}``: no
    query, no identifiers (span attributes stay low-cardinality and carry no tokens)."""
    if not path:
        return ""
    p = path.split("?", 1)[0].split("#", 1)[0]
    if not p.startswith("/"):
        return "/"
    parts = ["{id}" if _ID.match(seg) else seg for seg in p.split("/")]
    out = "/".join(parts)
    return out[:256]


def _ns(t: float) -> int:
    return int(t * 1e9)


class SessionTrace:
    """The spans of one sandbox session."""

    def __init__(self, tracing: "Tracing", policy) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        self.t = tracing
        self.agent = policy.name
        self.bindings = {b.name: list(getattr(b, "hosts", ()) or ()) for b in getattr(policy, "credentials", ())}
        self.began = time.time()
        self.root = tracing.tracer.start_span(f"agentvm.session {policy.name}", context=otel_context.Context(),
                                              start_time=_ns(self.began),
                                              attributes={"agentvm.agent": policy.name,
                                                          "agentvm.substrate": getattr(policy, "substrate", "") or ""})
        self.ctx = trace.set_span_in_context(self.root)
        sc = self.root.get_span_context()
        self.trace_id, self.span_id = sc.trace_id, sc.span_id
        self.sandbox_id: str | None = None
        self.ended = False

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-01"

    def env(self) -> tuple[tuple[str, str], ...]:
        return (("TRACEPARENT", self.traceparent),)

    def bind(self, sandbox_id: str, **attrs) -> None:
        self.sandbox_id = sandbox_id
        self.root.set_attribute("agentvm.sandbox_id", sandbox_id)
        for k, v in attrs.items():
            if v is not None:
                self.root.set_attribute(f"agentvm.{k}", v)
        self.t.sessions_put(sandbox_id, self)

    def span(self, name: str, start: float, end: float | None = None, attributes: dict | None = None,
             parent=None, error: str | None = None):
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        ctx = trace.set_span_in_context(parent) if parent is not None else self.ctx
        sp = self.t.tracer.start_span(name, context=ctx, start_time=_ns(start),
                                      attributes={k: v for k, v in (attributes or {}).items() if v is not None})
        if error:
            sp.set_status(Status(StatusCode.ERROR, error[:200]))
        sp.end(end_time=_ns(end if end is not None else time.time()))
        return sp

    def end(self, exit_code: int | None = None, error: str | None = None) -> None:
        """End the session's trace after the events already queued for it."""
        if self.ended:
            return
        self.ended = True
        self.t.submit(("end", self, exit_code, error))

    def _end_now(self, exit_code: int | None, error: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if exit_code is not None:
            self.root.set_attribute("agentvm.exit_code", exit_code)
        if error:
            self.root.set_status(Status(StatusCode.ERROR, error[:200]))
        self.root.end()
        if self.sandbox_id:
            self.t.sessions_pop(self.sandbox_id)


class Tracing:
    def __init__(self, endpoint: str, sample_allowed: float = 1.0) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        _quiet_exporter_logs()
        self.endpoint = endpoint.rstrip("/")
        # the share of plain allowed egress decisions (no credential, no LLM usage) that become
        # spans; denials, credential uses, LLM calls, tools, approvals and lifecycle always do
        self.sample_allowed = max(0.0, min(1.0, float(sample_allowed)))
        self.provider = TracerProvider(resource=Resource.create({"service.name": "agent-vm",
                                                                 "service.version": __version__}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=self.endpoint + "/v1/traces", timeout=10),
            schedule_delay_millis=500, max_queue_size=8192))
        self.tracer = self.provider.get_tracer("agentvm", __version__)
        self._sessions: dict[str, SessionTrace] = {}
        self._approvals: dict[str, float] = {}
        self._lock = threading.Lock()
        # events are turned into spans on a worker thread: the daemon's loop (which is also the
        # gate's) only appends to a bounded queue; what does not fit is dropped and counted
        self._q: collections.deque = collections.deque()
        self._wake = threading.Event()
        self.dropped = 0
        self._stop = False
        self._worker = threading.Thread(target=self._work, name="agentvm-tracing", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ sessions
    def begin(self, policy) -> SessionTrace:
        return SessionTrace(self, policy)

    def sessions_put(self, sid: str, st: SessionTrace) -> None:
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[sid] = st

    def sessions_pop(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def session(self, sid: str | None) -> SessionTrace | None:
        with self._lock:
            return self._sessions.get(sid) if sid else None

    # ------------------------------------------------------------------ events
    def observe(self, rec: dict) -> None:
        """One daemon event (``Daemon.emit``): queued for the worker; never raises or blocks."""
        kind = rec.get("kind")
        if kind not in ("egress", "approval.requested", "approval.answered") and not (
                isinstance(kind, str) and kind.startswith(("syscall.", "ssh."))):
            return
        if (kind == "egress" and self.sample_allowed < 1.0 and rec.get("verdict") == "allow"
                and not rec.get("credentials") and not rec.get("llm") and random.random() >= self.sample_allowed):
            return
        self.submit(("event", rec))

    def submit(self, item: tuple) -> None:
        if len(self._q) >= MAX_QUEUE:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10000 == 0:
                import logging

                logging.getLogger("agentvm.tracing").warning(
                    "tracing is behind: %d events dropped (spans not exported)", self.dropped)
            return
        self._q.append(item)
        self._wake.set()

    def _work(self) -> None:
        while not self._stop or self._q:
            if not self._q:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            item = self._q.popleft()
            try:
                if item[0] == "event":
                    self._event(item[1])
                elif item[0] == "end":
                    item[1]._end_now(*item[2:])
            except Exception:  # noqa: BLE001 - tracing must never break the daemon
                pass

    def flush(self, timeout: float = 5.0) -> None:
        """Until the queue is empty (the spans are handed to the exporter)."""
        deadline = time.monotonic() + timeout
        while self._q and time.monotonic() < deadline:
            time.sleep(0.01)

    def _event(self, rec: dict) -> None:
        try:
            kind = rec.get("kind")
            if kind == "egress":
                self._decision(rec)
            elif kind == "approval.requested":
                with self._lock:
                    if len(self._approvals) > 10000:
                        self._approvals.clear()
                    self._approvals[str(rec.get("id"))] = float(rec.get("time") or time.time())
            elif kind == "approval.answered":
                self._approval(rec)
            elif kind.startswith("syscall."):
                self._syscall(rec)
            elif kind.startswith("ssh."):
                self._ssh(rec)
        except Exception:  # noqa: BLE001 - tracing must never break the daemon
            pass

    def _syscall(self, rec: dict) -> None:
        """An escape probe (``syscall.denied``/``syscall.watched``, agentvm.sysaudit): a span event
        of the sandbox's session - a zero-length span named after the record's kind."""
        st = self.session(rec.get("sandbox"))
        if st is None:
            return
        t = float(rec.get("time") or time.time())
        st.span(rec["kind"], t, t, attributes={
            "agentvm.syscall": rec.get("syscall") or "", "agentvm.rule": rec.get("rule") or "",
            "agentvm.errno": str(rec.get("errno") or ""), "agentvm.pid": int(rec.get("pid") or 0),
            "agentvm.exe": rec.get("exe") or "", "agentvm.argv": " ".join(rec.get("argv") or [])[:512],
            "agentvm.args": json.dumps(rec.get("args") or {}, sort_keys=True, default=str)},
            error=None)

    def _ssh(self, rec: dict) -> None:
        """A signing decision of the gate's ssh-agent (``ssh.sign`` / ``ssh.refuse``)."""
        st = self.session(rec.get("sandbox"))
        if st is None:
            return
        t = float(rec.get("time") or time.time())
        st.span(rec["kind"], t, t, attributes={
            "agentvm.ssh.verdict": rec.get("verdict") or "", "agentvm.ssh.key": rec.get("key") or "",
            "server.address": rec.get("host") or "", "agentvm.ssh.reason": rec.get("reason") or ""},
            error=rec.get("reason") if rec.get("verdict") == "refuse" else None)

    def _decision(self, rec: dict) -> None:
        st = self.session(rec.get("sandbox"))
        if st is None:
            return
        end = float(rec.get("time") or time.time())
        ms = rec.get("upstream_ms")
        start = end - float(ms) / 1000.0 if isinstance(ms, (int, float)) and ms > 0 else end
        verdict = rec.get("verdict")
        host = rec.get("host") or ""
        attrs: dict[str, Any] = {
            "agentvm.egress.verdict": verdict, "agentvm.egress.rule": rec.get("rule"),
            "agentvm.egress.phase": rec.get("phase"), "server.address": host or None, "server.port": rec.get("port"),
            "url.template": path_template(rec.get("path")) or None, "agentvm.egress.bytes_out": rec.get("bytes_out"),
            "agentvm.egress.bytes_in": rec.get("bytes_in"), "agentvm.egress.upstream_ms": ms,
        }
        if rec.get("method"):
            attrs["http.request.method"] = rec["method"]
        llm = rec.get("llm")
        if isinstance(llm, dict):  # OpenTelemetry's GenAI conventions
            attrs["gen_ai.response.model"] = llm.get("model")
            attrs["gen_ai.usage.input_tokens"] = llm.get("input_tokens")
            attrs["gen_ai.usage.output_tokens"] = llm.get("output_tokens")
            attrs["agentvm.llm.cost"] = llm.get("cost")
            attrs["agentvm.llm.estimated"] = bool(llm.get("estimated"))
        if rec.get("tool"):
            name = f"tool {rec['tool']}"
            attrs["agentvm.tool"] = rec["tool"]
        else:
            name = f"egress {rec.get('method') or ''} {host}".replace("  ", " ").strip()
        if verdict != "allow":
            attrs["agentvm.egress.reason"] = str(rec.get("reason") or "")[:300]
        parent = st.span(name, start, end, attrs, error=f"denied: {rec.get('rule')}" if verdict == "deny" else None)
        for cred in rec.get("credentials") or ():
            st.span(f"credential {cred}", start, start, {"agentvm.credential.name": cred,
                                                         "agentvm.credential.bound_hosts": st.bindings.get(cred, []),
                                                         "agentvm.credential.host": host, "agentvm.credential.use": "swap"},
                    parent=parent)
        if rec.get("credential") and verdict == "deny":
            cred = rec["credential"]
            st.span(f"credential {cred}", start, start, {"agentvm.credential.name": cred,
                                                         "agentvm.credential.bound_hosts": st.bindings.get(cred, []),
                                                         "agentvm.credential.host": host, "agentvm.credential.use": "blocked"},
                    parent=parent, error=str(rec.get("rule")))

    def _approval(self, rec: dict) -> None:
        st = self.session(rec.get("sandbox_id") or rec.get("sandbox"))
        if st is None:
            return
        with self._lock:
            start = self._approvals.pop(str(rec.get("id")), None)
        end = float(rec.get("time") or time.time())
        state = rec.get("state")
        st.span(f"approval {rec.get('what') or ''}".strip(), start or end, end,
                {"agentvm.approval.id": rec.get("id"), "agentvm.approval.state": state,
                 "agentvm.approval.by": rec.get("actor"), "agentvm.approval.target": rec.get("target")},
                error=None if state == "approved" else f"approval {state}")

    def shutdown(self) -> None:
        self.flush()
        self._stop = True
        self._wake.set()
        self._worker.join(timeout=5)
        try:
            self.provider.shutdown()
        except Exception:  # noqa: BLE001
            pass


class _OncePerMinute:
    """A logging filter: the SDK logs every failed batch (a dead collector would fill the
    daemon's log); one line a minute says it is still failing."""

    def __init__(self) -> None:
        self.last = 0.0
        self.held = 0

    def filter(self, record) -> bool:
        now = time.monotonic()
        if now - self.last >= 60:
            if self.held:
                record.msg = f"{record.msg} ({self.held} similar messages in the last minute not shown)"
            self.last, self.held = now, 0
            return True
        self.held += 1
        return False


def _quiet_exporter_logs() -> None:
    import logging

    for name in ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.sdk.trace.export",
                 "opentelemetry.sdk._shared_internal", "opentelemetry.exporter.otlp.proto.http",
                 "opentelemetry.exporter"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMinute) for f in lg.filters):
            lg.addFilter(_OncePerMinute())


def check_endpoint(url: str) -> str:
    from urllib.parse import urlsplit

    from agentvm.errors import ConfigError

    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or u.username:
        raise ConfigError(f"the OTLP endpoint {url!r} is not an http(s) base URL",
                          hint="give the collector's OTLP/HTTP base URL, e.g. http://127.0.0.1:4318 "
                          "(agent-vm appends /v1/traces)", code="config.otlp-endpoint")
    return url.rstrip("/")


def from_env_or(endpoint: str | None, sample_allowed: float | None = None) -> "Tracing | None":
    import os

    url = endpoint or os.environ.get("AGENTVM_OTLP_ENDPOINT") or ""
    if not url:
        return None
    if sample_allowed is None:
        sample_allowed = check_sample(os.environ.get("AGENTVM_OTLP_SAMPLE_ALLOWED") or 1.0)
    return Tracing(check_endpoint(url), check_sample(sample_allowed))


def check_sample(v) -> float:
    from agentvm.errors import ConfigError

    try:
        f = float(v)
    except (TypeError, ValueError):
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise ConfigError(f"the trace sample ratio {v!r} is not a number from 0 to 1",
                          hint="e.g. --otlp-sample-allowed 0.1 (one plain allowed request in ten becomes a span)",
                          code="config.otlp-sample")
    return f

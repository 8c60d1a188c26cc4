"""The relay of an agent's own OpenTelemetry export to the daemon's collector.

An instrumented agent (its SDK reads ``OTEL_EXPORTER_OTLP_ENDPOINT``, which agent-vm points
at ``http://127.0.0.1:<proxy port>/otlp``) posts OTLP/HTTP to the gate's proxy port; the gate
forwards the body, unchanged, to ``<collector>/v1/<signal>``. The operator writes no egress
rule for it, and the agent cannot choose where it goes: the collector is the daemon's.

Bounded like every other door: POST of ``application/x-protobuf`` or ``application/json``
only (gzip allowed, as the SDKs send it), at most ``MAX_BODY`` bytes, counted against the
sandbox's bytes-out budget, ``CONCURRENCY`` exports in flight per gate, ``TIMEOUT`` seconds
for the collector. Every relayed export is a decision on the log (``telemetry:relay``).

What an agent sends here reaches the operator's collector, and only it. Spans are data the
agent chose to write, so the relay marks them: each export is parsed (OTLP protobuf or JSON,
gzip undone within ``MAX_DECODED`` bytes) and every resource in it gets the attributes
``agentvm.relayed=true``, ``agentvm.sandbox`` and ``agentvm.agent`` set by the gate (any the
agent wrote under ``agentvm.`` are dropped first), and an export that claims agent-vm's own
``service.name`` is refused. A collector or a query can so always tell agent-vm's own spans
(``service.name=agent-vm``, no ``agentvm.relayed``) from what an agent sent. The export goes
on as protobuf.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from agentvm.gate import h1
from agentvm.gate.asgi import TooLarge, read_body
from agentvm.gate.endpoint import Cut

MAX_BODY = 4 * 1024 * 1024
MAX_DECODED = MAX_BODY  # a gzip export, inflated: no bigger than a plain one (a bomb is refused)
MAX_RESOURCES = 1000  # resources in one export (each is stamped: counted before anything is parsed)
MAX_RECORDS = 100_000  # scopes + spans/metrics/log records in one export
MAX_OUT = 2 * MAX_BODY  # the stamped export
MAX_ANSWER = 64 * 1024
TIMEOUT = 10.0
CONCURRENCY = 4
_TYPES = (b"application/x-protobuf", b"application/json")


class TelemetryRelay:
    def __init__(self, collector: str) -> None:
        self.collector = collector.rstrip("/")
        self._slots = asyncio.Semaphore(CONCURRENCY)

    async def relay(self, ep, stream, body, req: h1.ProxyRequest, signal: str) -> tuple[bool, bytes]:
        """-> (keep the connection, bytes after this request)."""
        ctype = (req.header(b"content-type") or b"").split(b";", 1)[0].strip().lower()
        coding = (req.header(b"content-encoding") or b"").strip().lower()
        if ctype not in _TYPES or coding not in (b"", b"gzip"):
            return await self._refuse(ep, stream, req, 415, "telemetry:bad-request",
                                      "OTLP/HTTP only: application/x-protobuf or application/json, optionally gzip")
        try:
            data = await read_body(stream, body, req, MAX_BODY)
        except TooLarge:
            return await self._refuse(ep, stream, req, 413, "telemetry:bad-request", f"an export over {MAX_BODY} bytes")
        if data is None:
            return False, b""
        try:
            ep.count_out(len(data))
        except Cut as cut:
            return await self._refuse(ep, stream, req, 413, cut.rule_id, "over the sandbox's bytes-out budget")
        url = f"{self.collector}/v1/{signal}"
        mine = getattr(ep, "_otlp_slot", None)
        if mine is None:
            mine = ep._otlp_slot = asyncio.Semaphore(1)  # one export of a sandbox at a time
        if mine.locked():
            return await self._refuse(ep, stream, req, 429, "telemetry:bad-request",
                                      "another export of this sandbox is being relayed: the SDK retries")
        async with mine, self._slots:
            try:
                data = await asyncio.to_thread(stamp, data, ctype, coding, signal, ep.sandbox_id, ep.agent)
            except ExportRefused as exc:
                return await self._refuse(ep, stream, req, 400, "telemetry:bad-request", str(exc))
            try:
                status, answer, atype = await asyncio.to_thread(_post, url, data,
                                                                {"Content-Type": "application/x-protobuf"})
                atype = "".join(c for c in atype if 32 <= ord(c) < 127)[:100] or "application/octet-stream"
            except (OSError, ValueError) as exc:
                ep.log(verdict="allow", rule_id="telemetry:relay", reason=f"the collector did not answer ({type(exc).__name__})",
                       host="", port=None, method="POST", path=req.path, phase="telemetry", bytes_out=len(data),
                       error="telemetry:unreachable")
                await stream.write(h1.error_response(502, "telemetry:unreachable", "the collector did not take the export"))
                return False, b""
        ep.log(verdict="allow", rule_id="telemetry:relay", reason=f"OTLP {signal} relayed to the collector ({status})",
               host="", port=None, method="POST", path=req.path, phase="telemetry", bytes_out=len(data),
               bytes_in=len(answer))
        head = (f"HTTP/1.1 {status} {'OK' if status < 300 else 'Error'}\r\ncontent-type: {atype}\r\n"
                f"content-length: {len(answer)}\r\n\r\n").encode("latin-1")
        await stream.write(head + answer)
        close = (req.header(b"connection") or b"").lower() == b"close" or req.http_version == "1.0"
        return not close, body.trailing

    async def _refuse(self, ep, stream, req, status: int, rule: str, reason: str) -> tuple[bool, bytes]:
        ep.log(verdict="deny", rule_id=rule, reason=reason, host="", port=None, method=req.method, path=req.path,
               phase="telemetry")
        await stream.write(h1.error_response(status, rule, reason))
        return False, b""


class ExportRefused(ValueError):
    pass


def _messages():
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    return {"traces": (trace_service_pb2.ExportTraceServiceRequest, "resource_spans"),
            "metrics": (metrics_service_pb2.ExportMetricsServiceRequest, "resource_metrics"),
            "logs": (logs_service_pb2.ExportLogsServiceRequest, "resource_logs")}


def stamp(data: bytes, ctype: bytes, coding: bytes, signal: str, sandbox: str, agent: str) -> bytes:
    """The export with the gate's marks on every resource, as protobuf (see the module's doc)."""
    import zlib

    from google.protobuf import json_format
    from google.protobuf.message import DecodeError

    if coding == b"gzip":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = d.decompress(data, MAX_DECODED)
        except zlib.error as exc:
            raise ExportRefused(f"the gzip body does not decode ({exc})") from None
        if d.unconsumed_tail:
            raise ExportRefused(f"the export inflates to over {MAX_DECODED} bytes")
    cls, field = _messages()[signal]
    msg = cls()
    try:
        if ctype == b"application/json":
            import json

            doc = json.loads(data)
            res = doc.get({"traces": "resourceSpans", "metrics": "resourceMetrics", "logs": "resourceLogs"}[signal]) \
                if isinstance(doc, dict) else None
            if isinstance(res, list) and len(res) > MAX_RESOURCES:
                raise ExportRefused(f"over {MAX_RESOURCES} resources in one export")
            json_format.ParseDict(doc, msg, ignore_unknown_fields=True)
        else:
            n = _top_level_count(data)  # before protobuf builds an object for each
            if n < 0:
                raise ExportRefused(f"not an OTLP {signal} export (malformed protobuf)")
            if n > MAX_RESOURCES:
                raise ExportRefused(f"over {MAX_RESOURCES} resources in one export")
            msg.ParseFromString(data)
    except ExportRefused:
        raise
    except (DecodeError, json_format.ParseError, ValueError, RecursionError, TypeError, AttributeError) as exc:
        raise ExportRefused(f"not an OTLP {signal} export ({type(exc).__name__})") from None
    records = 0
    for rs in getattr(msg, field):
        attrs = rs.resource.attributes
        for kv in attrs:
            if kv.key == "service.name" and _looks_like_ours(kv.value.string_value):
                raise ExportRefused("service.name 'agent-vm' is agent-vm's own; an agent's spans must use another name")
        _strip_ours(attrs)
        for key, value in (("agentvm.relayed", None), ("agentvm.sandbox", sandbox), ("agentvm.agent", agent)):
            kv = attrs.add()
            kv.key = key
            if value is None:
                kv.value.bool_value = True
            else:
                kv.value.string_value = value
        # agent-vm's own spans carry agentvm.* attributes at span level too: none of an agent's may
        for scope in _children(rs):
            records += 1
            if hasattr(scope, "scope"):
                _strip_ours(scope.scope.attributes)
                if _looks_like_ours(scope.scope.name):
                    raise ExportRefused("an instrumentation scope named like agent-vm's own")
            for rec in _children(scope):
                records += 1
                if records > MAX_RECORDS:
                    raise ExportRefused(f"over {MAX_RECORDS} records in one export")
                if hasattr(rec, "attributes"):
                    for kv in rec.attributes:
                        if kv.key == "service.name" and _looks_like_ours(kv.value.string_value):
                            raise ExportRefused("a record claims service.name 'agent-vm'")
                    _strip_ours(rec.attributes)
    out = msg.SerializeToString()
    if len(out) > MAX_OUT:
        raise ExportRefused(f"the export is over {MAX_OUT} bytes once marked")
    return out


def _children(m) -> list:
    for name in ("scope_spans", "scope_metrics", "scope_logs", "spans", "metrics", "log_records"):
        if hasattr(m, name):
            return list(getattr(m, name))
    return []


def _strip_ours(attrs) -> None:
    keep = [kv for kv in attrs if not kv.key.lower().startswith("agentvm")]
    if len(keep) != len(attrs):
        del attrs[:]
        attrs.extend(keep)


def _looks_like_ours(name: str) -> bool:
    """``agent-vm`` however it is dressed up: to a reader (:func:`agentvm.names.looks_like`:
    case, compatibility forms, invisible characters - format characters, every
    Default_Ignorable_Code_Point such as variation selectors or the Hangul fillers, U+2800 -,
    spaces, any dash, Latin small capitals and the Unicode confusables of UTS #39 - a minus
    sign, Cyrillic or Greek letters). A name over :data:`agentvm.names.MAX_NAME` characters is
    refused outright, before it is normalised (NFKC can make it 18 times longer, on the gate's
    shared loop; and what it would read as is not looked at)."""
    from agentvm.names import MAX_NAME, looks_like

    if isinstance(name, str) and len(name) > MAX_NAME:
        raise ExportRefused(f"a service or scope name of {len(name)} characters (at most {MAX_NAME})")
    return looks_like(name or "", "agent-vm", "agentvm", "agent_vm")


def _top_level_count(data: bytes) -> int:
    """Top-level fields of a protobuf message, counted from the wire format without parsing it
    (each is one resource of an OTLP export); -1 for a malformed buffer."""
    i, n, end = 0, 0, len(data)
    try:
        while i < end:
            tag, i = _varint(data, i)
            wt = tag & 7
            if wt == 2:
                ln, i = _varint(data, i)
                i += ln
            elif wt == 0:
                _, i = _varint(data, i)
            elif wt == 1:
                i += 8
            elif wt == 5:
                i += 4
            else:
                return -1
            n += 1
            if n > MAX_RESOURCES:
                return n
    except IndexError:
        return -1
    return n if i == end else -1


def _varint(b: bytes, i: int) -> tuple[int, int]:
    shift = v = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if not c & 0x80:
            return v, i
        shift += 7
        if shift > 63:
            raise IndexError


def _post(url: str, data: bytes, headers: dict) -> tuple[int, bytes, str]:
    # the collector is the operator's: no proxy variables of the daemon's environment apply
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with opener.open(req, timeout=TIMEOUT) as r:
            return r.status, r.read(MAX_ANSWER), r.headers.get("Content-Type", "application/x-protobuf")
    except urllib.error.HTTPError as e:
        return e.code, e.read(MAX_ANSWER), e.headers.get("Content-Type", "text/plain")

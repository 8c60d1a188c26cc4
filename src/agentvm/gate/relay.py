"""The HTTP/1.1 relay of one forwarded request: the exchange core (``gate.exchange``) decided
it may go (:class:`~agentvm.gate.exchange.Forward`); this moves its body up and the answer
down, with the checks that can only happen on the bytes in flight:

* the body size against the rule's ``maxBody`` (cut: 413) and the sandbox's bytes-out limit;
* credentials: a placeholder anywhere in a body is refused before it is sent (the body is
  held up to ``CRED_BUFFER`` for that scan), SigV4/HMAC requests are buffered and re-signed,
  and a bound upstream's echo of a real value is scrubbed from the response (decoded first
  when it is compressed);
* an allowed WebSocket upgrade becomes an opaque (counted) relay.

One :class:`Relay` per request: its context is attributes, not positional arguments.
"""

from __future__ import annotations

from time import monotonic

from agentvm.gate import encoding, framing, h1, rules
# (the names the request path uses, bound once: a module attribute costs a lookup on every use)
from agentvm.gate.framing import END, LAST_CHUNK, NEED_DATA, Head, ResponseReader, Upgraded, request_head, response_head
from agentvm.gate.framing import chunk as frame_chunk
from agentvm.gate.h1 import forward_headers, response_headers
from agentvm.gate.endpoint import Endpoint
from agentvm.gate.credentials import StreamGuard, is_stream_type
from agentvm.gate.exchange import Forward, cred_deny
from agentvm.gate.streams import Interrupted, PlainStream, client_gone

CRED_BUFFER = 1 << 20  # request bodies held for a placeholder scan before anything is sent
# a SigV4/HMAC request is buffered whole to be re-signed: per request, and per sandbox in total
RESIGN_MAX_BODY = 64 * 1024 * 1024
RESIGN_BUDGET = 96 * 1024 * 1024
EMIT_BATCH = 65536  # response bytes coalesced into one write (one TLS record for a small answer)
# seconds the gate waits for the next bytes of an upstream's answer (Squid's read_timeout is 15
# minutes; a model thinking before its first token can take minutes). A sandbox that gives up
# first is seen at once (its EOF interrupts the wait): this only bounds an upstream that goes
# silent while the sandbox keeps waiting too. Checked by the gate's sweep (server.py)
UPSTREAM_IDLE_TIMEOUT = 900.0


class BodyEnded(Exception):
    """The sandbox stopped sending (or sent something else) in the middle of a request body."""


class Stale(Exception):
    """A pooled upstream connection turned out closed before answering (safe to retry)."""


class UpstreamError(Exception):
    """The upstream broke the exchange - not the gate, not the sandbox. Logged with its own rule
    id (``upstream:protocol-error``: it broke HTTP/1.1 or closed mid-message;
    ``upstream:reset``: its connection failed), never as ``internal-error``; ``answered`` says
    whether the sandbox already got a response head (else it gets a 502)."""

    def __init__(self, rule_id: str, reason: str, *, answered: bool, status: int = 502):
        super().__init__(reason)
        self.rule_id, self.reason, self.answered, self.status = rule_id, reason, answered, status


class ClientGone(Exception):
    """The sandbox closed its connection before the request went upstream: it is not sent."""


class BadBody(Exception):
    """The sandbox's request body broke HTTP/1.1 framing (a bad chunk size, for example)."""


async def request_body(client, body: framing.RequestBody):
    """The pieces of the current request's body from the sandbox, until its end."""
    while True:
        try:
            ev = body.next_event()
        except framing.FramingError as exc:
            raise BadBody(str(exc)) from None
        except EOFError:
            raise BodyEnded() from None
        if ev is NEED_DATA:
            body.receive_data(await client.read())  # b"" is the sandbox's EOF
            continue
        if ev is END:
            return
        yield ev


class ResponseScrub:
    """One response to a sandbox holding credentials, scrubbed (HTTP/1.1 and HTTP/2 alike): an
    upstream echoing a real value must not hand it to the sandbox - header names and values,
    the reason phrase, the body; a compressed echo is still an echo, so a body in a coding the
    gate decodes is decoded, scrubbed and forwarded as identity (its length may change: the
    caller re-frames it).

    A response to a request a credential was swapped into (``swapped``) is where an echo comes
    from, and gets two more checks: its body is sniffed for a compression it does not declare
    (:func:`encoding.sniff`, on what the declared codings decode to), and a stream (an event
    stream, NDJSON and the like, or a body of no declared type) is read event by event
    (:class:`credentials.StreamGuard`: a value split across events cuts it). What the gate cannot inspect - a body compressed without saying so, a coding it cannot
    decode - is refused when one of the swapped credentials is ``inspect: strict`` (the
    default): ``credential:uninspectable-body`` / ``-encoding``; with only ``lenient`` ones it
    goes through as it is, its bytes scrubbed, and the log says ``"uninspected"``."""

    def __init__(self, scrubber, *, swapped: bool = False, strict: bool = True) -> None:
        self.scrubber = scrubber
        self.decoder = None
        self.decoded_from: str | None = None
        self.swapped, self.strict = swapped, strict
        # what tells whether the (decoded) body is compressed without saying so; None once it
        # has told (or when it is not asked)
        self.sniff = encoding.Sniffer() if swapped and scrubber.encoded else None
        self.guard = StreamGuard(scrubber._t) if swapped and scrubber.encoded else None
        self.released = 0  # body bytes handed on (none yet: a refusal can still be a 502)
        self.uninspected: str | None = None  # lenient: why the body went through unread

    def head(self, headers: list[tuple[bytes, bytes]], raw_headers, reason: bytes) -> tuple[list, bytes]:
        """-> (headers, reason) to send; raises ``encoding.DecodeError`` for a coding the gate
        cannot decode. ``headers`` are already without hop-by-hop fields; ``raw_headers`` are
        as received (the codings as sent, even where ``Connection: content-encoding`` hid them)."""
        sc = self.scrubber
        if self.guard is not None and not is_stream_type(next((v for k, v in headers if k == b"content-type"), None)):
            self.guard = None  # not a stream (a document is scrubbed whole; see credentials.StreamGuard)
        out = sc.headers((k, v) for k, v in headers if k not in (b"content-length", b"content-encoding"))
        codings = b", ".join(bytes(v) for k, v in raw_headers if bytes(k).lower() == b"content-encoding")
        if codings and sc.encoded:
            try:
                decoder = encoding.Decoder(codings)
            except encoding.DecodeError as err:
                if not (self.swapped and not self.strict):
                    raise
                # lenient: forwarded as it is, its bytes scrubbed (they cannot be read)
                self.uninspected = err.reason
                self.sniff = self.guard = None
                out.append((b"content-encoding", codings))
                decoder = None
            if decoder is not None and decoder.steps:
                self.decoder, self.decoded_from = decoder, codings.decode("latin-1")
        elif codings:
            out.append((b"content-encoding", codings))  # forwarded as it is (raw-scrub)
        return out, sc.header(reason)

    def _sniffed(self, part: bytes, final: bool = False) -> bytes:
        """``part`` once the sniff has decided (with what it held), b"" while it cannot tell."""
        found = self.sniff.feed(part, final)
        if found == "":
            return b""
        head, self.sniff = self.sniff.head, None
        if found:
            reason = (f"the response body is {found}-compressed without a Content-Encoding that says so: the gate "
                      "cannot inspect it for a credential's value")
            if self.strict:
                raise encoding.DecodeError("credential:uninspectable-body", reason)
            self.uninspected = reason
            self.guard = None  # (compressed bytes: no events to read)
        return head

    def _out(self, part: bytes):
        if self.sniff is not None:
            part = self._sniffed(part)
            if not part:
                return b""
        data = self.scrubber.feed(part)
        if data and self.guard is not None:
            data = self.guard.feed(data)
        self.released += len(data)
        return data

    def body(self, piece: bytes):
        """Scrubbed bytes for a piece of the body (lazy: decoding happens as they are taken)."""
        for part in (self.decoder.feed(piece) if self.decoder is not None else (piece,)):
            data = self._out(part)
            if data:
                yield data

    def finish(self):
        if self.decoder is not None:
            for part in self.decoder.finish():
                data = self._out(part)
                if data:
                    yield data
        if self.sniff is not None:
            part = self._sniffed(b"", final=True)
            if part:
                data = self.scrubber.feed(part)
                if data and self.guard is not None:
                    data = self.guard.feed(data)
                if data:
                    self.released += len(data)
                    yield data
        rest = self.scrubber.finish()
        if self.guard is not None:
            rest = self.guard.feed(rest) + self.guard.finish()
        if rest:
            self.released += len(rest)
            yield rest


def response_scrub(scrubber, creds, swap) -> ResponseScrub | None:
    """The :class:`ResponseScrub` of one response (None when nothing is to be scrubbed):
    ``swap`` says which credentials the request carried, and so how strictly it is read."""
    if scrubber is None or not scrubber.active:
        return None
    used = swap.used if swap is not None else None
    if not used:
        return ResponseScrub(scrubber)
    bindings = creds.bindings
    strict = any(getattr(bindings.get(n), "inspect", "strict") != "lenient" for n in used)
    return ResponseScrub(scrubber, swapped=True, strict=strict)


class Relay:
    """One request/response between ``client`` (its request body read through ``body``) and
    ``upstream``. :meth:`run` returns (keep the client connection, leftover bytes of the
    client's next request, the upstream connection is reusable)."""

    def __init__(self, ep: Endpoint, client, body: framing.RequestBody, upstream, fwd: Forward, *,
                 pooled: bool, splice):
        self.ep, self.client, self.body, self.upstream = ep, client, body, upstream
        self.fwd, self.req, self.d = fwd, fwd.req, fwd.decision
        self.cred = fwd.swap
        self.pooled = pooled  # a pooled connection may turn out stale: retry once on a fresh one
        self.splice = splice  # coroutine function relaying an upgraded connection
        req = self.req
        self.host_value = req.host if req.port in (80, 443) else f"{req.host}:{req.port}"
        self.ws = req.upgrade_websocket  # decide() allowed it, so a rule says websocket: true
        creds = ep.creds
        self.budget = fwd.budget  # the budget that reserved this request (metered), or None
        self.meter, self.llm_counted = None, False
        self.scanner = creds.body_scanner(req.host) if creds is not None else None
        self.scrubber = creds.scrubber() if creds is not None else None
        self.sent = 0
        self._watching: PlainStream | None = None  # the sandbox's connection, while its EOF interrupts the upstream
        self.t0 = monotonic()  # for the decision's upstream_ms
        # the sandbox's connection stays open after this exchange: HTTP/1.1 without "close"
        conn = {t.strip().lower() for k, v in req.headers if k == b"connection" for t in v.split(b",")}
        self.client_keep = req.http_version == "1.1" and b"close" not in conn

    # -- log/answer helpers ----------------------------------------------------------------
    def _log(self, **kw) -> None:
        req = self.fwd.logged  # the agent's own target: a swapped query-string value is never logged
        self.ep.log(host=req.host, port=req.port, method=req.method, path=req.path, **kw)

    async def _cred_deny(self, err) -> None:
        cmd = cred_deny(self.fwd.logged, err)
        self.ep.log(**cmd.log_fields())
        await self.client.write(cmd.as_http1())

    async def _undecodable(self, err, *, answered: bool = False) -> None:
        """A response the scrubber cannot read is never passed on: 502 (or, once its head has
        gone out, the response is cut short), logged with the rule id."""
        self._log(verdict="deny", rule_id=err.rule_id, reason=err.reason, phase="response", bytes_out=self.sent)
        if not answered:
            await self.client.write(h1.error_response(502, err.rule_id, err.reason))

    async def _over_max_body(self, max_body: int) -> None:
        rule = rules.max_body(self.d)
        self._log(verdict="deny", rule_id=rule, reason=f"body over {max_body} bytes: cut", phase="stream",
                  bytes_out=self.sent)
        await self.client.write(h1.error_response(413, rule, f"request body over {max_body} bytes"))

    def _count_llm(self) -> dict | None:
        """Count the metered response once - also when it ended early (the sandbox hung up
        mid-stream, the upstream cut it): tokens generated are tokens spent."""
        meter = self.meter
        if meter is None or not meter.answered or self.llm_counted:
            return None
        self.llm_counted = True
        return self.budget.add(*meter.finish(self.sent))

    def _unwatch(self) -> None:
        """The sandbox's connection stops interrupting this relay's upstream (see _response)."""
        if self._watching is not None:
            self._watching.on_gone = None
            self._watching = None

    def _count_out(self, n: int) -> None:
        self.ep.count_out(n, self.req.host, self.req.port)

    # -- request ---------------------------------------------------------------------------
    async def run(self) -> tuple[bool, bytes, bool]:
        req, scrubber, cred = self.req, self.scrubber, self.cred
        headers = forward_headers(req, self.host_value, keep_upgrade=self.ws)
        if scrubber is not None and scrubber.encoded and not (cred is not None and cred.resign):
            # ask only for codings the gate can decode (and so scrub); a signed request keeps
            # its header (it may be signed) and relies on the response check alone
            headers = encoding.narrow_accept_headers(headers)
        if self.budget is not None and not (cred is not None and cred.resign):
            # a metered LLM API answers uncompressed: its usage is read as it streams past
            headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"] + [(b"accept-encoding",
                                                                                          b"identity")]
        try:
            try:
                if cred is not None and cred.resign:
                    # a signed request: the whole body is needed to check and redo the signature
                    held = [0]  # bytes this request holds against the sandbox's re-sign budget
                    try:
                        return await self._send_resigned(headers, held)
                    finally:
                        self.ep.resign_buffered -= held[0]
                return await self._send_streamed(headers)
            except ClientGone:  # nothing was written upstream: the connection stays good for the pool
                self._log(verdict="deny", rule_id="client-gone", phase="request",
                          reason="the client closed the connection before the request was forwarded")
                return False, b"", self.upstream.reusable
            except BadBody as exc:
                self._log(verdict="deny", rule_id="bad-request:bad-body", reason=f"request body framing: {exc}"[:300],
                          phase="stream", bytes_out=self.sent)
                await self.client.write(h1.error_response(400, "bad-request:bad-body", "malformed request body framing"))
                return False, b"", False
        finally:
            self._unwatch()
            llm = self._count_llm()  # a response cut short still counts
            if llm is not None:
                self._log(verdict="allow", rule_id=self.d.rule_id, reason="LLM response ended early: counted",
                          phase="budget", bytes_out=self.sent, llm=llm)

    # Writes toward the upstream: handed to the socket at once (send), and awaited only while
    # the upstream is not taking bytes - no coroutine per write on the common path.
    def _up_failed(self, exc: BaseException, head: bool) -> Exception:
        if self.pooled and head:
            return Stale()  # a pooled connection the upstream had closed: retried once, fresh
        return UpstreamError("upstream:reset", f"sending to the upstream failed: {type(exc).__name__}", answered=False)

    def _send_up(self, data: bytes, head: bool = False) -> bool:
        """``data`` to the upstream now; True when the caller must ``await _up_drained(head)``."""
        try:
            return self.upstream.send(data)
        except (ConnectionError, OSError) as exc:
            raise self._up_failed(exc, head) from None

    async def _up_drained(self, head: bool = False) -> None:
        try:
            await self.upstream.drained()
        except (ConnectionError, OSError) as exc:
            raise self._up_failed(exc, head) from None

    async def _write_up(self, data: bytes, *, head: bool = False) -> None:
        if self._send_up(data, head):
            await self._up_drained(head)

    def _send_head(self, headers) -> bool:
        """The request head to the upstream now; True when the caller must ``await
        _up_drained(True)``."""
        req = self.req
        if client_gone(self.client):
            raise ClientGone()  # its EOF came with (or after) the body: the request is not sent late
        head = request_head(req.method, req.path, headers)
        self._count_out(len(head))  # a head carries data out too (path, headers)
        return self._send_up(head, True)

    async def _send_streamed(self, headers) -> tuple[bool, bytes, bool]:
        """With credentials in the sandbox, a body is scanned before anything is sent: the head
        waits until the body is complete (or CRED_BUFFER is exceeded - then it streams, and a
        placeholder found later cuts the upstream request mid-body)."""
        req, scanner, max_body = self.req, self.scanner, self.fwd.max_body
        held: list[bytes] | None = [] if scanner is not None else None
        held_len = 0
        frame = frame_chunk if req.chunked else bytes  # the body is re-framed as it was declared
        if held is None and self._send_head(headers):
            await self._up_drained(True)
        if (req.header(b"expect") or b"").lower() == b"100-continue" and not self.body.done:
            await self.client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            if not self.body.done:  # (most requests have no body: no reader to start)
                async for chunk in request_body(self.client, self.body):
                    self.sent += len(chunk)
                    if max_body is not None and self.sent > max_body:
                        await self._over_max_body(max_body)
                        return False, b"", False
                    self._count_out(len(chunk))
                    data = chunk
                    if scanner is not None:
                        try:
                            data = scanner.feed(data)
                        except Exception as err:  # CredentialError: a placeholder in the body
                            await self._cred_deny(err)
                            return False, b"", False
                    if held is not None:
                        held.append(data)
                        held_len += len(data)
                        if held_len <= CRED_BUFFER:
                            continue
                        if self._send_head(headers):
                            await self._up_drained(True)
                        data, held = b"".join(held), None
                    if data:
                        await self._write_up(frame(data))
        except BodyEnded:
            return False, b"", False
        rest = scanner.finish() if scanner is not None else b""
        if held is not None:
            if self._send_head(headers):
                await self._up_drained(True)
            rest = b"".join(held) + rest
        if rest:
            await self._write_up(frame(rest))
        if req.chunked:
            await self._write_up(LAST_CHUNK)
        return await self._response()

    async def _send_resigned(self, headers, held: list[int]) -> tuple[bool, bytes, bool]:
        from agentvm.gate import signing

        ep, req, cred, max_body = self.ep, self.req, self.cred, self.fwd.max_body
        body = bytearray()
        try:
            async for chunk in request_body(self.client, self.body):
                body += chunk
                ep.resign_buffered += len(chunk)
                held[0] += len(chunk)
                if max_body is not None and len(body) > max_body:
                    await self._over_max_body(max_body)
                    return False, b"", False
                if len(body) > RESIGN_MAX_BODY:
                    self._log(verdict="deny", rule_id="limit:resign-body", phase="stream", bytes_out=len(body),
                              reason=f"a signed request body over {RESIGN_MAX_BODY} bytes cannot be buffered to re-sign")
                    await self.client.write(h1.error_response(413, "limit:resign-body", "signed request body too large"))
                    return False, b"", False
                if ep.resign_buffered > RESIGN_BUDGET:
                    # all of this sandbox's signed requests in flight share one memory budget
                    self._log(verdict="deny", rule_id="limit:resign-memory", reason="too many signed bytes buffered at once",
                              phase="stream")
                    await self.client.write(h1.error_response(503, "limit:resign-memory",
                                                              "too many signed request bytes in flight"))
                    return False, b"", False
        except BodyEnded:
            return False, b"", False
        try:
            if self.scanner is not None:
                self.scanner.feed(bytes(body))
            sreq = signing.Request(
                method=req.method,
                url=f"https://{self.host_value}{req.path}",
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
                body=bytes(body),
            )
            for b in cred.resign:
                if b.mode == "sigv4":
                    # UNSIGNED-PAYLOAD / STREAMING-UNSIGNED-PAYLOAD-TRAILER (boto3's default for S3
                    # uploads over TLS): the body carries no signature, only the header one is redone
                    sreq = signing.resign_sigv4(sreq, access_key_id=b.sigv4_access_key_id,
                                                placeholder_secret=ep.creds.placeholders[b.name],
                                                real_secret=ep.creds.value(b.name), allow_unsigned_payload=True)
                else:
                    from types import SimpleNamespace

                    sreq = signing.resign_hmac(sreq, SimpleNamespace(**{k: (v or None) if k == "timestamp_header" else v
                                                                         for k, v in b.hmac}),
                                               placeholder=ep.creds.placeholders[b.name], real=ep.creds.value(b.name))
        except signing.SigningError as err:
            self._log(verdict="deny", rule_id=f"credential:{err.code}", reason=str(err), phase="request", alert=True,
                      credential=",".join(b.name for b in cred.resign))
            await self.client.write(h1.deny_response(f"credential:{err.code}", str(err), host=req.host, port=req.port))
            return False, b"", False
        except Exception as err:
            if hasattr(err, "rule_id"):
                await self._cred_deny(err)
            else:
                await self.client.write(h1.error_response(502, "credential:resign-failed", type(err).__name__))
            return False, b"", False
        from urllib.parse import urlsplit

        u = urlsplit(sreq.url)
        target = u.path + ("?" + u.query if u.query else "")
        # what the gate signed with a real key is scrubbed from the answer like a real value
        # (an upstream that echoes the request would hand the sandbox a capability: review 8)
        was = {k.lower(): v for k, v in headers}
        now = {k.lower(): v for k, v in sreq.headers}
        both = sorted(set(was) & {k.lower().encode("latin-1") for k in now})
        made = signing.derived([req.path] + [was[k].decode("latin-1") for k in both],
                               [target] + [now[k.decode("latin-1")] for k in both])
        if made and ep.creds is not None:  # (this answer and every later one of the session)
            ep.creds.remember_derived(made)
            self.scrubber = ep.creds.scrubber()
        new_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in sreq.headers
                       if k.lower() not in ("transfer-encoding", "content-length")]
        new_headers.append((b"content-length", str(len(sreq.body)).encode()))
        if client_gone(self.client):
            raise ClientGone()  # the sandbox closed while the body was read: not sent late (nor counted)
        self._count_out(len(sreq.body))
        head = request_head(req.method, target, new_headers)
        self._count_out(len(head))
        self.pooled = False  # a signed request is never retried (its signature is single-use)
        await self._write_up(head + sreq.body)
        self.sent = len(sreq.body)
        self.ws = False
        return await self._response()

    # -- response ---------------------------------------------------------------------------
    # What goes to the sandbox is coalesced: one TLS record/send for a small response. Methods,
    # not closures inside _response: compiled (agentvm.gate.accel), closures that call each
    # other share one scope object that holds them - a reference cycle per request that only
    # the garbage collector frees.
    def _held(self, data: bytes) -> bool:
        """``data`` held for the next write (no coroutine): True when a write is due."""
        if data:
            self._out.append(data)
            self._out_len += len(data)
        return self._out_len >= EMIT_BATCH

    def _emit_now(self, data: bytes, flush: bool = False) -> bool:
        """``data`` held, and all that is held handed to the sandbox's socket when ``flush`` or a
        write is due; True when the caller must ``await self.client.drained()``."""
        if (self._held(data) or flush) and self._out:
            out = b"".join(self._out)
            self._out.clear()
            self._out_len = 0
            return self.client.send(out)
        return False

    async def _emit(self, data: bytes, flush: bool = False) -> None:
        if self._emit_now(data, flush):
            await self.client.drained()

    async def _scrubbed_out(self, pieces, scrub=None) -> bool:
        """Scrubbed pieces to the sandbox; False when the body does not decode or is refused
        (what was sent stays, the response ends unfinished; a refusal before any of the body
        went out, its head still held, is a 502 instead)."""
        meter = self.meter
        try:
            for data in pieces:
                if meter is not None:
                    meter.feed(data)
                await self._emit(self._frame(data))
        except encoding.DecodeError as err:
            if scrub is not None and not scrub.released and self._out:
                self._out.clear()  # only the head, never sent: the answer is the refusal
                self._out_len = 0
                await self._undecodable(err)
                return False
            await self._emit(b"", flush=True)
            await self._undecodable(err, answered=True)
            return False
        return True

    async def _response(self) -> tuple[bool, bytes, bool]:
        ep, req, d, client = self.ep, self.req, self.d, self.client
        scrubber, cred = self.scrubber, self.cred
        leftover = self.body.trailing
        reader = ResponseReader(req.method)
        self._out: list[bytes] = []  # held for the sandbox (see _held)
        self._out_len = 0
        self._frame = bytes  # how body pieces are framed toward the sandbox (set with the head)
        held, emit, scrubbed_out = self._held, self._emit, self._scrubbed_out
        up, gate = self.upstream, ep.gate
        # the sandbox closing its connection (its client gave up) ends the wait for the answer at
        # once: the upstream connection is closed, not held until the upstream answers
        raw = getattr(client, "raw", client)
        if isinstance(raw, PlainStream) and isinstance(up, PlainStream):
            if client_gone(raw):
                up.interrupt()
            else:
                raw.on_gone = up.interrupt
                self._watching = raw

        received = 0
        answered = False
        keep = self.client_keep
        scrub = response_scrub(scrubber, ep.creds, cred)
        meter = self.meter = self.budget.meter() if self.budget is not None else None
        while True:
            try:
                ev = reader.next_event()
            except framing.FramingError as exc:
                if self.pooled and not answered:
                    raise Stale() from None
                await emit(b"", flush=True)
                raise UpstreamError("upstream:protocol-error", str(exc)[:300], answered=answered) from None
            if ev is NEED_DATA:
                # what was decoded so far goes out before waiting: a stream (SSE, chunked
                # progress) reaches the agent as it is sent, not when the response ends
                if self._out and (scrub is None or scrub.sniff is None) and self._emit_now(b"", True):
                    await client.drained()  # (not while the body is sniffed: its refusal is a 502)
                gate.watch_read(up)
                try:
                    data = await up.read()
                except Interrupted as exc:
                    if exc.why == "client-left":
                        self._log(verdict="allow", rule_id=d.rule_id, phase="response", error="client-left",
                                  reason="the sandbox closed its connection before the answer ended: the upstream "
                                  "connection is closed too", bytes_out=self.sent, bytes_in=received)
                        return False, b"", False
                    raise UpstreamError("upstream:timeout", f"the upstream sent nothing for {UPSTREAM_IDLE_TIMEOUT:g} s "
                                        "while its answer was awaited", answered=answered, status=504) from None
                except (ConnectionError, OSError) as exc:
                    if self.pooled and not answered:
                        raise Stale() from None
                    raise UpstreamError("upstream:reset", f"the upstream connection failed: {type(exc).__name__}",
                                        answered=answered) from None
                finally:
                    gate.unwatch_read(up)
                try:
                    reader.receive_data(data)  # b"" signals EOF
                except framing.FramingError as exc:
                    if self.pooled and not answered:
                        raise Stale() from None
                    await emit(b"", flush=True)
                    raise UpstreamError("upstream:protocol-error", str(exc)[:300], answered=answered) from None
                continue
            if isinstance(ev, Upgraded):
                if not self.ws or not any(k == b"upgrade" and v.strip().lower() == b"websocket"
                                          for k, v in ev.head.headers):
                    # only the WebSocket a rule allowed: never another protocol the upstream picked
                    raise UpstreamError("upstream:protocol-error", "the upstream switched to a protocol not asked for",
                                        answered=answered)
                self._unwatch()  # the splice ends each way on its own: an EOF is not a client gone
                if isinstance(up, PlainStream):
                    up.uninterrupt()  # (an EOF that came with the 101 had interrupted it already)
                await emit(b"", flush=True)
                head = ev.head
                wh = response_headers(head.headers, keep_upgrade=True)
                await client.write(response_head(
                    101, scrubber.header(head.reason) if scrub else head.reason,
                    scrubber.headers(wh) if scrub else wh))
                # the upgraded connection is relayed as bytes (still counted against bytesOut)
                if ev.rest:
                    await client.write(ev.rest)
                if leftover:
                    self._count_out(len(leftover))
                    await self.upstream.write(leftover)
                out, inn = await self.splice(ep, client, self.upstream, (req.host, req.port))
                self._log(verdict="allow", rule_id=d.rule_id, reason="websocket relayed", phase="websocket",
                          bytes_out=self.sent + out, bytes_in=inn)
                return False, b"", False
            if isinstance(ev, Head):
                if ev.status < 200:
                    continue  # 100 Continue, 103 Early Hints: the gate answered Expect itself
                answered = True
                rh = response_headers(ev.headers)
                reason = ev.reason
                if scrub is not None:
                    try:
                        rh, reason = scrub.head(rh, ev.headers, reason)  # its length may change: chunked
                    except encoding.DecodeError as err:
                        await self._undecodable(err)
                        return False, b"", False
                if meter is not None:
                    meter.head(ev.status, ev.headers)
                bodyless = req.method == "HEAD" or ev.status in (204, 304)
                if bodyless or any(k == b"content-length" for k, _ in rh):
                    self._frame = bytes  # as the upstream declared it (its length was checked by the parser)
                elif self.client_keep:
                    rh.append((b"transfer-encoding", b"chunked"))
                    self._frame = frame_chunk
                else:
                    self._frame, keep = bytes, False  # HTTP/1.0 or "close": the end of the connection frames it
                if not keep:
                    rh.append((b"connection", b"close"))
                if held(response_head(ev.status, reason, rh)) and self._emit_now(b""):
                    await client.drained()
                continue
            if ev is END:
                self._unwatch()  # nothing more is read from the upstream
                if scrub is not None and not await scrubbed_out(scrub.finish(), scrub):
                    return False, b"", False
                if self._emit_now(LAST_CHUNK if self._frame is frame_chunk else b"", True):
                    await client.drained()
                break
            # a piece of the body
            received += len(ev)
            if scrub is None:
                if meter is not None:
                    meter.feed(ev)
                if held(self._frame(ev)) and self._emit_now(b""):
                    await client.drained()
            elif not await scrubbed_out(scrub.body(ev), scrub):
                return False, b"", False
        ep.bytes_in += received
        extra = {}
        if cred is not None and cred.used:
            extra["credentials"] = sorted(set(cred.used))
        if scrubber is not None and scrubber.hits:
            extra["scrubbed"] = scrubber.hits
            extra["alert"] = True
        if scrub is not None and scrub.decoded_from:
            extra["decoded"] = scrub.decoded_from
        if scrub is not None and scrub.uninspected:
            extra["uninspected"] = scrub.uninspected
            extra["alert"] = True
        llm = self._count_llm()
        if llm is not None:
            extra["llm"] = llm
        us = round((monotonic() - self.t0) * 1e6)
        if extra and (len(extra) > 1 or "credentials" not in extra):
            self._log(verdict="allow", rule_id=d.rule_id, reason=d.reason, phase="request", bytes_out=self.sent,
                      bytes_in=received, upstream_ms=us / 1000, **extra)
        else:  # the common records, on their own path (the log line was ~10% of the gate's CPU)
            lg = self.fwd.logged
            ep.log_relayed(d.rule_id, d.reason, lg.host, lg.port, lg.method, lg.path, self.sent, received, us,
                           extra.get("credentials"))
        reusable = reader.reusable and self.upstream.reusable
        return keep, leftover, reusable

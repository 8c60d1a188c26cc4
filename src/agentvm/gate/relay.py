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

import h11

from agentvm.gate import encoding, h1
from agentvm.gate.endpoint import Endpoint
from agentvm.gate.exchange import Forward

CRED_BUFFER = 1 << 20  # request bodies held for a placeholder scan before anything is sent
# a SigV4/HMAC request is buffered whole to be re-signed: per request, and per sandbox in total
RESIGN_MAX_BODY = 64 * 1024 * 1024
RESIGN_BUDGET = 96 * 1024 * 1024
EMIT_BATCH = 65536  # response bytes coalesced into one write (one TLS record for a small answer)


class BodyEnded(Exception):
    """The sandbox stopped sending (or sent something else) in the middle of a request body."""


class Stale(Exception):
    """A pooled upstream connection turned out closed before answering (safe to retry)."""


class UpstreamError(Exception):
    """The upstream broke the exchange - not the gate, not the sandbox. Logged with its own rule
    id (``upstream:protocol-error``: it broke HTTP/1.1 or closed mid-message;
    ``upstream:reset``: its connection failed), never as ``internal-error``; ``answered`` says
    whether the sandbox already got a response head (else it gets a 502)."""

    def __init__(self, rule_id: str, reason: str, *, answered: bool):
        super().__init__(reason)
        self.rule_id, self.reason, self.answered = rule_id, reason, answered


class BadBody(Exception):
    """The sandbox's request body broke HTTP/1.1 framing (a bad chunk size, for example)."""


async def request_body(client, down: h11.Connection):
    """The chunks of the current request's body from the sandbox, until its end (h11 framing)."""
    while True:
        try:
            ev = down.next_event()
        except h11.RemoteProtocolError as exc:
            raise BadBody(str(exc)) from None
        if ev is h11.NEED_DATA:
            data = await client.read()
            if not data:
                raise BodyEnded()
            down.receive_data(data)
            continue
        if isinstance(ev, h11.Data):
            yield ev.data
            continue
        if isinstance(ev, h11.EndOfMessage):
            return
        raise BodyEnded()


class Relay:
    """One request/response between ``client`` (h11 server side ``down``) and ``upstream``
    (h11 client side ``up``). :meth:`run` returns (keep the client connection, leftover bytes
    of the client's next request, the upstream connection is reusable)."""

    def __init__(self, ep: Endpoint, client, down: h11.Connection, upstream, up: h11.Connection, fwd: Forward, *,
                 pooled: bool, splice):
        self.ep, self.client, self.down, self.upstream, self.up = ep, client, down, upstream, up
        self.fwd, self.req, self.d = fwd, fwd.req, fwd.decision
        self.cred = fwd.swap
        self.pooled = pooled  # a pooled connection may turn out stale: retry once on a fresh one
        self.splice = splice  # coroutine function relaying an upgraded connection
        req = self.req
        self.host_value = req.host if req.port in (80, 443) else f"{req.host}:{req.port}"
        self.ws = req.upgrade_websocket  # decide() allowed it, so a rule says websocket: true
        creds = ep.creds
        self.scanner = creds.body_scanner(req.host) if creds is not None else None
        self.scrubber = creds.scrubber() if creds is not None else None
        self.sent = 0

    # -- log/answer helpers ----------------------------------------------------------------
    def _log(self, **kw) -> None:
        req = self.req
        self.ep.log(host=req.host, port=req.port, method=req.method, path=req.path, **kw)

    async def _cred_deny(self, err) -> None:
        self._log(verdict="deny", rule_id=err.rule_id, reason=err.reason, phase="request", credential=err.name,
                  alert=err.alert)
        await self.client.write(h1.deny_response(err.rule_id, err.reason, host=self.req.host, port=self.req.port))

    async def _undecodable(self, err, *, answered: bool = False) -> None:
        """A response the scrubber cannot read is never passed on: 502 (or, once its head has
        gone out, the response is cut short), logged with the rule id."""
        self._log(verdict="deny", rule_id=err.rule_id, reason=err.reason, phase="response", bytes_out=self.sent)
        if not answered:
            await self.client.write(h1.error_response(502, err.rule_id, err.reason))

    async def _over_max_body(self, max_body: int) -> None:
        rule = (self.d.body_rule_id or self.d.rule_id) + ":max-body"
        self._log(verdict="deny", rule_id=rule, reason=f"body over {max_body} bytes: cut", phase="stream",
                  bytes_out=self.sent)
        await self.client.write(h1.error_response(413, rule, f"request body over {max_body} bytes"))

    def _count_out(self, n: int) -> None:
        self.ep.count_out(n, self.req.host, self.req.port)

    # -- request ---------------------------------------------------------------------------
    async def run(self) -> tuple[bool, bytes, bool]:
        req, scrubber, cred = self.req, self.scrubber, self.cred
        headers = h1.forward_headers(req, self.host_value, keep_upgrade=self.ws)
        if scrubber is not None and scrubber.encoded and not (cred is not None and cred.resign):
            # ask only for codings the gate can decode (and so scrub); a signed request keeps
            # its header (it may be signed) and relies on the response check alone
            headers = [(k, encoding.narrow_accept(v)) if k == b"accept-encoding" else (k, v) for k, v in headers]
        try:
            if cred is not None and cred.resign:
                # a signed request: the whole body is needed to check and redo the signature
                held = [0]  # bytes this request holds against the sandbox's re-sign budget
                try:
                    return await self._send_resigned(headers, held)
                finally:
                    self.ep.resign_buffered -= held[0]
            return await self._send_streamed(headers)
        except BadBody as exc:
            self._log(verdict="deny", rule_id="bad-request:bad-body", reason=f"request body framing: {exc}"[:300],
                      phase="stream", bytes_out=self.sent)
            await self.client.write(h1.error_response(400, "bad-request:bad-body", "malformed request body framing"))
            return False, b"", False

    async def _write_up(self, data: bytes, *, head: bool = False) -> None:
        try:
            await self.upstream.write(data)
        except (ConnectionError, OSError) as exc:
            if self.pooled and head:
                raise Stale() from None
            raise UpstreamError("upstream:reset", f"sending to the upstream failed: {type(exc).__name__}",
                                answered=False) from None

    async def _send_streamed(self, headers) -> tuple[bool, bytes, bool]:
        """With credentials in the sandbox, a body is scanned before anything is sent: the head
        waits until the body is complete (or CRED_BUFFER is exceeded - then it streams, and a
        placeholder found later cuts the upstream request mid-body)."""
        req, up, scanner, max_body = self.req, self.up, self.scanner, self.fwd.max_body
        held: list[bytes] | None = [] if scanner is not None else None
        held_len = 0

        async def send_head() -> None:
            head = up.send(h11.Request(method=req.method, target=req.path, headers=headers))
            self._count_out(len(head))  # a head carries data out too (path, headers)
            await self._write_up(head, head=True)

        if held is None:
            await send_head()
        if (req.header(b"expect") or b"").lower() == b"100-continue" and self.down.their_state is h11.SEND_BODY:
            await self.client.write(self.down.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            async for chunk in request_body(self.client, self.down):
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
                    await send_head()
                    data, held = b"".join(held), None
                if data:
                    await self._write_up(up.send(h11.Data(data=data)))
        except BodyEnded:
            return False, b"", False
        rest = scanner.finish() if scanner is not None else b""
        if held is not None:
            await send_head()
            rest = b"".join(held) + rest
        if rest:
            await self._write_up(up.send(h11.Data(data=rest)))
        end = up.send(h11.EndOfMessage())
        if end:
            await self._write_up(end)
        return await self._response()

    async def _send_resigned(self, headers, held: list[int]) -> tuple[bool, bytes, bool]:
        from agentvm.gate import signing

        ep, req, cred, max_body = self.ep, self.req, self.cred, self.fwd.max_body
        body = bytearray()
        try:
            async for chunk in request_body(self.client, self.down):
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
        new_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in sreq.headers
                       if k.lower() not in ("transfer-encoding", "content-length")]
        new_headers.append((b"content-length", str(len(sreq.body)).encode()))
        self._count_out(len(sreq.body))
        head = self.up.send(h11.Request(method=req.method, target=target, headers=new_headers))
        self._count_out(len(head))
        self.pooled = False  # a signed request is never retried (its signature is single-use)
        await self._write_up(head)
        if sreq.body:
            await self._write_up(self.up.send(h11.Data(data=sreq.body)))
        await self._write_up(self.up.send(h11.EndOfMessage()))
        self.sent = len(sreq.body)
        self.ws = False
        return await self._response()

    # -- response --------------------------------------------------------------------------
    async def _response(self) -> tuple[bool, bytes, bool]:
        ep, req, d, client, up, down = self.ep, self.req, self.d, self.client, self.up, self.down
        scrubber, cred = self.scrubber, self.cred
        leftover = down.trailing_data[0]
        # response: coalesce what goes to the sandbox (one TLS record/send for a small response)
        pending_out: list[bytes] = []
        pending_len = 0

        async def emit(data: bytes, flush: bool = False) -> None:
            nonlocal pending_len
            if data:
                pending_out.append(data)
                pending_len += len(data)
            if pending_out and (flush or pending_len >= EMIT_BATCH):
                out = b"".join(pending_out)
                pending_out.clear()
                pending_len = 0
                await client.write(out)

        async def scrubbed_out(pieces) -> bool:
            """Decoded pieces (decoding is lazy: it happens here), scrubbed, to the sandbox; False
            when the body does not decode (what was sent stays, the response ends unfinished)."""
            try:
                for piece in pieces:
                    data = scrubber.feed(piece)
                    if data:
                        await emit(down.send(h11.Data(data=data)))
            except encoding.DecodeError as err:
                await emit(b"", flush=True)
                await self._undecodable(err, answered=True)
                return False
            return True

        received = 0
        answered = False
        scrubbing = scrubber is not None and scrubber.active
        decoder = None
        decoded_from = None
        while True:
            try:
                ev = up.next_event()
            except h11.RemoteProtocolError as exc:
                if self.pooled and not answered:
                    raise Stale() from None
                await emit(b"", flush=True)
                raise UpstreamError("upstream:protocol-error", f"the upstream broke HTTP/1.1: {exc}"[:300],
                                    answered=answered) from None
            if ev is h11.NEED_DATA:
                # what was decoded so far goes out before waiting: a stream (SSE, chunked
                # progress) reaches the agent as it is sent, not when the response ends
                await emit(b"", flush=True)
                try:
                    data = await self.upstream.read()
                except (ConnectionError, OSError) as exc:
                    if self.pooled and not answered:
                        raise Stale() from None
                    raise UpstreamError("upstream:reset", f"the upstream connection failed: {type(exc).__name__}",
                                        answered=answered) from None
                up.receive_data(data)  # b"" signals EOF
                continue
            if isinstance(ev, h11.InformationalResponse):
                if self.ws and ev.status_code == 101:
                    await emit(b"", flush=True)
                    wh = h1.response_headers(ev.headers, keep_upgrade=True)
                    await client.write(down.send(h11.InformationalResponse(
                        status_code=101, reason=scrubber.header(bytes(ev.reason)) if scrubbing else ev.reason,
                        headers=scrubber.headers(wh) if scrubbing else wh)))
                    # the upgraded connection is relayed as bytes (still counted against bytesOut)
                    up_rest, down_rest = up.trailing_data[0], down.trailing_data[0]
                    if up_rest:
                        await client.write(up_rest)
                    if down_rest:
                        self._count_out(len(down_rest))
                        await self.upstream.write(down_rest)
                    out, inn = await self.splice(ep, client, self.upstream, (req.host, req.port))
                    self._log(verdict="allow", rule_id=d.rule_id, reason="websocket relayed", phase="websocket",
                              bytes_out=self.sent + out, bytes_in=inn)
                    return False, b"", False
                continue
            if isinstance(ev, h11.Response):
                answered = True
                rh = h1.response_headers(ev.headers)
                reason = ev.reason
                if scrubbing:
                    # an upstream echoing a real value must not hand it to the sandbox (names,
                    # values, the reason phrase); the body may change length: re-framed (chunked)
                    rh = scrubber.headers((k, v) for k, v in rh if k not in (b"content-length", b"content-encoding"))
                    reason = scrubber.header(bytes(ev.reason))
                    # the codings as sent, even where Connection: content-encoding tried to hide them
                    codings = b", ".join(bytes(v) for k, v in ev.headers if bytes(k).lower() == b"content-encoding")
                    if codings and scrubber.encoded:
                        # a compressed echo is still an echo: decode, scrub, forward identity
                        try:
                            decoder = encoding.Decoder(codings)
                        except encoding.DecodeError as err:
                            await self._undecodable(err)
                            return False, b"", False
                        if decoder.steps:
                            decoded_from = codings.decode("latin-1")
                        else:
                            decoder = None
                    elif codings:
                        rh.append((b"content-encoding", codings))  # forwarded as it is (raw-scrub)
                await emit(down.send(h11.Response(status_code=ev.status_code, reason=reason, headers=rh)))
                continue
            if isinstance(ev, h11.Data):
                received += len(ev.data)
                if not scrubbing:
                    await emit(down.send(h11.Data(data=ev.data)))
                elif not await scrubbed_out(decoder.feed(ev.data) if decoder is not None else (ev.data,)):
                    return False, b"", False
                continue
            if isinstance(ev, h11.EndOfMessage):
                if scrubbing:
                    if not await scrubbed_out(decoder.finish() if decoder is not None else ()):
                        return False, b"", False
                    rest = scrubber.finish()
                    if rest:
                        await emit(down.send(h11.Data(data=rest)))
                await emit(down.send(h11.EndOfMessage()), flush=True)
                break
            if isinstance(ev, h11.ConnectionClosed):
                if self.pooled and not answered:
                    raise Stale()
                await emit(b"", flush=True)
                return False, b"", False
        ep.bytes_in += received
        extra = {}
        if cred is not None and cred.used:
            extra["credentials"] = sorted(set(cred.used))
        if scrubber is not None and scrubber.hits:
            extra["scrubbed"] = scrubber.hits
            extra["alert"] = True
        if decoded_from:
            extra["decoded"] = decoded_from
        self._log(verdict="allow", rule_id=d.rule_id, reason=d.reason, phase="request", bytes_out=self.sent,
                  bytes_in=received, **extra)
        keep = down.our_state is h11.DONE and down.their_state is h11.DONE
        reusable = up.our_state is h11.DONE and up.their_state is h11.DONE and self.upstream.reusable
        if reusable:
            up.start_next_cycle()
        return keep, leftover, reusable

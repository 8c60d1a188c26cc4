"""HTTP/2 inside a terminated tunnel: every stream decided on its own, relayed to an HTTP/2
upstream (gRPC, HTTP/2-only SDKs).

The gate offers ``h2`` to the sandbox only when the upstream chose ``h2`` on a connection the
gate opened first (``server.Gate._terminate``), so every stream has an HTTP/2 stream to go
to; with an HTTP/1.1 upstream the sandbox is offered HTTP/1.1 and nothing here runs.

Per stream, as for an HTTP/1.1 request in a tunnel: the head goes through the exchange core
(``exchange.request``: admission, ``decide()``, ``:authority`` must be the tunnel's host,
credentials swapped in headers), a denial is a 403 on that stream alone (``x-agentvm-denied``
and the JSON body; the connection and its other streams go on), the request body is counted
against ``bytesOut`` and ``maxBody`` and scanned for placeholders, the response (headers,
body, trailers) is scrubbed of real values, and one decision record is written when the
stream ends (``"protocol": "h2"``).

Flow control is end to end: data from one side is acknowledged (its window given back) only
once it was sent on to the other side, so a slow reader slows its writer and the gate holds
at most a window per stream - no reader ever waits on the other connection.
SigV4/HMAC re-signing needs the whole body before the head and is refused on HTTP/2 streams
(``credential:resign-h2``); the same client over HTTP/1.1 is re-signed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from agentvm.gate import encoding, h1, rules
from agentvm.gate import exchange as ex
from agentvm.gate.endpoint import Endpoint
from agentvm.gate.relay import response_scrub
from agentvm.gate.streams import READ

ALPN = "h2"
MAX_DECODERS = 8  # streams of one sandbox decoding a compressed body at the same time
_CANCEL = h2.errors.ErrorCodes.CANCEL
_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM


class _Stream:
    """One sandbox stream and the upstream stream it became."""

    __slots__ = ("down", "up", "req", "fwd", "scanner", "scrub", "to_up", "to_down", "up_end", "down_end",
                 "trailers", "sent", "received", "t0", "answered", "done", "status", "head_only", "head")

    def __init__(self, down: int) -> None:
        self.down = down
        self.up: int | None = None
        self.req = self.fwd = self.scanner = self.scrub = None
        self.to_up: deque = deque()  # (bytes, bytes to acknowledge on the sandbox's side)
        self.to_down: deque = deque()  # (bytes, bytes to acknowledge on the upstream's side)
        self.up_end = self.down_end = False  # END_STREAM queued toward that side
        self.trailers = None
        self.sent = self.received = 0
        self.t0 = time.monotonic()  # for the decision's upstream_ms
        self.answered = False
        self.done = False  # decided and logged (or refused): nothing more to relay
        self.status = 0
        self.head_only = False  # the request ended with its headers (END_STREAM sent with them)
        self.head = None  # the response head, held while the body's first bytes are sniffed


class H2Bridge:
    """One HTTP/2 connection from the sandbox (``client``, TLS ended by the gate) bridged to
    one HTTP/2 connection to the upstream (``upstream``, a PlainStream over TLS)."""

    def __init__(self, ep: Endpoint, client, upstream, tunnel: ex.Tunnel) -> None:
        self.ep, self.client, self.upstream, self.tunnel = ep, client, upstream, tunnel
        self.down = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=True, normalize_inbound_headers=True))
        self.up = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.streams: dict[int, _Stream] = {}
        self.by_up: dict[int, _Stream] = {}
        self.host_value = tunnel.host if tunnel.port == 443 else f"{tunnel.host}:{tunnel.port}"

    async def run(self) -> None:
        self.down.initiate_connection()
        self.up.initiate_connection()
        self.up.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})  # no pushed streams to track
        await self._flush()
        readers = [asyncio.ensure_future(self._read(self.client, self.down, self._down_event)),
                   asyncio.ensure_future(self._read(self.upstream, self.up, self._up_event))]
        try:
            # either side's end (or failure) ends the bridge: both readers are finished here
            done, _ = await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
        finally:
            for t in readers:
                t.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            self._release()
            for s in list(self.streams.values()):
                if s.fwd is not None and not s.done:
                    self._log_stream(s, error="upstream:reset" if s.answered else None)

    async def _read(self, stream, conn, handle) -> None:
        while True:
            data = await stream.read(READ)
            if not data:
                return
            try:
                events = conn.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                # the connection is broken: say so, answer with GOAWAY, end the bridge
                t = self.tunnel
                if conn is self.down:
                    self.ep.log(verdict="deny", rule_id="bad-request:h2-protocol", reason=f"{type(exc).__name__}",
                                host=t.host, port=t.port, phase="request", protocol="h2")
                else:
                    self.ep.log(verdict="allow", rule_id="upstream:protocol-error", reason=f"the upstream broke HTTP/2: {type(exc).__name__}",
                                host=t.host, port=t.port, phase="upstream", error="upstream:protocol-error",
                                protocol="h2")
                await self._flush()
                return
            for ev in events:
                if isinstance(ev, h2.events.ConnectionTerminated):
                    await self._flush()
                    return
                handle(ev)
            await self._flush()

    async def _flush(self) -> None:
        out = self.up.data_to_send()
        if out:
            await self.upstream.write(out)
        out = self.down.data_to_send()
        if out:
            await self.client.write(out)

    # -- the sandbox's side ----------------------------------------------------------------
    def _down_event(self, ev) -> None:
        if isinstance(ev, h2.events.RequestReceived):
            self._request(ev)
        elif isinstance(ev, h2.events.DataReceived):
            self._request_data(ev)
        elif isinstance(ev, h2.events.StreamEnded):
            s = self.streams.get(ev.stream_id)
            if s is not None and s.up is not None and not s.done and not s.head_only:
                if s.req.content_length is not None and s.sent != s.req.content_length:
                    self._length_mismatch(s)
                    return
                if s.scanner is not None:
                    try:
                        rest = s.scanner.finish()
                    except Exception as err:  # CredentialError
                        self._refuse_cred(s, err)
                        return
                    if rest:
                        s.to_up.append((rest, 0))
                s.up_end = True
                self._pump_up(s)
        elif isinstance(ev, h2.events.StreamReset):
            s = self.streams.pop(ev.stream_id, None)
            if s is not None and s.up is not None:
                self.by_up.pop(s.up, None)
                self._reset(self.up, s.up, _CANCEL)
                self._drop_down(s)  # received from the upstream, never to be sent
                if not s.done:
                    self._log_stream(s, error="client-reset")
        elif isinstance(ev, h2.events.WindowUpdated):
            for s in self._waiting(ev.stream_id, up=False):
                self._pump_down(s)

    def _request(self, ev: h2.events.RequestReceived) -> None:
        s = _Stream(ev.stream_id)
        self.streams[ev.stream_id] = s
        try:
            req = h1.request_from_h2(ev.headers)
        except h1.ProtocolError as exc:
            self._deny(s, ex.bad_request(exc, self.tunnel.host, self.tunnel.port))
            return
        s.req = req
        cmd = next(ex.request(self.ep, req, scheme="https", tunnel=self.tunnel))
        if isinstance(cmd, ex.Deny):
            self._deny(s, cmd)
            return
        if isinstance(cmd, ex.Hold):  # holding one stream for a human would stall the connection's others
            self._deny(s, ex.deny(req, "approval:h2-unsupported", "a request that needs a human approval (action: "
                                  "ask) is refused on HTTP/2; the same client over HTTP/1.1 is held", explain=False))
            return
        if isinstance(cmd, ex.Admit):  # (a budget kept by the daemon: nothing reserved yet) as below
            self._deny(s, ex.deny(req, "budget:unmetered-connection", "this HTTP/2 connection was opened before the "
                                  "LLM budget was set; reconnect (metered requests use HTTP/1.1)", explain=False))
            return
        if not isinstance(cmd, ex.Forward):  # a tunnel's requests never need a lookup
            self._deny(s, ex.Deny(rule_id="internal-error", reason="unexpected command", phase="request",
                                  host=req.host, port=req.port, method=req.method, path=req.path))
            return
        if cmd.budget is not None:
            # a metered API is only offered HTTP/1.1 (its usage is read there); an HTTP/2
            # connection that predates a budget set live is refused per stream, so the client
            # reconnects and is metered
            cmd.budget.release()
            self._deny(s, ex.deny(req, "budget:unmetered-connection", "this HTTP/2 connection was opened before the "
                                  "LLM budget was set; reconnect (metered requests use HTTP/1.1)", explain=False))
            return
        if cmd.swap is not None and cmd.swap.resign:
            self._deny(s, ex.deny(req, "credential:resign-h2", "SigV4/HMAC re-signing is not supported on HTTP/2 "
                                  "streams; the same client over HTTP/1.1 is re-signed", explain=False))
            return
        if ev.stream_ended is not None and req.content_length:
            # a declared body that never came: the upstream must not be told to expect one
            self._deny(s, ex.Deny(rule_id="bad-request:bad-content-length", reason="Content-Length without a body",
                                  phase="request", host=req.host, port=req.port, method=req.method, path=req.path,
                                  status=400, answer="error"))
            return
        s.fwd = cmd
        creds = self.ep.creds
        if creds is not None:
            s.scanner = creds.body_scanner(req.host)
            s.scrub = response_scrub(creds.scrubber(), creds, cmd.swap)
        headers = h1.h2_forward_headers(cmd.req, self.host_value)
        if s.scrub is not None and s.scrub.scrubber.encoded:
            headers = encoding.narrow_accept_headers(headers)
        try:
            s.up = self.up.get_next_available_stream_id()
            s.head_only = ev.stream_ended is not None
            self.up.send_headers(s.up, headers, end_stream=s.head_only)
        except (h2.exceptions.ProtocolError, h2.exceptions.TooManyStreamsError) as exc:
            # the sandbox may retry a REFUSED_STREAM; the refusal is still a decision on record
            self.ep.log(verdict="deny", rule_id="limit:upstream-streams", reason=f"the upstream connection cannot take "
                        f"another stream ({type(exc).__name__})", host=req.host, port=req.port, method=req.method,
                        path=req.path, phase="request", protocol="h2")
            self._reset(self.down, s.down, _REFUSED)
            self.streams.pop(s.down, None)
            return
        self.by_up[s.up] = s
        self.ep.count_out(sum(len(k) + len(v) for k, v in headers), req.host, req.port)  # a head carries data out

    def _request_data(self, ev: h2.events.DataReceived) -> None:
        s = self.streams.get(ev.stream_id)
        n = ev.flow_controlled_length
        if s is None or s.up is None or s.done:
            self._ack(self.down, ev.stream_id, n)  # a refused stream's body is dropped
            return
        data = ev.data
        s.sent += len(data)
        self.ep.count_out(len(data), s.req.host, s.req.port)
        max_body = s.fwd.max_body
        if max_body is not None and s.sent > max_body:
            self._reset(self.up, s.up, _CANCEL)
            self._deny(s, ex.Deny(rule_id=rules.max_body(s.fwd.decision), reason=f"body over {max_body} bytes: cut", phase="stream",
                                  host=s.req.host, port=s.req.port, method=s.req.method, path=s.req.path, status=413))
            self._ack(self.down, s.down, n)
            return
        if s.scanner is not None:
            try:
                data = s.scanner.feed(data)
            except Exception as err:  # CredentialError: a placeholder in the body
                self._ack(self.down, s.down, n)
                self._refuse_cred(s, err)
                return
        s.to_up.append((data, n))
        self._pump_up(s)

    def _length_mismatch(self, s: _Stream) -> None:
        """The body sent differs from its declared Content-Length: the upstream stream is reset,
        never ended (an upstream reading the declared length would take the rest from the next
        request - HTTP/2 to HTTP/1.1 smuggling)."""
        self._reset(self.up, s.up, _CANCEL)
        req = s.req
        self._deny(s, ex.Deny(rule_id="bad-request:bad-content-length", reason=f"body of {s.sent} bytes, "
                              f"Content-Length {req.content_length}", phase="stream", host=req.host, port=req.port,
                              method=req.method, path=req.path, status=400, answer="error"))

    def _refuse_cred(self, s: _Stream, err) -> None:
        self._reset(self.up, s.up, _CANCEL)
        self._deny(s, ex.cred_deny(s.req, err))

    def _deny(self, s: _Stream, cmd: ex.Deny) -> None:
        """Log the denial and answer it on this stream only (unless an answer already began)."""
        self.ep.log(**cmd.log_fields(), protocol="h2")
        s.done = True
        self._drop(s.to_up, self.down, s.down)
        if s.up is not None:
            self.by_up.pop(s.up, None)
        self._drop_down(s)
        if s.answered:
            self._reset(self.down, s.down, _CANCEL)
            self._forget(s)
            return
        rid, body = h1.deny_document(cmd.rule_id, cmd.reason, host=cmd.host, port=cmd.port or 0,
                                     allow=cmd.how_to_allow)
        try:
            self.down.send_headers(s.down, [(b":status", str(cmd.status).encode()), (b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()),
                                            (b"x-agentvm-denied", rid.encode())])
            s.answered = True
            s.to_down.append((body, 0))
            s.down_end = True
            self._pump_down(s)  # once sent, the stream is forgotten (_forget)
        except h2.exceptions.ProtocolError:
            self._reset(self.down, s.down, _CANCEL)
            self._forget(s)

    # -- the upstream's side ---------------------------------------------------------------
    def _up_event(self, ev) -> None:
        s = self.by_up.get(getattr(ev, "stream_id", 0) or 0)
        if isinstance(ev, h2.events.ResponseReceived):
            if s is not None:
                self._response(s, ev)
        elif isinstance(ev, h2.events.DataReceived):
            n = ev.flow_controlled_length
            if s is None:
                self._ack(self.up, ev.stream_id, n)
                return
            s.received += len(ev.data)
            self.ep.bytes_in += len(ev.data)
            # scrubbed (and decoded) lazily, as the sandbox's window allows: a compressed body
            # is never expanded ahead of what can be sent (no decompression bomb in the gate)
            body = ev.data if s.scrub is None else s.scrub.body(ev.data)
            if s.head is not None:
                body = self._sniffed(s, body, n)
                if body is None:
                    return
            s.to_down.append((body, n))
            self._pump_down(s)
        elif isinstance(ev, h2.events.TrailersReceived):
            if s is not None:
                trailers = [(k, v) for k, v in ev.headers]
                s.trailers = s.scrub.scrubber.headers(trailers) if s.scrub is not None else trailers
        elif isinstance(ev, h2.events.StreamEnded):
            if s is not None:
                if s.scrub is not None:
                    rest = s.scrub.finish()
                    if s.head is not None:
                        rest = self._sniffed(s, rest, 0)
                        if rest is None:
                            return
                    s.to_down.append((rest, 0))
                s.down_end = True
                self._pump_down(s)
        elif isinstance(ev, h2.events.StreamReset):
            if s is not None:
                self.by_up.pop(s.up, None)
                self.streams.pop(s.down, None)
                self._drop(s.to_up, self.down, s.down)
                self._drop_down(s)
                self._reset(self.down, s.down, ev.error_code)
                if not s.done:
                    self._log_stream(s, error="upstream:reset")
        elif isinstance(ev, h2.events.WindowUpdated):
            for s2 in self._waiting(ev.stream_id, up=True):
                self._pump_up(s2)

    def _response(self, s: _Stream, ev: h2.events.ResponseReceived) -> None:
        headers = [(bytes(k), bytes(v)) for k, v in ev.headers]
        status = next((v for k, v in headers if k == b":status"), b"")
        s.status = int(status) if status.isdigit() else 0
        rest = [(k, v) for k, v in headers if not k.startswith(b":")]
        if s.scrub is not None:
            try:
                rest, _ = s.scrub.head(rest, rest, b"")
            except encoding.DecodeError as err:
                self._undecodable(s, err)
                return
        if s.scrub is not None and s.scrub.sniff is not None and ev.stream_ended is None:
            # the body's first bytes decide whether it is compressed without saying so: until
            # then the head waits, so a refusal is still a 502 (_sniffed)
            s.head = [(b":status", status)] + rest
            return
        s.answered = True
        try:
            self.down.send_headers(s.down, [(b":status", status)] + rest, end_stream=ev.stream_ended is not None)
        except h2.exceptions.ProtocolError:  # a head the sandbox's side cannot take (or it is gone)
            self._reset(self.down, s.down, _CANCEL)
            self._log_stream(s, error="upstream:protocol-error")
            self._forget(s)
            return
        if ev.stream_ended is not None:
            self._finish(s)

    def _sniffed(self, s: _Stream, body, ack: int):
        """While the head waits for the sniff: the body's pieces pulled until it has decided
        (a few bytes), then the head sent; the pieces (and the rest, lazily) to queue. None when
        the body is refused (a 502 on this stream; ``ack`` given back)."""
        pulled = []
        try:
            while s.scrub.sniff is not None:
                piece = next(body, None)
                if piece is None:
                    break
                pulled.append(piece)
        except encoding.DecodeError as err:
            self._ack(self.up, s.up, ack)
            s.head = None
            self._undecodable(s, err)
            return None
        if s.scrub.sniff is None:
            head, s.head = s.head, None
            s.answered = True
            try:
                self.down.send_headers(s.down, head)
            except h2.exceptions.ProtocolError:
                self._ack(self.up, s.up, ack)
                self._reset(self.down, s.down, _CANCEL)
                self._log_stream(s, error="upstream:protocol-error")
                self._forget(s)
                return None
        return itertools.chain(pulled, body)

    def _undecodable(self, s: _Stream, err) -> None:
        self._reset(self.up, s.up, _CANCEL)
        req = s.req
        self._deny(s, ex.Deny(rule_id=err.rule_id, reason=err.reason, phase="response", host=req.host, port=req.port,
                              method=req.method, path=req.path, status=502))

    # -- moving data, flow control -----------------------------------------------------------
    def _waiting(self, stream_id: int, *, up: bool):
        if stream_id:  # one stream's window (ids of the connection whose window grew)
            s = self.by_up.get(stream_id) if up else self.streams.get(stream_id)
            return [s] if s is not None else []
        return list(self.streams.values())

    def _pump_up(self, s: _Stream) -> None:
        if s.done or s.up is None:
            return
        if not self._pump(self.up, s.up, s.to_up, self.down, s.down):
            return
        if s.up_end:
            try:
                self.up.end_stream(s.up)
            except h2.exceptions.ProtocolError:
                pass
            s.up_end = False

    def _pump_down(self, s: _Stream) -> None:
        if s.head is not None:
            return  # nothing goes out before the head (see _sniffed)
        try:
            if not self._pump(self.down, s.down, s.to_down, self.up, s.up):
                return
        except encoding.DecodeError as err:  # a body that does not decode, found as it is sent
            self._undecodable(s, err)
            return
        if s.down_end:
            try:
                if s.trailers is not None:
                    self.down.send_headers(s.down, s.trailers, end_stream=True)
                else:
                    self.down.end_stream(s.down)
            except h2.exceptions.ProtocolError:
                pass
            s.down_end = False
            if not s.done:
                self._finish(s)
            else:
                self._forget(s)

    def _pump(self, conn, sid: int, queue: deque, other, other_sid) -> bool:
        """Send what the window allows; True when ``queue`` is empty. An entry is bytes, or an
        iterator of bytes (a scrubbed body) pulled one piece at a time, only while the window
        is open; its ``ack`` is given back to the sender once it is exhausted."""
        while queue:
            data, ack = queue[0]
            try:
                window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
            except h2.exceptions.StreamClosedError:
                self._drop(queue, other, other_sid)
                if conn is self.down:
                    self._release(sid)
                return False
            if not isinstance(data, (bytes, bytearray, memoryview)):
                if window <= 0 or not self._decoder_slot(sid):
                    return False
                piece = next(data, None)  # may raise encoding.DecodeError: the caller's
                if piece is None:
                    queue.popleft()
                    self._release(sid)
                    if ack and other_sid is not None:
                        self._ack(other, other_sid, ack)
                else:
                    queue.appendleft((memoryview(piece), 0))
                continue
            if window <= 0 and data:
                return False
            n = min(window, len(data))
            if n:
                try:
                    conn.send_data(sid, bytes(data[:n]))
                except h2.exceptions.ProtocolError:
                    self._drop(queue, other, other_sid)
                    return False
            if n < len(data):
                queue[0] = (memoryview(data)[n:], ack)  # no copy of the rest per window update
                continue
            queue.popleft()
            if ack and other_sid is not None:
                self._ack(other, other_sid, ack)
        return True

    # A decoded (scrubbed) body is produced piece by piece as the sandbox reads it; a piece can
    # be up to ~1 MiB (encoding.PIECE, zstd slices), so the streams that may hold one at a time
    # are few per sandbox (MAX_DECODERS, across its connections): the rest wait their turn with
    # only their compressed bytes queued (bounded by the upstream's flow-control window).
    def _decoder_slot(self, sid: int) -> bool:
        held = self.ep.decoders
        key = (id(self), sid)
        if key in held:
            return True
        if len(held) >= MAX_DECODERS:
            self.ep.decoder_waiters.add(self)
            return False
        held.add(key)
        return True

    def _release(self, sid: int | None = None) -> None:
        """Give back this bridge's decoder slot for ``sid`` (all of them when None) and let a
        waiting bridge of the same sandbox take it."""
        ep = self.ep
        before = len(ep.decoders)
        if sid is None:
            ep.decoders.difference_update({k for k in ep.decoders if k[0] == id(self)})
            ep.decoder_waiters.discard(self)
        else:
            ep.decoders.discard((id(self), sid))
        if len(ep.decoders) < before:
            for b in list(ep.decoder_waiters):
                ep.decoder_waiters.discard(b)
                b._wake()

    def _wake(self) -> None:
        """A decoder slot came free: pump the streams whose next data is a body to decode."""
        for s in list(self.streams.values()):
            if s.to_down and not isinstance(s.to_down[0][0], (bytes, bytearray, memoryview)):
                self._pump_down(s)
        task = asyncio.get_running_loop().create_task(self._flush())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a closed connection: nothing to say

    def _drop_down(self, s: _Stream) -> None:
        """Nothing more of the upstream's answer goes to the sandbox: acknowledge what is queued
        and free the stream's decoder slot."""
        self._drop(s.to_down, self.up, s.up)
        self._release(s.down)

    def _drop(self, queue: deque, other, other_sid) -> None:
        """Data that will not be forwarded is still acknowledged to its sender: the connection's
        window must come back, or every other stream of that connection starves."""
        for _, ack in queue:
            if other_sid is not None:
                self._ack(other, other_sid, ack)
        queue.clear()

    @staticmethod
    def _ack(conn, sid: int, n: int) -> None:
        if n:
            try:
                conn.acknowledge_received_data(n, sid)
            except (h2.exceptions.ProtocolError, KeyError, ValueError):
                pass

    @staticmethod
    def _reset(conn, sid: int | None, code) -> None:
        if sid is None:
            return
        try:
            conn.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:
            pass

    @staticmethod
    def _closed(conn, sid: int) -> bool:
        st = conn.streams.get(sid)
        return st is None or st.closed

    @staticmethod
    def _remote_closed(conn, sid: int) -> bool:
        st = conn.streams.get(sid)
        return st is None or st.closed or st.state_machine.state.name in ("HALF_CLOSED_REMOTE", "CLOSED")

    def _finish(self, s: _Stream) -> None:
        self._log_stream(s)
        self._forget(s)

    def _forget(self, s: _Stream) -> None:
        """The stream is over toward the sandbox: nothing of it is kept, and what is still
        open of it (the sandbox still sending, the upstream stream) is reset."""
        self.by_up.pop(s.up, None)
        self.streams.pop(s.down, None)
        self._drop_down(s)
        self._drop(s.to_up, self.down, s.down)
        if s.up is not None and not self._closed(self.up, s.up):
            self._reset(self.up, s.up, _CANCEL)
        if not self._remote_closed(self.down, s.down):
            self._reset(self.down, s.down, h2.errors.ErrorCodes.NO_ERROR)  # stop its body: not read

    def _log_stream(self, s: _Stream, error: str | None = None) -> None:
        s.done = True
        d, req = s.fwd.decision, s.req
        extra = {"protocol": "h2", "status": s.status}
        swap = s.fwd.swap
        if swap is not None and swap.used:
            extra["credentials"] = sorted(set(swap.used))
        if s.scrub is not None and s.scrub.scrubber.hits:
            extra["scrubbed"] = s.scrub.scrubber.hits
            extra["alert"] = True
        if s.scrub is not None and s.scrub.decoded_from:
            extra["decoded"] = s.scrub.decoded_from
        if s.scrub is not None and s.scrub.uninspected:
            extra["uninspected"] = s.scrub.uninspected
            extra["alert"] = True
        if error:
            extra["error"] = error
        self.ep.log(verdict="allow", rule_id=d.rule_id, reason=d.reason, host=req.host, port=req.port,
                    method=req.method, path=req.path, phase="request", bytes_out=s.sent, bytes_in=s.received,
                    upstream_ms=round((time.monotonic() - s.t0) * 1000, 3), **extra)


"""The daemon's HTTP transport: HTTP/1.1 (h11) over the owner-only unix socket and, with a
bearer token, a TCP listener; request heads and bodies bounded in size and time; JSON answers,
NDJSON or frame streams, the one error path; and the web console's door (ASGI, in-process).
What a request means is the router's (``agentvm.daemon.router``); what it does, the control
plane's (``agentvm.daemon.control``).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hmac
import json
import logging
import os
import time

import h11

from agentvm.daemon.events import refuse
from agentvm.daemon.router import dispatch
from agentvm.daemon.transfer import BodyStream, is_upload as _is_upload, send_fd
from agentvm.errors import AgentVMError

log = logging.getLogger("agentvm.daemon")

SOCKET_NAME = "agentvm.sock"
MAX_BODY = 64 * 1024 * 1024  # a request body read into memory (every route but a cp upload's)
LARGE_BODY = 1024 * 1024  # bodies above this are read (or a cp upload staged) at most UPLOADS at a time
UPLOADS = 2
BODY_TIMEOUT = 30.0  # seconds a request body may stall between reads
HEAD_TIMEOUT = 30.0  # seconds a TCP client has to send a whole request head (before any auth)
TCP_CONNECTIONS = 256  # TCP connections open at once (the unix socket is the owner's only)
CONSOLE_BODY = 64 * 1024  # a console form (and anything else sent before the console's own check)
FRAMES_TYPE = "application/x-agentvm-frames"
ATTACH_PROTOCOL = "agentvm-frames/1"  # an interactive session's upgraded connection (docs/daemon.md)
MAX_IN_FRAME = 65536  # bytes of one client frame of an interactive session
IN_QUEUE = 4  # client frames read ahead of the session (then the socket is not read: back-pressure)

# the request's stream reader, for handlers that must notice the client hanging up mid-response
_CLIENT_READER: contextvars.ContextVar = contextvars.ContextVar("agentvm_client_reader", default=None)
# this request's head (for the few routes that read a header: a cp download's Accept)
_HEADERS: contextvars.ContextVar = contextvars.ContextVar("agentvm_headers", default=())
# this connection's run streams frames (agentvm.cli.fastrun's thin client) instead of NDJSON
_FRAMED: contextvars.ContextVar = contextvars.ContextVar("agentvm_framed", default=False)


class HttpServer:
    """The HTTP adapter over a ControlPlane (``cp``): its listeners, connections and streams."""

    def __init__(self, cp, listen: str | None = None) -> None:
        self.cp = cp
        self.listen = listen
        self.token = None
        self.servers: list[asyncio.AbstractServer] = []
        self.socket_path = cp.paths.runtime / SOCKET_NAME
        self._tcp_conns = 0  # TCP connections open now (capped: TCP_CONNECTIONS)
        self._uploads = UPLOADS  # free slots for large request bodies
        self._console = None  # the web console's app, made on its first request

    async def start(self) -> None:
        """Listen: the unix socket (owner-only), and the TCP listener with its token."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists():
            self.socket_path.unlink()
        old = os.umask(0o177)
        try:
            srv = await asyncio.start_unix_server(self._conn, path=str(self.socket_path))
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self.servers.append(srv)
        if self.listen:
            host, _, port = self.listen.rpartition(":")
            tok = self.cp.paths.home / "daemon.token"
            if not tok.exists():
                fd = os.open(tok, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=") + b"\n")
                os.close(fd)
            self.token = tok.read_text().strip()
            self.servers.append(await asyncio.start_server(lambda r, w: self._conn(r, w, tcp=True), host or "127.0.0.1",
                                                           int(port)))

    def close_listeners(self) -> None:
        for srv in self.servers:
            srv.close()

    def remove_socket(self) -> None:
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, tcp: bool = False) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
        _CLIENT_READER.set(reader)
        held: list[bool] = []  # whether this request holds an upload slot
        if tcp:
            if self._tcp_conns >= TCP_CONNECTIONS:  # unauthenticated peers cannot hold the loop's sockets
                writer.close()
                return
            self._tcp_conns += 1
        try:
            req, body = await self._read_request(conn, reader, held, tcp)
            if req is None:
                return
            actor = "operator-tcp" if tcp else "operator"
            if req.method != b"GET":
                # a client that gave up (its timeout) while the daemon was stopped or busy must not
                # have its change applied late, unseen: a request whose connection is gone is dropped
                await asyncio.sleep(0)
                if reader.at_eof():
                    self.cp.record("operator.request-dropped", actor=actor, method=req.method.decode(),
                                target=req.target.decode()[:200], reason="the client closed the connection first")
                    return
            if _is_console(req.target):
                return await self._serve_console(req, body, conn, writer, reader, tcp)
            _HEADERS.set(tuple(req.headers))
            await dispatch(self, req.method.decode(), req.target.decode(), body, conn, writer, actor)
        except AgentVMError as e:  # every refusal: its status and exit code from agentvm.errorcodes
            await self._fail(conn, writer, e.status, e.to_dict())
            if e.status in (408, 413, 429, 401) or conn.their_state is h11.SEND_BODY:
                await _drain(reader, writer)  # a client still sending its body then reads our answer
        except h11.RemoteProtocolError as e:
            try:  # not HTTP: still an answer that says so, not a silently closed connection
                await self._fail(conn, writer, 400, refuse("api.bad-request", f"not a valid HTTP request: {e}").to_dict())
            except Exception:
                pass
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        except Exception as e:  # noqa: BLE001
            log.exception("internal error serving a request")
            try:
                await self._fail(conn, writer, 500, {"error": "internal", "message": f"{type(e).__name__}: {e}",
                                                     "hint": "a bug in agent-vm: the daemon's log has the traceback",
                                                     "exit_code": 125})
            except Exception:
                pass
        finally:
            if tcp:
                self._tcp_conns -= 1
            if held:
                self._uploads += 1
            try:
                writer.close()
            except Exception:
                pass

    async def _read_request(self, conn, reader, held: list[bool], tcp: bool = False):
        """One request, its body bounded in size, in time (BODY_TIMEOUT between reads) and in
        how many large ones are buffered at once; on TCP the token is checked before a byte of
        the body is read."""
        req, body = None, bytearray()
        console_limit = False
        # a TCP peer (not yet authenticated) has HEAD_TIMEOUT for the whole head; the owner's
        # unix socket may idle before its first byte
        head_deadline = time.monotonic() + HEAD_TIMEOUT if tcp else None
        # a console body on TCP is read before its session is checked: all of it within one
        # deadline (no trickle of a byte per BODY_TIMEOUT can hold a connection slot)
        unauth_deadline = time.monotonic() + HEAD_TIMEOUT + BODY_TIMEOUT if tcp else None
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                if req is not None:
                    wait = BODY_TIMEOUT
                    if console_limit:
                        wait = min(wait, max(0.0, unauth_deadline - time.monotonic()))
                elif head_deadline is not None:
                    wait = max(0.0, head_deadline - time.monotonic())
                else:
                    wait = None
                try:
                    data = await asyncio.wait_for(reader.read(65536), wait)
                except asyncio.TimeoutError:
                    if req is None:
                        raise refuse("api.timeout", f"no whole request head within {HEAD_TIMEOUT:g}s") from None
                    raise refuse("api.timeout", f"the request body stalled for {BODY_TIMEOUT:g}s") from None
                conn.receive_data(data)
                if not data and req is None:
                    return None, b""
                continue
            if isinstance(ev, h11.Request):
                req = ev
                length = next((v for k, v in ev.headers if k.lower() == b"content-length"), b"0")
                size = int(length) if length.isdigit() else 0
                if tcp and _is_console(ev.target):
                    # the console checks its own sessions (a browser has a cookie, not the
                    # token); what it may be sent before that check is small
                    if size > CONSOLE_BODY:
                        raise refuse("api.too-large", f"a console request over {CONSOLE_BODY} bytes")
                    console_limit = True
                elif tcp:
                    auth = next((v.decode("latin-1") for k, v in ev.headers if k.lower() == b"authorization"), "")
                    if not (self.token and auth.startswith("Bearer ") and hmac.compare_digest(auth[7:], self.token)):
                        raise refuse("api.unauthorized", "a bearer token is required on the TCP listener")
                if _is_upload(ev):
                    # a cp upload is not read here: the control plane stages it on the state disk
                    # as it arrives, bounded by its destination (BodyStream); it is refused first,
                    # before a byte of it is read, when its Content-Length cannot fit
                    if size > LARGE_BODY or not length.isdigit():
                        self._take_upload_slot(held)
                    return req, BodyStream(conn, reader, size if length.isdigit() else None, BODY_TIMEOUT)
                if size > MAX_BODY:
                    raise refuse("api.too-large", f"request body of {size} bytes is over the limit of {MAX_BODY}")
                if size > LARGE_BODY:
                    self._take_upload_slot(held)
            elif isinstance(ev, h11.Data):
                body += ev.data
                if console_limit and len(body) > CONSOLE_BODY:
                    raise refuse("api.too-large", f"a console request over {CONSOLE_BODY} bytes")
                if len(body) > MAX_BODY:
                    raise refuse("api.too-large", "request body too large")
                if len(body) > LARGE_BODY and not held:  # a chunked body grew large: same rule
                    self._take_upload_slot(held)
            elif isinstance(ev, h11.EndOfMessage):
                return req, bytes(body)
            elif isinstance(ev, h11.ConnectionClosed):
                return None, b""

    def _take_upload_slot(self, held: list[bool]) -> None:
        # a large body is buffered whole (or a cp upload staged): only a few at a time, the rest
        # are told to retry
        if self._uploads <= 0:
            raise refuse("api.busy", f"{UPLOADS} large uploads are already in progress",
                           hint="retry in a moment")
        self._uploads -= 1
        held.append(True)

    async def _json(self, conn, writer, status: int, doc) -> None:
        data = json.dumps(doc, sort_keys=True, default=str).encode()
        writer.write(conn.send(h11.Response(status_code=status, headers=[("content-type", "application/json"),
                                                                         ("content-length", str(len(data))),
                                                                         ("connection", "close")])))
        writer.write(conn.send(h11.Data(data=data)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    async def _raw(self, conn, writer, status: int, data: bytes, ctype: str) -> None:
        writer.write(conn.send(h11.Response(status_code=status, headers=[("content-type", ctype),
                                                                         ("content-length", str(len(data))),
                                                                         ("connection", "close")])))
        writer.write(conn.send(h11.Data(data=data)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    async def _send_fd(self, conn, writer, fd: int, size: int, headers: list) -> None:
        """A download streamed from a file descriptor (agentvm.daemon.transfer.send_fd)."""
        await send_fd(conn, writer, fd, size, headers)

    # ---------------------------------------------------------------- the web console
    def console(self):
        if self._console is None:
            from agentvm.console.app import Console

            self._console = Console(self.cp, token=self.token, listen=self.listen)
        return self._console

    def console_login(self, actor: str) -> dict:
        """A one-time login link for a browser (minted for whoever holds the API: the socket's
        owner or the token's holder)."""
        if not self.listen:
            raise refuse("console.no-listener", "the console is served on the daemon's TCP listener, and this daemon "
                           "has none", hint="restart the daemon with `agentvm up --listen 127.0.0.1:7070`")
        from agentvm.console.app import CODE_TTL

        code = self.console().sessions.mint_code()
        self.cp.record("console.login-link", actor=actor, expires_in=CODE_TTL)
        host, _, port = self.listen.rpartition(":")
        host = host or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return {"url": f"http://{host}:{port}/login?code={code}", "expires_in": CODE_TTL}

    async def _serve_console(self, req, body: bytes, conn, writer, reader, tcp: bool) -> None:
        """One request to the console app (ASGI, in-process), framed back through h11."""
        app = self.console()
        target = req.target.decode("ascii", "replace")
        path, _, query = target.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method.decode("ascii", "replace"), "scheme": "http", "path": path,
                 "raw_path": path.encode("ascii", "replace"), "query_string": query.encode("ascii", "replace"),
                 "root_path": "", "headers": [(bytes(k).lower(), bytes(v)) for k, v in req.headers],
                 "client": ("127.0.0.1", 0) if tcp else None, "server": None, "state": {},
                 "agentvm.transport": "tcp" if tcp else "unix"}
        delivered = False
        gone = asyncio.Event()

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not gone.is_set():  # until the browser goes away (a stream ends with it)
                try:
                    while await reader.read(65536):
                        pass
                except (ConnectionError, OSError):
                    pass
                gone.set()
            return {"type": "http.disconnect"}

        async def send(msg):
            kind = msg.get("type")
            if kind == "http.response.start":
                headers = [(k, v) for k, v in msg.get("headers", []) if k.lower() not in (b"connection",)]
                headers.append((b"connection", b"close"))
                status = int(msg["status"])
                writer.write(conn.send(h11.Response(status_code=status, headers=headers, reason=_phrase(status))))
            elif kind == "http.response.body":
                if msg.get("body"):
                    writer.write(conn.send(h11.Data(data=bytes(msg["body"]))))
                if not msg.get("more_body", False):
                    writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()

        await app(scope, receive, send)

    async def _fail(self, conn, writer, status: int, doc: dict) -> None:
        """One error path for every route: an error object (code, message, hint, exit code - what
        the embedded path prints), as the response, or as the last line of a response that is
        already streaming (a refusal found after a run's output began)."""
        if conn.our_state is h11.SWITCHED_PROTOCOL:  # an interactive session: its end frame says it
            from agentvm.runreport import error_text

            text = error_text(str(doc.get("error", "daemon.error")), str(doc.get("message", "")),
                              str(doc.get("hint") or ""))
            await _raw_exit(writer, doc.get("exit_code", 125), text)
        elif conn.our_state is h11.SEND_BODY:
            if _FRAMED.get():
                from agentvm.runreport import error_text

                text = error_text(str(doc.get("error", "daemon.error")), str(doc.get("message", "")),
                                  str(doc.get("hint") or ""))
                await self._stream_exit(conn, writer, doc.get("exit_code", 125), text)
            else:
                await self._stream_line(conn, writer, {"error": doc})
            await self._stream_end(conn, writer)
        elif conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._json(conn, writer, status, doc)

    async def _stream_start(self, conn, writer) -> None:
        ctype = FRAMES_TYPE if _FRAMED.get() else "application/x-ndjson"
        writer.write(conn.send(h11.Response(status_code=200, headers=[("content-type", ctype),
                                                                      ("connection", "close")])))
        await writer.drain()

    async def _stream_frame(self, conn, writer, kind: bytes, payload: bytes) -> None:
        """One frame of a framed run: ``KIND LENGTH\\n PAYLOAD`` (o: stdout, e: stderr, x: the end)."""
        writer.write(conn.send(h11.Data(data=kind + str(len(payload)).encode() + b"\n" + payload)))
        await writer.drain()

    async def _stream_exit(self, conn, writer, exit_code, text: str) -> None:
        """A framed run's last frame: its exit code, and what the client prints on stderr."""
        code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else 125
        await self._stream_frame(conn, writer, b"x", f"{code}\n{text}".encode("utf-8", "replace"))

    async def _stream_line(self, conn, writer, doc) -> None:
        writer.write(conn.send(h11.Data(data=json.dumps(doc, default=str).encode() + b"\n")))
        await writer.drain()

    async def _stream_end(self, conn, writer) -> None:
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()

    @staticmethod
    def header(name: str) -> str:
        """This request's header ``name`` ("" when absent)."""
        key = name.lower().encode()
        return next((bytes(v).decode("latin-1") for k, v in _HEADERS.get() if bytes(k).lower() == key), "")

    @staticmethod
    def set_framed() -> None:
        """This request's run answers in frames (agentvm.cli.fastrun's thin client)."""
        _FRAMED.set(True)

    @staticmethod
    def framed() -> bool:
        return _FRAMED.get()

    def output(self, conn, writer) -> "HttpOutput":
        """A streamed answer as the control plane's Output (agentvm.daemon.pump)."""
        return HttpOutput(self, conn, writer)

    def attached(self, conn, writer) -> "HttpAttached":
        """An interactive session on this request's connection (upgraded to ATTACH_PROTOCOL):
        the control plane's Attached (agentvm.daemon.pump). Refused unless the client asked for
        the upgrade - before anything runs."""
        if conn.their_state is not h11.MIGHT_SWITCH_PROTOCOL:
            raise refuse("api.bad-request", f"an interactive session is an upgraded connection: send "
                         f"'Connection: Upgrade' and 'Upgrade: {ATTACH_PROTOCOL}'",
                         "docs/daemon.md, \"Interactive sessions\", describes the protocol")
        return HttpAttached(conn, writer, _CLIENT_READER.get())


class HttpOutput:
    """A command's output as NDJSON lines (``{"stream", "data": base64}``) or, on a framed
    run, ``o``/``e`` frames."""

    def __init__(self, http: HttpServer, conn, writer) -> None:
        self.http, self.conn, self.writer = http, conn, writer

    async def start(self) -> None:
        await self.http._stream_start(self.conn, self.writer)

    async def write(self, stream: str, data: bytes) -> None:
        if _FRAMED.get():
            await self.http._stream_frame(self.conn, self.writer, b"o" if stream == "stdout" else b"e", data)
        else:
            await self.http._stream_line(self.conn, self.writer, {"stream": stream,
                                                                   "data": base64.b64encode(data).decode()})

    def hangup(self):
        creader = _CLIENT_READER.get()
        return asyncio.ensure_future(creader.read(1)) if creader is not None else None


async def _raw_exit(writer, exit_code, text: str) -> None:
    code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else 125
    payload = f"{code}\n{text}".encode("utf-8", "replace")
    writer.write(b"x" + str(len(payload)).encode() + b"\n" + payload)
    await writer.drain()


class HttpAttached:
    """An interactive session over an upgraded connection (``101 Switching Protocols`` to
    ATTACH_PROTOCOL): ``KIND LENGTH\\n PAYLOAD`` frames both ways, no HTTP framing. Client to
    daemon: ``i`` stdin bytes (at most MAX_IN_FRAME), ``c`` stdin closed, ``w`` "ROWS COLS", ``s``
    a signal name; daemon to client: ``o``, ``e`` output, ``x`` the end ("CODE\\n" + report).

    Bounded both ways: at most IN_QUEUE client frames are read ahead of the session (then the
    socket is not read and the client's writes block); output waits on the socket's drain. A
    malformed frame ends the session as a client that went away does."""

    def __init__(self, conn, writer, reader) -> None:
        self.conn, self.writer, self.reader = conn, writer, reader
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=IN_QUEUE)
        self.buf = bytearray(conn.trailing_data[0])
        self.gone: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = None
        self._started = False

    async def start(self) -> None:
        if not self._started:
            self._started = True
            self.writer.write(self.conn.send(h11.InformationalResponse(
                status_code=101, headers=[("upgrade", ATTACH_PROTOCOL), ("connection", "upgrade")])))
            await self.writer.drain()
        if self._task is None:
            self._task = asyncio.ensure_future(self._read_frames())

    async def write(self, stream: str, data: bytes) -> None:
        self.writer.write((b"o" if stream == "stdout" else b"e") + str(len(data)).encode() + b"\n" + data)
        await self.writer.drain()

    async def exit(self, exit_code, text: str) -> None:
        """The session's last frame; the connection closes after it."""
        await _raw_exit(self.writer, exit_code, text)
        self.close()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def hangup(self):
        return self.gone

    async def read(self):
        if self._task is None:
            self._task = asyncio.ensure_future(self._read_frames())
        ev = await self.queue.get()
        if ev is None:
            self.queue.put_nowait(None)  # every later read is None too
        return ev

    def _mark_gone(self) -> None:
        if not self.gone.done():
            self.gone.set_result(b"")

    async def _more(self) -> bool:
        data = await self.reader.read(65536) if self.reader is not None else b""
        self.buf += data
        return bool(data)

    async def _read_frames(self) -> None:
        from agentvm.daemon import pump as p

        try:
            while True:
                while b"\n" not in self.buf:
                    if len(self.buf) > 10 or not await self._more():
                        return
                nl = self.buf.index(b"\n")
                kind, digits = bytes(self.buf[:1]), bytes(self.buf[1:nl])
                if not 0 < len(digits) <= 6 or not digits.isdigit() or not digits.isascii():
                    return
                n = int(digits)
                if n > MAX_IN_FRAME or (kind != b"i" and n > 32):
                    return
                while len(self.buf) < nl + 1 + n:
                    if not await self._more():
                        return
                payload = bytes(self.buf[nl + 1:nl + 1 + n])
                del self.buf[:nl + 1 + n]
                if kind == b"i":
                    ev = p.StdinData(payload)
                elif kind == b"c":
                    ev = p.StdinEof()
                elif kind == b"w":
                    f = payload.split(b" ")
                    if len(f) != 2 or not all(x.isdigit() and 0 < len(x) <= 5 for x in f):
                        return
                    ev = p.Resize(min(int(f[0]), 65535), min(int(f[1]), 65535))
                elif kind == b"s":
                    name = payload.decode("ascii", "replace")
                    if name not in p.SIGNALS:
                        continue  # a signal this daemon does not forward: ignored, not fatal
                    ev = p.Signal(name)
                else:
                    return
                await self._put(ev)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            return
        finally:
            self._mark_gone()
            while self.queue.full():
                self.queue.get_nowait()
            self.queue.put_nowait(None)

    async def _put(self, ev) -> None:
        """Queue one event; while the session is not taking them, watch for the client's
        hang-up (the kernel's RDHUP) so a blocked session still notices it went away."""
        while True:
            put = asyncio.ensure_future(self.queue.put(ev))
            await asyncio.wait({put}, timeout=1.0)
            if put.done() or not put.cancel():
                return
            await asyncio.gather(put, return_exceptions=True)
            if _peer_closed(self.writer):
                raise ConnectionError("the client went away")


def _peer_closed(writer) -> bool:
    import select

    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    p = select.poll()
    p.register(sock.fileno(), select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))


def _phrase(status: int) -> bytes:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _is_console(target: bytes) -> bool:
    """Everything but the API (``/v1/...``) and ``/metrics`` is the console's."""
    path = target.split(b"?", 1)[0]
    return not (path == b"/v1" or path.startswith(b"/v1/") or path == b"/metrics")


async def _drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: float = 5.0) -> None:
    """After an early answer (413, 429...): stop writing, then read and drop what the client is
    still sending for a while, so it gets to read the answer instead of a reset."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
        deadline = asyncio.get_running_loop().time() + limit
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or not await asyncio.wait_for(reader.read(1 << 16), left):
                return
    except (asyncio.TimeoutError, ConnectionError, OSError):
        return

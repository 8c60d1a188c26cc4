"""``sandbox.get_host(port)``: HTTP and WebSocket proxied to a server on the sandbox's loopback.

How a request for a sandbox's port reaches the adapter (read from ``e2b`` 2.63.0,
``e2b-code-interpreter`` 2.11.5 and the npm ``e2b`` 2.51.0):

* **by header**: with ``E2B_SANDBOX_URL`` set, the SDKs send every in-sandbox request to that URL
  with ``E2b-Sandbox-Id: SID`` and ``E2b-Sandbox-Port: PORT`` (the code interpreter's
  ``/execute`` and ``/contexts`` go to port 49999 this way; envd's own calls say 49983, which
  stays the envd API);
* **by host name**: ``get_host(port)`` is ``f"{port}-{sid}.{domain}"`` where ``domain`` is the
  create answer's ``domain`` (else ``E2B_DOMAIN``). ``agentvm e2b serve`` answers
  ``localhost:PORT`` (and ``agentvm e2b env`` prints it as ``E2B_DOMAIN``), so
  ``http://8888-SID.localhost:49983/`` reaches the adapter wherever ``*.localhost`` is loopback
  (browsers, curl, systemd-resolved); anything else can connect to the adapter's address and
  send that ``Host``. The route is read from ``Host``.

Who may: the sandbox's ``X-Access-Token`` (envd's token), its ``E2B-Traffic-Access-Token``
(``trafficAccessToken`` of create/connect, what E2B asks for on a restricted sandbox's ports)
or the ``X-API-Key`` of the tenant that owns it. Anything else (no token, another sandbox's
token, another tenant's key, an id that does not exist) gets the same 502 as a sandbox that
does not exist. A port the template does not list (``agentvm template add FILE --port N``) is
refused with 403 ``e2b.port-refused``, before any connection is made. Every request and
WebSocket session is recorded (``e2b.port``), without the tokens; the tokens and routing
headers are not forwarded to the sandbox.

How the sandbox's loopback is reached: the sandbox has its own network namespace and nothing in
it is given a new route. A short-lived thread of the adapter joins that namespace
(``setns(CLONE_NEWNET)``), connects to ``127.0.0.1:PORT``, and ends; the socket stays in the
sandbox's namespace, the adapter relays bytes over it. The namespace is found from the
sandbox's cgroup (``<hierarchy>/agentvm/<sandbox-id>``, where the launcher puts every process
of the sandbox before bwrap forks; a sandbox cannot leave it): its processes are either in the
host's namespace (the bwrap monitor) or in the sandbox's; exactly one other namespace must be
found, else nothing is joined. The process is pinned with a pidfd while its namespace is opened,
and is checked to be alive and still in the cgroup afterwards, so a recycled pid is never used.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("agentvm.e2b.ports")

ENVD_PORT = 49983
CLONE_NEWNET = 0x40000000
_HOST_ROUTE = re.compile(r"^(\d{1,5})-([A-Za-z0-9]{1,64})\.")
_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# not forwarded to the sandbox: hop-by-hop headers and the adapter's own routing and tokens
_DROP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
         "proxy-authorization", "proxy-authenticate", "x-access-token", "e2b-traffic-access-token", "x-api-key",
         "e2b-sandbox-id", "e2b-sandbox-port", "content-length"}
_WS_DROP = _DROP | {"host", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                    "sec-websocket-protocol", "sec-websocket-accept"}
_RESP_DROP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
              "proxy-authenticate"}
STARTUP_GRACE = 60.0  # seconds after a sandbox starts during which a refused connect is retried (a kernel server on a loaded host)
CONNECT_TIMEOUT = 10.0


class PortUnreachable(Exception):
    """The sandbox's port cannot be reached (nothing listens, or the namespace is not there).
    ``transient``: the sandbox's processes were not found where they will be once it runs (its
    cgroup empty or missing: starting, or restarting) - retried while the sandbox is young."""

    transient = False


class _ClientGone(Exception):
    pass


# -- routing ---------------------------------------------------------------------------------

def route_of(headers: dict[str, str]) -> tuple[str, int] | None:
    """``(sandbox id, port)`` when a request is for a sandbox's port (not envd's), else None."""
    sid, port = headers.get("e2b-sandbox-id"), headers.get("e2b-sandbox-port")
    if sid is not None and port is not None:
        if not port.isdigit():
            return (sid, -1)
        p = int(port)
        return None if p == ENVD_PORT else (sid, p)
    m = _HOST_ROUTE.match(headers.get("host", ""))
    if m is not None:
        p = int(m.group(1))
        return None if p == ENVD_PORT else (m.group(2), p)
    return None


# -- the sandbox's network namespace -----------------------------------------------------------

def _cgroup_dirs(sandbox_id: str) -> list[Path]:
    from agentvm import cgroups as cg

    layout = cg.detect()
    roots = []
    if layout.mode == "v2" and layout.v2_root is not None:
        roots.append(layout.v2_root)
    for ctrl in ("pids", "memory"):
        if ctrl in layout.v1:
            roots.append(layout.v1[ctrl])
    if layout.v2_root is not None and layout.v2_root not in roots:
        roots.append(layout.v2_root)
    return [r / cg.PARENT / sandbox_id for r in roots if (r / cg.PARENT / sandbox_id / "cgroup.procs").is_file()]


def _ns_ino(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _in_cgroup(pid: int, sandbox_id: str) -> bool:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    want = f"/agentvm/{sandbox_id}"
    return any(line.rsplit(":", 1)[-1].rstrip() == want for line in text.splitlines())


def open_sandbox_netns(sandbox_id: str) -> int:
    """An fd of the network namespace of the sandbox whose cgroup is ``agentvm/<sandbox_id>``.
    Fails closed (PortUnreachable) unless exactly one namespace other than the adapter's own
    is found among the cgroup's processes, and a process of it is verified after opening."""
    if not _SANDBOX_ID.fullmatch(sandbox_id or ""):
        raise PortUnreachable(f"not a sandbox id: {sandbox_id!r}")
    dirs = _cgroup_dirs(sandbox_id)
    if not dirs:
        exc = PortUnreachable(f"sandbox {sandbox_id} has no cgroup (is it running?)")
        exc.transient = True
        raise exc
    own = os.stat("/proc/self/ns/net")
    own_ns = (own.st_dev, own.st_ino)
    pids: list[int] = []
    for d in dirs:
        try:
            pids += [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
    by_ns: dict[tuple[int, int], list[int]] = {}
    for pid in sorted(set(pids)):
        ns = _ns_ino(pid)
        if ns is not None and ns != own_ns:
            by_ns.setdefault(ns, []).append(pid)
    if len(by_ns) != 1:
        exc = PortUnreachable(f"sandbox {sandbox_id}: {len(by_ns)} network namespaces found in its cgroup "
                              "(exactly one is required; nothing is joined)")
        exc.transient = not by_ns  # none yet (starting); two is never retried
        raise exc
    (ns, candidates), = by_ns.items()
    for pid in candidates:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            try:
                fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            st = os.fstat(fd)
            ok = (st.st_dev, st.st_ino) == ns and _in_cgroup(pid, sandbox_id)
            try:
                signal.pidfd_send_signal(pidfd, 0)  # still the process the pidfd pinned: the pid was not reused
            except OSError:
                ok = False
            if ok:
                return fd
            os.close(fd)
        finally:
            os.close(pidfd)
    raise PortUnreachable(f"sandbox {sandbox_id}: its processes ended while its namespace was being opened")


_libc = None


def _setns(fd: int, nstype: int) -> None:
    fn = getattr(os, "setns", None)
    if fn is not None:  # Python 3.12+
        fn(fd, nstype)
        return
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, nstype) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def connect_in_netns(ns_fd: int, port: int, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A TCP socket connected to ``127.0.0.1:port`` inside the namespace ``ns_fd``, made by a
    thread of its own that joins the namespace and ends (no other thread ever runs in it)."""
    box: dict[str, Any] = {}

    def run():
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(ns_fd, CLONE_NEWNET)
            try:
                box["sock"] = socket.create_connection(("127.0.0.1", port), timeout=timeout)
            except OSError as exc:
                box["error"] = exc
            finally:
                try:
                    _setns(own, CLONE_NEWNET)
                except OSError:  # the thread ends now either way; nothing else runs on it
                    log.warning("e2b ports: could not return a connect thread to its namespace")
        except OSError as exc:
            box["error"] = exc
        finally:
            os.close(own)

    t = threading.Thread(target=run, name=f"e2b-port-{port}", daemon=True)
    t.start()
    t.join(timeout + 5)
    if t.is_alive():
        raise PortUnreachable(f"connecting to port {port} did not finish in {timeout:.0f}s")
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == errno.EPERM:
            raise PortUnreachable("joining the sandbox's network namespace needs CAP_SYS_ADMIN "
                                  "(run `agentvm e2b serve` as root, like the daemon)") from exc
        raise PortUnreachable(f"port {port}: {exc.strerror or exc}") from exc
    sock = box["sock"]
    sock.settimeout(None)
    sock.setblocking(False)
    return sock


def connect_sandbox_port(sandbox_id: str, port: int, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    fd = open_sandbox_netns(sandbox_id)
    try:
        return connect_in_netns(fd, port, timeout)
    finally:
        os.close(fd)


async def port_socket_async(sandbox_id: str, port: int, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """:func:`connect_sandbox_port` without blocking the loop (its own thread, never a pool's)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def done(ok, val):
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(val)

    def run():
        try:
            s = connect_sandbox_port(sandbox_id, port, timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(done, False, exc)
            return
        loop.call_soon_threadsafe(done, True, s)

    threading.Thread(target=run, name="e2b-port-open", daemon=True).start()
    return await fut


# -- the HTTP client side: httpcore over the socket made above ------------------------------------

def _network_backend(opener):
    import httpcore

    class Stream(httpcore.AsyncNetworkStream):
        def __init__(self, reader, writer):
            self.r, self.w = reader, writer

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            try:
                return await asyncio.wait_for(self.r.read(max_bytes), timeout)
            except asyncio.TimeoutError:
                raise httpcore.ReadTimeout("reading from the sandbox's port timed out") from None
            except OSError as exc:
                raise httpcore.ReadError(str(exc)) from exc

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            if not buffer:
                return
            try:
                self.w.write(buffer)
                await asyncio.wait_for(self.w.drain(), timeout)
            except asyncio.TimeoutError:
                raise httpcore.WriteTimeout("writing to the sandbox's port timed out") from None
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc

        async def aclose(self) -> None:
            self.w.close()
            try:
                await self.w.wait_closed()
            except OSError:
                pass

        def get_extra_info(self, info: str) -> Any:
            return None

    class Backend(httpcore.AsyncNetworkBackend):
        async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            sock = await opener(port)
            reader, writer = await asyncio.open_connection(sock=sock)
            return Stream(reader, writer)

        async def connect_unix_socket(self, *a, **kw):  # pragma: no cover - never asked
            raise httpcore.ConnectError("no unix sockets")

        async def sleep(self, seconds: float) -> None:
            await asyncio.sleep(seconds)

    return Backend()


# -- the ASGI side ---------------------------------------------------------------------------

def _json_response(status: int, doc: dict) -> tuple[int, list, bytes]:
    body = json.dumps(doc).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())], body


async def _send_plain(send, status: int, headers: list, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _deny_ws(scope, send, status: int, headers: list, body: bytes) -> None:
    """Refuse a WebSocket before accepting it: an HTTP answer where the server can send one."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})


# WebSocket messages through the proxy, each way: at most WS_MAX_MESSAGE bytes (a larger one ends the
# connection with 1009), and at most WS_MAX_QUEUE frames received from the sandbox and not yet sent on
WS_MAX_MESSAGE = 16 * 1024 * 1024
WS_MAX_QUEUE = 1


class PortProxy:
    """The port proxy of one E2B service (``svc``: :class:`agentvm.e2b.app.E2BService`)."""

    def __init__(self, svc):
        self.svc = svc

    # authentication: the sandbox's tokens, or its owner's API key; the same answer otherwise
    def box_for(self, sid: str, hdrs: dict[str, str]):
        box = self.svc.boxes.get(sid)
        if box is None or box.state != "running":
            return None
        tok, traffic = hdrs.get("x-access-token"), hdrs.get("e2b-traffic-access-token")
        if tok and box.access_ok(tok):  # (by digest: a token handed out before a daemon restart too)
            return box
        if traffic and box.traffic_ok(traffic):
            return box
        key = hdrs.get("x-api-key")
        if key and self.svc.tenant_of(key) == box.tenant:
            return box
        return None

    async def _open(self, box, port: int):
        """A socket to the sandbox's port; refused connects are retried while the sandbox is young
        (its server may still be starting), then answered at once."""
        deadline = box.running_since + STARTUP_GRACE
        delay = 0.1
        while True:
            try:
                return await self.svc.backend.port_socket(box.name, port)
            except PortUnreachable as exc:
                refused = isinstance(exc.__cause__, ConnectionRefusedError) or exc.transient
                if not refused or time.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def __call__(self, scope, receive, send, route: tuple[str, int], hdrs: dict[str, str]) -> None:
        sid, port = route
        ws = scope["type"] == "websocket"
        if ws and (await receive())["type"] != "websocket.connect":
            return
        refuse = (lambda st, h, b: _deny_ws(scope, send, st, h, b)) if ws else (
            lambda st, h, b: _send_plain(send, st, h, b))
        box = self.box_for(sid, hdrs)
        if box is None:
            return await refuse(*_json_response(502, {"code": 502, "message": f"The sandbox {sid!r} was not found",
                                                      "sandboxId": sid}))
        where = {"tenant": box.tenant, "sandbox": box.name, "port": port, "path": scope.get("path", "")}
        if port not in box.ports:
            self.svc.record("e2b.port.refused", **where, reason="not in template")
            listed = ", ".join(map(str, box.ports)) or "none"
            return await refuse(*_json_response(403, {
                "code": 403, "sandboxId": sid, "port": port,
                "message": f"port {port} is not open: template {box.template!r} allows ports [{listed}] "
                           f"(`agentvm template add FILE --port {port}` adds it) [e2b.port-refused]"}))
        t0 = time.monotonic()
        try:
            sock = await self._open(box, port)
        except PortUnreachable as exc:
            self.svc.record("e2b.port.unreachable", **where, error=str(exc))
            return await refuse(*_json_response(502, {
                "code": 502, "sandboxId": sid, "port": port,
                "message": f"The sandbox is running but port {port} is not open: {exc} [e2b.port-unreachable]"}))
        if ws:
            await self._websocket(scope, receive, send, sock, port, where, t0)
        else:
            await self._http(scope, receive, send, sock, port, where, t0)

    # -- HTTP --------------------------------------------------------------------------------
    async def _http(self, scope, receive, send, sock, port, where, t0) -> None:
        import httpcore

        used = []

        async def opener(_port):
            if used:  # one connection per request: each is opened (and checked) afresh
                raise httpcore.ConnectError("one connection per request")
            used.append(1)
            return sock

        # the body is framed as the client framed it (Content-Length or chunked): h11 reads those two
        headers = [(k, v) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in _DROP - {"content-length", "transfer-encoding"}]
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"])
        more = [has_body]

        async def body():
            while more[0]:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise _ClientGone()
                chunk = msg.get("body", b"")
                more[0] = msg.get("more_body", False)
                if chunk:
                    yield chunk

        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target = target.split(b"?", 1)[0] + b"?" + scope["query_string"]
        url = httpcore.URL(scheme=b"http", host=b"127.0.0.1", port=port, target=target)
        status, sent = 0, 0
        pool = httpcore.AsyncConnectionPool(network_backend=_network_backend(opener), max_connections=1,
                                            retries=0)
        try:
            async with pool:
                try:
                    async with pool.stream(scope["method"], url, headers=headers,
                                           content=body() if has_body else None,
                                           extensions={"timeout": {"connect": CONNECT_TIMEOUT, "read": None,
                                                                   "write": 60.0, "pool": CONNECT_TIMEOUT}}) as resp:
                        status = resp.status
                        out = [(k, v) for k, v in resp.headers if k.decode("latin-1").lower() not in _RESP_DROP]
                        await send({"type": "http.response.start", "status": resp.status, "headers": out})
                        await self._pump_body(resp, receive, send, more)
                        sent = 1
                except _ClientGone:
                    status = status or 499
                except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.TimeoutException) as exc:
                    if status == 0:
                        await _send_plain(send, *_json_response(502, {
                            "code": 502, "port": port,
                            "message": f"the server on port {port} did not answer: {exc} [e2b.port-unreachable]"}))
                        status = 502
        finally:
            try:
                sock.close()
            except OSError:
                pass
            self.svc.record("e2b.port", **where, method=scope["method"], status=status, complete=bool(sent),
                            ms=round((time.monotonic() - t0) * 1000))

    @staticmethod
    async def _pump_body(resp, receive, send, more) -> None:
        """The upstream body to the client as it comes; a client that goes away ends it."""
        async def pump():
            async for chunk in resp.aiter_stream():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        async def watch():
            while more[0]:  # the request body is still being read by the upstream call
                await asyncio.sleep(0.05)
            while True:  # (an empty request's own http.request message comes first)
                if (await receive())["type"] == "http.disconnect":
                    return

        p, w = asyncio.ensure_future(pump()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({p, w}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (p, w):
                t.cancel()
            for t in (p, w):
                try:
                    await t
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the outcome is p's
                    pass
        if p.done() and not p.cancelled() and p.exception() is not None:
            raise p.exception()

    # -- WebSocket -----------------------------------------------------------------------------
    async def _websocket(self, scope, receive, send, sock, port, where, t0) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                if k.decode("latin-1").lower() not in _WS_DROP]
        path = scope.get("raw_path") or scope["path"].encode()
        path = path.split(b"?", 1)[0].decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        frames = [0, 0]
        code = None
        try:
            try:
                upstream = await connect(f"ws://127.0.0.1:{port}{path}", sock=sock, additional_headers=hdrs,
                                         subprotocols=scope.get("subprotocols") or None, open_timeout=CONNECT_TIMEOUT,
                                         max_size=WS_MAX_MESSAGE, max_queue=WS_MAX_QUEUE, compression=None,
                                         user_agent_header=None, origin=None, ping_interval=None)
            except InvalidStatus as exc:
                r = exc.response
                await _deny_ws(scope, send, r.status_code,
                               [(b"content-type", b"text/plain; charset=utf-8")], bytes(r.body or b""))
                code = r.status_code
                return
            except (InvalidHandshake, OSError, asyncio.TimeoutError) as exc:
                await _deny_ws(scope, send, *_json_response(502, {
                    "code": 502, "port": port,
                    "message": f"the server on port {port} did not accept a WebSocket: {exc} [e2b.port-unreachable]"}))
                code = 502
                return
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            code = 101

            async def down():  # sandbox -> client
                # a message over WS_MAX_MESSAGE is refused as its frame header arrives (never
                # reassembled): the connection ends with 1009 on both sides
                rc = None
                try:
                    async for m in upstream:
                        frames[1] += 1
                        if isinstance(m, bytes):
                            await send({"type": "websocket.send", "bytes": m})
                        else:
                            await send({"type": "websocket.send", "text": m})
                except ConnectionClosed as exc:
                    if exc.sent is not None and exc.sent.code == 1009:
                        rc = 1009  # the sandbox sent a message over WS_MAX_MESSAGE
                rc = rc or upstream.close_code or 1000
                await send({"type": "websocket.close", "code": rc if rc not in (1005, 1006) else 1000})

            async def up():  # client -> sandbox
                while True:
                    m = await receive()
                    if m["type"] == "websocket.disconnect":
                        await upstream.close(m.get("code", 1000) if m.get("code", 1000) not in (1005, 1006) else 1000)
                        return
                    frames[0] += 1
                    data = m.get("bytes") if m.get("bytes") is not None else (m.get("text") or "")
                    if len(data) > WS_MAX_MESSAGE:  # (the server's own ws_max_size normally stops it first)
                        await upstream.close(1009, "message too big")
                        await send({"type": "websocket.close", "code": 1009})
                        return
                    await upstream.send(data)

            tasks = [asyncio.ensure_future(down()), asyncio.ensure_future(up())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    try:
                        await t
                    except (asyncio.CancelledError, ConnectionClosed, Exception):  # noqa: BLE001
                        pass
                await upstream.close()
        finally:
            try:
                sock.close()
            except OSError:
                pass
            self.svc.record("e2b.port.websocket", **where, status=code, frames_in=frames[0], frames_out=frames[1],
                            ms=round((time.monotonic() - t0) * 1000))


def allowed_ports(ports: Iterable[int]) -> tuple[int, ...]:
    """A template's ports as the proxy uses them: envd's own port is never proxied."""
    return tuple(sorted({int(p) for p in ports if 0 < int(p) < 65536 and int(p) != ENVD_PORT}))

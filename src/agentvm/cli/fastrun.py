"""`agentvm run` through a daemon that is up: the thin client.

Everything a run needs happens in the daemon (policy, sandbox, gate, audit); the client sends
the command line as typed and relays the output stream. It imports nothing it does not need
(no dataclasses, no http.client - whose email parser and ssl cost more than the rest of the
client together): one unix socket, one HTTP/1.1 request, a chunked NDJSON response.
"""

from __future__ import annotations

import json
import os
import socket

DEFAULT_TIMEOUT = 60.0


def socket_path() -> str:
    """The daemon's socket, by the rules of ``agentvm.locations`` (as the library's paths)."""
    from agentvm.locations import default_dirs

    return os.path.join(default_dirs()[1], "agentvm.sock")


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError("the daemon closed the connection mid-answer")
        ln, _, self.buf = self.buf.partition(b"\r\n")
        return ln

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("the daemon closed the connection mid-answer")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while self._fill():
            pass
        out, self.buf = self.buf, b""
        return out


def connect() -> socket.socket | None:
    """A connection to the daemon, or None when none is listening (then the run is embedded)."""
    path = socket_path()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError, PermissionError):
        s.close()
        return None
    return s


def run_stream(sock: socket.socket, doc: dict):
    """POST /v1/run on ``sock``; yields the events (``data`` decoded). A refusal - before the
    stream or inside it - raises the same error the embedded path raises."""
    import binascii

    try:
        timeout = float(os.environ.get("AGENTVM_CLIENT_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        timeout = DEFAULT_TIMEOUT
    body = json.dumps(doc).encode()
    head = (f"POST /v1/run HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock.settimeout(timeout)
    try:
        sock.sendall(head + body)
        r = _Reader(sock)
        status_line = r.line().decode("latin-1")
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise ConnectionError(f"not an HTTP answer: {status_line[:80]!r}") from None
        headers = {}
        while True:
            ln = r.line()
            if not ln:
                break
            k, _, v = ln.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
    except (TimeoutError, socket.timeout):
        sock.close()
        from agentvm.daemon.client import DaemonUnavailable

        raise DaemonUnavailable(f"the agent-vm daemon did not answer within {timeout:g}s ({socket_path()})",
                                hint="it may be stopped or overloaded; AGENTVM_CLIENT_TIMEOUT sets the wait",
                                code="daemon.timeout") from None
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"

    def chunks():
        if chunked:
            while True:
                size = int(r.line().split(b";")[0] or b"0", 16)
                if size == 0:
                    return
                yield r.exactly(size)
                r.exactly(2)
        elif "content-length" in headers:
            yield r.exactly(int(headers["content-length"]))
        else:
            yield r.rest()

    try:
        if status >= 300:
            data = b"".join(chunks())
            try:
                doc_ = json.loads(data or b"{}")
            except ValueError:
                doc_ = {}
            from agentvm.daemon.client import error_from

            raise error_from(doc_ if isinstance(doc_, dict) else {}, status)
        sock.settimeout(None)  # the stream is as long as the run; the answer came in time
        pending = b""
        for chunk in chunks():
            pending += chunk
            while b"\n" in pending:
                ln, _, pending = pending.partition(b"\n")
                if not ln.strip():
                    continue
                ev = json.loads(ln)
                if isinstance(ev, dict) and isinstance(ev.get("error"), dict):
                    from agentvm.daemon.client import error_from

                    raise error_from(ev["error"])
                if "data" in ev:
                    ev["data"] = binascii.a2b_base64(ev["data"])
                yield ev
    finally:
        sock.close()

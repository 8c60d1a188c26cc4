"""A small client for the daemon's API (unix socket, or TCP with a bearer token).

Used by the CLI and by the SDK (``agentvm.Sandbox``); the library never imports the CLI.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

from agentvm.daemon.apierror import ApiFailure, DaemonUnavailable, error_from  # noqa: F401 (their home for clients)
from agentvm.errors import ConfigError


DEFAULT_TIMEOUT = 60.0  # seconds a command waits for the daemon's answer (AGENTVM_CLIENT_TIMEOUT)


STREAM_CHUNK = 1 << 20  # bytes of a cp upload sent at once (http.client's blocksize)
STREAM_RATE = 20 << 20  # bytes/s a cp is given at least, on top of the timeout, before it is called stuck


class Download:
    """A cp download being received: ``kind`` ("file" or "tar"), ``counts`` (a folder's
    files, dirs, bytes, skipped), ``read(n)`` the next bytes (b"" at the end; a body cut short
    raises http.client.IncompleteRead), ``close()``."""

    def __init__(self, kind: str, counts: dict, body, conn) -> None:
        self.kind, self.counts, self._body, self._conn = kind, counts, body, conn

    def read(self, n: int = STREAM_CHUNK) -> bytes:
        return self._body.read(n)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def __enter__(self) -> "Download":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None):
        super().__init__("localhost", timeout=timeout, blocksize=STREAM_CHUNK)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.timeout is not None:
            s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def default_socket() -> Path:
    from agentvm.paths import default_paths

    return default_paths().runtime / "agentvm.sock"


class Client:
    def __init__(self, socket_path: str | Path | None = None, *, url: str | None = None, token: str | None = None,
                 timeout: float | None = None):
        self.socket_path = str(socket_path or default_socket())
        self.url = url or os.environ.get("AGENTVM_DAEMON_URL")
        self.token = token or os.environ.get("AGENTVM_DAEMON_TOKEN")
        if timeout is None:
            try:
                timeout = float(os.environ.get("AGENTVM_CLIENT_TIMEOUT", DEFAULT_TIMEOUT))
            except ValueError:
                raise ConfigError("AGENTVM_CLIENT_TIMEOUT must be a number of seconds") from None
        self.timeout = timeout

    def available(self) -> bool:
        try:
            self.request("GET", "/v1/sandboxes")
            return True
        except (DaemonUnavailable, ApiFailure):
            return False

    def _conn(self):
        if self.url:
            host, _, port = self.url.replace("http://", "").rstrip("/").rpartition(":")
            return http.client.HTTPConnection(host, int(port), timeout=self.timeout, blocksize=STREAM_CHUNK)
        return _UnixConnection(self.socket_path, self.timeout)

    def _send(self, method: str, path: str, body, ctype: str, extra: dict | None = None, *,
              timeout: float | None = None):
        c = self._conn()
        headers = {"Content-Type": ctype, **(extra or {})}
        if self.url and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if timeout is not None:
            c.timeout = timeout
        try:
            try:
                c.request(method, path, body=body, headers=headers)
                # kept: a response that closes the connection takes the socket from ``c`` (c.sock
                # is None then), and a stream must still lift the timeout from it (see stream())
                c.avm_sock = c.sock
            except (BrokenPipeError, ConnectionResetError):
                # the daemon answered early (413, 429...) and stopped reading: its answer may be there
                return c, c.getresponse()
            return c, c.getresponse()
        except TimeoutError as exc:  # socket.timeout
            c.close()  # the daemon drops a request whose client has gone, rather than apply it late
            raise DaemonUnavailable(
                f"the agent-vm daemon did not answer within {self.timeout:g}s ({self.url or self.socket_path})",
                hint="it may be stopped or overloaded: check its log (`agentvm up --foreground`); "
                "AGENTVM_CLIENT_TIMEOUT sets the wait", code="daemon.timeout") from exc
        except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as exc:
            c.close()
            raise DaemonUnavailable(f"the agent-vm daemon closed the connection ({self.url or self.socket_path})",
                                    hint="it may be shutting down: `agentvm up` starts it again") from exc
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            raise self._refused(exc) from exc

    def _refused(self, exc: OSError) -> DaemonUnavailable:
        """A connection the daemon's socket refused: no permission (PermissionError), else no
        daemon there."""
        if isinstance(exc, PermissionError):
            return DaemonUnavailable(f"no permission to talk to the daemon at {self.socket_path}",
                                     hint="the control socket is owner-only: use the daemon's user")
        return DaemonUnavailable(f"the agent-vm daemon is not running ({self.url or self.socket_path})",
                                 hint="start it with `agentvm up`")

    def request(self, method: str, path: str, doc=None, *, raw: bytes | None = None):
        body = raw if raw is not None else (json.dumps(doc).encode() if doc is not None else None)
        c, r = self._send(method, path, body, "application/octet-stream" if raw is not None else "application/json")
        return _answer(c, r)

    def stream(self, method: str, path: str, doc=None) -> Iterator[dict]:
        c, r = self._send(method, path, json.dumps(doc).encode() if doc is not None else None, "application/json")
        try:
            if r.status >= 300:
                try:
                    body = json.loads(r.read() or b"{}")
                except ValueError:
                    body = {}
                raise error_from(body if isinstance(body, dict) else {}, r.status)
            sock = c.sock or getattr(c, "avm_sock", None)
            if sock is not None:  # the stream is as long as the run (silent for minutes, maybe): the answer came in time
                sock.settimeout(None)
            while True:
                line = r.readline()
                if not line:
                    return
                ev = json.loads(line)
                if isinstance(ev, dict) and isinstance(ev.get("error"), dict):
                    raise error_from(ev["error"])  # a refusal found after the stream began
                yield ev
        finally:
            c.close()

    # -- operations ---------------------------------------------------------------------------
    def create(self, spec_text: str, file: str = "<sdk>", ttl: float | None = None, idle_timeout: float | None = None):
        return self.request("POST", "/v1/sandboxes", {"spec": spec_text, "file": file, "ttl": ttl, "idle_timeout": idle_timeout})

    def ps(self):
        return self.request("GET", "/v1/sandboxes")

    def get(self, name: str):
        return self.request("GET", f"/v1/sandboxes/{quote(name)}")

    def action(self, name: str, action: str):
        return self.request("POST", f"/v1/sandboxes/{quote(name)}/{action}")

    def rm(self, name: str, keep_workspace: bool = False):
        """Stop and remove it; its workspace too unless ``keep_workspace`` (or the agent file's
        ``workspace.keep``)."""
        return self.request("DELETE", f"/v1/sandboxes/{quote(name)}" + ("?keep_workspace=1" if keep_workspace else ""))

    def exec(self, name: str, argv: list[str], timeout: float | None = None) -> Iterator[dict]:
        for ev in self.stream("POST", f"/v1/sandboxes/{quote(name)}/exec", {"argv": argv, "timeout": timeout}):
            if "data" in ev:
                ev = dict(ev, data=base64.b64decode(ev["data"]))
            yield ev

    def connect_raw(self):
        """A connected socket to the daemon and the header lines it needs (the token on TCP),
        for an interactive session (``agentvm.cli.fastrun.attach``, :class:`AttachedSession`)."""
        import socket

        try:
            if self.url:
                host, _, port = self.url.replace("http://", "").rstrip("/").rpartition(":")
                s = socket.create_connection((host, int(port)), timeout=self.timeout)
            else:
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(self.timeout)
                s.connect(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError, PermissionError) as exc:
            raise self._refused(exc) from exc
        headers = f"Authorization: Bearer {self.token}\r\n".encode() if self.url and self.token else b""
        return s, headers

    def exec_session(self, name: str, argv: list[str], *, timeout: float | None = None,
                     tty: tuple[int, int] | None = None) -> "AttachedSession":
        """``exec`` with stdin (and with ``tty`` (rows, cols) a terminal) as an
        :class:`AttachedSession` (docs/daemon.md "Interactive sessions")."""
        doc: dict = {"argv": argv, "timeout": timeout}
        if tty is not None:
            doc["tty"] = {"rows": tty[0], "cols": tty[1]}
        return AttachedSession(self, f"/v1/sandboxes/{quote(name)}/exec/attach", doc)

    def run_session(self, doc: dict, *, tty: tuple[int, int] | None = None) -> "AttachedSession":
        """``run`` (the body of ``POST /v1/run``) with stdin / a terminal, as an AttachedSession."""
        doc = dict(doc)
        if tty is not None:
            doc["tty"] = {"rows": tty[0], "cols": tty[1]}
        return AttachedSession(self, "/v1/run/attach", doc)

    def run(self, doc: dict) -> Iterator[dict]:
        for ev in self.stream("POST", "/v1/run", doc):
            if "data" in ev:
                ev = dict(ev, data=base64.b64decode(ev["data"]))
            yield ev

    def logs(self, name: str) -> str:
        return self.request("GET", f"/v1/sandboxes/{quote(name)}/logs")["log"]

    def put_file(self, name: str, path: str, data: bytes):
        return self.request("PUT", f"/v1/sandboxes/{quote(name)}/files?path={quote(path)}", raw=data)

    def put_stream(self, name: str, path: str, fh, size: int, *, tar: bool = False) -> dict:
        """Upload ``size`` bytes read from the binary file ``fh`` (a file, or with ``tar`` a
        folder's tar stream) STREAM_CHUNK at a time: never the whole in memory. The daemon
        stages it on its state disk and refuses it up front when ``size`` cannot fit."""
        target = f"/v1/sandboxes/{quote(name)}/files?path={quote(path)}" + ("&tar=1" if tar else "")
        timeout = None if self.timeout is None else self.timeout + size / STREAM_RATE
        c, r = self._send("PUT", target, fh, "application/octet-stream", {"Content-Length": str(size)},
                          timeout=timeout)
        return _answer(c, r)

    def open_download(self, name: str, path: str, *, tar: bool = True) -> "Download":
        """A file (``kind`` "file") or, with ``tar``, a folder (``kind`` "tar": a tar stream) of
        the workspace as a :class:`Download` to ``read()`` STREAM_CHUNK at a time and close."""
        target = f"/v1/sandboxes/{quote(name)}/files?path={quote(path)}" + ("&tar=1" if tar else "")
        c, r = self._send("GET", target, None, "application/json", {"Accept": "application/octet-stream"})
        try:
            if r.status >= 300:
                data = r.read()
                try:
                    doc = json.loads(data) if data else {}
                except ValueError:
                    doc = {"message": data[:200].decode(errors="replace")}
                raise error_from(doc if isinstance(doc, dict) else {}, r.status)
            if (r.getheader("content-type") or "").startswith("application/json"):  # a daemon without streaming
                import io

                d = json.loads(r.read())
                c.close()
                return Download(d.get("kind", "file"), d, io.BytesIO(base64.b64decode(d["data"])), None)
            try:
                counts = json.loads(r.getheader("x-agentvm-counts") or "{}")
            except ValueError:
                counts = {}
            return Download(r.getheader("x-agentvm-kind") or "file", counts, r, c)
        except BaseException:
            c.close()
            raise

    def get_file(self, name: str, path: str) -> bytes:
        return base64.b64decode(self.request("GET", f"/v1/sandboxes/{quote(name)}/files?path={quote(path)}")["data"])

    def put_tree(self, name: str, path: str, tar_bytes: bytes):
        """A folder into the workspace, as a tar stream (folders and regular files only)."""
        return self.request("PUT", f"/v1/sandboxes/{quote(name)}/files?path={quote(path)}&tar=1", raw=tar_bytes)

    def get_path(self, name: str, path: str) -> tuple[str, bytes]:
        """A file (``("file", bytes)``) or a folder (``("tar", a tar stream)``) of the workspace."""
        d = self.request("GET", f"/v1/sandboxes/{quote(name)}/files?path={quote(path)}&tar=1")
        return d.get("kind", "file"), base64.b64decode(d["data"])

    def policy(self, name: str, op: str, **kw):
        return self.request("POST", f"/v1/sandboxes/{quote(name)}/policy", {"op": op, **kw})

    def approvals(self, all_states: bool = False):
        return self.request("GET", "/v1/approvals" + ("?all=1" if all_states else ""))

    def approval(self, request_id: str):
        return self.request("GET", f"/v1/approvals/{quote(request_id)}")

    def answer(self, request_id: str, approve: bool, note: str | None = None, *, digest: str | None = None,
               via: str | None = None):
        doc = {k: v for k, v in (("note", note), ("digest", digest), ("via", via)) if v is not None}
        return self.request("POST", f"/v1/approvals/{quote(request_id)}/{'approve' if approve else 'deny'}", doc)

    def audit(self, since: float | None = None, sandbox: str | None = None):
        q = []
        if since is not None:
            q.append(f"since={since}")
        if sandbox:
            q.append(f"sandbox={quote(sandbox)}")
        return self.request("GET", "/v1/audit" + ("?" + "&".join(q) if q else ""))

    def verify(self):
        return self.request("GET", "/v1/audit/verify")

    def fleet(self, op: str, doc: dict | None = None):
        if op == "status":
            return self.request("GET", "/v1/fleet/status")
        return self.request("POST", f"/v1/fleet/{op}", doc or {})

    def console_login(self):
        return self.request("POST", "/v1/console/login", {})

    def events(self) -> Iterator[dict]:
        return self.stream("GET", "/v1/events")

    def shutdown(self):
        return self.request("POST", "/v1/shutdown")


def _answer(c, r):
    """A whole answer's JSON document (None when empty; a body that is not JSON as its
    ``message``), the connection closed; a status of 300 or more raised as the daemon's error."""
    try:
        data = r.read()
    finally:
        c.close()
    try:
        out = json.loads(data) if data else None
    except ValueError:
        out = {"message": data[:200].decode(errors="replace")}
    if r.status >= 300:
        raise error_from(out or {}, r.status)
    return out


def ensure_spec_text(spec) -> tuple[str, str]:
    p = Path(spec)
    if "\n" not in str(spec) and p.exists():
        return p.read_text(), str(p)
    if isinstance(spec, str) and "apiVersion" in spec:
        return spec, "<sdk>"
    raise ConfigError(f"{spec!r} is neither an agent file nor agent YAML")


class AttachedSession:
    """An interactive session over an upgraded connection (docs/daemon.md): ``send(data)``,
    ``close_stdin()``, ``resize(rows, cols)``, ``signal("INT")``; ``events()`` yields
    ``("stdout"|"stderr", bytes)`` and last ``("exit", (code, text))``. Blocking; safe to
    write from one thread while another reads."""

    def __init__(self, client: Client, path: str, doc: dict) -> None:
        import threading

        from agentvm.cli import fastrun

        self._f = fastrun
        self.sock, headers = client.connect_raw()
        body = json.dumps(doc).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: Upgrade\r\nUpgrade: {fastrun.ATTACH_PROTOCOL}\r\n"
                ).encode() + headers + b"\r\n"
        self._lock = threading.Lock()
        try:
            self.sock.sendall(head + body)
            r = fastrun._Reader(self.sock, client.timeout)
            status, hdrs = r.head()
        except TimeoutError:
            self.sock.close()
            raise DaemonUnavailable(f"the agent-vm daemon did not answer within {client.timeout:g}s",
                                    code="daemon.timeout") from None
        if status != 101:
            try:
                for _ in fastrun._events(r, status if status >= 300 else 502, hdrs):
                    pass
            finally:
                self.sock.close()
            raise DaemonUnavailable(f"the daemon answered {status} to an interactive session")
        self.sock.settimeout(None)
        self._buf = bytearray(r.buf)

    def _send(self, frame: bytes) -> None:
        with self._lock:
            self.sock.sendall(frame)

    def send(self, data: bytes) -> None:
        for i in range(0, len(data), self._f.IN_FRAME):
            self._send(self._f._frame(b"i", data[i:i + self._f.IN_FRAME]))

    def close_stdin(self) -> None:
        self._send(self._f._frame(b"c"))

    def resize(self, rows: int, cols: int) -> None:
        self._send(self._f._frame(b"w", b"%d %d" % (rows, cols)))

    def signal(self, name: str) -> None:
        self._send(self._f._frame(b"s", name.encode("ascii")))

    def events(self):
        while True:
            nl = self._buf.find(b"\n", 0, 11)
            if nl >= 0:
                n = int(self._buf[1:nl])
                if n > self._f.MAX_PIECE:
                    raise ConnectionError("a frame over the size limit")
                if len(self._buf) >= nl + 1 + n:
                    kind, payload = bytes(self._buf[:1]), bytes(self._buf[nl + 1:nl + 1 + n])
                    del self._buf[:nl + 1 + n]
                    if kind == b"x":
                        code, _, text = payload.partition(b"\n")
                        yield "exit", (int(code), text.decode("utf-8", "replace"))
                        return
                    yield ("stdout" if kind == b"o" else "stderr"), payload
                    continue
            elif len(self._buf) > 10:
                raise ConnectionError("a malformed frame")
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the daemon closed the session without an end")
            self._buf += data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

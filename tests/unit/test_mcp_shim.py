"""agentvm-mcp (the sandbox's stdio shim to the tool gateway) against a loopback HTTP server:
it keeps connections alive, and a kept connection the server closed while idle costs one
resend on a new connection - never a lost or a doubled message."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
from pathlib import Path

SHIM = Path(__file__).resolve().parents[2] / "src" / "agentvm" / "native" / "agentvm-mcp.py"


def load_shim(monkeypatch, url: str):
    monkeypatch.setenv("AGENTVM_MCP_URL", url)
    spec = importlib.util.spec_from_file_location("agentvm_mcp_shim", SHIM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Server:
    """HTTP/1.1 on loopback: answers each POST with its JSON-RPC id echoed; closes a connection
    after ``close_after`` answers on it (without saying so, as an idle timeout does)."""

    def __init__(self, close_after: int, for_first: int = 1 << 30) -> None:
        self.close_after, self.for_first = close_after, for_first  # ... on the first ``for_first`` connections
        self.connections = 0
        self.bodies: list[dict] = []
        self.ls = socket.create_server(("127.0.0.1", 0))
        self.port = self.ls.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            self.connections += 1
            n = self.close_after if self.connections <= self.for_first else 1 << 30
            threading.Thread(target=self._serve, args=(c, n), daemon=True).start()

    def _serve(self, c: socket.socket, answers: int) -> None:
        f = c.makefile("rb")
        for _ in range(answers):
            head = []
            while (line := f.readline()) not in (b"\r\n", b""):
                head.append(line)
            if not head:
                break
            n = int([h for h in head if h.lower().startswith(b"content-length")][0].split(b":")[1])
            msg = json.loads(f.read(n))
            self.bodies.append(msg)
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": {}}).encode()
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
        f.close()
        c.close()


def test_connections_are_kept_alive(monkeypatch, capsys):
    srv = Server(close_after=100)
    shim = load_shim(monkeypatch, f"http://127.0.0.1:{srv.port}/mcp")
    for i in range(5):
        shim.send(json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/list"}).encode())
    out = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [m["id"] for m in out] == [0, 1, 2, 3, 4]
    assert srv.connections == 1


def test_connections_the_gateway_closed_while_idle_are_not_used_and_nothing_is_sent_twice(monkeypatch, capsys):
    import time

    srv = Server(close_after=1, for_first=3)  # closed after one answer, as by an idle timeout
    shim = load_shim(monkeypatch, f"http://127.0.0.1:{srv.port}/mcp")
    # several idle connections at once, as concurrent requests leave them
    held = []
    for i in range(3):
        c = shim._connection()
        c.request("POST", "/mcp", body=json.dumps({"jsonrpc": "2.0", "id": i, "method": "x"}).encode(),
                  headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        print(resp.read().decode())
        held.append((c, resp))
    for c, resp in held:
        shim._done(c, resp)
    time.sleep(0.2)  # the server has closed them all
    for i in range(3, 6):
        shim.send(json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": "x"}}).encode())
    out = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert sorted(m["id"] for m in out) == [0, 1, 2, 3, 4, 5] and all("result" in m for m in out), out
    assert sorted(m["id"] for m in srv.bodies) == [0, 1, 2, 3, 4, 5], "each message reached the server exactly once"


def test_a_gateway_that_is_down_answers_each_request_with_an_error(monkeypatch, capsys):
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    shim = load_shim(monkeypatch, f"http://127.0.0.1:{port}/mcp")
    shim.send(b'{"jsonrpc": "2.0", "id": 7, "method": "tools/list"}')
    out = json.loads(capsys.readouterr().out)
    assert out["id"] == 7 and "cannot be reached" in out["error"]["message"]

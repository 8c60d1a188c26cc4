"""A stream from the daemon (exec, events) may be silent for longer than the client's timeout:
the timeout covers only the wait for the answer's head. A response that closes the connection
(``Connection: close``) takes the socket out of the http.client connection, and the timeout was
then never lifted: an `agentvm exec` whose command printed nothing for 60 s failed with
``internal error [TimeoutError]`` (found by a helper session re-running a review PoC)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from agentvm.daemon.client import Client


@pytest.mark.parametrize("close", [True, False])
def test_a_stream_silent_for_longer_than_the_timeout_is_read_to_its_end(tmp_path, close):
    path = str(tmp_path / "d.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve():
        c, _ = srv.accept()
        req = b""
        while b"\r\n\r\n" not in req:  # the whole request (head, then its body): unread bytes at close reset it
            req += c.recv(65536)
        head, _, body = req.partition(b"\r\n\r\n")
        n = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")), 0))
        while len(body) < n:
            body += c.recv(65536)
        head = "HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
        head += "Connection: close\r\n\r\n" if close else "Transfer-Encoding: identity\r\n\r\n"
        c.sendall(head.encode() + json.dumps({"data": "YQ=="}).encode() + b"\n")
        time.sleep(1.5)  # silent for three times the client's timeout
        c.sendall(json.dumps({"exit_code": 0}).encode() + b"\n")
        c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        events = list(Client(path, timeout=0.5).exec("x", ["sleep", "60"]))
    finally:
        srv.close()
        t.join(5)
    assert events == [{"data": b"a"}, {"exit_code": 0}]

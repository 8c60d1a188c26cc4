"""The thin client of `agentvm run` finds the daemon where the library puts it, and reads
its chunked NDJSON stream (output, refusals inside the stream) as the full client does."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from agentvm.cli import fastrun
from agentvm.paths import default_paths


@pytest.mark.parametrize("env", [
    {},
    {"AGENTVM_HOME": "/srv/avm"},
    {"AGENTVM_HOME": "/srv/avm", "AGENTVM_RUNTIME_DIR": "/run/x"},
    {"AGENTVM_RUNTIME_DIR": "/run/y"},
    {"XDG_RUNTIME_DIR": "/run/user/1000"},
    {"XDG_RUNTIME_DIR": "/run/user/1000", "AGENTVM_HOME": "/srv/h"},
])
@pytest.mark.parametrize("euid", [0, 1000])
def test_socket_path_matches_the_librarys(monkeypatch, env, euid):
    for k in ("AGENTVM_HOME", "AGENTVM_RUNTIME_DIR", "XDG_RUNTIME_DIR", "XDG_DATA_HOME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("os.geteuid", lambda: euid)
    assert fastrun.socket_path() == str(default_paths().runtime / "agentvm.sock")


def _serve(answer: bytes):
    a, b = socket.socketpair()

    def run():
        data = b""
        while b"\r\n\r\n" not in data:
            data += b.recv(65536)
        b.sendall(answer)
        b.close()

    threading.Thread(target=run, daemon=True).start()
    return a


def _chunked(*lines: dict) -> bytes:
    out = b""
    for d in lines:
        body = json.dumps(d).encode() + b"\n"
        out += f"{len(body):x}\r\n".encode() + body + b"\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n" + out + b"0\r\n\r\n"


def test_stream_events_are_decoded():
    import base64

    sock = _serve(_chunked({"stream": "stdout", "data": base64.b64encode(b"hi\n").decode()}, {"result": {"exit_code": 3}}))
    evs = list(fastrun.run_stream(sock, {"command": ["x"]}))
    assert evs == [{"stream": "stdout", "data": b"hi\n"}, {"result": {"exit_code": 3}}]


def test_a_refusal_before_or_inside_the_stream_is_the_same_error():
    err = {"error": "policy.test", "message": "refused", "hint": "fix", "exit_code": 77}
    body = json.dumps(err).encode()
    sock = _serve(b"HTTP/1.1 403 Forbidden\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    with pytest.raises(Exception) as ei:
        list(fastrun.run_stream(sock, {}))
    assert (ei.value.code, ei.value.message, ei.value.hint, ei.value.exit_code) == ("policy.test", "refused", "fix", 77)
    sock = _serve(_chunked({"error": err}))
    with pytest.raises(Exception) as ei:
        list(fastrun.run_stream(sock, {}))
    assert ei.value.code == "policy.test" and ei.value.exit_code == 77


def test_no_daemon_means_an_embedded_run(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTVM_RUNTIME_DIR", str(tmp_path))
    assert fastrun.connect() is None


def _python_client(env: dict, *args: str):
    import subprocess
    import sys

    code = "import sys; from agentvm.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=60)


def test_the_python_thin_client_relays_frames_and_imports_nothing_it_does_not_need(tmp_path):
    """`run -- CMD` with a daemon up, when the compiled entry point is not there (python -m
    agentvm, or no compiler at install): the same request, the frames relayed byte for byte,
    the report as rendered by the daemon, the exit code - and no json, socket, argparse or
    runtime imported on the way."""
    import os

    from tests.unit.test_client_c import FakeDaemon, frames

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env["AGENTVM_RUNTIME_DIR"] = str(tmp_path / "rt")
    d = FakeDaemon(str(tmp_path / "rt" / "agentvm.sock"),
                   frames((b"o", b"out\xff\n"), (b"e", b"err\n"), (b"x", b"3\nthe report\n")))
    try:
        r = _python_client({**env, "PYTHONPROFILEIMPORTTIME": "1"}, "run", "--", "echo", 'q"uote', "ünï")
    finally:
        d.close()
    assert r.returncode == 3 and r.stdout == b"out\xff\n"
    err = r.stderr.decode()
    assert err.endswith("err\nthe report\n"), err[-300:]
    imported = {ln.split("|")[-1].strip() for ln in err.splitlines() if ln.startswith("import time:")}
    assert "agentvm.cli.fastrun" in imported
    for heavy in ("json", "socket", "argparse", "agentvm.cli.run_cmd", "agentvm.runtime", "typing"):
        assert heavy not in imported, f"the thin client imported {heavy}"
    assert d.requests == [json.loads('{"command":["echo","q\\"uote","ünï"],' + fastrun._NO_OPTIONS + "}")]
    assert d.paths == [fastrun.FRAMES_PATH]


def test_the_python_thin_client_says_when_the_daemon_breaks_off(tmp_path):
    import os

    from tests.unit.test_client_c import FakeDaemon, frames

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env["AGENTVM_RUNTIME_DIR"] = str(tmp_path / "rt")
    d = FakeDaemon(str(tmp_path / "rt" / "agentvm.sock"), frames((b"o", b"partial\n"))[:-5])
    try:
        r = _python_client(env, "run", "--", "true")
    finally:
        d.close()
    assert r.returncode == 125 and r.stdout == b"partial\n" and b"without a result" in r.stderr


def test_the_python_thin_client_takes_the_full_path_for_a_daemon_without_frames(tmp_path):
    """An older daemon (404 for /v1/run/frames, having run nothing): asked again the full
    path's way (NDJSON on /v1/run), once."""
    import base64
    import os

    from tests.unit.test_client_c import FakeDaemon

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env["AGENTVM_RUNTIME_DIR"] = str(tmp_path / "rt")

    def old_daemon(path: str) -> bytes:
        if path != "/v1/run":
            return b'HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}'
        return _chunked({"stream": "stdout", "data": base64.b64encode(b"old\n").decode()},
                        {"result": {"exit_code": 4, "teardown": {"verified": True}}})

    d = FakeDaemon(str(tmp_path / "rt" / "agentvm.sock"), old_daemon)
    try:
        r = _python_client(env, "run", "--", "true")
    finally:
        d.close()
    assert d.paths == [fastrun.FRAMES_PATH, "/v1/run"]
    assert r.returncode == 4 and r.stdout == b"old\n", r.stderr


@pytest.mark.parametrize("body", [
    b"ffffffffffffffff\r\n" + b"A" * 5000,
    b"-1\r\n" + b"A" * 5000,
    b"0x10\r\n" + b"A" * 16 + b"\r\n",
    b"5\r\nx2\n0\nXY0\r\n\r\n",
    b"4\r\no\n\n\n\r\n0\r\n\r\n",
    b"e\r\no99999999999\n\r\n0\r\n\r\n",
    b"6\r\nx-1\n0\n\r\n0\r\n\r\n",
    b"7\r\nx4\n256\n\r\n0\r\n\r\n",
    b"5\r\nAAAAA\r\n" * 400,
])
def test_the_python_thin_client_refuses_a_hostile_answer_cleanly(tmp_path, body):
    import os

    from tests.unit.test_client_c import HEAD, FakeDaemon

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env["AGENTVM_RUNTIME_DIR"] = str(tmp_path / "rt")
    d = FakeDaemon(str(tmp_path / "rt" / "agentvm.sock"), HEAD + body)
    try:
        r = _python_client(env, "run", "--", "true")
    finally:
        d.close()
    assert r.returncode == 125 and b"without a result" in r.stderr and b"Traceback" not in r.stderr, r.stderr


def test_the_python_thin_client_wants_the_whole_head_within_the_timeout(tmp_path):
    import os
    import time

    from tests.unit.test_client_c import HEAD, FakeDaemon

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env.update(AGENTVM_RUNTIME_DIR=str(tmp_path / "rt"), AGENTVM_CLIENT_TIMEOUT="0.5")
    d = FakeDaemon(str(tmp_path / "rt" / "agentvm.sock"), HEAD, trickle=0.05)
    try:
        t = time.monotonic()
        r = _python_client(env, "run", "--", "true")
        took = time.monotonic() - t
    finally:
        d.close()
    assert r.returncode == 125 and b"did not answer within 0.5s" in r.stderr and took < 3, r.stderr


def test_a_daemon_timeout_says_where_the_daemons_log_is(tmp_path):
    """Both clients' daemon.timeout hint names the log `agentvm up` writes (<home>/daemon.log)."""
    import os

    from tests.unit.test_client_c import HEAD, FakeDaemon

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env.update(AGENTVM_HOME=str(tmp_path / "home"), AGENTVM_RUNTIME_DIR=str(tmp_path / "rt"),
               AGENTVM_CLIENT_TIMEOUT="0.5")
    d = FakeDaemon(str(tmp_path / "rt" / "agentvm.sock"), HEAD, trickle=0.05)
    try:
        fast = _python_client(env, "run", "--", "true")  # the thin client
        full = _python_client(env, "run", "--env", "A=1", "--", "true")  # the full path (an option)
    finally:
        d.close()
    for r in (fast, full):
        assert r.returncode == 125 and b"[daemon.timeout]" in r.stderr, r.stderr
        assert f"  hint: it may be stopped or overloaded: its log is {tmp_path}/home/daemon.log;".encode() in r.stderr, r.stderr

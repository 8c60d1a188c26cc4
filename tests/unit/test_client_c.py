"""The compiled entry point (src/agentvm/native/agentvm-client.c), built here with gcc and run
against a fake daemon on a real unix socket: what it sends is what the Python thin client
sends, it relays frames byte for byte, and everything that is not its one job goes to the
Python entry point unchanged - with no request sent to the daemon first."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agentvm.cli import fastrun
from agentvm.locations import default_dirs

SRC = Path(__file__).resolve().parents[2] / "src" / "agentvm" / "native" / "agentvm-client.c"
ENTRY = 'import json, sys\nprint("FALLBACK " + json.dumps(sys.argv[1:]))\n'

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build the client "
                                "(scripts/install.sh installs it)")


def _build(d: Path, name: str, *flags: str) -> Path:
    entry = d / "entry.py"
    entry.write_text(ENTRY)
    os.chmod(entry, 0o644)
    exe = d / name
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", *flags, "-o", str(exe), f'-DAGENTVM_PYTHON="{sys.executable}"',
                    f'-DAGENTVM_PY_ENTRY="{entry}"', str(SRC)], check=True)
    return exe


@pytest.fixture(scope="module")
def build_dir():
    d = Path(tempfile.mkdtemp(prefix="agentvm-client-test-", dir="/tmp"))  # reachable by another uid
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def client(build_dir):
    return _build(build_dir, "agentvm")


@pytest.fixture(scope="module")
def asan_client(build_dir):
    """The same client with AddressSanitizer and UBSan: a memory error is a crash, not luck."""
    return _build(build_dir, "agentvm-asan", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")


class FakeDaemon:
    """A unix socket at ``path`` that records each request and answers with ``answer`` (bytes,
    or a function of the request's path; None: never in time)."""

    def __init__(self, path: str, answer: bytes | None, trickle: float = 0.0) -> None:
        self.path, self.answer, self.requests, self.paths = path, answer, [], []
        self.trickle = trickle  # seconds between bytes of the answer
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.s = socket.socket(socket.AF_UNIX)
        self.s.bind(path)
        os.chmod(path, 0o777)
        self.s.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.s.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += c.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
            while len(body) < n:
                body += c.recv(65536)
            self.paths.append(head.split(b" ")[1].decode())
            self.requests.append(json.loads(body))
            answer = self.answer(self.paths[-1]) if callable(self.answer) else self.answer
            if answer is not None:
                try:
                    if self.trickle:
                        for i in range(len(answer)):
                            c.sendall(answer[i:i + 1])
                            time.sleep(self.trickle)
                    else:
                        c.sendall(answer)
                except OSError:
                    pass
                c.close()
            else:
                threading.Timer(5, c.close).start()  # never answers in time

    def close(self) -> None:
        self.s.close()
        os.unlink(self.path)


def frames(*items: tuple[bytes, bytes], cut: int = 7) -> bytes:
    """A framed answer, its frames cut across chunks of ``cut`` bytes on purpose."""
    body = b"".join(k + str(len(p)).encode() + b"\n" + p for k, p in items)
    chunks = [b"%x\r\n" % len(body[i:i + cut]) + body[i:i + cut] + b"\r\n" for i in range(0, len(body), cut)]
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/x-agentvm-frames\r\ntransfer-encoding: chunked\r\n\r\n"
            + b"".join(chunks) + b"0\r\n\r\n")


def env_for(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTVM_", "XDG_"))}
    env.update({"AGENTVM_HOME": str(tmp_path / "home")}, **extra)
    return env


def sock_path(env: dict) -> str:
    old = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        return os.path.join(default_dirs()[1], "agentvm.sock")
    finally:
        os.environ.clear()
        os.environ.update(old)


def run(client, args, env, stdin=subprocess.DEVNULL, **kw):
    return subprocess.run([str(client), *args], env=env, stdin=stdin, capture_output=True, timeout=30, **kw)


def test_a_run_is_sent_as_the_python_client_sends_it_and_its_frames_are_relayed(client, tmp_path):
    env = env_for(tmp_path)
    answer = frames((b"o", b"out \x00\xff bytes\n"), (b"e", b"err\n"), (b"o", b"more\n"),
                    (b"x", b"7\nagentvm: the report\n"))
    d = FakeDaemon(sock_path(env), answer)
    try:
        args = ["/bin/echo", 'a"b\\c', "tab\there", "\x01ctl\x7f", "ünïcødé 😀", "--json", "-f"]
        r = run(client, ["run", "--", *args], env)
    finally:
        d.close()
    assert r.returncode == 7, r.stderr
    assert r.stdout == b"out \x00\xff bytes\nmore\n"
    assert r.stderr == b"err\nagentvm: the report\n"
    body = d.requests[0]
    expected = json.loads('{"command":' + json.dumps(args) + "," + fastrun._NO_OPTIONS + "}")
    assert body == expected and d.paths == [fastrun.FRAMES_PATH]


def test_the_form_without_double_dash_is_the_same_run(client, tmp_path):
    env = env_for(tmp_path)
    d = FakeDaemon(sock_path(env), frames((b"x", b"0\n")))
    try:
        r = run(client, ["run", "true", "--json"], env)
    finally:
        d.close()
    assert r.returncode == 0 and d.requests[0]["command"] == ["true", "--json"]


@pytest.mark.parametrize("case", ["option", "no-command", "other-command", "no-daemon-env",
                                  "file-stdin", "not-utf8", "no-socket"])
def test_what_is_not_its_job_goes_to_python_unchanged_and_unsent(client, tmp_path, case):
    env = env_for(tmp_path)
    args = {"option": ["run", "--json", "--", "true"], "no-command": ["run", "--"], "other-command": ["status"],
            "not-utf8": ["run", "--", "echo", os.fsdecode(b"\xff\xfe")]}.get(case, ["run", "--", "true"])
    stdin = subprocess.DEVNULL
    if case == "no-daemon-env":
        env["AGENTVM_NO_DAEMON"] = "1"
    if case == "file-stdin":
        f = tmp_path / "in.txt"
        f.write_text("x")
        stdin = open(f)  # noqa: SIM115 - closed with the test
    d = None if case == "no-socket" else FakeDaemon(sock_path(env), frames((b"x", b"0\n")))
    try:
        r = run(client, args, env, stdin=stdin)
    finally:
        if d is not None:
            d.close()
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode(errors="surrogateescape").strip() == "FALLBACK " + json.dumps(args)
    assert d is None or d.requests == [], "nothing is sent to the daemon before handing over"


@pytest.mark.parametrize("status", [b"403 Forbidden", b"404 Not Found"])
def test_a_refusal_or_an_older_daemon_is_handed_to_python_to_ask_again_and_say(client, tmp_path, status):
    """Before the run: a refusal, or a daemon without /v1/run/frames (404). Nothing ran, so
    Python may ask again (its own way)."""
    env = env_for(tmp_path)
    body = b'{"error": "policy.denied", "message": "no", "exit_code": 77}'
    d = FakeDaemon(sock_path(env), b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n" % len(body) + body)
    try:
        r = run(client, ["run", "--", "true"], env)
    finally:
        d.close()
    assert r.stdout.decode().startswith("FALLBACK ") and len(d.requests) == 1


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\n{}\n\n\n\r\n0\r\n\r\n",
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 102 Processing\r\n\r\n",  # interim: the daemon has the request
    b"HTTP/1.1 2",
])
def test_a_run_that_may_have_started_is_never_asked_for_twice(client, tmp_path, answer):
    """A 2xx in another form (or a broken answer): the run may be under way - an error, no
    second ask."""
    env = env_for(tmp_path)
    d = FakeDaemon(sock_path(env), answer)
    try:
        r = run(client, ["run", "--", "true"], env)
    finally:
        d.close()
    assert r.returncode == 125 and not r.stdout.startswith(b"FALLBACK") and len(d.requests) == 1


def test_the_whole_head_is_due_within_the_timeout_however_it_trickles(client, tmp_path):
    env = env_for(tmp_path, AGENTVM_CLIENT_TIMEOUT="0.5")
    d = FakeDaemon(sock_path(env), b"HTTP/1.1 200 OK\r\ncontent-type: application/x-agentvm-frames\r\n"
                   b"transfer-encoding: chunked\r\n\r\n", trickle=0.05)
    try:
        t = time.monotonic()
        r = run(client, ["run", "--", "true"], env)
        took = time.monotonic() - t
    finally:
        d.close()
    assert r.returncode == 125 and b"did not answer within 0.5s" in r.stderr and took < 2


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-agentvm-frames\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("body", [
    b"ffffffffffffffff\r\n" + b"A" * 5000,           # a size that wraps
    b"-1\r\n" + b"A" * 5000,                         # strtoul would take it
    b"8000000000000000\r\nAAAA",                     # a size that would double its buffer forever
    b"0x10\r\n" + b"A" * 16 + b"\r\n",                # not hex digits only
    b" 10\r\n" + b"A" * 16 + b"\r\n",
    b"5\r\nx2\n0\nXY0\r\n\r\n",                      # no CRLF after the chunk
    b"4\r\no\n\n\n\r\n0\r\n\r\n",                     # a frame with no length
    b"e\r\no99999999999\n\r\n0\r\n\r\n",               # a frame length over the limit
    b"6\r\nx-1\n0\n\r\n0\r\n\r\n",                   # a sign
    b"7\r\nx4\n256\n\r\n0\r\n\r\n",                   # an exit code over 255 (would wrap to 0)
    b"5\r\nAAAAA\r\n" * 400,                        # a frame head that never ends (would grow forever)
])
def test_a_hostile_answer_is_refused_without_a_memory_error(asan_client, tmp_path, body):
    """Whatever listens at the socket path (a daemon, or something that took its place) cannot
    make the client overflow, spin or read what it did not send: under ASan/UBSan, exit 125."""
    env = env_for(tmp_path, ASAN_OPTIONS="detect_leaks=0")
    d = FakeDaemon(sock_path(env), HEAD + body)
    try:
        r = run(asan_client, ["run", "--", "true"], env)
    finally:
        d.close()
    assert r.returncode == 125, (r.returncode, r.stderr[-2000:])
    assert b"AddressSanitizer" not in r.stderr and b"runtime error" not in r.stderr
    assert b"agentvm: the daemon ended the run without a result" in r.stderr


def test_a_broken_or_silent_daemon_is_an_error_not_a_hang(client, tmp_path):
    env = env_for(tmp_path, AGENTVM_CLIENT_TIMEOUT="0.5")
    d = FakeDaemon(sock_path(env), None)
    try:
        r = run(client, ["run", "--", "true"], env)
    finally:
        d.close()
    assert r.returncode == 125 and b"did not answer within 0.5s" in r.stderr and b"AGENTVM_CLIENT_TIMEOUT" in r.stderr
    env = env_for(tmp_path)
    d = FakeDaemon(sock_path(env), frames((b"o", b"partial\n"))[:-5])  # cut before its end frame
    try:
        r = run(client, ["run", "--", "true"], env)
    finally:
        d.close()
    assert r.returncode == 125 and r.stdout == b"partial\n" and b"without a result" in r.stderr


def test_a_reader_that_goes_away_ends_the_client_with_141(client, tmp_path):
    env = env_for(tmp_path)
    d = FakeDaemon(sock_path(env), frames(*[(b"o", b"y" * 60000)] * 50, (b"x", b"0\n"), cut=65536))
    try:
        p = subprocess.Popen([str(client), "run", "--", "yes"], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.read(10)
        p.stdout.close()
        assert p.wait(timeout=30) == 141
    finally:
        d.close()


@pytest.mark.parametrize("extra", [
    {},
    {"AGENTVM_RUNTIME_DIR": "RT"},
    {"AGENTVM_HOME": None, "AGENTVM_RUNTIME_DIR": "RT2"},  # never the system daemon's own path
])
def test_it_finds_the_daemon_where_the_library_puts_it_as_root(client, tmp_path, extra):
    env = env_for(tmp_path)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(tmp_path / v)
    path = sock_path(env)
    assert path.startswith(str(tmp_path))
    d = FakeDaemon(path, frames((b"x", b"0\n")))
    try:
        r = run(client, ["run", "--", "true"], env)
    finally:
        d.close()
    assert r.returncode == 0 and len(d.requests) == 1, r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the client as another user")
@pytest.mark.parametrize("kind", ["xdg-runtime", "home", "xdg-data"])
def test_it_finds_the_daemon_where_the_library_puts_it_as_a_user(client, kind, monkeypatch):
    uid = 54321
    base = Path(tempfile.mkdtemp(prefix="agentvm-client-user-", dir="/tmp"))
    os.chmod(base, 0o755)
    env = {"PATH": os.environ["PATH"], "HOME": str(base / "h")}
    if kind == "xdg-runtime":
        env["XDG_RUNTIME_DIR"] = str(base / "xdg")
    if kind == "xdg-data":
        env["XDG_DATA_HOME"] = str(base / "data")
    # the library's answer for that user and environment
    monkeypatch.setattr("os.geteuid", lambda: uid)
    path = sock_path(env)
    monkeypatch.undo()
    assert path.startswith(str(base))
    d = FakeDaemon(path, frames((b"x", b"0\n")))
    try:
        r = subprocess.run([str(client), "run", "--", "true"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=30, user=uid)
    finally:
        d.close()
    shutil.rmtree(base, ignore_errors=True)
    assert r.returncode == 0 and len(d.requests) == 1, (r.stdout, r.stderr)


class FakeAttachDaemon:
    """A daemon's interactive session (docs/daemon.md): answers 101, records every client frame
    until ``c`` (stdin's end) or ``s`` (a signal), then sends ``answer`` (raw frames)."""

    def __init__(self, path: str, answer, status: bytes = b"101 Switching Protocols") -> None:
        self.path, self.answer, self.status = path, answer, status
        self.heads: list[bytes] = []
        self.bodies: list[dict] = []
        self.frames: list[tuple[bytes, bytes]] = []
        self.got_end = threading.Event()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.s = socket.socket(socket.AF_UNIX)
        self.s.bind(path)
        self.s.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            c, _ = self.s.accept()
        except OSError:
            return
        data = b""
        while b"\r\n\r\n" not in data:
            data += c.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        self.heads.append(head)
        n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
        while len(rest) < n:
            rest += c.recv(65536)
        self.bodies.append(json.loads(rest[:n]))
        buf = rest[n:]
        c.sendall(b"HTTP/1.1 " + self.status + b"\r\nupgrade: agentvm-frames/1\r\nconnection: upgrade\r\n\r\n")
        while True:
            while b"\n" in buf:
                h, _, tail = buf.partition(b"\n")
                k, m = h[:1], int(h[1:])
                if len(tail) < m:
                    break
                self.frames.append((k, tail[:m]))
                buf = tail[m:]
                if k in (b"c", b"s"):
                    self.got_end.set()
            if self.got_end.is_set():
                break
            more = c.recv(65536)
            if not more:
                break
            buf += more
        answer = self.answer(self) if callable(self.answer) else self.answer
        try:
            c.sendall(answer)
        except OSError:
            pass
        c.close()

    def close(self) -> None:
        self.s.close()
        os.unlink(self.path)


def raw_frames(*items: tuple[bytes, bytes]) -> bytes:
    return b"".join(k + str(len(p)).encode() + b"\n" + p for k, p in items)


@pytest.mark.parametrize("which", ["client", "asan_client"])
def test_a_pipe_on_stdin_is_an_interactive_session_frames_both_ways(which, request, tmp_path):
    """stdin as ``i`` frames (at most 64 KiB each), its end as ``c``; the output frames relayed
    byte for byte, the exit code from ``x`` - over the upgraded connection, asked for as the
    Python client asks (same body, /v1/run/attach)."""
    exe = request.getfixturevalue(which)
    env = env_for(tmp_path, ASAN_OPTIONS="detect_leaks=0")
    data = os.urandom(200_000)

    def answer(d):
        got = b"".join(p for k, p in d.frames if k == b"i")
        return raw_frames((b"o", b"len=%d\n" % len(got)), (b"e", b"err \x00\n"), (b"x", b"9\nthe report\n"))

    d = FakeAttachDaemon(sock_path(env), answer)
    try:
        r = run(exe, ["run", "--", "cat"], env, stdin=None, input=data)
    finally:
        d.close()
    assert r.returncode == 9, r.stderr
    assert r.stdout == b"len=%d\n" % len(data)
    assert r.stderr == b"err \x00\nthe report\n"
    head = d.heads[0].decode().lower()
    assert head.startswith("post /v1/run/attach ") and "upgrade: agentvm-frames/1" in head
    assert "connection: upgrade" in head
    assert d.bodies[0] == json.loads('{"command":["cat"],' + fastrun._NO_OPTIONS + "}")
    ins = [p for k, p in d.frames if k == b"i"]
    assert b"".join(ins) == data and max(len(p) for p in ins) <= 65536
    assert d.frames[-1] == (b"c", b""), "stdin's end is sent"


def test_a_signal_to_the_client_is_forwarded_as_a_frame(client, tmp_path):
    env = env_for(tmp_path)
    d = FakeAttachDaemon(sock_path(env), raw_frames((b"x", b"130\n")))
    try:
        p = subprocess.Popen([str(client), "run", "--", "sleep", "100"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not d.heads and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        p.send_signal(2)
        assert d.got_end.wait(10), "no frame for the signal"
        assert p.wait(timeout=10) == 130
        p.stdin.close()
        p.stdout.close()
        p.stderr.close()
    finally:
        d.close()
    assert (b"s", b"INT") in d.frames


@pytest.mark.parametrize("body", [b"o99999999999\n", b"z3\nabc", b"o5\nab"])
def test_a_hostile_session_answer_is_an_error_not_a_crash(asan_client, tmp_path, body):
    env = env_for(tmp_path, ASAN_OPTIONS="detect_leaks=0")
    d = FakeAttachDaemon(sock_path(env), body)
    try:
        r = run(asan_client, ["run", "--", "cat"], env, stdin=None, input=b"x")
    finally:
        d.close()
    assert r.returncode == 125, r.stderr
    assert b"without a result" in r.stderr and b"AddressSanitizer" not in r.stderr


# ---------------------------------------------------------------- the terminal output filter
from tests.unit.test_termfilter import CLIP, TABLE  # noqa: E402 (one table for both machines)


@pytest.fixture(scope="module")
def termfilter_driver(build_dir):
    """The client's filter (tf_feed) alone, with ASan/UBSan: stdin whole, split at every byte
    boundary and a byte at a time must agree (else exit 3); the answer on stdout."""
    return _build(build_dir, "termfilter-test", "-DAGENTVM_TERMFILTER_TEST", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=all")


@pytest.mark.parametrize("data,want", TABLE)
def test_the_c_filter_gives_the_python_filters_answer_split_anywhere(termfilter_driver, data, want):
    r = subprocess.run([str(termfilter_driver)], input=data, capture_output=True, timeout=30,
                       env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == want


def test_the_c_filter_drops_a_sequence_past_its_bound(termfilter_driver):
    data = b"\x1b]52;c;" + b"A" * 5000 + b"\x07tail" + b"\x1bP" + b"x" * 5000
    r = subprocess.run([str(termfilter_driver)], input=data, capture_output=True, timeout=60,
                       env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert r.returncode == 0, r.stderr
    assert b"\x1b" not in r.stdout and b"52;c" not in r.stdout and r.stdout.endswith(b"\x07tail")


def _on_ptys(client, args, env, stdin=subprocess.DEVNULL, input_=None):
    """Run the client with stdout and stderr on two terminals (raw: no newline translation);
    what each terminal received."""
    import pty
    import tty

    got = []
    masters, slaves = [], []
    for _ in range(2):
        m, s = pty.openpty()
        tty.setraw(s)
        masters.append(m)
        slaves.append(s)
    p = subprocess.Popen([str(client), *args], env=env, stdin=stdin, stdout=slaves[0], stderr=slaves[1])
    for s in slaves:
        os.close(s)
    if input_ is not None:
        p.stdin.write(input_)
        p.stdin.close()
    rc = p.wait(timeout=30)
    for m in masters:
        data = b""
        while True:
            try:
                chunk = os.read(m, 65536)
            except OSError:  # EIO: every slave closed
                break
            if not chunk:
                break
            data += chunk
        os.close(m)
        got.append(data)
    return rc, got[0], got[1]


SANDBOX_OUT = (b"a" + CLIP + b"\x1b[31mred\x1b[0m" + b"\x1b[6n" + b"\x1b]0;pwned\x07" + b"\xc2\x9b6n"
               + b"\x1bP$qm\x1b\\" + b"b\n")
SHOWN = b"a\x1b[31mred\x1b[0m6nb\n"


@pytest.mark.parametrize("raw", [False, True])
def test_a_terminal_gets_the_sandbox_output_filtered_unless_raw_output(client, tmp_path, raw):
    env = env_for(tmp_path, **({"AGENTVM_RAW_OUTPUT": "1"} if raw else {}))
    # split across chunks of 5 bytes: the sequences arrive cut in pieces
    answer = frames((b"o", SANDBOX_OUT[:9]), (b"o", SANDBOX_OUT[9:]), (b"e", b"err\x1b[5n\x1b]52;c;QQ==\x1b"),
                    (b"x", b"3\nagentvm: the report\n"), cut=5)
    d = FakeDaemon(sock_path(env), answer)
    try:
        rc, out, err = _on_ptys(client, ["run", "--", "x"], env)
    finally:
        d.close()
    assert rc == 3
    if raw:
        assert out == SANDBOX_OUT
        assert err == b"err\x1b[5n\x1b]52;c;QQ==\x1bagentvm: the report\n"
    else:
        assert out == SHOWN
        # what the sandbox left incomplete does not swallow the report
        assert err == b"erragentvm: the report\n"


def test_a_pipe_gets_the_exact_bytes_even_with_a_terminal_on_stderr(client, tmp_path):
    env = env_for(tmp_path)
    d = FakeDaemon(sock_path(env), frames((b"o", SANDBOX_OUT), (b"e", SANDBOX_OUT), (b"x", b"0\n")))
    try:
        r = run(client, ["run", "--", "x"], env)
    finally:
        d.close()
    assert r.returncode == 0 and r.stdout == SANDBOX_OUT and r.stderr == SANDBOX_OUT


def test_an_interactive_session_on_a_terminal_is_filtered_too(client, tmp_path):
    env = env_for(tmp_path)
    d = FakeAttachDaemon(sock_path(env), raw_frames((b"o", SANDBOX_OUT), (b"e", b"e\x1b[c\n"), (b"x", b"0\n")))
    try:
        rc, out, err = _on_ptys(client, ["run", "--", "cat"], env, stdin=subprocess.PIPE, input_=b"in")
    finally:
        d.close()
    assert rc == 0 and out == SHOWN and err == b"e\n"


def test_the_c_and_python_filters_agree_on_random_sequences(termfilter_driver):
    """A differential check beyond the table: random strings over the bytes the machines care
    about (a fixed seed: the same cases every run), each split everywhere by the driver."""
    import random

    from agentvm.termfilter import TermFilter

    rnd = random.Random(20261128)
    alphabet = [b"\x1b", b"[", b"]", b"P", b"\\", b"\x07", b"6", b"n", b"c", b"5", b"2", b";", b"?", b"$", b"q",
                b"m", b"0", b"1", b"t", b"\xc2", b"\x9b", b"\x18", b"\n", b"a", b">", b"\x05", b" ", b"8", b"Z",
                b"_", b"(", b"x", b"\x7f", b"\xe2", b"\xe0", b"\xf0", b"\xc0", b"\x80", b"\xa0"]
    for _ in range(60):
        data = b"".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 80)))
        f = TermFilter()
        want = f.feed(data) + f.finish()
        r = subprocess.run([str(termfilter_driver)], input=data, capture_output=True, timeout=30,
                           env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
        assert r.returncode == 0, (data, r.stderr)
        assert r.stdout == want, data

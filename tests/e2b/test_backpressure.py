"""Back-pressure on a process's output through the daemon-served E2B API (security review:
one tenant grew the root daemon's memory by ~180 MB/s with a `yes` whose stream it never read).

Each test speaks the Connect protocol on a raw socket with a small receive buffer, as the
reproduction did, so that "not reading" really stops reading. The daemon runs with
AGENTVM_E2B_SUBSCRIBER_LAG=15: a client that reads nothing for 15 s is dropped.

* a client that does not read for 10 s: the daemon's RSS grows < 64 MiB, the command is held
  (not buffered), and once the client reads, the output goes on from where it was - `seq`'s
  numbers with none missing (a process and a terminal);
* a slow reader: every number, in order, and the RSS bounded;
* a client that does not read for longer than the lag: its stream ends with a clear error
  (resource_exhausted, "dropped"), everything before it was intact, the process keeps running
  (Connect follows it again), and the RSS stays bounded.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import struct
import time
import urllib.request

import pytest

from tests.e2b.conftest import _cleanup, _free_port, daemon_up
from tests.helpers import needs_root

integration = pytest.mark.integration

LAG = 15  # AGENTVM_E2B_SUBSCRIBER_LAG of this module's daemon
MiB = 1024 * 1024
SEQ = ["/bin/sh", "-c", "exec seq 1 1000000000000"]
YES = ["/bin/sh", "-c", "exec yes " + "A" * 100]


@pytest.fixture(scope="module")
def server(avm_home):
    if os.geteuid() != 0:
        pytest.skip("the daemon's sandboxes need root here")
    port = _free_port()
    old = os.environ.get("AGENTVM_E2B_SUBSCRIBER_LAG")
    os.environ["AGENTVM_E2B_SUBSCRIBER_LAG"] = str(LAG)  # the daemon `up` starts inherits it
    try:
        env = daemon_up(port)
    finally:
        if old is None:
            os.environ.pop("AGENTVM_E2B_SUBSCRIBER_LAG", None)
        else:
            os.environ["AGENTVM_E2B_SUBSCRIBER_LAG"] = old
    try:
        yield {"env": env, "home": avm_home, "pid": int((avm_home / "run" / "daemon.pid").read_text()),
               "uid_base": os.environ.get("AGENTVM_UID_BASE")}
    finally:
        _cleanup(avm_home)


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _rest(env, method, path, body=None):
    req = urllib.request.Request(env["E2B_API_URL"] + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"X-API-Key": env["E2B_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


@pytest.fixture
def box(server):
    doc = _rest(server["env"], "POST", "/sandboxes", {"templateID": "base", "timeout": 300})
    try:
        yield {**server, "sid": doc["sandboxID"], "token": doc["envdAccessToken"]}
    finally:
        _rest(server["env"], "DELETE", f"/sandboxes/{doc['sandboxID']}")


class Stream:
    """One server-streaming Connect call (connect+json) on a raw socket: the test decides when
    it reads (a 4 KiB receive buffer: not reading fills it quickly)."""

    def __init__(self, box, method: str, msg: dict):
        host, port = box["env"]["E2B_API_URL"].split("//")[1].split(":")
        body = json.dumps(msg).encode()
        body = b"\x00" + struct.pack(">I", len(body)) + body
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(60)
        self.sock.connect((host, int(port)))
        self.sock.sendall(
            f"POST /process.Process/{method} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n"
            f"E2b-Sandbox-Id: {box['sid']}\r\nX-Access-Token: {box['token']}\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode() + body)
        self.raw = b""  # bytes received, not yet de-chunked
        self.body = b""  # de-chunked, not yet parsed into envelopes
        self.headers_done = False
        self.eof = False

    def _recv(self, n: int = 65536) -> None:
        data = self.sock.recv(n)
        if not data:
            self.eof = True
        self.raw += data
        if not self.headers_done and b"\r\n\r\n" in self.raw:
            head, _, self.raw = self.raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            self.headers_done = True
        while self.headers_done:
            line, sep, rest = self.raw.partition(b"\r\n")
            if not sep:
                return
            size = int(line, 16)
            if len(rest) < size + 2:
                return
            self.body += rest[:size]
            self.raw = rest[size + 2:]
            if size == 0:
                self.eof = True
                return

    def next(self, recv: int = 65536) -> dict:
        """The next message (``{"end_stream": ...}`` for the last one)."""
        while True:
            if len(self.body) >= 5:
                flags, size = self.body[0], struct.unpack(">I", self.body[1:5])[0]
                if len(self.body) >= 5 + size:
                    doc = json.loads(self.body[5:5 + size])
                    self.body = self.body[5 + size:]
                    return {"end_stream": doc} if flags & 2 else doc
            if self.eof:
                raise AssertionError("the stream ended without its end message")
            self._recv(recv)

    def close(self) -> None:
        self.sock.close()


class Numbers:
    """`seq`'s output as it arrives: every number must be the one after the last."""

    def __init__(self):
        self.last, self.partial, self.bytes = 0, b"", 0

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        lines = (self.partial + data.replace(b"\r", b"")).split(b"\n")  # a terminal writes \r\n
        self.partial = lines.pop()
        for line in lines:
            n = int(line)
            assert n == self.last + 1, f"after {self.last} came {n}: output was lost"
            self.last = n


def _data(msg: dict) -> bytes | None:
    data = msg.get("event", {}).get("data")
    if not data:
        return None
    (kind, b64), = data.items()
    assert kind in ("stdout", "pty"), msg
    return base64.b64decode(b64)


def _start(box, argv, pty: bool) -> tuple[Stream, int]:
    msg = {"process": {"cmd": argv[0], "args": argv[1:]}}
    if pty:
        msg["pty"] = {"size": {"rows": 24, "cols": 80}}
    s = Stream(box, "Start", msg)
    first = s.next(recv=4096)
    pid = first["event"]["start"]["pid"]
    return s, int(pid)


def _read(s: Stream, nums: Numbers | None, *, seconds: float = 0, nbytes: int = 0, pause: float = 0.0) -> None:
    """Read data messages for ``seconds`` or until ``nbytes``; ``pause`` between reads: a slow reader."""
    t0 = time.monotonic()
    got = 0
    while (seconds and time.monotonic() - t0 < seconds) or (nbytes and got < nbytes):
        msg = s.next()
        assert "end_stream" not in msg and "end" not in msg.get("event", {}), f"the stream ended: {msg}"
        data = _data(msg)
        if data:
            got += len(data)
            if nums is not None:
                nums.feed(data)
        if pause:
            time.sleep(pause)


def _not_reading(pid: int, seconds: float) -> int:
    """The daemon's RSS growth (bytes, the largest seen) while nobody reads for ``seconds``."""
    base = _rss(pid)
    peak = base
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(1)
        peak = max(peak, _rss(pid))
    return peak - base


@integration
@needs_root
@pytest.mark.parametrize("pty", [False, True], ids=["process", "pty"])
def test_a_client_that_does_not_read_holds_the_command_not_the_daemons_memory(box, pty):
    s, _ = _start(box, SEQ, pty)
    try:
        grew = _not_reading(box["pid"], 10)
        assert grew < 64 * MiB, f"the daemon's RSS grew {grew / MiB:.1f} MiB in 10 s of unread output"
        # then it reads: every number from 1, in order - the command waited, nothing was dropped
        nums = Numbers()
        _read(s, nums, nbytes=8 * MiB)
        assert nums.last > 100_000
    finally:
        s.close()


@integration
@needs_root
@pytest.mark.parametrize("pty", [False, True], ids=["process", "pty"])
def test_a_slow_reader_gets_every_byte_in_order(box, pty):
    s, _ = _start(box, SEQ, pty)
    try:
        base = _rss(box["pid"])
        nums = Numbers()
        _read(s, nums, seconds=8, pause=0.02)  # ~50 reads/s: far slower than seq writes
        grew = _rss(box["pid"]) - base
        assert nums.last > 1000
        assert grew < 64 * MiB, f"the daemon's RSS grew {grew / MiB:.1f} MiB for a slow reader"
    finally:
        s.close()


@integration
@needs_root
@pytest.mark.parametrize("pty", [False, True], ids=["process", "pty"])
def test_a_client_that_never_reads_is_dropped_with_a_clear_end(box, pty):
    s, pid = _start(box, YES if not pty else SEQ, pty)
    try:
        grew = _not_reading(box["pid"], LAG + 7)
        assert grew < 64 * MiB, f"the daemon's RSS grew {grew / MiB:.1f} MiB in {LAG + 7} s of unread output"
        # what was already on its way arrives intact, then the stream ends with the reason
        nums = Numbers() if pty else None
        end = None
        for _ in range(100_000):
            msg = s.next()
            if "end_stream" in msg:
                end = msg["end_stream"]
                break
            data = _data(msg)
            if data and nums is not None:
                nums.feed(data)
            elif data:
                assert set(data.split(b"\n")[:-1]) <= {b"A" * 100}, data[:200]
        assert end is not None and "error" in end, end
        assert end["error"]["code"] == "resource_exhausted", end
        assert "dropped" in end["error"]["message"] and "connect" in end["error"]["message"], end
        s.close()
        # the process kept running: Connect follows it again, and its output still flows
        c = Stream(box, "Connect", {"process": {"pid": pid}})
        try:
            assert c.next()["event"]["start"]["pid"] == pid
            got = b""
            while len(got) < 256 * 1024:
                msg = c.next()
                assert "end_stream" not in msg, msg
                got += _data(msg) or b""
            if pty:
                nums2 = [int(x) for x in got.replace(b"\r", b"").split(b"\n")[1:-1]]
                assert nums2 == list(range(nums2[0], nums2[0] + len(nums2)))  # in order, none lost
                assert nums2[0] > nums.last  # later output: the process went on without the dropped client
            else:
                assert set(got.split(b"\n")[1:-1]) == {b"A" * 100}
        finally:
            c.close()
    finally:
        s.close()


@integration
@needs_root
def test_killing_the_sandbox_ends_the_unread_stream_and_keeps_the_memory(server):
    """A sandbox killed under an unread stream: the stream ends, the daemon's memory did not grow."""
    doc = _rest(server["env"], "POST", "/sandboxes", {"templateID": "base", "timeout": 300})
    b = {**server, "sid": doc["sandboxID"], "token": doc["envdAccessToken"]}
    base = _rss(server["pid"])
    s, _ = _start(b, YES, False)
    try:
        time.sleep(3)
        _rest(server["env"], "DELETE", f"/sandboxes/{doc['sandboxID']}")
        s.sock.settimeout(30)
        for _ in range(100_000):  # reads what was on its way, then the end
            msg = s.next()
            if "end_stream" in msg or "end" in msg.get("event", {}):
                break
        else:
            raise AssertionError("the stream did not end after the kill")
        grew = _rss(server["pid"]) - base
        assert grew < 64 * MiB, f"the daemon's RSS grew {grew / MiB:.1f} MiB"
    finally:
        s.close()


@integration
@needs_root
def test_agentvm_e2b_serve_holds_the_command_too(fresh_home, server):
    """`agentvm e2b serve` (DaemonBackend, its own process over the daemon's HTTP API): an unread
    stream holds the command, not the memory of the adapter's process or of the daemon."""
    from tests.e2b.conftest import served_beside

    if os.environ["AGENTVM_UID_BASE"] == str(server.get("uid_base")):
        os.environ["AGENTVM_UID_BASE"] = str(int(os.environ["AGENTVM_UID_BASE"]) + 100_000)
    with served_beside(fresh_home) as srv:
        env = srv["env"]
        doc = _rest(env, "POST", "/sandboxes", {"templateID": "base", "timeout": 300})
        b = {"env": env, "sid": doc["sandboxID"], "token": doc["envdAccessToken"]}
        daemon = int((fresh_home / "run" / "daemon.pid").read_text())
        s, _ = _start(b, SEQ, False)
        try:
            d0 = _rss(daemon)
            grew = _not_reading(srv["proc"].pid, 10)
            assert grew < 64 * MiB, f"`agentvm e2b serve`'s RSS grew {grew / MiB:.1f} MiB in 10 s of unread output"
            assert _rss(daemon) - d0 < 64 * MiB
            nums = Numbers()
            _read(s, nums, nbytes=8 * MiB)
            assert nums.last > 100_000
        finally:
            s.close()
            _rest(env, "DELETE", f"/sandboxes/{doc['sandboxID']}")


# -- the channel itself (no sandbox) ------------------------------------------------------------

def test_channel_put_waits_for_room_and_close_releases_a_waiting_producer():
    import asyncio

    from agentvm.e2b.backend import EventChannel

    async def go():
        ch = EventChannel(2)
        assert await ch.put("a") and await ch.put("b")
        assert not await ch.put("c", timeout=0.01)  # full: not queued, the caller decides (envd drops)
        waiting = asyncio.ensure_future(ch.put("c"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and len(ch) == 2  # back-pressure: waits, holds nothing more
        assert await ch.get() == "a"
        assert await waiting is True and len(ch) == 2
        blocked = asyncio.ensure_future(ch.put("d"))
        for _ in range(5):
            await asyncio.sleep(0)
        ch.close()  # the consumer is gone: what it held is released, the producer goes on
        assert await blocked is False and len(ch) == 0
        assert await ch.put("e") is False and len(ch) == 0
        assert await ch.get() is EventChannel.END

    asyncio.run(go())


def test_channel_finish_and_drop_always_fit_and_end_in_order():
    import asyncio

    from agentvm.e2b.backend import EventChannel, ExecEvent

    async def go():
        ch = EventChannel(1)
        await ch.put(ExecEvent("stdout", b"1"))
        ch.finish(ExecEvent("exit", exit_code=3))  # full, and the end still fits (never waits)
        got = [ev async for ev in ch.events()]
        assert [e.kind for e in got] == ["stdout", "exit"] and got[1].exit_code == 3
        ch = EventChannel(1)
        await ch.put("queued")
        ch.drop("dropped")  # what was queued is released; the reason is next, then the end
        assert await ch.get() == "dropped" and await ch.get() is EventChannel.END

    asyncio.run(go())

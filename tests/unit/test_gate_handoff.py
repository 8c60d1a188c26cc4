"""The bridge's hand-off at the gate (agentvm.gate.server, HANDOFF_PREFIX), in-process: a real
Gate on a unix socket, real sockets handed over with SCM_RIGHTS from this test (standing in for
a sandbox's bridge, which holds the endpoint's key). Only a hello with the endpoint's key makes a
channel; on a channel only one connected TCP socket per message is served; the rest is refused
and logged. The same from inside a real sandbox (where the agent has no key):
tests/integration/test_gate_e2e.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

from agentvm.gate.policy import compile_egress
from agentvm.gate.server import HANDOFF_ACK, HANDOFF_CHANNELS, HANDOFF_PREFIX, Gate
from tests.unit.test_gate_server import Upstream, req

KEY = "0123456789abcdef0123456789abcdef"  # an obviously fake test key


def hello(key: str = KEY) -> bytes:
    return HANDOFF_PREFIX + key.encode() + b"\r\n\r\n"


async def _gate(tmp: Path, key: str = KEY):
    up = Upstream()
    await up.start()
    eg = compile_egress(None, extra_allow=[f"up.test:{up.port}"], extra_hosts={"up.test": "127.0.0.1"})
    gate = Gate(tmp / "gate", tmp / "logs")
    ep = await gate.open_endpoint("sbx-h", "agent", eg, tmp / "h.sock", bridge_key=key)
    return gate, ep, up


def _records(tmp: Path) -> list[dict]:
    p = tmp / "logs" / "sbx-h.egress.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


async def _channel(path: Path, greeting: bytes) -> tuple[socket.socket, bytes]:
    """Connect, greet; -> (the socket, what the gate answered: the ACK, or b"" when it closed)."""
    loop = asyncio.get_running_loop()
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.setblocking(False)
    await loop.sock_connect(c, str(path))
    await loop.sock_sendall(c, greeting)
    try:
        got = await asyncio.wait_for(loop.sock_recv(c, 16), 5)
    except ConnectionError:
        got = b""
    return c, got


async def _closed(c: socket.socket) -> bool:
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(c, 1), 5) == b""
    except ConnectionError:
        return True


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    cl = socket.create_connection(ls.getsockname())
    sv, _ = ls.accept()
    ls.close()
    return cl, sv


async def _ask(cl: socket.socket, data: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    cl.setblocking(False)
    await loop.sock_sendall(cl, data)
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = await asyncio.wait_for(loop.sock_recv(cl, 65536), 5)
        if not chunk:
            break
        out += chunk
    return out


def test_a_connection_handed_over_with_the_key_is_served_by_policy(tmp_path):
    async def main():
        gate, ep, up = await _gate(tmp_path)
        chan, ack = await _channel(ep.sock_path, hello())
        assert ack == HANDOFF_ACK
        cl, sv = _tcp_pair()
        socket.send_fds(chan, [b"C"], [sv.fileno()])
        sv.close()
        ok = await _ask(cl, req(up.port, path="/handed"))
        assert ok.startswith(b"HTTP/1.1 200"), ok
        cl2, sv2 = _tcp_pair()
        socket.send_fds(chan, [b"C"], [sv2.fileno()])
        sv2.close()
        denied = await _ask(cl2, req(80, host="denied.test"))
        assert denied.startswith(b"HTTP/1.1 403") and b"default-deny" in denied, denied
        assert b"/handed" in up.received and b"denied.test" not in up.received
        for s in (cl, cl2):
            s.close()
        # the endpoint closing ends its channels
        await gate.close_endpoint("sbx-h")
        assert await _closed(chan)
        chan.close()
        return _records(tmp_path)

    recs = asyncio.run(asyncio.wait_for(main(), 60))
    assert any(r.get("host") == "denied.test" and r["rule"] == "default-deny" for r in recs), recs
    assert not any(r["rule"] == "handoff:refused" for r in recs), recs


def test_a_hello_without_the_key_is_refused_and_alerted(tmp_path):
    async def main():
        gate, ep, up = await _gate(tmp_path)
        got = {}
        for name, greeting in (("none", HANDOFF_PREFIX + b"\r\n\r\n"), ("wrong", hello("f" * 32)),
                               ("short", hello(KEY[:31])), ("v1", b"\x00agentvm-bridge-handoff/1\r\n\r\n"),
                               ("eager", hello() + req(up.port))):
            c, ack = await _channel(ep.sock_path, greeting)
            got[name] = ack
            c.close()
        await gate.close_endpoint("sbx-h")
        return got, _records(tmp_path)

    got, recs = asyncio.run(asyncio.wait_for(main(), 60))
    # no acknowledgement: no channel (the v1 hello is a refused head, answered 400)
    assert got["none"] == got["wrong"] == got["short"] == got["eager"] == b"", got
    assert got["v1"].startswith(b"HTTP/1.1 400"), got
    refused = [r for r in recs if r["rule"] == "handoff:refused"]
    assert len(refused) == 4 and all(r.get("alert") == "security" for r in refused), recs


def test_an_endpoint_without_a_key_takes_no_hand_off(tmp_path):
    async def main():
        gate, ep, _up = await _gate(tmp_path, key="")
        c, ack = await _channel(ep.sock_path, hello())
        c.close()
        await gate.close_endpoint("sbx-h")
        return ack, _records(tmp_path)

    ack, recs = asyncio.run(asyncio.wait_for(main(), 60))
    assert ack == b""
    assert [r["rule"] for r in recs] == ["handoff:refused"], recs


def test_anything_but_one_connected_tcp_socket_ends_the_channel(tmp_path):
    async def main():
        gate, ep, up = await _gate(tmp_path)
        keep = []
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        a, b = socket.socketpair()
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        f = os.open("/dev/null", os.O_RDONLY)
        c1, s1 = _tcp_pair()
        c2, s2 = _tcp_pair()
        keep += [ls, a, b, u, c1, s1, c2, s2]
        cases = {"file": ([f], b"C"), "udp": ([u.fileno()], b"C"), "listening": ([ls.fileno()], b"C"),
                 "unix": ([a.fileno()], b"C"), "two": ([s1.fileno(), s2.fileno()], b"C"),
                 "byte": ([s1.fileno()], b"X"), "none": ([], b"C")}
        ended = {}
        for name, (fds, byte) in cases.items():
            chan, ack = await _channel(ep.sock_path, hello())
            assert ack == HANDOFF_ACK, name
            socket.send_fds(chan, [byte], fds)
            ended[name] = await _closed(chan)
            chan.close()
        # still serving: a good hand-off on a new channel
        chan, ack = await _channel(ep.sock_path, hello())
        cl, sv = _tcp_pair()
        socket.send_fds(chan, [b"C"], [sv.fileno()])
        sv.close()
        ok = await _ask(cl, req(up.port, path="/after"))
        cl.close()
        chan.close()
        os.close(f)
        for s in keep:
            s.close()
        await gate.close_endpoint("sbx-h")
        return ended, ok, _records(tmp_path)

    ended, ok, recs = asyncio.run(asyncio.wait_for(main(), 60))
    assert ended == {k: True for k in ended} and len(ended) == 7, ended
    assert ok.startswith(b"HTTP/1.1 200"), ok
    assert len([r for r in recs if r["rule"] == "handoff:refused"]) == 7, recs


def test_an_endpoint_keeps_a_bounded_number_of_channels(tmp_path):
    async def main():
        gate, ep, _up = await _gate(tmp_path)
        acks = []
        socks = []
        for _ in range(HANDOFF_CHANNELS + 2):
            c, ack = await _channel(ep.sock_path, hello())
            acks.append(ack)
            socks.append(c)
        for c in socks:
            c.close()
        await gate.close_endpoint("sbx-h")
        return acks

    acks = asyncio.run(asyncio.wait_for(main(), 60))
    assert acks == [HANDOFF_ACK] * HANDOFF_CHANNELS + [b""] * 2, acks



def test_a_flood_of_refused_hellos_is_counted_not_logged_one_by_one(tmp_path):
    """Alerts have a rate limit of their own (review 6): an agent sending refused hellos by the
    thousand gets ALERT_LOG_BURST of them logged, the rest counted in summary records that are
    alerts too - nothing lost, the log (and the daemon's audit chain) bounded."""
    from agentvm.gate.endpoint import ALERT_LOG_BURST

    n = 400

    async def main():
        gate, ep, _up = await _gate(tmp_path)
        for _ in range(n):
            c, _ack = await _channel(ep.sock_path, hello("e" * 32))
            c.close()
        alerts = ep.alerts
        await gate.close_endpoint("sbx-h")
        return alerts, _records(tmp_path)

    alerts, recs = asyncio.run(asyncio.wait_for(main(), 120))
    assert alerts == n
    one_by_one = [r for r in recs if r["rule"] == "handoff:refused"]
    summaries = [r for r in recs if r["rule"] == "log:suppressed"]
    assert ALERT_LOG_BURST <= len(one_by_one) < n // 2, len(one_by_one)
    assert summaries and all(r.get("alert") == "security" for r in summaries), summaries
    assert len(one_by_one) + sum(r["suppressed"] for r in summaries) == n


def test_a_flood_of_one_alert_does_not_hide_another(tmp_path):
    """Review 7: with the alert bucket drained by refused hellos, a different alert (here a
    credential leak's, logged as the gate logs it) is still written - the first of each
    (rule, target) always is - and the flood's summary follows with the next relayed record."""

    async def main():
        gate, ep, up = await _gate(tmp_path)
        for _ in range(300):
            c, _ack = await _channel(ep.sock_path, hello("e" * 32))
            c.close()
        ep.log(verdict="deny", rule_id="credential:leak:k.test", reason="a placeholder sent to a host it is not "
               "bound to", host="evil.test", port=443, phase="request", alert="security")
        ep.log_relayed("allow:up", "allowed", "up.test", up.port, "GET", "/", 10, 10, 100)
        ep.flush_log()
        recs = _records(tmp_path)
        await gate.close_endpoint("sbx-h")
        return recs

    recs = asyncio.run(asyncio.wait_for(main(), 120))
    assert [r for r in recs if r["rule"] == "credential:leak:k.test" and r.get("alert") == "security"], recs
    summaries = [r for r in recs if r["rule"] == "log:suppressed" and r.get("alert")]
    assert summaries and sum(r["suppressed"] for r in summaries) > 0, recs

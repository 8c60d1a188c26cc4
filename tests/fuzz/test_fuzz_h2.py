"""Fuzzing the gate's HTTP/2 side (gate/h2relay.py through ``h2``): a sandbox's connection made
of frames an h2 client writes - heads with missing, repeated or forged pseudo-headers, bodies,
resets, settings, pings, window updates - sometimes corrupted byte by byte, fed to a real
H2Bridge in arbitrary pieces. The bridge must end cleanly (a GOAWAY, a 4xx on a stream, a
reset): no exception out of it, no request upstream for a stream the policy denies."""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from pathlib import Path

import h2.config
import h2.connection
from hypothesis import given, strategies as st

from agentvm.gate import exchange as ex
from agentvm.gate.endpoint import Endpoint
from agentvm.gate.h2relay import H2Bridge
from agentvm.gate.policy import compile_egress
from agentvm.gate.server import Gate
from tests.fuzz.grammar import FUZZ, splits

PSEUDO = st.sampled_from([b":method", b":path", b":authority", b":scheme", b":status", b":protocol", b":x"])
REGULAR = st.sampled_from([b"content-length", b"te", b"connection", b"host", b"x-api-key", b"transfer-encoding",
                           b"upgrade", b"cookie", b"X-Upper"])


@st.composite
def head(draw):
    if draw(st.integers(0, 9)) < 6:  # mostly well-formed: the paths past the head get reached
        return [(b":method", draw(st.sampled_from([b"GET", b"POST"]))), (b":scheme", b"https"),
                (b":authority", draw(st.sampled_from([b"api.test", b"other.test"]))),
                (b":path", draw(st.sampled_from([b"/", b"/x?y=1"])))] + \
            draw(st.lists(st.tuples(st.sampled_from([b"x-api-key", b"accept", b"content-length"]),
                                    st.sampled_from([b"1", b"0", b"abc", b"5"])), max_size=2))
    base = [(b":method", draw(st.sampled_from([b"GET", b"POST", b"CONNECT", b"", b"G ET"]))),
            (b":scheme", draw(st.sampled_from([b"https", b"http", b""]))),
            (b":authority", draw(st.sampled_from([b"api.test", b"api.test:443", b"other.test", b"", b"api.test:99999"]))),
            (b":path", draw(st.sampled_from([b"/", b"/x?y=1", b"", b"*", b"//a"])))]
    base = draw(st.permutations(base))
    base = base[: draw(st.integers(0, len(base)))] if draw(st.integers(0, 5)) == 0 else base
    extra = draw(st.lists(st.tuples(st.one_of(PSEUDO, REGULAR), st.binary(max_size=12)), max_size=4))
    return base + extra


@st.composite
def connection_bytes(draw) -> bytes:
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None,
                                                             validate_outbound_headers=False,
                                                             normalize_outbound_headers=False))
    c.initiate_connection()
    sid = 1
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["req", "req", "data", "reset", "ping", "settings", "window"]))
        try:
            if op == "req":
                c.send_headers(sid, draw(head()), end_stream=draw(st.booleans()))
                sid += 2
            elif op == "data" and sid > 1:
                c.send_data(sid - 2, draw(st.binary(max_size=50)), end_stream=draw(st.booleans()))
            elif op == "reset" and sid > 1:
                c.reset_stream(sid - 2)
            elif op == "ping":
                c.ping(draw(st.binary(min_size=8, max_size=8)))
            elif op == "settings":
                c.update_settings({draw(st.integers(1, 6)): draw(st.integers(0, 2**31 - 1))})
            elif op == "window":
                c.increment_flow_control_window(draw(st.integers(1, 2**31 - 1)))
        except Exception:  # noqa: BLE001 - (the client refused to write it: next op)
            pass
    data = c.data_to_send()
    if draw(st.integers(0, 3)) == 0 and len(data) > 24:
        i = draw(st.integers(24, len(data) - 1))  # (past the preface: a corrupted frame, not a wrong protocol)
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    return data


class _Side:
    """One side of the bridge: reads the given pieces, then waits for ``until`` and ends."""

    def __init__(self, pieces, until: asyncio.Event | None = None):
        self.pieces, self.until, self.out = list(pieces), until, bytearray()
        self.done = asyncio.Event()

    async def read(self, n: int = 65536) -> bytes:
        if self.pieces:
            return self.pieces.pop(0)
        self.done.set()
        if self.until is not None:
            await self.until.wait()
        return b""

    async def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        pass


_DIR = Path(tempfile.mkdtemp(prefix="agentvm-test-fuzz-h2-"))
atexit.register(shutil.rmtree, _DIR, True)
_GATE = Gate(_DIR / "state", _DIR / "logs")


@FUZZ
@given(data=connection_bytes(), parts=st.data())
def test_h2_connections(data, parts):
    pieces = parts.draw(splits(data))
    policy = compile_egress(None, extra_allow=["api.test:443"], extra_hosts={"api.test": "127.0.0.1"})

    async def main():
        ep = Endpoint(_GATE, "sb-fuzz", "fuzz", policy, _DIR / "sb.sock", _DIR / "logs" / "sb-fuzz.egress.jsonl")
        client = _Side(pieces)
        upstream = _Side([], until=client.done)
        bridge = H2Bridge(ep, client, upstream, ex.Tunnel("api.test", 443, "127.0.0.1", "api.test"))
        try:
            await asyncio.wait_for(bridge.run(), 10)
        finally:
            ep.close_log()
        # every stream sent upstream names the tunnel's host: nothing reaches another
        if upstream.out:
            up = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
            up.initiate_connection()
            for ev in up.receive_data(bytes(upstream.out)):
                for k, v in getattr(ev, "headers", None) or []:
                    if k == b":authority":
                        assert v in (b"api.test", b"api.test:443"), v

    asyncio.run(main())

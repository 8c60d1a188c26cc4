"""Gate workers (agentvm.gate.workers) without a sandbox: real worker processes, a real unix
socket handed over, a real upstream on loopback; live changes acknowledged before they return,
records back, a killed worker replaced on the same socket, counters at close."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from pathlib import Path

import pytest

from agentvm.gate.policy import compile_egress
from agentvm.gate.server import run
from agentvm.gate.workers import WorkerPool, unplaceable


class _Up(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t

    def data_received(self, data):
        if b"\r\n\r\n" in data:
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


async def _get(sock: Path, port: int) -> tuple[int, bytes]:
    r, w = await asyncio.open_unix_connection(str(sock))
    w.write(f"GET http://up.test:{port}/x HTTP/1.1\r\nHost: up.test:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    status = int(data.split(b" ", 2)[1])
    return status, data


def _policy(port: int, *, allow: bool = True):
    return compile_egress(None, extra_allow=[f"up.test:{port}"] if allow else [], extra_hosts={"up.test": "127.0.0.1"})


def test_pool_serves_applies_live_changes_and_replaces_a_killed_worker(tmp_path):
    records: list[dict] = []
    events: list[tuple[str, dict]] = []

    async def main():
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(_Up, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        pool = WorkerPool(2, tmp_path / "state", tmp_path / "logs", on_record=records.append,
                          on_event=lambda kind, **d: events.append((kind, d)))
        await pool.start()
        try:
            pids = pool.pids()
            assert len(pids) == 2 and os.getpid() not in pids
            a = await pool.open("sb-a", "agent-a", _policy(port), tmp_path / "a.sock", uid=None, creds=None)
            b = await pool.open("sb-b", "agent-b", _policy(port), tmp_path / "b.sock", uid=None, creds=None)
            assert a.worker is not b.worker  # spread: the worker with fewest endpoints takes the next
            assert oct((tmp_path / "a.sock").stat().st_mode & 0o777) == "0o600"
            assert (await _get(tmp_path / "a.sock", port))[0] == 200
            await asyncio.sleep(0.05)
            assert any(r["sandbox"] == "sb-a" and r["verdict"] == "allow" for r in records)
            # a live deny: acknowledged, then in force from the next request
            a.set_policy(_policy(port, allow=False))
            await a.synced()
            status, body = await _get(tmp_path / "a.sock", port)
            assert status == 403 and b"default-deny" in body
            assert (await _get(tmp_path / "b.sock", port))[0] == 200  # the other worker's sandbox untouched
            b.paused = True
            await b.synced()
            assert (await _get(tmp_path / "b.sock", port))[0] == 403
            b.paused = False
            await b.synced()
            # a killed worker: replaced, the same socket handed over, the daemon-side state re-applied
            victim = a.worker
            os.kill(victim.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(victim.lost, 10)
            await pool.replaced(victim)
            assert a.worker is not victim and a.worker.alive and a.worker.proc.pid != victim.proc.pid
            assert [k for k, _ in events] == ["gate.worker-lost", "gate.worker-restarted"]
            assert events[1][1]["sandboxes"] == ["sb-a"] and a.counts_lost and not b.counts_lost
            status, _ = await _get(tmp_path / "a.sock", port)
            assert status == 403, "the replacement must serve the live policy, not the one the endpoint opened with"
            a.set_policy(_policy(port))
            await a.synced()
            assert (await _get(tmp_path / "a.sock", port))[0] == 200
            # close: the worker's counters come back; the socket is gone
            await pool.close(b)
            assert b.allowed == 1 and sum(b.denials.values()) == 1 and not (tmp_path / "b.sock").exists()
        finally:
            await pool.stop()
            srv.close()
        for w in pool.workers:
            assert w.proc.returncode is not None, "a worker outlived the pool"

    run(main())


def test_a_worker_that_cannot_open_an_endpoint_refuses_and_leaves_nothing(tmp_path):
    async def main():
        pool = WorkerPool(1, tmp_path / "state", tmp_path / "logs", on_record=lambda r: None,
                          on_event=lambda kind, **d: None)
        await pool.start()
        try:
            with pytest.raises(Exception, match="gate worker 0"):
                # not an EgressPolicy: the worker's Gate fails to open it, and says so
                await pool.open("sb-x", "x", object(), tmp_path / "x.sock", uid=None, creds=None)
            assert not (tmp_path / "x.sock").exists() and not pool.workers[0].endpoints
            assert pool.workers[0].alive  # one failed call does not cost the worker
        finally:
            await pool.stop()

    run(main())


def test_unplaceable_names_what_only_the_daemon_carries():
    from types import SimpleNamespace

    plain = compile_egress(None, extra_allow=["a.test:443"])
    assert unplaceable(plain) is None
    import dataclasses

    ask = dataclasses.replace(plain, allow=(dataclasses.replace(plain.allow[0], ask=True),))
    assert "action: ask" in unplaceable(ask)
    assert "tools" in unplaceable(plain, SimpleNamespace(tools=SimpleNamespace(servers=("s",)), budget=None))
    assert unplaceable(plain, SimpleNamespace(tools=SimpleNamespace(servers=()), budget=None)) is None
    assert "budget" in unplaceable(plain, SimpleNamespace(tools=None, budget=object()))
    assert "vault" in unplaceable(plain, None, SimpleNamespace())  # credentials with no spec to rebuild from


def test_a_policy_crosses_to_a_worker_without_its_memo():
    from agentvm.gate.policy import decide_request

    pol = compile_egress(None, extra_allow=["a.test:443"])
    want = decide_request(pol, "a.test", 443, "https", "GET", "/", 0, "a.test", False)
    assert want.allowed and pol._decisions
    copy = pickle.loads(pickle.dumps(pol))
    assert copy == pol and copy._decisions == {}
    assert decide_request(copy, "a.test", 443, "https", "GET", "/", 0, "a.test", False) == want


@pytest.mark.parametrize("text,want", [("0", 0), ("2", 2), (" 3 ", 3), ("auto", None)])
def test_gate_workers_option(text, want):
    from agentvm.cli.daemon_cmds import _gate_workers

    got = _gate_workers(text)
    assert got == (want if want is not None else max(1, min(64, len(os.sched_getaffinity(0)))))


@pytest.mark.parametrize("text", ["-1", "65", "many", ""])
def test_gate_workers_option_refuses_with_the_range(text):
    import click

    from agentvm.cli.daemon_cmds import _gate_workers

    if text == "":
        assert _gate_workers(text) == 0
        return
    with pytest.raises(click.BadParameter, match="0 to 64, or auto"):
        _gate_workers(text)

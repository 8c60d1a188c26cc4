"""Gate workers (agentvm.gate.workers) without a sandbox: real worker processes, a real unix
socket handed over, a real upstream on loopback; live changes acknowledged before they return,
records back, a killed worker replaced on the same socket, counters at close."""

from __future__ import annotations

import asyncio
import contextlib
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
        async with _running(tmp_path, 2, events, records) as (pool, port):
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

    # held requests and LLM budgets are served by a worker, which asks the daemon (issue 43)
    ask = dataclasses.replace(plain, allow=(dataclasses.replace(plain.allow[0], ask=True),))
    assert unplaceable(ask) is None
    assert "tools" in unplaceable(plain, SimpleNamespace(tools=SimpleNamespace(servers=("s",)), budget=None))
    # (a pool whose host keeps the tool gateway may take one: not enabled by the daemon yet)
    assert unplaceable(plain, SimpleNamespace(tools=SimpleNamespace(servers=("s",)), run_dir="/r"), tools=True) is None
    assert unplaceable(plain, SimpleNamespace(tools=SimpleNamespace(servers=()), budget=None)) is None
    assert unplaceable(plain, SimpleNamespace(tools=None, budget=object())) is None
    assert "vault" in unplaceable(plain, None, SimpleNamespace())  # credentials with no spec to rebuild from


def test_a_policy_crosses_to_a_worker_without_its_memo():
    from agentvm.gate.policy import decide_request

    pol = compile_egress(None, extra_allow=["a.test:443"])
    want = decide_request(pol, "a.test", 443, "https", "GET", "/", 0, "a.test", False)
    assert want.allowed and pol._decisions
    copy = pickle.loads(pickle.dumps(pol))
    assert copy == pol and copy._decisions == {}
    assert decide_request(copy, "a.test", 443, "https", "GET", "/", 0, "a.test", False) == want


@pytest.mark.parametrize("text,want", [("0", 0), ("2", 2), (" 3 ", 3), ("auto", None), ("agent", "agent"),
                                       ("", "agent")])
def test_gate_workers_option(text, want):
    from agentvm.cli.daemon_cmds import _gate_workers

    got = _gate_workers(text)
    assert got == (want if want is not None else max(1, min(64, len(os.sched_getaffinity(0)))))


@pytest.mark.parametrize("text", ["-1", "1025", "many", ""])
def test_gate_workers_option_refuses_with_the_range(text):
    import click

    from agentvm.cli.daemon_cmds import _gate_workers

    if text == "":
        assert _gate_workers(text) == "agent"  # (the default: one confined worker per running agent)
        return
    with pytest.raises(click.BadParameter, match="0 to 1024, or auto"):
        _gate_workers(text)


@contextlib.asynccontextmanager
async def _running(tmp_path, n, events=None, records=None):
    """A started pool of ``n`` workers and the port of an upstream (_Up) on loopback; both
    stopped after."""
    srv = await asyncio.get_running_loop().create_server(_Up, "127.0.0.1", 0)
    pool = _pool(tmp_path, n, events, records)
    await pool.start()
    try:
        yield pool, srv.sockets[0].getsockname()[1]
    finally:
        await pool.stop()
        srv.close()


async def _flood(pool, tmp_path, port: int, total: int | None = None):
    """Sandbox sb-a on the pool with no rate limit, and a client sending it requests one after
    another on one keep-alive connection (``total``, or until cancelled) -> (its task, [answered])."""
    import dataclasses

    from agentvm.gate.policy import EgressLimits

    unlimited = dataclasses.replace(_policy(port), limits=EgressLimits(requests_per_second=1e9, burst=10**9))
    await pool.open("sb-a", "a", unlimited, tmp_path / "a.sock", uid=None, creds=None)
    r, w = await asyncio.open_unix_connection(str(tmp_path / "a.sock"))
    req = f"GET http://up.test:{port}/x HTTP/1.1\r\nHost: up.test:{port}\r\n\r\n".encode()
    answered = [0]

    async def client():
        try:
            while total is None or answered[0] < total:
                w.write(req)
                await r.readuntil(b"\r\n\r\n")
                await r.readexactly(2)
                answered[0] += 1
        finally:
            w.close()

    return asyncio.ensure_future(client()), answered


def _pool(tmp_path, n, events=None, records=None):
    return WorkerPool(n, tmp_path / "state", tmp_path / "logs",
                      on_record=(records.append if records is not None else lambda r: None),
                      on_event=lambda kind, **d: (events.append((kind, d)) if events is not None else None))


async def _served_as(sock: Path, port: int, records: list, sandbox: str) -> None:
    await asyncio.sleep(0.05)  # (records of earlier requests come in batches: RECORD_DELAY)
    n = len(records)
    await _get(sock, port)
    for _ in range(100):
        if len(records) > n:
            break
        await asyncio.sleep(0.02)
    assert [r["sandbox"] for r in records[n:]] == [sandbox], f"{sock.name} was served as {records[n:]}"


def test_a_call_that_cannot_be_sent_queues_no_socket(tmp_path):
    """(review: an open that failed to pickle left its socket queued, and every later sandbox
    was served on the socket of the one before it)"""
    records: list[dict] = []

    async def main():
        async with _running(tmp_path, 1, records=records) as (pool, port):
            with pytest.raises(Exception):
                await pool.open("sb-a", "a", lambda: None, tmp_path / "a.sock", uid=None, creds=None)
            assert not (tmp_path / "a.sock").exists()
            await pool.open("sb-b", "b", _policy(port), tmp_path / "b.sock", uid=None, creds=None)
            await pool.open("sb-c", "c", _policy(port), tmp_path / "c.sock", uid=None, creds=None)
            await _served_as(tmp_path / "b.sock", port, records, "sb-b")
            await _served_as(tmp_path / "c.sock", port, records, "sb-c")

    run(main())


def test_a_socket_out_of_step_with_its_call_makes_the_worker_exit_not_misserve(tmp_path):
    import socket

    records: list[dict] = []
    events: list = []

    async def main():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stray:
            stray.bind(str(tmp_path / "stray.sock"))
            stray.listen()
            async with _running(tmp_path, 1, events, records) as (pool, port):
                w = pool.workers[0]
                socket.send_fds(w._fd_sock, [b"999999"], [stray.fileno()])  # queued for no call
                with pytest.raises(Exception, match="gate worker 0"):
                    await pool.open("sb-b", "b", _policy(port), tmp_path / "b.sock", uid=None, creds=None)
                assert not (tmp_path / "b.sock").exists()
                await pool.replaced(w)
                assert "gate.worker-lost" in [k for k, _ in events] and pool.workers[0].alive
                await pool.open("sb-c", "c", _policy(port), tmp_path / "c.sock", uid=None, creds=None)
                await _served_as(tmp_path / "c.sock", port, records, "sb-c")

    run(main())


def test_a_replacement_that_dies_while_taking_sandboxes_back_is_replaced_again(tmp_path, monkeypatch):
    """(review: a replacement killed between two re-opens left its slot dead for good, and a
    change 'synced' while nothing served the sandbox)"""
    import agentvm.gate.workers as W

    records: list[dict] = []
    events: list = []
    started = []
    real_call = W.GateWorker.call

    async def call(self, op, *args, **kw):
        v = await real_call(self, op, *args, **kw)
        if op == "open" and len(started) == 2 and self.proc.pid == started[1]:
            os.kill(self.proc.pid, signal.SIGKILL)  # the first replacement dies after its first re-open
            await asyncio.sleep(0.2)
        return v

    real_start = W.GateWorker.start

    async def start(self):
        await real_start(self)
        started.append(self.proc.pid)

    monkeypatch.setattr(W.GateWorker, "call", call)
    monkeypatch.setattr(W.GateWorker, "start", start)

    async def main():
        async with _running(tmp_path, 1, events, records) as (pool, port):
            a = await pool.open("sb-a", "a", _policy(port), tmp_path / "a.sock", uid=None, creds=None)
            b = await pool.open("sb-b", "b", _policy(port), tmp_path / "b.sock", uid=None, creds=None)
            os.kill(pool.workers[0].proc.pid, signal.SIGKILL)
            await asyncio.wait_for(pool.workers[0].lost, 10)
            await pool.settle(0)  # the replacement, with nobody waiting on it
            assert len(started) == 3, "the replacement that died was replaced in its turn"
            assert pool.workers[0].alive and a.served and b.served
            a.paused = True
            await a.synced()
            assert [k for k, _ in events].count("gate.worker-lost") == 2
            assert events[-1][0] == "gate.worker-restarted" and sorted(events[-1][1]["sandboxes"]) == ["sb-a", "sb-b"]
            assert (await _get(tmp_path / "a.sock", port))[0] == 403  # paused, on the third worker
            await _served_as(tmp_path / "b.sock", port, records, "sb-b")

    run(main())


def test_a_change_a_worker_fails_replaces_it_and_the_next_change_is_served(tmp_path):
    async def main():
        events: list = []
        async with _running(tmp_path, 1, events) as (pool, port):
            a = await pool.open("sb-a", "a", _policy(port), tmp_path / "a.sock", uid=None, creds=None)
            first = pool.workers[0]
            a.set_policy(object())  # not a policy: the worker fails it
            with pytest.raises(Exception, match="not served by a gate worker"):
                await a.synced()
            assert not first.alive and "failed to apply a change" in first.reason
            a.set_policy(_policy(port, allow=False))  # a good one: the endpoint is opened with it
            await a.synced()
            assert a.served and pool.workers[0].alive
            assert (await _get(tmp_path / "a.sock", port))[0] == 403

    run(main())


def _held(pid: int, sock) -> int:
    """How many descriptors of process ``pid`` are the listening socket ``sock`` (one, when one
    server accepts on it)."""
    target = f"socket:[{os.fstat(sock.fileno()).st_ino}]"
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == target
        except OSError:
            pass
    return n


def test_two_waits_on_an_unserved_endpoint_open_it_once(tmp_path):
    """(review: two synced() at once on an endpoint its worker had failed both re-opened it, and
    an orphan server kept accepting on its socket with the old state)"""
    async def main():
        async with _running(tmp_path, 1) as (pool, port):
            a = await pool.open("sb-a", "a", _policy(port), tmp_path / "a.sock", uid=None, creds=None)
            a.set_policy(object())  # fails on the worker: replaced, and the endpoint is not served
            with pytest.raises(Exception, match="not served"):
                await a.synced()
            a._policy = _policy(port, allow=False)  # (a good state, not pushed: the waits re-open it)
            await asyncio.gather(a.synced(), a.synced())
            assert a.served
            assert _held(pool.workers[0].proc.pid, a.sock) == 1
            assert (await _get(tmp_path / "a.sock", port))[0] == 403

    run(main())


def test_an_open_whose_replacement_cannot_take_it_leaves_nothing(tmp_path, monkeypatch):
    """(review: pool.open returned an error but left the endpoint registered, its socket bound,
    re-opened by every later replacement)"""
    import agentvm.gate.workers as W
    from agentvm.errors import AgentVMError

    real_call = W.GateWorker.call
    first = []

    async def call(self, op, *args, **kw):
        if op == "open" and first and self is not first[0]:
            raise AgentVMError("simulated: the replacement cannot take it")
        v = await real_call(self, op, *args, **kw)
        if op == "open" and not first:
            first.append(self)
            os.kill(self.proc.pid, signal.SIGKILL)  # dies right after acknowledging the open
            await asyncio.wait_for(self.lost, 10)
            await self.pool.settle(self.index)  # (its replacement tried to take it: however long its start took)
        return v

    monkeypatch.setattr(W.GateWorker, "call", call)

    async def main():
        pool = _pool(tmp_path, 1)
        await pool.start()
        try:
            with pytest.raises(AgentVMError):
                await pool.open("sb-a", "a", _policy(1), tmp_path / "a.sock", uid=None, creds=None)
            await pool.settle(0)
            assert not pool.workers[0].endpoints and not (tmp_path / "a.sock").exists()
        finally:
            await pool.stop()

    run(main())


def test_a_cancelled_close_still_releases_the_daemons_socket(tmp_path):
    """(review: a close cancelled while it waited for the worker left the daemon's listening
    socket open and its path bound for the daemon's lifetime)"""
    async def main():
        pool = _pool(tmp_path, 1)
        await pool.start()
        try:
            ep = await pool.open("sb-a", "a", _policy(1), tmp_path / "a.sock", uid=None, creds=None)
            t = asyncio.ensure_future(pool.close(ep))
            await asyncio.sleep(0)  # (the close call is on its way)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert ep.sock.fileno() == -1 and not (tmp_path / "a.sock").exists()
        finally:
            await pool.stop()

    run(main())


def test_a_daemon_that_stops_reading_holds_the_worker_and_loses_no_record(tmp_path):
    """The worker sends every record before it goes on: while the daemon reads nothing its
    requests wait (as the daemon's own gate would on a stalled loop) instead of records piling up
    in the worker's memory; once the daemon reads again, every record arrives."""
    records: list[dict] = []

    async def main():
        async with _running(tmp_path, 1, records=records) as (pool, port):
            total = 6000
            task, answered = await _flood(pool, tmp_path, port, total)  # (its client starts at the next await)
            pool.workers[0]._writer.pause_reading()  # the daemon reads nothing from the worker
            await asyncio.sleep(3)
            held = answered[0]
            assert held < total, "the worker went on while the daemon read nothing"
            await asyncio.sleep(0.5)
            assert answered[0] == held, "held: no request is answered while its record cannot be sent"
            pool.workers[0]._writer.resume_reading()
            await asyncio.wait_for(task, 60)
            await asyncio.sleep(0.1)
            assert len([x for x in records if x["sandbox"] == "sb-a"]) == total, "every record arrives"

    run(main())


class _Exited(Exception):
    pass


def _sender_pair(monkeypatch, limit: float):
    import socket

    import agentvm.gate.workers as W

    monkeypatch.setattr(W, "STALL_LIMIT", limit)

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(W.os, "_exit", exit_)
    a, b = socket.socketpair()
    a.setblocking(False)
    s = W._Sender(a.fileno())
    flushed = []
    s.before_exit = lambda: flushed.append(True)
    return s, a, b, flushed


def test_a_worker_whose_daemon_reads_nothing_writes_its_logs_and_exits(monkeypatch):
    """(review: the stall exit skipped the decision-log lines held for the loop's turn)"""
    s, a, b, flushed = _sender_pair(monkeypatch, 0.3)
    try:
        with pytest.raises(_Exited):
            s.send(b"x" * (8 << 20))  # far more than the socket holds; nobody reads
        assert flushed == [True] and s.closed
    finally:
        a.close()
        b.close()


def test_a_daemon_that_reads_slowly_is_not_taken_for_gone(monkeypatch):
    """(review: the stall deadline was not reset by progress)"""
    import threading

    s, a, b, flushed = _sender_pair(monkeypatch, 0.5)
    got = []

    def reader():
        while True:
            data = b.recv(1 << 16)
            if not data:
                return
            got.append(len(data))
            time.sleep(0.05)

    import time

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        s.send(b"x" * (4 << 20))  # read at ~1 MiB/s: longer than the limit, never idle that long
        assert time.monotonic() - t0 > 0.5 and not flushed and not s.closed
    finally:
        a.close()
        t.join(5)
        b.close()


def test_a_gone_daemon_closes_the_sender_without_exiting(monkeypatch):
    s, a, b, flushed = _sender_pair(monkeypatch, 5)
    b.close()
    s.send(b"x" * 1000)
    s.send(b"y")
    assert s.closed and not flushed
    a.close()


def test_stopping_a_worker_blocked_on_its_daemon_is_prompt_and_graceful(tmp_path):
    """(review: a graceful close of the channel waited for a worker blocked sending to the
    daemon, which waited for the daemon: both stuck until the worker was killed)"""
    import time

    async def main():
        async with _running(tmp_path, 1) as (pool, port):
            task, answered = await _flood(pool, tmp_path, port)  # (its client starts at the next await)
            worker = pool.workers[0]
            worker._writer.pause_reading()
            await asyncio.sleep(2)  # the worker is blocked sending records nobody reads
            t0 = time.monotonic()
            await pool.stop()
            took = time.monotonic() - t0
            task.cancel()
        assert took < 3, f"stop took {took:.1f} s"
        assert worker.proc.returncode == 0, "it exited on its own (not killed)"
        lines = (tmp_path / "logs" / "sb-a.egress.jsonl").read_text().splitlines()
        assert len(lines) >= answered[0] > 0, "every answered request is in the decision log"

    run(main())


def test_per_agent_workers_start_on_demand_retire_and_refuse_past_their_slots(tmp_path, monkeypatch):
    """The daemon's default pool (issue 43): no worker before an agent's first sandbox; one per
    agent; retired after its last sandbox closes (its slot free again); an agent past the last
    slot is refused (gate.no-worker-slot), never served by another agent's worker."""
    import agentvm.gate.workers as W
    from agentvm.gate.workers import NoWorkerSlot

    monkeypatch.setattr(W, "MAX_WORKERS", 2)
    events: list = []

    async def main():
        up = await asyncio.get_running_loop().create_server(_Up, "127.0.0.1", 0)
        port = up.sockets[0].getsockname()[1]
        pool = WorkerPool(0, tmp_path / "state", tmp_path / "logs", on_record=lambda r: None,
                          on_event=lambda kind, **d: events.append((kind, d)), isolate="agent", retire=0.2)
        await pool.start()
        try:
            assert pool.pids() == [], "no worker before the first sandbox"
            a1 = await pool.open("sb-a1", "a", _policy(port), tmp_path / "a1.sock", uid=None, creds=None)
            a2 = await pool.open("sb-a2", "a", _policy(port), tmp_path / "a2.sock", uid=None, creds=None)
            b = await pool.open("sb-b", "b", _policy(port), tmp_path / "b.sock", uid=None, creds=None)
            assert a1.worker is a2.worker and b.worker is not a1.worker and len(pool.pids()) == 2
            with pytest.raises(NoWorkerSlot) as err:
                await pool.open("sb-c", "c", _policy(port), tmp_path / "c.sock", uid=None, creds=None)
            assert err.value.code == "gate.no-worker-slot" and "stop the sandboxes" in (err.value.hint or "")
            assert not (tmp_path / "c.sock").exists() and len(pool.pids()) == 2
            assert (await _get(tmp_path / "b.sock", port))[0] == 200
            # b's last sandbox closes: its worker retires, its slot serves c
            pid_b = b.worker.proc.pid
            await pool.close(b)
            for _ in range(100):
                if any(k == "gate.worker-retired" for k, _ in events):
                    break
                await asyncio.sleep(0.05)
            retired = [d for k, d in events if k == "gate.worker-retired"]
            assert retired and retired[0]["pid"] == pid_b and retired[0]["tenant"] == "agent:b", events
            c = await pool.open("sb-c", "c", _policy(port), tmp_path / "c.sock", uid=None, creds=None)
            assert c.worker.proc.pid != pid_b and c.worker.tenant == "agent:c"
            assert (await _get(tmp_path / "c.sock", port))[0] == 200
            # one of a's two sandboxes closes: its worker stays
            await pool.close(a1)
            await asyncio.sleep(0.4)
            assert a2.worker.alive and not a2.worker.retired
            assert (await _get(tmp_path / "a2.sock", port))[0] == 200
        finally:
            await pool.stop()
            up.close()

    run(main())


def test_a_spare_worker_is_taken_by_an_agents_first_sandbox_and_made_again(tmp_path):
    """``spare=1``: a started worker that serves nobody waits for the next agent (its first
    sandbox waits for no start) and is made again once taken; it becomes that agent's alone."""
    events: list = []

    async def main():
        up = await asyncio.get_running_loop().create_server(_Up, "127.0.0.1", 0)
        port = up.sockets[0].getsockname()[1]
        pool = WorkerPool(0, tmp_path / "state", tmp_path / "logs", on_record=lambda r: None,
                          on_event=lambda kind, **d: events.append((kind, d)), isolate="agent", retire=0.2, spare=1)
        await pool.start()
        try:
            spare = [w for w in pool.workers if w.alive and w.tenant is None]
            assert len(spare) == 1 and spare[0].ready
            a = await pool.open("sb-a", "a", _policy(port), tmp_path / "a.sock", uid=None, creds=None)
            assert a.worker is spare[0] and a.worker.tenant == "agent:a"
            assert (await _get(tmp_path / "a.sock", port))[0] == 200
            for _ in range(200):
                again = [w for w in pool.workers if w.alive and w.ready and w.tenant is None]
                if again:
                    break
                await asyncio.sleep(0.05)
            assert again and again[0] is not a.worker, "a new spare"
            b = await pool.open("sb-b", "b", _policy(port), tmp_path / "b.sock", uid=None, creds=None)
            assert b.worker is again[0] and b.worker is not a.worker
            started = [d for k, d in events if k == "gate.worker-started"]
            assert [d["tenant"] for d in started] == ["agent:a", "agent:b"] and all(d.get("spare") for d in started)
            # before the daemon restarts its persistent sandboxes: a spare for each, at once; the
            # ones left unclaimed are retired afterwards (one spare stays)
            for _ in range(200):
                if [w for w in pool.workers if w.alive and w.ready and w.tenant is None]:
                    break
                await asyncio.sleep(0.05)
            await pool.prestart(3)
            assert len([w for w in pool.workers if w.alive and w.ready and w.tenant is None]) == 3
            await pool.trim_spares()
            assert len([w for w in pool.workers if w.alive and not w.retired and w.tenant is None]) == 1
            assert a.worker.alive and b.worker.alive
        finally:
            await pool.stop()
            up.close()

    run(main())


def test_a_daemon_made_as_a_library_confines_its_gate_by_default():
    """Not only the CLI: ``Daemon(...)`` and ``run_daemon(...)`` called without a gate mode get
    confined per-agent workers; the daemon's own gate is an opt-in (``gate_workers=0``)."""
    import inspect

    from agentvm.daemon.control import ControlPlane
    from agentvm.daemon.server import Daemon, run_daemon

    for fn in (Daemon.__init__, run_daemon, ControlPlane.__init__):
        assert inspect.signature(fn).parameters["gate_workers"].default == "agent", fn

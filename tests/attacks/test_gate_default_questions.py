"""A compromised gate worker asking the daemon (issue 43: held requests and LLM budgets are
served by workers, which ask the daemon - the monitor - small typed questions).

A real confined worker runs code a "sandbox" sent (the TEST-ONLY eval hook, as in
test_gate_containment.py) and uses its channel to the daemon as an attacker would: it asks
about another agent's sandbox, asks the daemon to hold a request its sandbox's policy does not
hold, counts usage into another agent's budget, sends questions that are not of their shape.
The daemon answers only about the sandboxes that worker serves, decides a held request again
under its own policy, and drops a worker whose question is malformed. And the honest path: a
request an ``action: ask`` rule holds waits in the daemon's approvals queue and is forwarded by
the worker once a human approves it; a metered request is admitted and counted by the daemon.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentvm.approvals import ApprovalStore
from agentvm.gate.budget import BudgetSpec
from agentvm.gate.policy import compile_egress
from agentvm.gate.server import run
from agentvm.gate.workers import WorkerPool
from tests.attacks.test_gate_containment import _eval, home, pytestmark  # noqa: F401 (fixture, marks)


def _extras(budget=None):
    return SimpleNamespace(tools=None, approval_timeout=20.0, webhook=None, policy_digest="test-digest",
                           budget=budget, budget_db=None)


def _ask_policy(port: int):
    from agentvm.spec.models import Egress

    eg = Egress.model_validate({"hosts": {"api.test": "127.0.0.1", "held.test": "127.0.0.1"},
                                "allow": [{"host": "api.test", "ports": [port]},
                                          {"host": "held.test", "ports": [port], "action": "ask"}]})
    return compile_egress(eg)


class _Up:
    """A loopback HTTP upstream that answers 200 and remembers the paths it was asked for."""

    def __init__(self):
        self.paths: list[str] = []
        self.srv = None

    async def start(self):
        async def handle(r, w):
            head = await r.readuntil(b"\r\n\r\n")
            self.paths.append(head.split(b" ")[1].decode())
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await w.drain()
            w.close()

        self.srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.port = self.srv.sockets[0].getsockname()[1]
        return self


async def _get(sock: Path, host: str, port: int, path: str, timeout: float = 30) -> tuple[int, str]:
    r, w = await asyncio.open_unix_connection(str(sock))
    w.write(f"GET http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(r.read(), timeout)
    w.close()
    head = data.split(b"\r\n\r\n", 1)[0].decode()
    denied = next((ln.split(":", 1)[1].strip() for ln in head.split("\r\n") if ln.lower().startswith("x-agentvm-denied")),
                  "")
    return int(head.split(" ", 2)[1]), denied


def _pool(home: Path, store: ApprovalStore, events: list) -> WorkerPool:
    return WorkerPool(0, home / "gate", home / "logs", on_record=lambda r: None,
                      on_event=lambda kind, **d: events.append((kind, d)), confine="full", isolate="agent",
                      approvals=lambda: store, retire=0.5)


def test_a_held_request_and_a_budget_are_served_by_the_worker_asking_the_daemon(home):
    home, _ = home
    store = ApprovalStore(home / "approvals.db")
    events: list = []

    async def main():
        up = await _Up().start()
        pool = _pool(home, store, events)
        await pool.start()
        try:
            pol = _ask_policy(up.port)
            spec = BudgetSpec(requests=2, hosts=("api.test",))
            ep = await pool.open("sb-a", "agent-a", pol, home / "a.sock", uid=None, creds=None,
                                 extras=_extras(spec))
            assert ep.worker.uid and ep.worker.proc.pid != os.getpid()
            # held: it waits in the daemon's queue until a human answers; then the worker forwards it
            held = asyncio.ensure_future(_get(home / "a.sock", "held.test", up.port, "/please"))
            for _ in range(200):
                rows = store.list(("pending",))
                if rows:
                    break
                await asyncio.sleep(0.05)
            assert rows and rows[0].sandbox == "sb-a" and rows[0].target.endswith("/please"), rows
            assert rows[0].policy == "test-digest" and "/please" not in up.paths
            store.answer(rows[0].id, True, "tester")
            assert await held == (200, "")
            assert "/please" in up.paths
            held = asyncio.ensure_future(_get(home / "a.sock", "held.test", up.port, "/no"))
            for _ in range(200):
                rows = store.list(("pending",))
                if rows:
                    break
                await asyncio.sleep(0.05)
            store.answer(rows[0].id, False, "tester")
            assert await held == (403, "approval:denied")
            # the requester hangs up while held: the row expires (nothing waits for the answer)
            r, w = await asyncio.open_unix_connection(str(home / "a.sock"))
            w.write(f"GET http://held.test:{up.port}/gone HTTP/1.1\r\nHost: held.test:{up.port}\r\n\r\n".encode())
            for _ in range(200):
                rows = store.list(("pending",))
                if rows:
                    break
                await asyncio.sleep(0.05)
            assert rows and rows[0].target.endswith("/gone"), rows
            w.close()
            for _ in range(100):
                if store.get(rows[0].id).state != "pending":
                    break
                await asyncio.sleep(0.05)
            assert store.get(rows[0].id).state == "expired"
            # a budget of 2 requests, kept by the daemon: 2 admitted and counted, the 3rd refused
            got = [await _get(home / "a.sock", "api.test", up.port, f"/llm{i}") for i in range(3)]
            assert got[:2] == [(200, ""), (200, "")] and got[2] == (429, "budget:exceeded"), got
            assert ep.budget.usage.requests == 2 and ep.reserved == 0
            await pool.close(ep)
            # its agent's last sandbox closed: the worker retires
            for _ in range(100):
                if any(k == "gate.worker-retired" for k, _ in events):
                    break
                await asyncio.sleep(0.05)
            assert any(k == "gate.worker-retired" and d["tenant"] == "agent:agent-a" for k, d in events), events
        finally:
            await pool.stop()
            up.srv.close()

    run(main())


ASK = """
import gc
asker = [o for o in gc.get_objects() if type(o).__name__ == "_Asker"][0]
{body}
result = "sent"
"""


def test_a_compromised_worker_asks_only_about_its_own_sandboxes(home):
    home, _ = home
    store = ApprovalStore(home / "approvals.db")
    events: list = []

    async def main():
        up = await _Up().start()
        pool = _pool(home, store, events)
        await pool.start()
        try:
            pol = _ask_policy(up.port)
            spec = BudgetSpec(requests=5, hosts=("api.test",))
            a = await pool.open("sb-a", "agent-a", pol, home / "a.sock", uid=None, creds=None, extras=_extras(spec))
            b = await pool.open("sb-b", "agent-b", pol, home / "b.sock", uid=None, creds=None, extras=_extras(spec))
            assert a.worker is not b.worker
            # A's worker: admissions and counts for B's sandbox; a hold for B; a hold for its own
            # sandbox of a request its policy allows without asking (a human is not to be
            # bothered by what the policy does not hold); a count past any size
            body = f"""
asker.ask("admit", "sb-b")
asker.tell("charge", "sb-b", "m", 10**6, 10**6, False)
asker.ask("hold", "sb-b", ("held.test", {up.port}, "http", "GET", "/b", None, None, False), False)
asker.ask("hold", "sb-a", ("api.test", {up.port}, "http", "GET", "/not-held", None, None, False), False)
asker.tell("release", "sb-b")
"""
            assert await _eval(home / "a.sock", ASK.format(body=body)) == "'sent'"
            await asyncio.sleep(0.5)
            assert b.reserved == 0 and b.budget.ledger.inflight == 0 and b.budget.usage.requests == 0
            assert not store.list(("pending", "expired", "approved", "denied")), "a hold the daemon should refuse"
            assert a.worker.alive, "(refusals, not a malformed channel: the worker is still served)"
            # a count into its own agent's budget is taken (never free) - bounded and typed
            body = 'asker.tell("charge", "sb-a", "m", 7, 8, False)'
            assert await _eval(home / "a.sock", ASK.format(body=body)) == "'sent'"
            await asyncio.sleep(0.3)
            assert a.budget.usage.tokens == 15 and a.budget.ledger.inflight == 0
            # a question not of its shape: the worker is dropped (and replaced)
            pid = a.worker.proc.pid
            body = 'asker.writer.send(__import__("agentvm.gate.workers", fromlist=["_pack"])._pack(("q", 1, "exec", "sb-a", ())))'
            await _eval(home / "a.sock", ASK.format(body=body))
            for _ in range(200):
                if any(k == "gate.worker-lost" and d.get("pid") == pid for k, d in events):
                    break
                await asyncio.sleep(0.05)
            lost = [d for k, d in events if k == "gate.worker-lost" and d.get("pid") == pid]
            assert lost and "unknown question" in lost[0]["reason"], events
        finally:
            await pool.stop()
            up.srv.close()

    run(main())

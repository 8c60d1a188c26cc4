"""The E2B adapter's persistence (agentvm.e2b.store) and its service across a restart, over a
fake backend: what is kept, what is never kept (a token's text), deadlines enforced after a
reload, tokens re-minted beside the old ones, and nothing kept for a sandbox the control plane
lost."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from agentvm.e2b.app import E2BService
from agentvm.e2b.backend import BoxInfo
from agentvm.e2b.model import Box, digest
from agentvm.e2b.store import E2BStore


class FakeBackend:
    def __init__(self):
        self.boxes: dict[str, str] = {}
        self.killed: list[str] = []

    async def create(self, name, spec_text, ttl):
        self.boxes[name] = "running"

    async def kill(self, name):
        self.killed.append(name)
        self.boxes.pop(name, None)

    async def pause(self, name):
        self.boxes[name] = "stopped"

    async def resume(self, name):
        self.boxes[name] = "running"

    async def info(self, name):
        return BoxInfo(name, self.boxes[name]) if name in self.boxes else None


def _box(sid="i" + "a" * 20, end_in=600.0, **kw) -> Box:
    now = time.time()
    return Box(sid, "alice", "base", f"e2b-{sid}", {"k": "v"}, {}, now, now + end_in, "tok-" + sid,
               traffic_token="trf-" + sid, ports=(8080,), **kw)


def _svc(tmp_path, backend, records=None):
    rec = records.append if records is not None else None
    return E2BService(backend, {"key-a": "alice"}, home=tmp_path, store=E2BStore(tmp_path / "e2b" / "sandboxes.db"),
                      audit=(lambda kind, **d: rec((kind, d))) if rec else None)


def test_the_store_keeps_the_sandbox_and_only_digests_of_its_tokens(tmp_path):
    st = E2BStore(tmp_path / "s.db")
    b = _box()
    st.save(b)
    st.close()
    dump = "\n".join(sqlite3.connect(tmp_path / "s.db").iterdump())
    assert b.token not in dump and b.traffic_token not in dump
    assert digest(b.token) in dump and digest(b.traffic_token) in dump
    (got,) = E2BStore(tmp_path / "s.db").load()
    assert (got.id, got.tenant, got.template, got.name, got.metadata, got.end_at, got.ports) == \
        (b.id, "alice", "base", b.name, {"k": "v"}, b.end_at, (8080,))
    assert got.known_tokens is False and got.token != b.token and got.traffic_token == ""
    assert got.access_ok(b.token) and not got.access_ok(got.token[:-1] + "x") and not got.access_ok(None)
    assert got.traffic_ok(b.traffic_token) and not got.traffic_ok("")
    assert (tmp_path / "s.db").stat().st_mode & 0o077 == 0


def test_a_reloaded_service_keeps_live_sandboxes_and_forgets_lost_ones(tmp_path):
    backend = FakeBackend()
    live, lost = _box("i" + "1" * 20), _box("i" + "2" * 20)
    records = []
    svc = _svc(tmp_path, backend)
    for b in (live, lost):
        svc.boxes[b.id] = b
        svc.save(b)
    backend.boxes[live.name] = "running"  # the control plane lost `lost`
    asyncio.run(svc.close())
    assert live.name in backend.boxes and not backend.killed  # a persistent service kills nothing at close

    svc2 = _svc(tmp_path, backend, records)
    asyncio.run(svc2.load())
    assert list(svc2.boxes) == [live.id]
    assert ("e2b.kill", {"tenant": "alice", "sandbox": lost.name, "reason": "gone at restart"}) in records
    assert svc2.envd_box(live.id, live.token) is svc2.boxes[live.id]  # the old token still opens it
    assert svc2.envd_box(live.id, "tok-wrong") is None and svc2.envd_box(lost.id, lost.token) is None
    # connect after a restart mints new tokens; the old ones keep working beside them
    b = svc2.handed_out(svc2.boxes[live.id])
    assert b.known_tokens and b.token != live.token and b.access_ok(b.token) and b.access_ok(live.token)
    assert b.traffic_token and b.traffic_ok(b.traffic_token)
    # and the new digests are kept too
    (again,) = E2BStore(tmp_path / "e2b" / "sandboxes.db").load()
    assert again.access_ok(b.token) and again.access_ok(live.token)


def test_a_deadline_that_passed_while_down_is_enforced_after_the_reload(tmp_path):
    backend = FakeBackend()
    expired, kept = _box("i" + "3" * 20, end_in=-5), _box("i" + "4" * 20, end_in=600)
    svc = _svc(tmp_path, backend)
    for b in (expired, kept):
        svc.boxes[b.id] = b
        svc.save(b)
        backend.boxes[b.name] = "running"
    records = []
    svc2 = _svc(tmp_path, backend, records)

    async def go():
        await svc2.load()
        task = asyncio.create_task(svc2.reap())
        deadline = time.monotonic() + 10
        while expired.id in svc2.boxes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(go())
    assert expired.id not in svc2.boxes and kept.id in svc2.boxes
    assert backend.killed == [expired.name]
    assert ("e2b.kill", {"tenant": "alice", "sandbox": expired.name, "reason": "timeout"}) in records
    assert [b.id for b in E2BStore(tmp_path / "e2b" / "sandboxes.db").load()] == [kept.id]


def test_a_deadline_change_is_kept(tmp_path):
    backend = FakeBackend()
    svc = _svc(tmp_path, backend)
    b = _box()
    svc.boxes[b.id] = b
    svc.save(b)
    svc.set_deadline(b, 1234567890.5)
    (got,) = E2BStore(tmp_path / "e2b" / "sandboxes.db").load()
    assert got.end_at == 1234567890.5


@pytest.mark.parametrize("failing", [True, False])
def test_a_kill_that_fails_keeps_the_sandbox_for_the_next_try(tmp_path, failing):
    class Failing(FakeBackend):
        async def kill(self, name):
            if failing:
                raise RuntimeError("the control plane refused")
            await super().kill(name)

    backend = Failing()
    svc = _svc(tmp_path, backend)
    b = _box()
    svc.boxes[b.id] = b
    svc.save(b)
    if failing:
        with pytest.raises(RuntimeError):
            asyncio.run(svc.kill(b))
        assert b.id in svc.boxes and len(E2BStore(tmp_path / "e2b" / "sandboxes.db").load()) == 1
    else:
        asyncio.run(svc.kill(b))
        assert b.id not in svc.boxes and E2BStore(tmp_path / "e2b" / "sandboxes.db").load() == []

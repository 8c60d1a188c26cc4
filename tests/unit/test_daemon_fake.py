"""The daemon's API, the SDK and the CLI against the fake backend (no sandbox is started):
lifecycle and state, validation, audit records, events, live policy, the TCP listener's token."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from agentvm.backends.fake import FakeBackend
from agentvm.daemon.client import ApiFailure, Client
from agentvm.daemon.server import Daemon
from agentvm.paths import Paths

SPEC = """apiVersion: agentvm/v1
kind: Agent
metadata: {{name: {name}}}
spec:
  lifecycle: {lifecycle}
  command: [worker]
  egress:
    allow:
      - {{host: pypi.org}}
"""


class Running:
    def __init__(self, tmp: Path, listen: str | None = None, gate_workers: int = 0):
        self.paths = Paths(home=tmp / "home", runtime=tmp / "run")
        self.backend = FakeBackend(0, hold=True)
        self.loop = asyncio.new_event_loop()
        self.daemon = None
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.daemon = Daemon(self.paths, backend=self.backend, listen=listen, gate_workers=gate_workers)
            ready.set()
            self.loop.run_until_complete(self.daemon.serve())

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)
        self.client = Client(self.paths.runtime / "agentvm.sock", timeout=30)
        deadline = time.monotonic() + (10 if not gate_workers else 40)
        while not self.client.available():
            assert time.monotonic() < deadline, "daemon did not come up"
            time.sleep(0.02)

    def stop(self):
        try:
            self.client.shutdown()
        except Exception:
            pass
        self.thread.join(30)


@pytest.fixture
def d(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")
    r = Running(tmp_path)
    yield r
    r.stop()


def spec(name="w1", lifecycle="persistent"):
    return SPEC.format(name=name, lifecycle=lifecycle)


def test_lifecycle_state_and_audit(d):
    c = d.client
    row = c.create(spec(), "w1.yaml")
    assert row["name"] == "w1" and row["state"] == "created"
    assert c.action("w1", "start")["state"] == "running"
    assert [r["name"] for r in c.ps()] == ["w1"]
    assert c.action("w1", "stop")["state"] == "stopped"
    assert c.action("w1", "restart")["state"] == "running"
    c.rm("w1")
    assert c.ps() == []
    kinds = [r["kind"] for r in c.audit()]
    for k in ("lifecycle.created", "lifecycle.start-requested", "lifecycle.running", "lifecycle.exited",
              "lifecycle.stopped", "lifecycle.removed"):
        assert k in kinds, k
    assert c.verify()["ok"]
    assert ("launch" in [x[0] for x in d.backend.calls]) and ("destroy" in [x[0] for x in d.backend.calls])


def test_bad_requests_change_nothing(d):
    c = d.client
    with pytest.raises(ApiFailure) as ei:
        c.create("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: x}\nspec: {limits: {memory: lots}}\n")
    assert ei.value.status == 400
    with pytest.raises(ApiFailure):
        c.action("nope", "start")
    c.create(spec())
    with pytest.raises(ApiFailure) as ei:
        c.create(spec())
    assert ei.value.status == 409
    c.action("w1", "start")
    before = c.get("w1")["policy_patch"]
    with pytest.raises(ApiFailure):
        c.policy("w1", "allow", rule="not a host!")
    assert c.get("w1")["policy_patch"] == before, "a change that fails validation changes nothing"


def test_live_policy_is_recorded_and_kept(d):
    c = d.client
    c.create(spec())
    c.action("w1", "start")
    r = c.policy("w1", "allow", rule="files.pythonhosted.org:443")
    assert r["applied"] and r["live"] is True
    assert c.policy("w1", "pause")["patch"]["paused"] is True
    ep = d.daemon.managed["w1"].endpoint
    assert ep.paused and any(rule.host == "files.pythonhosted.org" for rule in ep.policy.allow)
    changes = [r for r in c.audit(sandbox="w1") if r["kind"] == "policy.change"]
    assert [ch["data"]["op"] for ch in changes] == ["allow", "pause"]
    # kept across a restart
    c.action("w1", "restart")
    ep = d.daemon.managed["w1"].endpoint
    assert ep.paused and any(rule.host == "files.pythonhosted.org" for rule in ep.policy.allow)


def test_exec_streams_and_sdk(d, monkeypatch):
    import agentvm

    c = d.client
    c.create(spec())
    c.action("w1", "start")
    evs = list(c.exec("w1", ["echo", "hi"]))
    assert evs[-1]["exit_code"] == 0 and any(e.get("data") == b"fake exec: echo hi\n" for e in evs)
    monkeypatch.setattr("agentvm.daemon.client.default_socket", lambda: d.paths.runtime / "agentvm.sock")
    with agentvm.Sandbox(spec("sdk1")) as sb:
        r = sb.exec(["make", "test"])
        assert r.ok and r.stdout == b"fake exec: make test\n"
        assert sb.status()["state"] == "running"
    assert "sdk1" not in [r["name"] for r in c.ps()], "removed on exit"

    async def go():
        async with agentvm.AsyncSandbox(spec("sdk2")) as sb:
            return await sb.exec(["true"])

    assert asyncio.run(go()).exit_code == 0


def test_events_stream(d):
    c = d.client
    got = []

    def reader():
        for ev in c.events():
            got.append(ev)
            if ev.get("kind") == "lifecycle.running":
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    time.sleep(0.2)
    c.create(spec())
    c.action("w1", "start")
    t.join(10)
    assert [e["kind"] for e in got][-1] == "lifecycle.running"


def test_a_reader_that_falls_behind_is_cut_off_and_costs_no_record(d, monkeypatch):
    """A stalled live reader (a console tab in the background) must not make the daemon drop
    audit records or fail an operator's action: it is cut off with a ``stream.lagged`` record."""
    import agentvm.daemon.events as events

    monkeypatch.setattr(events, "SUBSCRIBER_BACKLOG", 5)
    stalled: asyncio.Queue = asyncio.Queue()
    d.loop.call_soon_threadsafe(d.daemon.subscribers.add, stalled)
    time.sleep(0.1)
    c = d.client
    c.create(spec())
    for _ in range(4):
        assert c.action("w1", "start")["state"] == "running"
        assert c.action("w1", "stop")["state"] in ("stopped", "exited")
    kinds = []
    while not stalled.empty():
        rec = stalled.get_nowait()
        kinds.append(None if rec is None else rec["kind"])
    assert kinds[-2:] == ["stream.lagged", None] and len(kinds) == 5 + 2, kinds
    assert stalled not in d.daemon.subscribers
    recs = [r.kind for r in d.daemon.audit.records(sandbox="w1", limit=1000)]
    assert recs.count("lifecycle.start-requested") == 4 and recs.count("lifecycle.stopped") == 4, recs


def test_control_socket_is_owner_only(d):
    st = os.stat(d.paths.runtime / "agentvm.sock")
    assert st.st_mode & 0o077 == 0


def test_tcp_listener_requires_the_token(tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = Running(tmp_path, listen=f"127.0.0.1:{port}")
    try:
        token = (r.paths.home / "daemon.token").read_text().strip()
        assert oct((r.paths.home / "daemon.token").stat().st_mode & 0o777) == "0o600"
        with pytest.raises(ApiFailure) as ei:
            Client(url=f"http://127.0.0.1:{port}", token="wrong").ps()
        assert ei.value.status == 401
        assert Client(url=f"http://127.0.0.1:{port}", token=token).ps() == []
        # a peer that never finishes its head is answered and dropped, not kept forever
        import agentvm.daemon.http as http

        monkeypatch.setattr(http, "HEAD_TIMEOUT", 0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            slow.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")
            got = b""
            while chunk := slow.recv(4096):  # until the daemon closes it
                got += chunk
        assert got.startswith(b"HTTP/1.1 408") and b"request head" in got, got
    finally:
        r.stop()


def _raw(d, data: bytes) -> tuple[int, dict]:
    import socket as _s

    s = _s.socket(_s.AF_UNIX)
    s.settimeout(10)
    s.connect(str(d.paths.runtime / "agentvm.sock"))
    s.sendall(data)
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    s.close()
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"[" * 100_000 + b"]" * 100_000, b'"a string"'])
def test_bad_json_is_a_400_that_says_why(d, body):
    status, doc = _raw(d, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert status == 400 and doc["error"] == "api.bad-request" and doc["exit_code"] == 78, doc
    assert [r["name"] for r in d.client.ps()] == []


def test_since_takes_the_cli_time_forms(d):
    with pytest.raises(ApiFailure) as ei:
        d.client.request("GET", "/v1/audit?since=abc")
    assert ei.value.status == 400 and "since" in ei.value.message and ei.value.exit_code == 78
    d.client.create(spec("w9"), "w9.yaml")
    assert any(r["kind"] == "lifecycle.created" for r in d.client.request("GET", "/v1/audit?since=10m"))
    assert not d.client.request("GET", f"/v1/audit?since={time.time() + 3600}")


def test_an_error_after_a_stream_began_reaches_the_client_whole(d, monkeypatch):
    """A refusal found once a run's stream has started is the same error (code, hint, exit
    code) the embedded path raises, not "ended without a result"."""
    from agentvm.errors import PolicyDenied
    from agentvm.runtime import Runtime

    def refuse(self, policy, **kw):
        raise PolicyDenied("refused for the test", hint="the fix", code="policy.test-refusal")

    monkeypatch.setattr(Runtime, "prepare", refuse)  # the lifecycle driver's first step
    with pytest.raises(Exception) as ei:
        list(d.client.run({"command": ["true"]}))
    err = ei.value
    assert (err.code, err.message, err.hint, err.exit_code) == ("policy.test-refusal", "refused for the test", "the fix", 77)


def test_a_request_whose_client_gave_up_is_not_applied(d):
    import socket as _s

    d.loop.call_soon_threadsafe(lambda: None)
    body = json.dumps({"spec": spec("late"), "file": "late.yaml"}).encode()
    s = _s.socket(_s.AF_UNIX)
    s.connect(str(d.paths.runtime / "agentvm.sock"))
    # stall the daemon's loop, send, and leave before it reads: like a client timeout while
    # the daemon was stopped (SIGSTOP) or overloaded
    stall = threading.Event()
    d.loop.call_soon_threadsafe(lambda: stall.wait(5))
    s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
              % (len(body), body))
    s.close()
    stall.set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kinds = [r["kind"] for r in d.client.audit()]
        if "operator.request-dropped" in kinds:
            break
        time.sleep(0.05)
    assert "operator.request-dropped" in kinds, kinds
    assert "late" not in [r["name"] for r in d.client.ps()]


def test_client_times_out_with_a_clear_error(tmp_path):
    import socket as _s

    from agentvm.daemon.client import DaemonUnavailable

    path = tmp_path / "mute.sock"
    srv = _s.socket(_s.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)  # accepts, never answers: a stopped daemon
    c = Client(path, timeout=0.5)
    t = time.monotonic()
    with pytest.raises(DaemonUnavailable) as ei:
        c.ps()
    assert time.monotonic() - t < 5 and ei.value.code == "daemon.timeout" and "did not answer" in ei.value.message
    srv.close()


def test_live_changes_stay_within_the_risk_tier_and_name_real_rules(d):
    c = d.client
    c.create("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: low}\nspec:\n  riskTier: L1\n  command: [w]\n")
    c.action("low", "start")
    with pytest.raises(ApiFailure) as ei:
        c.policy("low", "allow", rule="pypi.org")
    assert ei.value.exit_code == 77 and "tier" in ei.value.message, ei.value.message
    assert c.get("low")["policy_patch"] == {}, "refused: nothing kept for the next start"
    c.action("low", "restart")  # and the agent still starts
    assert c.get("low")["state"] == "running"
    c.create(spec("w2"))
    with pytest.raises(ApiFailure) as ei:
        c.policy("w2", "remove", rule_id="nosuch-rule")
    assert ei.value.exit_code == 78 and "nosuch-rule" in ei.value.message and "allow[0]" in ei.value.message
    c.policy("w2", "deny", rule="pypi.org")
    v = c.policy("w2", "show")
    deny = [r for r in v["rules"] if r["kind"] == "deny" and r["host"] == "pypi.org"]
    assert deny and deny[0]["ports"] == "all", v["rules"]
    assert any(r["kind"] == "allow" and r["host"] == "pypi.org" and r["ports"] == [443] for r in v["rules"])
    assert v["network"] == "gate" and v["paused"] is False


def test_a_start_that_fails_is_an_error_with_the_reason(d, monkeypatch):
    from agentvm.errors import PolicyDenied

    c = d.client
    c.create(spec("bad"))

    async def refuse(self, m, row):
        raise PolicyDenied("the grant is gone", hint="recreate it", code="policy.test-start")

    monkeypatch.setattr(Daemon, "_run_once", refuse)
    with pytest.raises(ApiFailure) as ei:
        c.action("bad", "start")
    assert (ei.value.code, ei.value.exit_code, ei.value.hint) == ("policy.test-start", 77, "recreate it")
    assert "the grant is gone" in ei.value.message


def test_garbage_on_the_socket_gets_a_400(d):
    status, doc = _raw(d, b"\x16\x03\x01\x00garbage that is not HTTP\r\n\r\n")
    assert status == 400 and doc["error"] == "api.bad-request", doc


def test_large_bodies_are_capped_and_limited_in_number(d):
    # (a cp upload is streamed, not read whole: tests/integration/test_cp_streaming.py; every
    # other route's body is read into memory, capped at MAX_BODY and a few large ones at a time)
    status, doc = _raw(d, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (100 << 20))
    assert status == 413 and doc["exit_code"] == 78, doc
    import socket as _s

    held = []
    try:
        for _ in range(2):  # two large bodies in progress (still coming)
            s = _s.socket(_s.AF_UNIX)
            s.connect(str(d.paths.runtime / "agentvm.sock"))
            s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (8 << 20))
            held.append(s)
        time.sleep(0.3)
        status, doc = _raw(d, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (8 << 20))
        assert status == 429 and doc["error"] == "api.busy", doc
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    status, doc = _raw(d, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n"
                       + b" " * 1999998 + b"{}")
    assert status == 400 and doc["error"] == "config.invalid", doc  # a slot is free again: read and answered


def test_an_early_refusal_of_a_big_upload_reaches_the_client(d):
    # a cp upload to a sandbox that does not exist is answered before its body is read; the
    # client, still sending, reads that answer (not a broken pipe)
    c = d.client
    with pytest.raises(ApiFailure) as ei:
        c.put_file("nosuch", "f", b"x" * (70 << 20))
    assert ei.value.status == 404 and ei.value.code == "sandbox.not-found", (ei.value.status, ei.value.message)


def test_a_stalled_body_does_not_hold_a_slot_forever(d, monkeypatch):
    import socket as _s

    import agentvm.daemon.http as srv

    monkeypatch.setattr(srv, "BODY_TIMEOUT", 0.5)
    s = _s.socket(_s.AF_UNIX)
    s.settimeout(10)
    s.connect(str(d.paths.runtime / "agentvm.sock"))
    s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\nabc")
    out = s.recv(65536)
    s.close()
    assert b" 408 " in out.split(b"\r\n")[0], out[:200]
    deadline = time.monotonic() + 10
    while d.daemon.http._uploads != srv.UPLOADS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.daemon.http._uploads == srv.UPLOADS, "the slot came back"


def test_allow_on_an_agent_with_no_route_is_an_error_not_a_no_op(d):
    c = d.client
    c.create("apiVersion: agentvm/v1\nkind: Agent\nmetadata: {name: offline}\nspec:\n  network: none\n  command: [w]\n")
    with pytest.raises(ApiFailure) as ei:
        c.policy("offline", "allow", rule="pypi.org")
    assert "no route out" in ei.value.message and ei.value.exit_code == 78, ei.value.message
    assert c.get("offline")["policy_patch"] == {}


def test_the_supervisor_only_makes_transitions_of_the_state_table(tmp_path, monkeypatch):
    """The daemon's states and their transitions are one table (daemon.state.TRANSITIONS): a
    lifecycle with a restart, a stop, a failed start and a removal only ever moves along it,
    and a transition not in it is refused."""
    from agentvm.daemon import state as st

    seen: list[tuple[str, str]] = []
    orig = st.State.update

    def spy(self, name, **fields):
        if "state" in fields:
            row = self.get(name)
            seen.append((row.state if row else None, fields["state"]))
        return orig(self, name, **fields)

    monkeypatch.setattr(st.State, "update", spy)
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")
    r = Running(tmp_path)
    try:
        c = r.client
        c.create(spec("t1"), "t1.yaml")
        c.action("t1", "start")
        r.backend.stop(r.daemon.managed["t1"].handle)  # the worker exits: persistent, so it restarts
        deadline = time.monotonic() + 10
        while c.get("t1")["restarts"] < 1:
            assert time.monotonic() < deadline, "no restart"
            time.sleep(0.02)
        deadline = time.monotonic() + 10
        while c.get("t1")["state"] != "running":
            assert time.monotonic() < deadline, c.get("t1")
            time.sleep(0.02)
        c.action("t1", "stop")
        r.backend.missing = {"cgroups"}  # the next start is refused: -> failed
        with pytest.raises(ApiFailure):
            c.action("t1", "start")
        c.rm("t1")
    finally:
        r.stop()
    assert seen, "no state changes were seen"
    for cur, new in seen:
        assert cur is None or new == cur or new in st.TRANSITIONS[cur], (cur, new, seen)
    for state in ("starting", "running", "backoff", "stopped", "failed"):
        assert any(new == state for _, new in seen), (state, seen)
    s = st.State(tmp_path / "t.db")
    s.create("x", "", "x.yaml", "ephemeral", None, None)
    with pytest.raises(st.IllegalTransition):
        s.update("x", state="running")  # created -> running skips starting
    s.update("x", state="starting")
    s.update("x", state="running")
    assert set(st.STATES) == set(st.TRANSITIONS) and all(v <= set(st.STATES) for v in st.TRANSITIONS.values())


def _start_held_at_attach(d, monkeypatch):
    """Start w1 in a thread, its first attach held until ``release`` is set; -> (release, the
    start's result list, the thread), once the start is held there."""
    from agentvm import lifecycle

    entered, release = threading.Event(), threading.Event()
    real = lifecycle.Lifecycle.attach

    def attach(self, s):
        if not entered.is_set():
            entered.set()
            release.wait(20)
        return real(self, s)

    monkeypatch.setattr(lifecycle.Lifecycle, "attach", attach)
    done: list = []
    t = threading.Thread(target=lambda: done.append(
        Client(d.paths.runtime / "agentvm.sock", timeout=60).action("w1", "start")))
    t.start()
    assert entered.wait(20)
    return release, done, t


def test_a_change_made_while_the_sandbox_starts_reaches_its_endpoint(d, monkeypatch):
    """(review: the start applied the state row it read before preparing the sandbox: a pause or
    a rule changed while it was prepared was stored, reported, and missing from the endpoint)"""
    c = d.client
    c.create(spec())
    release, done, t = _start_held_at_attach(d, monkeypatch)
    c.policy("w1", "pause")
    c.policy("w1", "allow", rule="files.pythonhosted.org:443")
    c.policy("w1", "budget", tokens=1000)
    release.set()
    t.join(30)
    assert done and done[0]["state"] == "running"
    ep = d.daemon.managed["w1"].endpoint
    assert ep.paused, "the pause made while it started"
    assert any(rule.host == "files.pythonhosted.org" for rule in ep.policy.allow), "the rule added while it started"
    assert ep.budget is not None and ep.budget.spec.tokens == 1000, "the budget set while it started"


def test_a_budget_set_while_a_worker_served_sandbox_starts_reaches_its_worker(tmp_path, monkeypatch):
    """(review: a budget set while a sandbox placed on a gate worker started failed that start
    for good. Issue 43: a worker meters - the daemon keeps the ledger - so the budget reaches
    the worker's endpoint, and the start is not redone elsewhere)"""
    monkeypatch.setenv("AGENTVM_ALLOW_FAKE", "1")
    d = Running(tmp_path, gate_workers=1)
    try:
        c = d.client
        c.create(spec())
        release, done, t = _start_held_at_attach(d, monkeypatch)
        c.policy("w1", "budget", tokens=1000)
        release.set()
        t.join(60)
        assert done and done[0]["state"] == "running", done
        ep = d.daemon.managed["w1"].endpoint
        assert ep.placement == "worker 0", "served by the gate worker"
        assert ep.budget is not None and ep.budget.spec.tokens == 1000
        kinds = [r["kind"] for r in c.audit(sandbox="w1")]
        assert "lifecycle.start-again" not in kinds and "lifecycle.failed" not in kinds
    finally:
        d.stop()


def test_an_open_abandoned_by_its_caller_is_undone_even_if_it_finishes(tmp_path):
    """(review: DaemonGateHost._call gave up on an open whose last step was still running: the
    endpoint was made, served and bound, and owned by nobody)"""
    import types

    from agentvm.daemon.server import DaemonGateHost
    from agentvm.errors import AgentVMError

    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    try:
        host = DaemonGateHost(types.SimpleNamespace(loop=loop))
        made, undone = [], []

        async def opener():
            await asyncio.sleep(0.05)
            time.sleep(0.3)  # the loop busy past the caller's timeout, in the open's last step
            made.append("endpoint")
            return "endpoint"

        async def undo(result):
            undone.append(result)

        with pytest.raises(AgentVMError, match="did not answer"):
            host._call(opener(), timeout=0.2, undo=undo)
        deadline = time.monotonic() + 5
        while not undone and time.monotonic() < deadline:
            time.sleep(0.02)
        assert made == ["endpoint"] and undone == ["endpoint"]

        async def slow():
            await asyncio.sleep(5)
            made.append("late")

        with pytest.raises(AgentVMError):
            host._call(slow(), timeout=0.1, undo=undo)
        time.sleep(0.3)
        assert "late" not in made, "a call still waiting is cancelled"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)

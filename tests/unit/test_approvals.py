"""The approvals queue: only a pending request can be answered, once; the deadline and a dead
holder answer it as expired; every request and answer reaches the audit record function."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from agentvm.approvals import ApprovalError, ApprovalStore


def store(tmp_path, records=None):
    return ApprovalStore(tmp_path / "approvals.db",
                         (lambda kind, **kw: records.append((kind, kw))) if records is not None else None)


def submit(s, timeout=60.0, **kw):
    return s.submit(kind="tool", sandbox="sb-1", agent="a", target="gh__create_issue",
                    summary={"preview": '{"title": "x"}', "keys": ["title"], "arguments": '{"title": "x"}'},
                    arg_digest="sha256:00", policy="sha256:11", timeout=timeout, **kw)


def test_answered_once_and_recorded(tmp_path):
    recs = []
    s = store(tmp_path, recs)
    r = submit(s)
    assert r.state == "pending" and r.id.startswith("apr-")
    assert s.answer(r.id, True, "cli:alice", "ok").state == "approved"
    with pytest.raises(ApprovalError, match="already approved"):
        s.answer(r.id, False, "cli:bob")
    assert [k for k, _ in recs] == ["approval.requested", "approval.answered"]
    assert recs[1][1]["actor"] == "cli:alice" and recs[1][1]["state"] == "approved"
    with pytest.raises(ApprovalError, match="no approval request"):
        s.get("apr-nope")


def test_the_deadline_denies(tmp_path):
    s = store(tmp_path)
    r = submit(s, timeout=0.2)
    done = asyncio.run(s.wait(r.id))
    assert done.state == "expired" and done.by == "timeout"
    with pytest.raises(ApprovalError):
        s.answer(r.id, True, "cli:late")


def test_an_answer_from_another_process_reaches_the_waiter(tmp_path):
    s = store(tmp_path)
    r = submit(s)
    code = (f"from agentvm.approvals import ApprovalStore; ApprovalStore({str(tmp_path / 'approvals.db')!r})"
            f".answer({r.id!r}, False, 'cli:other', 'no')")

    async def main():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
        done = await asyncio.wait_for(s.wait(r.id), 30)
        await proc.wait()
        return done

    done = asyncio.run(main())
    assert (done.state, done.by, done.note) == ("denied", "cli:other", "no")


def test_a_request_whose_holder_died_is_expired_not_left_to_be_approved(tmp_path):
    code = ("from agentvm.approvals import ApprovalStore; s = ApprovalStore(%r); "
            "r = s.submit(kind='egress', sandbox='sb', agent='a', target='POST x:80/', summary={}, arg_digest='d', "
            "policy='p', timeout=600); print(r.id)") % str(tmp_path / "approvals.db")
    rid = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    s = store(tmp_path)  # opening reaps
    r = s.get(rid)
    assert r.state == "expired" and r.by == "reaper"
    with pytest.raises(ApprovalError, match="already expired"):
        s.answer(rid, True, "cli:alice")


def test_a_live_holders_request_is_not_reaped(tmp_path):
    s = store(tmp_path)
    r = submit(s)
    other = ApprovalStore(tmp_path / "approvals.db")  # same process: the holder is alive
    assert other.get(r.id).state == "pending"
    assert other.list()[0].id == r.id


def test_a_request_that_cannot_be_recorded_is_not_queued(tmp_path):
    def refuse(kind, **kw):
        raise OSError("disk full")

    s = ApprovalStore(tmp_path / "approvals.db", refuse)
    with pytest.raises(OSError):
        submit(s)
    assert s.list(("pending", "approved", "denied", "expired")) == []


def test_the_database_is_not_world_readable(tmp_path):
    store(tmp_path)
    assert os.stat(tmp_path / "approvals.db").st_mode & 0o077 == 0  # previews of arguments: not for others


def test_the_webhook_gets_the_pending_request_and_its_outcome_is_kept(tmp_path):
    import http.server
    import json
    import threading

    got = []

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.handle_request, daemon=True).start()
    s = store(tmp_path)
    r = submit(s, webhook=f"http://127.0.0.1:{srv.server_address[1]}/hook")
    end = time.time() + 10
    while not s.notified and time.time() < end:
        time.sleep(0.05)
    assert s.notified == [(r.id, "delivered 204")]
    # argument names and the digest, never their values (a webhook may be a third party's)
    assert got[0]["id"] == r.id and got[0]["summary"] == {"keys": ["title"]} and got[0]["digest"] == "sha256:00"
    assert "approve" in got[0]["answer"]["cli"]
    assert s.get(r.id).notified == "delivered 204" and s.get(r.id).state == "pending"  # a webhook never answers
    srv.server_close()
    r2 = submit(s, webhook=f"http://127.0.0.1:{srv.server_address[1]}/hook")  # nobody listens now
    end = time.time() + 10
    while len(s.notified) < 2 and time.time() < end:
        time.sleep(0.05)
    assert s.get(r2.id).notified.startswith("failed: ")


def test_what_a_sandbox_wrote_cannot_drive_the_operators_terminal(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from agentvm.cli import approvals_cmd

    s = store(tmp_path)
    r = s.submit(kind="access", sandbox="sb", agent="a", target="agentvm__request_access",
                 summary={"access": "\x1b]52;c;ZXZpbA==\x07 and \x1b[2J", "preview": "x"}, arg_digest="d", policy="p",
                 timeout=60)
    monkeypatch.setattr(approvals_cmd, "_store", lambda: s)
    out = CliRunner().invoke(approvals_cmd.approvals, ["show", r.id]).output
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]52" in out


def test_a_sandbox_cannot_flood_the_queue(tmp_path):
    from agentvm.approvals import MAX_PENDING

    s = store(tmp_path)
    for _ in range(MAX_PENDING):
        submit(s)
    with pytest.raises(ApprovalError, match="waiting for a human"):
        submit(s)
    other = s.submit(kind="tool", sandbox="sb-2", agent="b", target="x", summary={}, arg_digest="d", policy="p",
                     timeout=60)
    assert other.state == "pending"  # another sandbox is not affected


def test_an_abandoned_wait_expires_its_request_and_does_not_count_against_the_sandbox(tmp_path):
    """A waiter cancelled (its sandbox stopped, paused or hung up) expires its row: nobody can
    approve an action that will never run, and dead rows never fill the per-sandbox limit."""
    import asyncio

    from agentvm.approvals import MAX_PENDING

    s = store(tmp_path)

    async def go():
        for _ in range(MAX_PENDING + 2):
            r = submit(s)
            t = asyncio.ensure_future(s.wait(r.id))
            await asyncio.sleep(0.01)
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
            assert s.get(r.id).state == "expired" and "abandoned" in s.get(r.id).note
        return submit(s)

    r = asyncio.run(go())
    assert r.state == "pending"


def test_two_answers_by_the_same_user_cannot_both_win(tmp_path):
    s = store(tmp_path)
    r = submit(s)
    assert s.answer(r.id, True, "console:console").state == "approved"
    with pytest.raises(ApprovalError):  # a second console tab, the same actor
        s.answer(r.id, False, "console:console")
    assert s.get(r.id).state == "approved"


# ---------------------------------------------------------------------------- the console's approve
def _console_post(console, path: str, form: str, *, cookie: str | None = None):
    """One POST through the console's own ASGI entry (the daemon hands it the scope the same
    way), as a browser session on the TCP listener: -> (status, body)."""
    headers = [(b"host", b"127.0.0.1:8765"), (b"content-type", b"application/x-www-form-urlencoded"),
               (b"origin", b"http://127.0.0.1:8765")]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8765), "agentvm.transport": "tcp"}
    body = [form.encode()]
    out = {"status": None, "body": b""}

    async def receive():
        return {"type": "http.request", "body": body.pop() if body else b"", "more_body": False}

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    asyncio.run(console(scope, receive, send))
    return out["status"], out["body"]


def _console(tmp_path):
    from types import SimpleNamespace

    from agentvm.console.app import COOKIE, Console

    s = store(tmp_path)
    from agentvm.daemon.control import ControlPlane

    # the console's approvals go through the control plane's own method (its store: this one)
    control = SimpleNamespace(gate=SimpleNamespace(approval_store=lambda: s))
    control.answer_approval = lambda *a, **kw: ControlPlane.answer_approval(control, *a, **kw)
    control._approval_call = lambda fn: ControlPlane._approval_call(control, fn)
    control._store = lambda: ControlPlane._store(control)
    control._wake_for_approval = lambda req, by: None  # (no sandbox here to wake)
    c = Console(control, token=None, listen="127.0.0.1:8765")
    sid, sess = c.sessions.redeem(c.sessions.mint_code())
    return c, s, f"{COOKIE}={sid}", sess["csrf"]


@pytest.mark.parametrize("digest", [None, "", "sha256:ff"])
def test_the_console_refuses_an_approval_without_the_digest_it_showed(tmp_path, digest):
    """Issue 35: the console's approve handler treated the shown digest as optional."""
    c, s, cookie, csrf = _console(tmp_path)
    r = submit(s)
    form = f"csrf={csrf}" + (f"&digest={digest}" if digest is not None else "")
    status, body = _console_post(c, f"/approvals/{r.id}/approve", form, cookie=cookie)
    assert status == 409, body[:300]
    assert s.get(r.id).state == "pending"  # nothing was approved


def test_the_console_approves_with_the_digest_it_showed_and_denies_without_one(tmp_path):
    c, s, cookie, csrf = _console(tmp_path)
    r = submit(s)
    status, _ = _console_post(c, f"/approvals/{r.id}/approve", f"csrf={csrf}&digest={r.digest}", cookie=cookie)
    assert status == 303 and s.get(r.id).state == "approved" and s.get(r.id).by == "console:console"
    r2 = submit(s)
    status, _ = _console_post(c, f"/approvals/{r2.id}/deny", f"csrf={csrf}", cookie=cookie)  # a denial needs none
    assert status == 303 and s.get(r2.id).state == "denied"


# ---------------------------------------------------------------------------- a waiter that is gone
def test_a_waiter_whose_requester_is_gone_expires_its_request_at_once(tmp_path):
    s = store(tmp_path)
    r = submit(s)
    flag = {"gone": False}

    async def go():
        t = asyncio.ensure_future(s.wait(r.id, gone=lambda: flag["gone"]))
        await asyncio.sleep(0.2)
        assert not t.done() and s.get(r.id).state == "pending"
        flag["gone"] = True
        async with asyncio.timeout(2):
            return await t

    out = asyncio.run(go())
    assert out.state == "expired" and "requester is gone" in out.note
    with pytest.raises(ApprovalError, match="already expired") as e:
        s.answer(r.id, True, "cli:op")
    assert e.value.code == "approvals.expired"


def test_a_liveness_check_that_fails_counts_as_gone(tmp_path):
    s = store(tmp_path)
    r = submit(s)

    def broken():
        raise OSError("bad fd")

    assert asyncio.run(s.wait(r.id, gone=broken)).state == "expired"


def test_a_waiting_request_beats_and_an_unbeaten_one_is_reaped_as_orphaned(tmp_path):
    from agentvm import approvals as ap

    s = store(tmp_path)
    r = submit(s)

    async def go():
        t = asyncio.ensure_future(s.wait(r.id))
        await asyncio.sleep(0.1)
        alive = s._db.execute("SELECT alive FROM approvals WHERE id=?", (r.id,)).fetchone()[0]
        t.cancel()
        return alive

    assert time.time() - asyncio.run(go()) < 5
    r2 = submit(s)
    s._db.execute("UPDATE approvals SET alive=? WHERE id=?", (time.time() - ap.ORPHANED_AFTER - 1, r2.id))
    assert s.list() == [] and s.get(r2.id).state == "expired" and "orphaned" in s.get(r2.id).note


def _endpoint(s):
    """An Endpoint with only what ``hold`` reads: a real instance (a subclass that skips the
    sockets and files of ``__init__``), since the compiled gate's Endpoint is a cdef class whose
    methods read their fields from the object's C layout - a stand-in object as ``self``
    crashes the interpreter there."""
    from types import SimpleNamespace

    from agentvm.gate.endpoint import Endpoint

    class Held(Endpoint):
        def __init__(self):  # noqa: D107 - nothing of the base's
            self.logged = []

        def log(self, **kw):
            self.logged.append(kw)

    ep = Held()
    ep.gate = SimpleNamespace(approval_store=lambda: s)
    ep.sandbox_id, ep.agent, ep.policy_digest = "sb-1", "a", "sha256:p"
    ep.approval_timeout, ep.approval_webhook = 60.0, None
    return ep


def test_a_held_egress_request_expires_when_its_connection_is_cut(tmp_path):
    """The gate's side (``exchange.Hold`` carried out by ``Endpoint.hold``): the requester's
    connection is cut while a human has not answered - the request expires, the flow is
    answered denied, and a later approval is refused."""
    from types import SimpleNamespace

    from agentvm.gate import exchange as ex

    s = store(tmp_path)
    ep = _endpoint(s)
    req = SimpleNamespace(method="POST", host="pay.test", port=443, path="/v1/charges", content_length=0, chunked=False)
    cmd = SimpleNamespace(req=req, decision=SimpleNamespace(rule_id="charges"))
    flag = {"gone": False}

    async def go():
        t = asyncio.ensure_future(ep.hold(cmd, gone=lambda: flag["gone"]))
        await asyncio.sleep(0.2)
        assert s.list()[0].state == "pending"
        flag["gone"] = True
        async with asyncio.timeout(2):
            return await t

    answer = asyncio.run(go())
    assert isinstance(answer, ex.Answered) and not answer.approved and "requester is gone" in answer.reason
    with pytest.raises(ApprovalError, match="already expired"):
        s.answer(answer.request_id, True, "cli:op")


@pytest.mark.parametrize("check", ["left", "raises"])
def test_an_egress_request_approved_as_its_requester_leaves_is_not_forwarded(tmp_path, check):
    """``Endpoint.hold`` answered approved without asking again whether the requester was still
    there (the tool gateway does): approved in the instant the connection was cut, the request
    went out for nobody. A ``gone()`` that fails counts as gone."""
    from types import SimpleNamespace

    from agentvm.gate import exchange as ex

    s = store(tmp_path)
    ep = _endpoint(s)
    req = SimpleNamespace(method="POST", host="pay.test", port=443, path="/v1/charges", content_length=0, chunked=False)
    cmd = SimpleNamespace(req=req, decision=SimpleNamespace(rule_id="charges"))
    left = {"now": False}

    def gone():
        if left["now"] and check == "raises":
            raise OSError("the socket is gone too")
        return left["now"]

    async def go():
        t = asyncio.ensure_future(ep.hold(cmd, gone=gone))
        await asyncio.sleep(0.2)
        row = s.list()[0]
        s.answer(row.id, True, "cli:op")
        left["now"] = True  # in the same instant (no await between): the waiter sees both
        async with asyncio.timeout(2):
            return await t, row.id

    answer, rid = asyncio.run(go())
    assert s.get(rid).state == "approved"
    assert isinstance(answer, ex.Answered) and not answer.approved and answer.rule_id == "client-gone"

"""The daemon's HTTP API routes: each request's path, body and query typed by its model
(``agentvm.daemon.api``: a wrong type is a 400 naming the field, before anything runs), then
one call of the control plane (``agentvm.daemon.control``), its answer written back as JSON or
a stream. Nothing here decides anything.

    GET    /v1/sandboxes                      ps
    POST   /v1/sandboxes                      create  {"spec": "<yaml>", "file": "...", "ttl", "idle_timeout"}
    POST   /v1/sandboxes/NAME/start|stop|restart
    DELETE /v1/sandboxes/NAME                 rm
    POST   /v1/sandboxes/NAME/exec            {"argv": [...], "timeout": s}  -> NDJSON stream
    GET    /v1/sandboxes/NAME/logs
    PUT    /v1/sandboxes/NAME/files?path=P    cp into the workspace (body = bytes, streamed: [&tar=1] a folder)
    GET    /v1/sandboxes/NAME/files?path=P    cp out of the workspace (JSON; with
                                              'Accept: application/octet-stream', the bytes, streamed)
    POST   /v1/sandboxes/NAME/policy          {"op": allow|deny|remove|pause|resume|revoke|restore, ...}
    GET    /v1/audit?since=&sandbox=          GET /v1/audit/verify
    GET    /v1/events                         NDJSON stream of decisions and lifecycle events
    GET    /v1/approvals[/ID], POST /v1/approvals/ID/approve|deny
    POST   /v1/console/login                  a one-time login link for the web console
    POST   /v1/fleet/plan|apply|rollback, GET /v1/fleet/status   promotion (agentvm.fleet)
    POST   /v1/run, /v1/run/frames            one command in a fresh sandbox, streamed
    POST   /v1/run/attach                     the same with stdin / a terminal: an upgraded
    POST   /v1/sandboxes/NAME/exec/attach     connection of frames both ways (docs/daemon.md)
    POST   /v1/shutdown
    GET    /v1/openapi.json                   this API, as OpenAPI (from the models)
    GET    /metrics                           Prometheus exposition (agentvm.observe.metrics)
"""

from __future__ import annotations

import asyncio
import base64
import json
from urllib.parse import parse_qs, urlsplit

from agentvm.daemon import api
from agentvm.daemon.events import refuse

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def dispatch(h, method: str, target: str, body: bytes, conn, writer, actor: str) -> None:
    """One API request on HttpServer ``h`` (its control plane: ``h.cp``)."""
    cp = h.cp
    u = urlsplit(target)
    parts = [p for p in u.path.split("/") if p]
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    doc = _json_body(body) if body and method in ("POST",) and parts[-1:] != ["files"] else None
    if parts == ["metrics"] and method == "GET":
        data = await asyncio.to_thread(cp.observer.exposition)
        return await h._raw(conn, writer, 200, data, METRICS_TYPE)
    if parts[:1] != ["v1"]:
        raise refuse("api.no-route", "unknown path")
    p = parts[1:]
    if p == ["openapi.json"] and method == "GET":
        from agentvm import __version__

        return await h._json(conn, writer, 200, api.openapi(__version__))
    if p[:1] == ["run"] and method == "POST" and isinstance(doc, dict) and "framing" in doc:
        # a client of this session's first framed runs: refused before anything runs
        raise refuse("api.bad-request", "'framing' is not a field of /v1/run: the framed run is "
                     "POST /v1/run/frames", "reinstall agent-vm's client: bash scripts/install.sh")
    model = body_model(method, p)
    m = api.parse(model, doc) if model is not None else None  # typed, whole, before anything runs
    query = query_model(method, p)
    qm = api.parse_query(query, q) if query is not None else None

    async def answer(doc, status: int = 200):
        return await h._json(conn, writer, status, doc)

    if p == ["sandboxes"] and method == "GET":
        return await answer(cp.sandboxes())
    if p == ["sandboxes"] and method == "POST":
        return await answer(await cp.create(m.spec, m.file, ttl=m.ttl, idle_timeout=m.idle_timeout, actor=actor), 201)
    if len(p) >= 2 and p[0] == "sandboxes":
        name = p[1]
        action = p[2] if len(p) > 2 else None
        if action is None and method == "GET":
            return await answer(cp.sandbox(name))
        if action is None and method == "DELETE":
            ws = await cp.remove(name, keep_workspace=qm.keep_workspace in ("1", "true"), actor=actor)
            return await answer({"removed": name, "workspace": ws})
        if action in ("start", "stop", "restart") and method == "POST":
            if action == "stop":
                await cp.stop(name, actor=actor)
                return await answer(cp.sandbox(name))
            if action == "restart":
                return await answer(await cp.restart(name, actor=actor))
            return await answer(await cp.start_and_wait(name, actor=actor))
        if action == "snapshot" and method == "POST":
            return await answer(await cp.snapshot(name, tag=m.tag, actor=actor, memory=m.memory), 201)
        if action == "restore" and method == "POST":
            return await answer(await cp.restore_snapshot(name, m.snapshot, actor=actor))
        if action in ("pause", "unpause", "suspend", "resume") and method == "POST":
            verb = {"resume": "resume_sandbox"}.get(action, action)  # (cp.resume: `up --no-resume`'s flag)
            return await answer(await getattr(cp, verb)(name, actor=actor))
        if action == "exec" and len(p) == 4 and p[3] == "attach" and method == "POST":
            io = h.attached(conn, writer)
            try:
                status = await cp.exec_attached(name, list(m.argv), io, tty=_tty(m.tty), timeout=m.timeout,
                                                actor=actor)
            except BaseException:
                io.close()
                raise
            se = status.setup_error
            text = f"agentvm: exec failed at step '{se.get('step')}': {se.get('message')}\n" if se else ""
            return await io.exit(status.exit_code, text)
        if action == "exec" and len(p) == 3 and method == "POST":
            out = h.output(conn, writer)
            status = await cp.exec(name, list(m.argv), out, timeout=m.timeout, actor=actor)
            await h._stream_line(conn, writer, {"exit_code": status.exit_code, "timed_out": status.timed_out,
                                                "setup_error": status.setup_error})
            return await h._stream_end(conn, writer)
        if action == "logs" and method == "GET":
            return await answer({"log": await cp.logs(name, qm.tail)})
        if action == "files":
            tar = qm.tar == "1"
            if method == "PUT":
                return await answer(await cp.copy_in(name, qm.path, body, tar=tar, actor=actor))
            if method == "GET" and RAW_TYPE in h.header("accept"):
                return await _download(h, cp, name, qm.path, tar, conn, writer, actor)
            if method == "GET":
                got = await cp.copy_out(name, qm.path, tar=tar, actor=actor)
                return await answer({**got, "data": base64.b64encode(got["data"]).decode()})
            cp.row(name)  # (a sandbox that does not exist: not-found first)
            raise refuse("api.method-not-allowed", "use GET or PUT")
        if action == "policy" and method == "POST":
            if m.op == "show":
                return await answer(cp.policy_view(name))
            from agentvm.policy_patch import parse_patch

            return await answer(await cp.change_policy(name, parse_patch(m.fields()), actor=actor))
    if p == ["snapshots"] and method == "GET":
        return await answer(cp.snapshot_list())
    if len(p) == 2 and p[0] == "snapshots" and method == "DELETE":
        return await answer(cp.snapshot_remove(p[1], actor=actor))
    if p == ["fork"] and method == "POST":
        return await answer(await cp.fork(m.source, m.new, actor=actor, memory=m.memory), 201)
    if p == ["console", "login"] and method == "POST":
        return await answer(h.console_login(actor))
    if p[:1] == ["approvals"]:
        return await answer(_approvals(cp, method, p[1:], m, qm, actor))
    if p[:1] == ["fleet"]:
        return await answer(await _fleet(cp, method, p[1:], m, actor))
    if p == ["run", "attach"] and method == "POST":
        io = h.attached(conn, writer)
        try:
            result = await cp.run_attached(run_request(m), io, tty=_tty(m.tty), actor=actor)
        except BaseException:
            io.close()
            raise
        if m.report == "json":
            return await io.exit(result.exit_code, json.dumps(result.to_dict(), sort_keys=True) + "\n")
        from agentvm.runreport import render

        return await io.exit(result.exit_code, render(result.to_dict()))
    if p in (["run"], ["run", "frames"]) and method == "POST":
        if p == ["run", "frames"]:
            # the thin client's: the same run, answered in frames (a daemon without this path
            # answers 404 before running anything, and the client takes the full path)
            h.set_framed()
        result = await cp.run(run_request(m), h.output(conn, writer), actor=actor)
        if h.framed():
            from agentvm.runreport import render

            await h._stream_exit(conn, writer, result.exit_code, render(result.to_dict()))
        else:
            await h._stream_line(conn, writer, {"result": result.to_dict()})
        return await h._stream_end(conn, writer)
    if p == ["audit"] and method == "GET":
        return await answer(cp.audit_records(since=_since(qm.since) if qm.since is not None else None,
                                             sandbox=qm.sandbox))
    if p == ["audit", "verify"] and method == "GET":
        return await answer(cp.audit_verify())
    if p == ["events"] and method == "GET":
        return await _events(h, conn, writer)
    if p == ["shutdown"] and method == "POST":
        cp.record("daemon.shutdown-requested", actor=actor)
        await answer({"stopping": True})
        cp.stopping.set()
        return
    raise refuse("api.no-route", f"no route for {method} {u.path}")


RAW_TYPE = "application/octet-stream"


async def _download(h, cp, name: str, path: str, tar: bool, conn, writer, actor: str) -> None:
    """A cp download as the bytes themselves, streamed from a file descriptor (a workspace
    file, or a folder's tar staged on the state disk); what it is in ``X-Agentvm-Kind``
    (file|tar) and, for a folder, ``X-Agentvm-Counts`` (JSON)."""
    got = await cp.copy_out_stream(name, path, tar=tar, actor=actor)
    fd = got.pop("fd")
    try:
        size = got.pop("size")
        headers = [("content-type", RAW_TYPE), ("x-agentvm-kind", got["kind"]),
                   ("x-agentvm-counts", json.dumps(got, sort_keys=True))]
        await h._send_fd(conn, writer, fd, size, headers)
    finally:
        import os

        os.close(fd)


def _tty(t) -> tuple[int, int] | None:
    return (t.rows, t.cols) if t is not None else None


def run_request(m: api.Run):
    """The API's run body as the control plane's RunRequest."""
    from agentvm.daemon.control import RunRequest

    return RunRequest(
        command=tuple(m.command) if m.command is not None else None,
        cli=m.cli.model_dump(exclude_unset=True, mode="json") if m.cli is not None else None,
        spec=m.spec, file=m.file, preset_dirs=tuple(m.preset_dirs) if m.preset_dirs is not None else None,
        stdin=base64.b64decode(getattr(m, "stdin", None) or ""),
        mounts=tuple((x.host, x.path, x.writable) for x in m.mounts), env=dict(m.env), timeout=m.timeout,
        memory=m.memory, allow=tuple(m.allow), hosts=dict(m.hosts), network=m.network, substrate=m.substrate)


def _approvals(cp, method: str, p: list, m, qm, actor: str):
    """The approvals queue over the API (the SDK, a webhook's answer): list, show, approve, deny."""
    if not p and method == "GET":
        return cp.approvals(all=qm.all in ("1", "true"))
    if len(p) == 1 and method == "GET":
        return cp.approval(p[0])
    if len(p) == 2 and p[1] in ("approve", "deny") and method == "POST":
        # typed by api.ApprovalAnswer; a digest binds the approval to the request shown
        by = f"{m.via} via api:{actor}" if m.via else f"api:{actor}"
        return cp.answer_approval(p[0], p[1] == "approve", by=by, note=m.note, digest=m.digest)
    cp._store()  # (no queue: approvals.unavailable before no-route, as before)
    raise refuse("api.no-route", "approvals: GET /v1/approvals[/ID], POST /v1/approvals/ID/approve|deny")


async def _fleet(cp, method: str, p: list, m, actor: str) -> dict:
    from agentvm.daemon.fleetops import Replay

    if p == ["plan"] and method == "POST":
        rp = m.replay
        replay = Replay(rp.since, rp.last, rp.all) if rp is not None else None
        return await cp.fleet_plan(m.repo, m.commit, replay, actor=actor)
    if p == ["apply"] and method == "POST":
        return await cp.fleet_apply(m.repo, m.commit, digest=m.digest, canary=m.canary, actor=actor)
    if p == ["status"] and method == "GET":
        return cp.fleet_status()
    if p == ["rollback"] and method == "POST":
        return await cp.fleet_rollback(m.to, canary=m.canary, actor=actor)
    raise refuse("api.no-route", "fleet: POST /v1/fleet/plan|apply|rollback, GET /v1/fleet/status")


async def _events(h, conn, writer) -> None:
    q = h.cp.subscribe()
    try:
        await h._stream_start(conn, writer)
        while True:
            rec = await q.get()
            if rec is None:
                break
            await h._stream_line(conn, writer, rec)
    finally:
        h.cp.unsubscribe(q)
    await h._stream_end(conn, writer)


_SANDBOX_POSTS = {"start": api.Empty, "stop": api.Empty, "restart": api.Empty, "exec": api.Exec,
                  "policy": api.POLICY_CHANGE, "pause": api.Empty, "unpause": api.Empty, "suspend": api.Empty,
                  "resume": api.Empty, "snapshot": api.SnapshotTake, "restore": api.SnapshotRestore}
_FLEET_POSTS = {"plan": api.FleetPlan, "apply": api.FleetApply, "rollback": api.FleetRollback}


def body_model(method: str, p: list[str]):
    """The model of a route's JSON body (``api.ROUTES`` publishes the same), or None."""
    if method != "POST":
        return None
    if p == ["sandboxes"]:
        return api.CreateSandbox
    if len(p) == 3 and p[0] == "sandboxes":
        return _SANDBOX_POSTS.get(p[2])
    if len(p) == 4 and p[0] == "sandboxes" and p[2:] == ["exec", "attach"]:
        return api.ExecAttach
    if p in (["run"], ["run", "frames"]):
        return api.Run
    if p == ["fork"]:
        return api.Fork
    if p == ["run", "attach"]:
        return api.RunAttach
    if len(p) == 3 and p[0] == "approvals" and p[2] in ("approve", "deny"):
        return api.ApprovalAnswer
    if len(p) == 2 and p[0] == "fleet":
        return _FLEET_POSTS.get(p[1])
    if p in (["console", "login"], ["shutdown"]):
        return api.Empty
    return None


def query_model(method: str, p: list[str]):
    if len(p) == 2 and p[0] == "sandboxes" and method == "DELETE":
        return api.RmQuery
    if len(p) == 3 and p[0] == "sandboxes" and p[2] == "logs" and method == "GET":
        return api.LogsQuery
    if len(p) == 3 and p[0] == "sandboxes" and p[2] == "files":
        return api.FilesQuery
    if p == ["audit"] and method == "GET":
        return api.AuditQuery
    if p == ["approvals"] and method == "GET":
        return api.ApprovalsQuery
    return None


def _json_body(body: bytes) -> dict:
    """A request body: one JSON object, or a 400 that says what is wrong."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise refuse("api.bad-request", "the request body is nested too deeply") from None
    except ValueError as exc:
        raise refuse("api.bad-request", f"the request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise refuse("api.bad-request", f"the request body must be a JSON object, not {type(doc).__name__}")
    return doc


def _since(text: str) -> float:
    from agentvm.units import parse_since

    try:
        return parse_since(text)
    except ValueError as exc:
        raise refuse("api.bad-request", f"since: {exc}", hint="a Unix time, a duration ago (10m, 2h, 1d) or an ISO date") from None

"""envd's Connect services (``process.Process``, ``filesystem.Filesystem``) over an E2BBackend.

Served by ``connectrpc``'s ASGI application with the generated code in ``_gen`` (the same
messages and paths the SDKs use). The app in ``app.py`` has already checked the sandbox id and
its access token; each call finds its sandbox again from the same headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import operator
import os
import re
import signal as _signal
import time
from typing import TYPE_CHECKING

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof
from protobuf.wkt.google.protobuf import timestamp_pb

from agentvm.e2b._gen import filesystem_connect as fsc
from agentvm.e2b._gen import filesystem_pb as fpb
from agentvm.e2b._gen import process_connect as pc
from agentvm.e2b._gen import process_pb as ppb
from agentvm.e2b.backend import BackendFailure, Entry, EventChannel, ExecSpec
from agentvm.e2b.model import Proc, resolve_path

if TYPE_CHECKING:
    from agentvm.e2b.app import E2BService
    from agentvm.e2b.model import Box

_CODES = {"not-found": Code.NOT_FOUND, "exists": Code.ALREADY_EXISTS, "permission": Code.PERMISSION_DENIED,
          "not-dir": Code.INVALID_ARGUMENT, "is-dir": Code.INVALID_ARGUMENT, "invalid": Code.INVALID_ARGUMENT,
          "unsupported": Code.UNIMPLEMENTED, "gone": Code.UNAVAILABLE, "internal": Code.INTERNAL,
          "too-many": Code.FAILED_PRECONDITION}  # a directory past MAX_LIST_ENTRIES: no retry will help


def _fail(exc: BackendFailure) -> ConnectError:
    return ConnectError(_CODES.get(exc.kind, Code.INTERNAL), str(exc))


def _box(svc: "E2BService", ctx) -> "Box":
    h = ctx.request_headers
    box = svc.envd_box(h.get("e2b-sandbox-id"), h.get("x-access-token"))
    if box is None or box.state != "running":
        raise ConnectError(Code.UNAVAILABLE, f"The sandbox {h.get('e2b-sandbox-id')!r} was not found")
    return box


def _keepalive(ctx) -> float:
    try:
        return min(max(float(ctx.request_headers.get("keepalive-ping-interval") or 50), 5.0), 300.0)
    except ValueError:
        return 50.0


def _resolve(path: str) -> str:
    try:
        return resolve_path(path)
    except BackendFailure as exc:
        raise _fail(exc) from None


# -- process -----------------------------------------------------------------------------------

def _select(box: "Box", sel) -> "Proc":
    s = sel.selector if sel is not None else None
    if s is not None and s.field == "pid":
        p = box.procs.get(int(s.value))
    elif s is not None and s.field == "tag":
        p = next((p for p in box.procs.values() if p.tag == s.value), None)
    else:
        p = None
    if p is None or p.done:
        raise ConnectError(Code.NOT_FOUND, "process not found")
    return p


def _event(ev) -> ppb.ProcessEvent:
    if ev.kind == "exit":
        status = f"exit status {ev.exit_code}" if ev.exit_code >= 0 else "error"
        end = ppb.ProcessEvent.EndEvent(exit_code=ev.exit_code, exited=True, status=status, error=ev.error)
        return ppb.ProcessEvent(event=Oneof("end", end))
    return ppb.ProcessEvent(event=Oneof("data", ppb.ProcessEvent.DataEvent(output=Oneof(ev.kind, ev.data))))


# Back-pressure (docs/e2b.md "Back-pressure"): a process's output is handed to each client that
# follows it (Start's stream, Connect's) through a channel of SUBSCRIBER_EVENTS events (chunks of
# at most 64 KiB). A full channel makes the process wait - the daemon stops reading its pipe and
# the command blocks on its write - for up to lag_seconds(); a client that has not made room by
# then is dropped: its stream ends with RESOURCE_EXHAUSTED and the process goes on without it.
SUBSCRIBER_EVENTS = 8
MAX_SUBSCRIBERS = 8  # clients following one process at once
MAX_PROCS = 32  # processes followed at once in one sandbox (running, starting, or ended with a client still reading)
MAX_WATCH_STREAMS = 16  # watch_dir streams open at once in one sandbox (create_watcher has its own 16)
MAX_WATCHERS = 16  # create_watcher watchers kept at once in one sandbox
# Listings and watches (docs/e2b.md "Listings and watches"): the agent fills the directories, so
# one listing is capped in the sandbox (backend.MAX_LIST_ENTRIES), parsed and diffed off the
# loop, at most MAX_LISTINGS_PER_TENANT run at once per tenant (the others wait their turn), and
# what the tenant's watchers keep between polls (a digest per path) is counted against
# WATCH_BUDGET: past it the watch is refused (RESOURCE_EXHAUSTED).
MAX_LISTINGS_PER_TENANT = 4
WATCH_BUDGET = 32 * 1024 * 1024  # estimated bytes held by one tenant's watchers together
ENTRY_COST = 120  # estimated bytes one watched path costs beyond its name (dict slot, digest)
LAG_SECONDS = 30.0
log = logging.getLogger("agentvm.e2b")


def lag_seconds() -> float:
    """How long a process waits for a client that does not read (AGENTVM_E2B_SUBSCRIBER_LAG,
    seconds, 1..3600; default LAG_SECONDS)."""
    try:
        return min(max(float(os.environ.get("AGENTVM_E2B_SUBSCRIBER_LAG") or LAG_SECONDS), 1.0), 3600.0)
    except ValueError:
        return LAG_SECONDS


class _Dropped:
    """The last item of a dropped client's channel: its stream ends with this error."""

    def __init__(self, message: str):
        self.message = message


def _retire(box: "Box", proc: "Proc") -> None:
    """An ended process leaves ``box.procs`` once no client follows it any more (its exit was
    delivered, or its clients left); a client that has not taken its end within lag_seconds()
    is dropped and the process leaves then (what its channel held is released)."""
    if not proc.done:
        return
    if not proc.subscribers:
        if box.procs.get(proc.pid) is proc:  # (a later process with the same pid stays)
            del box.procs[proc.pid]
        return
    if proc.expiry is None:
        def expire() -> None:
            for sub in list(proc.subscribers):
                sub.drop(_Dropped(f"process {proc.pid} ended {lag_seconds():.0f} s ago and this stream did not read "
                                  "its end: dropped"))
            proc.subscribers.clear()
            _retire(box, proc)

        proc.expiry = asyncio.get_running_loop().call_later(lag_seconds(), expire)


async def _pump(proc: "Proc", box: "Box | None" = None) -> None:
    lag = lag_seconds()
    try:
        async for ev in proc.handle.events():
            if ev.kind == "exit":
                for sub in list(proc.subscribers):
                    sub.finish(ev)  # the end always fits: never waits
                break
            for sub in list(proc.subscribers):
                if await sub.put(ev, timeout=lag):
                    continue
                with contextlib.suppress(ValueError):
                    proc.subscribers.remove(sub)
                if not sub.finished:  # still full after `lag`: the client does not read
                    log.warning("e2b: process %s: a client that read nothing for %.0f s was dropped", proc.pid, lag)
                    sub.drop(_Dropped(
                        f"this stream was dropped: its client read none of process {proc.pid}'s output for {lag:.0f} s "
                        f"({SUBSCRIBER_EVENTS} chunks behind; the daemon does not buffer output for a client that "
                        "does not read). The process keeps running: follow it again with connect"))
    finally:
        proc.done = True
        close = getattr(proc.handle, "close", None)
        if close is not None:
            close()  # what the process's own channel holds is released; its pump never waits again
        for sub in list(proc.subscribers):
            sub.finish()
        if box is not None:
            _retire(box, proc)


def _subscribe(proc: "Proc") -> EventChannel:
    if len(proc.subscribers) >= MAX_SUBSCRIBERS:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_SUBSCRIBERS} streams follow one process")
    sub = EventChannel(SUBSCRIBER_EVENTS)
    proc.subscribers.append(sub)
    return sub


def _unsubscribe(proc: "Proc", sub: EventChannel, box: "Box | None" = None) -> None:
    with contextlib.suppress(ValueError):
        proc.subscribers.remove(sub)
    sub.close()  # what it held is released; a pump waiting for room in it goes on
    if box is not None:
        _retire(box, proc)
        if not proc.subscribers and proc.expiry is not None:
            proc.expiry.cancel()


async def _follow(q: EventChannel, interval: float, wrap):
    keep = ppb.ProcessEvent(event=Oneof("keepalive", ppb.ProcessEvent.KeepAlive()))
    while True:
        try:
            ev = await asyncio.wait_for(q.get(), interval)
        except asyncio.TimeoutError:
            yield wrap(keep)
            continue
        if ev is EventChannel.END:
            return
        if isinstance(ev, _Dropped):
            raise ConnectError(Code.RESOURCE_EXHAUSTED, ev.message)
        yield wrap(_event(ev))
        if ev.kind == "exit":
            return


class ProcessService:
    def __init__(self, svc: "E2BService"):
        self.svc = svc

    async def list(self, request, ctx):
        box = _box(self.svc, ctx)
        return ppb.ListResponse(processes=[
            ppb.ProcessInfo(config=ppb.ProcessConfig(cmd=p.cmd, args=p.args, envs=p.envs, cwd=p.cwd), pid=p.pid,
                            tag=p.tag) for p in box.procs.values() if not p.done])

    async def start(self, request, ctx):
        box = _box(self.svc, ctx)
        cfg = request.process
        if cfg is None or not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        pty = None
        if request.pty is not None:
            size = request.pty.size
            pty = (size.cols, size.rows) if size is not None else (80, 24)
        from agentvm.e2b import templates as tpls
        from agentvm.errors import PolicyDenied

        try:  # the same names refused as at create (templates.check_envs)
            tpls.check_command_envs(box.template, dict(cfg.envs or {}), self.svc.home)
        except PolicyDenied as exc:
            raise ConnectError(Code.PERMISSION_DENIED, str(exc)) from None
        envs = dict(box.envs)
        envs.update(dict(cfg.envs or {}))
        cwd = _resolve(cfg.cwd) if cfg.cwd else None
        user = _user(ctx)
        spec = ExecSpec([cfg.cmd, *cfg.args], env=envs, cwd=cwd, stdin=bool(request.stdin), pty=pty)
        # the slot is taken before the first await: concurrent Starts cannot all pass the check
        if len(box.procs) + box.starting >= MAX_PROCS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_PROCS} processes run at once in a sandbox "
                                                        "through this API; wait for one to end or kill one")
        box.starting += 1
        try:
            handle = await self.svc.backend.exec(box.name, spec)  # (cancelled: the backend aborts it)
        except BackendFailure as exc:
            raise _fail(exc) from None
        finally:
            box.starting -= 1
        pid = handle.pid or (max(box.procs, default=10_000) + 1)
        proc = Proc(pid, request.tag, cfg.cmd, list(cfg.args), dict(cfg.envs or {}), cfg.cwd, handle)
        q = _subscribe(proc)
        box.procs[pid] = proc
        proc.task = asyncio.create_task(_pump(proc, box))
        self.svc.record("e2b.exec", tenant=box.tenant, sandbox=box.name, argv=[cfg.cmd, *cfg.args], user_asked=user, pid=pid)
        try:
            yield ppb.StartResponse(event=ppb.ProcessEvent(event=Oneof("start", ppb.ProcessEvent.StartEvent(pid=pid))))
            async for r in _follow(q, _keepalive(ctx), lambda e: ppb.StartResponse(event=e)):
                yield r
        finally:
            _unsubscribe(proc, q, box)

    async def connect(self, request, ctx):
        box = _box(self.svc, ctx)
        proc = _select(box, request.process)
        q = _subscribe(proc)
        try:
            yield ppb.ConnectResponse(event=ppb.ProcessEvent(event=Oneof("start", ppb.ProcessEvent.StartEvent(
                pid=proc.pid))))
            async for r in _follow(q, _keepalive(ctx), lambda e: ppb.ConnectResponse(event=e)):
                yield r
        finally:
            _unsubscribe(proc, q, box)

    async def update(self, request, ctx):
        proc = _select(_box(self.svc, ctx), request.process)
        if request.pty is not None and request.pty.size is not None:
            try:
                await proc.handle.resize(request.pty.size.cols, request.pty.size.rows)
            except BackendFailure as exc:
                raise _fail(exc) from None
        return ppb.UpdateResponse()

    async def send_input(self, request, ctx):
        proc = _select(_box(self.svc, ctx), request.process)
        inp = request.input
        data = inp.input.value if inp is not None and inp.input is not None else b""
        try:
            await proc.handle.write_stdin(data)
        except BackendFailure as exc:
            raise _fail(exc) from None
        return ppb.SendInputResponse()

    async def stream_input(self, request, ctx):
        raise ConnectError(Code.UNIMPLEMENTED, "stdin streaming needs the daemon's exec stdin relay (docs/e2b.md)")

    async def close_stdin(self, request, ctx):
        proc = _select(_box(self.svc, ctx), request.process)
        try:
            await proc.handle.close_stdin()
        except BackendFailure as exc:
            raise _fail(exc) from None
        return ppb.CloseStdinResponse()

    async def send_signal(self, request, ctx):
        box = _box(self.svc, ctx)
        proc = _select(box, request.process)
        sig = int(request.signal or 0)
        if sig not in (int(_signal.SIGKILL), int(_signal.SIGTERM)):
            raise ConnectError(Code.INVALID_ARGUMENT, "only SIGTERM and SIGKILL")
        try:
            await self.svc.backend.signal(box.name, proc.pid, sig)
        except BackendFailure as exc:
            raise _fail(exc) from None
        self.svc.record("e2b.signal", tenant=box.tenant, sandbox=box.name, pid=proc.pid, signal=sig)
        return ppb.SendSignalResponse()


def _user(ctx) -> str:
    """The user the SDK asked for (Basic auth ``user:``). Every process runs as the sandbox's
    agent uid whatever is asked: there is no root in an agent-vm sandbox."""
    import base64

    auth = ctx.request_headers.get("authorization") or ""
    if auth.lower().startswith("basic "):
        try:
            return base64.b64decode(auth[6:]).decode().partition(":")[0]
        except ValueError:
            return "?"
    return "user"


# -- filesystem --------------------------------------------------------------------------------

def _entry(e: Entry) -> fpb.EntryInfo:
    kind = {"file": fpb.FileType.FILE, "dir": fpb.FileType.DIRECTORY, "symlink": fpb.FileType.SYMLINK}.get(
        e.type, fpb.FileType.UNSPECIFIED)
    secs = int(e.mtime)
    return fpb.EntryInfo(name=e.name, type=kind, path=e.path, size=e.size, mode=e.mode, permissions=e.permissions,
                         owner=e.owner, group=e.group,
                         modified_time=timestamp_pb.Timestamp(seconds=secs, nanos=int((e.mtime - secs) * 1e9)),
                         symlink_target=e.symlink_target, is_symlink=e.type == "symlink")


class FilesystemService:
    def __init__(self, svc: "E2BService"):
        self.svc = svc

    async def _do(self, coro):
        try:
            return await coro
        except BackendFailure as exc:
            raise _fail(exc) from None

    async def stat(self, request, ctx):
        box = _box(self.svc, ctx)
        return fpb.StatResponse(entry=_entry(await self._do(self.svc.backend.stat(box.name, _resolve(request.path)))))

    async def make_dir(self, request, ctx):
        box = _box(self.svc, ctx)
        path = _resolve(request.path)
        made = await self._do(self.svc.backend.make_dir(box.name, path))
        if not made:
            raise ConnectError(Code.ALREADY_EXISTS, f"{path} already exists")
        return fpb.MakeDirResponse(entry=_entry(await self._do(self.svc.backend.stat(box.name, path))))

    async def move(self, request, ctx):
        box = _box(self.svc, ctx)
        src, dst = _resolve(request.source), _resolve(request.destination)
        await self._do(self.svc.backend.move(box.name, src, dst))
        return fpb.MoveResponse(entry=_entry(await self._do(self.svc.backend.stat(box.name, dst))))

    def _listing(self, tenant: str) -> asyncio.Semaphore:
        gates = self.svc.listing_gates
        if tenant not in gates:
            gates[tenant] = asyncio.Semaphore(MAX_LISTINGS_PER_TENANT)
        return gates[tenant]

    async def _list(self, box, path: str, depth: int) -> list[Entry]:
        async with self._listing(box.tenant):
            return await self._do(self.svc.backend.list_dir(box.name, path, depth))

    async def list_dir(self, request, ctx):
        box = _box(self.svc, ctx)
        got = await self._list(box, _resolve(request.path), int(request.depth or 1))
        return fpb.ListDirResponse(entries=await asyncio.to_thread(lambda: [_entry(e) for e in got]))

    async def remove(self, request, ctx):
        box = _box(self.svc, ctx)
        await self._do(self.svc.backend.remove(box.name, _resolve(request.path)))
        return fpb.RemoveResponse()

    # watches: polled listings (the sandbox's own view), diffed into events
    async def _snapshot(self, box, path: str, recursive: bool, key: str) -> dict[str, int]:
        """What a watch keeps of ``path``: path -> a digest of (type, size, mtime), its low bit
        set for a file; its estimated size is held as ``box.held[key]``, within WATCH_BUDGET
        for the tenant's watches together."""
        got = await self._list(box, path, 64 if recursive else 1)
        snap, cost = await asyncio.to_thread(_compact, got)
        del got
        others = sum(c for b in list(self.svc.boxes.values()) if b.tenant == box.tenant
                     for k, c in b.held.items() if not (b is box and k == key))
        if others + cost > WATCH_BUDGET:
            box.held.pop(key, None)
            raise ConnectError(Code.RESOURCE_EXHAUSTED,
                               f"watching {path} would hold ~{cost >> 10} KiB; this tenant's watches hold "
                               f"~{others >> 10} KiB of at most {WATCH_BUDGET >> 20} MiB: stop a watch, or watch a "
                               "narrower directory")
        box.held[key] = cost
        return snap

    @staticmethod
    def _diff(old: dict, new: dict, root: str) -> list[fpb.FilesystemEvent]:
        import posixpath

        out = []
        for p in new.keys() - old.keys():
            out.append(fpb.FilesystemEvent(name=posixpath.relpath(p, root), type=fpb.EventType.CREATE))
        for p in old.keys() - new.keys():
            out.append(fpb.FilesystemEvent(name=posixpath.relpath(p, root), type=fpb.EventType.REMOVE))
        for p in new.keys() & old.keys():
            if new[p] != old[p] and new[p] & 1:
                out.append(fpb.FilesystemEvent(name=posixpath.relpath(p, root), type=fpb.EventType.WRITE))
        return out

    async def watch_dir(self, request, ctx):
        box = _box(self.svc, ctx)
        path = _resolve(request.path)
        if box.watch_streams >= MAX_WATCH_STREAMS:  # each holds a snapshot of its tree
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCH_STREAMS} watch_dir streams per sandbox; "
                                                        "stop one first")
        box.watch_streams += 1
        import secrets

        key = "stream-" + secrets.token_hex(8)
        try:
            snap = await self._snapshot(box, path, bool(request.recursive), key)
            yield fpb.WatchDirResponse(event=Oneof("start", fpb.WatchDirResponse.StartEvent()))
            last = time.monotonic()
            while box.state == "running" and box.id in self.svc.boxes:
                await asyncio.sleep(0.5)
                new = await self._snapshot(box, path, bool(request.recursive), key)
                for ev in await asyncio.to_thread(self._diff, snap, new, path):
                    yield fpb.WatchDirResponse(event=Oneof("filesystem", ev))
                    last = time.monotonic()
                snap = new
                if time.monotonic() - last > _keepalive(ctx):
                    yield fpb.WatchDirResponse(event=Oneof("keepalive", fpb.WatchDirResponse.KeepAlive()))
                    last = time.monotonic()
        finally:
            box.watch_streams -= 1
            box.held.pop(key, None)

    async def create_watcher(self, request, ctx):
        import secrets

        box = _box(self.svc, ctx)
        path = _resolve(request.path)
        if len(box.watchers) >= MAX_WATCHERS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} watchers per sandbox")
        wid = secrets.token_hex(8)
        snap = await self._snapshot(box, path, bool(request.recursive), wid)
        if len(box.watchers) >= MAX_WATCHERS:  # others were made while this one listed
            box.held.pop(wid, None)
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} watchers per sandbox")
        box.watchers[wid] = {"path": path, "recursive": bool(request.recursive), "snap": snap}
        return fpb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(self, request, ctx):
        box = _box(self.svc, ctx)
        w = box.watchers.get(request.watcher_id)
        if w is None:
            raise ConnectError(Code.NOT_FOUND, "watcher not found")
        try:
            new = await self._snapshot(box, w["path"], w["recursive"], request.watcher_id)
        except ConnectError as exc:
            if exc.code == Code.RESOURCE_EXHAUSTED:  # past a cap: the watcher cannot go on
                box.watchers.pop(request.watcher_id, None)
                box.held.pop(request.watcher_id, None)
            raise
        events = await asyncio.to_thread(self._diff, w["snap"], new, w["path"])
        w["snap"] = new
        return fpb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, request, ctx):
        box = _box(self.svc, ctx)
        box.watchers.pop(request.watcher_id, None)
        box.held.pop(request.watcher_id, None)
        return fpb.RemoveWatcherResponse()


def _compact(entries: list[Entry]) -> tuple[dict[str, int], int]:
    """A watch's snapshot (path -> digest, low bit: a file) and its estimated size in bytes."""
    snap: dict[str, int] = {}
    cost = 0
    for e in entries:
        snap[e.path] = ((hash((e.type, e.size, e.mtime)) & ((1 << 60) - 1)) << 1) | (e.type == "file")
        cost += len(e.path) + ENTRY_COST
    return snap, cost


# -- request decoding (review 8, finding 1) ----------------------------------------------------
# Every Connect request message - unary or enveloped (streaming), after decompression (a GET's
# ``?message=`` too, were one accepted: no envd method is side-effect free, so a GET is a 405)
# - is decoded by one of these codecs, so nothing a tenant sends reaches
# protobuf's native parsers unbounded: JSON nested deeper than MAX_JSON_DEPTH is refused before
# the native JSON parser (which recurses and dies of SIGSEGV at ~20,000 levels, taking the daemon
# with it) sees it; the native binary parser stops at its own depth (100); and whatever either
# raises is a typed ``invalid_argument``, never an ``unknown``/500.

MAX_JSON_DEPTH = 64  # envd's messages nest a few levels; unknown fields are skipped, not kept
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")  # an opening bracket 2, a closing one 0


def json_depth(data: bytes | bytearray) -> int:
    """How deep the arrays and objects of ``data`` (JSON text) nest, string literals skipped.
    Text that is not JSON may get any answer; the parser refuses it afterwards. Linear, in C:
    the strings are cut out by a regex, the brackets kept by ``translate``, and the running
    depth (+1 per opening, -1 per closing bracket) summed by ``accumulate``."""
    steps = _JSON_STRING.sub(b"", bytes(data)).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    if not steps:
        return 0
    if b"\x02" * (MAX_JSON_DEPTH + 1) in steps:  # the plain deep body: answered without the sum
        return MAX_JSON_DEPTH + 1
    return max(map(operator.sub, itertools.accumulate(steps), itertools.count(1)))


def _bad_message(exc: BaseException) -> ConnectError:
    return ConnectError(Code.INVALID_ARGUMENT, f"the request message could not be decoded: {type(exc).__name__}: "
                                               f"{str(exc)[:200]}")


class _BoundedCodec:
    """A connectrpc codec whose decoding errors - the native parser's too - are typed
    ``invalid_argument``; ``_check`` looks at the bytes first."""

    def __init__(self, inner):
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message) -> bytes:
        return self._inner.encode(message)

    def _check(self, data) -> None:
        pass

    def decode(self, data, message_class):
        self._check(data)
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the parser says of a tenant's bytes
            raise _bad_message(exc) from None


class BoundedJSONCodec(_BoundedCodec):
    """connectrpc's JSON codec behind a nesting bound (MAX_JSON_DEPTH)."""

    def __init__(self):
        from connectrpc.codec import proto_json_codec

        super().__init__(proto_json_codec())

    def _check(self, data) -> None:
        depth = json_depth(data)
        if depth > MAX_JSON_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"the request's JSON nests {'more than ' if depth == MAX_JSON_DEPTH + 1 else ''}"
                               f"{depth} levels deep; agent-vm's envd accepts at most {MAX_JSON_DEPTH} "
                               "(send the message as the E2B SDKs build it)")


class BoundedProtoCodec(_BoundedCodec):
    """connectrpc's binary codec; the native parser's own errors (its depth limit too) typed."""

    def __init__(self):
        from connectrpc.codec import proto_binary_codec

        super().__init__(proto_binary_codec())


def codecs() -> list:
    return [BoundedProtoCodec(), BoundedJSONCodec()]


def connect_apps(svc: "E2BService") -> dict:
    return {"/process.Process/": pc.ProcessASGIApplication(ProcessService(svc), codecs=codecs()),
            "/filesystem.Filesystem/": fsc.FilesystemASGIApplication(FilesystemService(svc), codecs=codecs())}

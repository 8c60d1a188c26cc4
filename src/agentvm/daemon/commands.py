"""Commands in sandboxes: ``exec`` in a running one, ``run`` (one command in a fresh sandbox,
the lifecycle sequence on the daemon's gate) and ``cp`` in and out of a running one's
workspace. Output is streamed to an :class:`~agentvm.daemon.pump.Output` (the transport's).

:class:`Commands` is a part of :class:`agentvm.daemon.control.ControlPlane`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from agentvm.daemon.events import refuse
from agentvm.daemon.pump import SIGNALS, Attached, ClientGone, Output, feed, pump, set_winsize
from agentvm.errors import PolicyDenied

log = logging.getLogger("agentvm.daemon")


@dataclass(frozen=True)
class RunRequest:
    """``agentvm run`` through the daemon: one command in a fresh sandbox. The options come
    either as the CLI took them (``cli``: its option names and strings, parsed by the embedded
    run's own code) or as values."""

    command: tuple[str, ...] | None = None
    cli: dict[str, Any] | None = None
    spec: str | None = None
    file: str = "<api>"
    preset_dirs: tuple[str, ...] | None = None
    stdin: bytes = b""
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (host, path, writable)
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    memory: int | None = None
    allow: tuple[str, ...] = ()
    hosts: dict[str, str] = field(default_factory=dict)
    network: str | None = None
    substrate: str | None = None


class Commands:
    """exec, run and cp (a part of the ControlPlane)."""

    async def exec(self, name: str, argv: list[str], out: Output, *, timeout: float | None = None,
                   actor: str = "operator"):
        """Run ``argv`` in the running sandbox ``name``, its output streamed to ``out``;
        returns its ExitStatus."""
        await self.wake(name, actor=actor, why="exec")  # a paused or suspended agent: woken, the caller waits
        m = self.managed.get(name)
        if m is None or m.handle is None:
            raise refuse("sandbox.not-running", f"{name} is not running", hint=f"agentvm start {name}")
        m.touch(self.state, time.time())
        self.record("operator.exec", actor=actor, sandbox=name, argv=argv)
        backend = m.backend
        o_r, o_w = os.pipe2(os.O_CLOEXEC)
        e_r, e_w = os.pipe2(os.O_CLOEXEC)
        stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        fut = asyncio.ensure_future(asyncio.to_thread(backend.exec, m.handle, argv, stdio=(stdin, o_w, e_w),
                                                      timeout=timeout))
        began = time.time()
        await out.start()
        status = await pump({o_r: "stdout", e_r: "stderr"}, fut, (o_w, e_w, stdin), out)
        _trace_exec(m, argv, began, status)
        return status

    def run_policy(self, req: RunRequest):
        """The policy of a run request (the same code as the embedded run builds it with)."""
        from agentvm.policy import MountGrant, Policy, compile_policy, with_overrides
        from agentvm.spec.loader import load_agent_text

        if req.spec:
            dirs = [Path(d) for d in req.preset_dirs] if req.preset_dirs is not None else None
            policy = compile_policy(load_agent_text(req.spec, req.file, preset_dirs=dirs).spec)
        else:
            net = (req.cli or {}).get("network") if req.cli is not None else req.network
            policy = Policy(name="run", network=net if net in ("gate", "none") else "gate")
        if req.cli is not None:
            # the thin client's options as typed: parsed here by the same code as embedded runs
            from agentvm.overrides import from_cli

            return with_overrides(policy, **from_cli(dict(req.cli), list(req.command) if req.command else None))
        return with_overrides(
            policy,
            command=tuple(req.command or ()) or None,
            mounts=tuple(MountGrant(h, p, bool(w)) for h, p, w in req.mounts),
            env=dict(req.env),
            timeout=req.timeout,
            memory=req.memory,
            allow=tuple(req.allow),
            hosts=dict(req.hosts),
            network=req.network,
            substrate=req.substrate,
        )

    async def run(self, req: RunRequest, out: Output, *, actor: str = "operator"):
        """``agentvm run`` through the daemon: one sandbox for one command (the lifecycle
        sequence on the daemon's gate, the same policy semantics as the embedded run), its
        output streamed to ``out``; returns its RunResult. A client that goes away is like
        Ctrl-C on an embedded run: the run is stopped (ClientGone)."""
        return await self._run(req, out, None, None, actor)

    async def run_attached(self, req: RunRequest, io: Attached, *, tty: tuple[int, int] | None = None,
                           actor: str = "operator"):
        """``run`` with the client's input relayed while it runs (``io.read()``: stdin bytes,
        stdin's end, window sizes, signals). ``tty`` (rows, cols): the sandbox gets a
        terminal of its own - a pty made here, its slave the command's controlling terminal
        (the helper's ``init --tty``, as the embedded run does it); the master stays in the
        daemon, never in the sandbox. Without ``tty``, stdin is a pipe. A forwarded signal
        (INT, TERM, HUP, QUIT) ends the run as that signal ends an embedded run (stopped, exit
        128+N); a client that goes away stops it (ClientGone). ``req.stdin`` is not used."""
        return await self._run(req, io, io, tty, actor)

    async def _run(self, req: RunRequest, out: Output, io: Attached | None, tty, actor: str):
        from agentvm.backends.base import ExitStatus
        from agentvm.errors import HostEnvironmentError

        try:
            policy = self.run_policy(req)
        except (PolicyDenied, HostEnvironmentError) as exc:
            # refused before the lifecycle's own preflight (a tier ceiling, an option): on the
            # chain all the same, as every refused run is
            self.record("run.refused", actor=actor, agent=_spec_name(req.spec), code=exc.code,
                        message=exc.message[:500])
            raise
        if not policy.command:
            raise refuse("api.bad-request", "nothing to run")
        note = None
        if tty is not None and not self.runtime.backend_for(policy).tty:
            # as the embedded run says it: no terminal, its stdin still relayed
            note = (f"agentvm: note: the {policy.substrate} substrate cannot give the sandbox a terminal yet: it "
                    "runs without one (its stdin and output are still this terminal; no job control, no line "
                    "editing)\r\n").encode()
            tty = None
        stop = asyncio.Event()
        signalled: list[int] = []
        feeder_args = {}
        if tty is not None:
            master, slave = os.openpty()  # non-inheritable: the master never reaches the sandbox
            set_winsize(slave, *tty)
            streams, our_ends, stdio = {master: "stdout"}, (slave,), (slave, slave, slave)
            stdin_w = os.dup(master)
            feeder_args = {"tty_fd": os.dup(master)}
        else:
            o_r, o_w = os.pipe2(os.O_CLOEXEC)
            e_r, e_w = os.pipe2(os.O_CLOEXEC)
            i_r, stdin_w = os.pipe2(os.O_CLOEXEC)
            streams, our_ends, stdio = {o_r: "stdout", e_r: "stderr"}, (o_w, e_w, i_r), (i_r, o_w, e_w)

        def on_signal(name: str) -> None:
            self.record("operator.run-signal", sandbox=policy.name, signal=name)
            if not signalled:
                signalled.append(SIGNALS[name])
            stop.set()

        def before_teardown(s) -> None:
            if signalled and s.status is not None and not s.status.timed_out:
                s.status = ExitStatus(exit_code=128 + signalled[0], signal=signalled[0],
                                      duration=s.status.duration)

        self.record("operator.run", actor=actor, sandbox=policy.name, command=list(policy.command),
                    **({"stdin": "tty" if tty is not None else "pipe"} if io is not None else {}))
        fut = asyncio.ensure_future(self._lifecycle().run_to_end(policy, stdio=stdio, tty=tty is not None,
                                                                 timed=True, stop=stop, grace=1.0,
                                                                 before_teardown=before_teardown))

        def client_gone():
            # like Ctrl-C on an embedded run: the caller is gone, so is the run
            if not stop.is_set():
                self.record("operator.run-abandoned", sandbox=policy.name, reason="the client went away")
            stop.set()

        if io is None:
            data = req.stdin

            def feed_stdin():
                try:
                    if data:
                        os.write(stdin_w, data)
                except OSError:
                    pass
                finally:
                    os.close(stdin_w)

            feeder = asyncio.ensure_future(asyncio.to_thread(feed_stdin))
        else:
            feeder = asyncio.ensure_future(feed(io, stdin_w, on_signal=on_signal, on_gone=client_gone,
                                                **feeder_args))
        await out.start()
        if note is not None:
            try:
                await out.write("stderr", note)
            except (ConnectionError, OSError):
                client_gone()
        try:
            return await pump(streams, fut, our_ends, out, client_gone)
        except ConnectionError as exc:
            if isinstance(exc, ClientGone):
                raise
            # the run's own failure (not the client's leaving): an answer, in the stream
            log.exception("a run failed")
            raise refuse("internal.bug", f"the run failed: {type(exc).__name__}: {exc}",
                         "a bug in agent-vm: the daemon's log has the traceback") from exc
        finally:
            if io is not None:
                # the run is over: a stdin that never closes holds nothing of the daemon's
                feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)

    async def exec_attached(self, name: str, argv: list[str], io: Attached, *, tty: tuple[int, int] | None = None,
                            timeout: float | None = None, actor: str = "operator"):
        """``exec`` with the client's input relayed (``exec -i``: a stdin pipe; ``exec -it``:
        ``tty`` (rows, cols), a pty made here whose slave becomes the command's controlling
        terminal inside the sandbox - its master stays in the daemon). A forwarded signal goes
        to the terminal's foreground process group (TIOCSIG); without a terminal, signals are
        not forwarded. A client that goes away closes the command's stdin (a terminal hangs
        up), so an interactive shell ends; the sandbox keeps running. Returns the ExitStatus."""
        await self.wake(name, actor=actor, why="exec")
        m = self.managed.get(name)
        if m is None or m.handle is None:
            raise refuse("sandbox.not-running", f"{name} is not running", hint=f"agentvm start {name}")
        backend = m.backend
        if tty is not None and not backend.tty:
            raise refuse("api.bad-request", f"the {backend.name} substrate cannot give a command a terminal yet",
                         "exec without -t")
        m.touch(self.state, time.time())
        self.record("operator.exec", actor=actor, sandbox=name, argv=argv, stdin="tty" if tty is not None else "pipe")
        kw: dict = {"timeout": timeout}
        feeder_args: dict = {}
        if tty is not None:
            master, slave = os.openpty()  # non-inheritable: the master never reaches the sandbox
            set_winsize(slave, *tty)
            streams, our_ends, stdio = {master: "stdout"}, (slave,), (slave, slave, slave)
            stdin_w = os.dup(master)
            sig_fd = os.dup(master)
            hup = [os.dup(slave)]  # to hang it up; closed the moment the command ends (below)
            feeder_args = {"tty_fd": sig_fd}
            argv = _with_ctty(backend, argv, kw)
        else:
            o_r, o_w = os.pipe2(os.O_CLOEXEC)
            e_r, e_w = os.pipe2(os.O_CLOEXEC)
            i_r, stdin_w = os.pipe2(os.O_CLOEXEC)
            streams, our_ends, stdio = {o_r: "stdout", e_r: "stderr"}, (o_w, e_w, i_r), (i_r, o_w, e_w)
            sig_fd, hup = None, [None]

        def on_signal(sig: str) -> None:
            # a pty delivers INT and QUIT to its foreground process group (TIOCSIG); HUP is a
            # hang-up of the terminal; TERM (and anything without a terminal) is not deliverable
            delivered = False
            if sig in ("INT", "QUIT") and sig_fd is not None:
                delivered = _tiocsig(sig_fd, SIGNALS[sig])
            elif sig == "HUP" and hup[0] is not None:
                delivered = _vhangup(hup[0])
            self.record("operator.exec-signal", sandbox=name, signal=sig, delivered=delivered)

        def on_gone() -> None:
            # the client is gone: its stdin ends (the feeder closes the pipe); a terminal hangs up
            self.record("operator.exec-abandoned", sandbox=name, reason="the client went away")
            if hup[0] is not None:
                _vhangup(hup[0])  # the terminal hangs up: its session gets SIGHUP, reads end

        def drop_hup(_fut=None) -> None:
            # a slave held open would keep the master from its EOF: closed as soon as the command
            # ends (on the loop, as every user of it: no fd number is used after it is freed)
            if hup[0] is not None:
                os.close(hup[0])
                hup[0] = None

        fut = asyncio.ensure_future(asyncio.to_thread(backend.exec, m.handle, argv, stdio=stdio, **kw))
        fut.add_done_callback(drop_hup)
        feeder = asyncio.ensure_future(feed(io, stdin_w, on_signal=on_signal, on_gone=on_gone, **feeder_args))
        began = time.time()
        await io.start()
        try:
            status = await pump(streams, fut, our_ends, io)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
            drop_hup()
        _trace_exec(m, argv, began, status)
        return status

    def _workspace_dir(self, name: str) -> tuple[Path, int | None]:
        m = self.managed.get(name)
        s = m.session if m is not None else None
        if s is None or s.res.workspace is None or s.handle is None:
            raise refuse("sandbox.not-running", f"{name} is not running (its workspace is mounted only while it runs)")
        return Path(s.res.workspace.host_dir), s.res.host_uid

    async def copy_in(self, name: str, path: str, data, *, tar: bool = False, actor: str = "operator") -> dict:
        """cp into a running sandbox's workspace: one file, or with ``tar`` a folder as a tar
        stream (daemon.files: the same path checks for every member). ``data``: bytes, or an
        upload arriving (an object with ``length``, None when unknown, and ``await read()``):
        that is staged on the state disk as it comes (:meth:`_stage`), never held in memory."""
        from agentvm.daemon import files

        self.row(name)  # not-found for a sandbox that does not exist, before "not running"
        await self.wake(name, actor=actor, why="cp")
        root, uid = self._workspace_dir(name)
        if isinstance(data, (bytes, bytearray, memoryview)):
            src, fd = data, None
        else:
            files.check_path(path)  # a path that leaves the workspace: refused before the body is read
            fd = await self._stage(name, path, data)
            src = fd
        try:
            if tar:
                tree = src if fd is None else os.fdopen(os.dup(fd), "rb")
                try:
                    got = await asyncio.to_thread(files.write_tree_beneath, root, path, tree, uid)
                finally:
                    if fd is not None:
                        tree.close()
                self.record("operator.cp-in", actor=actor, sandbox=name, path=path, folder=True, **got)
                return {"written": got["bytes"], "path": path, **got}
            n = await asyncio.to_thread(files.write_beneath, root, path, src, uid)
        finally:
            if fd is not None:
                os.close(fd)  # (a nameless file: its space is freed here)
        self.record("operator.cp-in", actor=actor, sandbox=name, path=path, bytes=n)
        return {"written": n, "path": path}

    def _cp_room(self, name: str) -> tuple[int, str]:
        """Bytes the workspace of ``name`` can still take, and what bounds it: a pool
        workspace's quota (its limits.disk less what it holds; the pool's free space when
        less), else its filesystem's free space (an image's, or the host's)."""
        m = self.managed.get(name)
        lease = m.session.res.workspace if m is not None and m.session is not None else None
        if lease is None:
            raise refuse("sandbox.not-running", f"{name} is not running (its workspace is mounted only while it runs)")
        if lease.kind == "pool" and lease.pool is not None:
            e = lease.pool.entry(name)
            _size, free = lease.pool.space()
            lim = (e.limit if e else 0) or lease.limit
            if lim:
                used = e.used if e else 0
                if lim - used <= free:
                    return max(0, lim - used), f"its limits.disk of {lim} bytes, {used} of them used"
            return free, "the free space of the workspace pool"
        v = os.statvfs(lease.host_dir)
        return v.f_bavail * v.f_frsize, "the free space of its workspace"

    async def _stage(self, name: str, path: str, body) -> int:
        """An upload, written as it arrives to a nameless file on the state disk
        (daemon.files.staging_open: root-only, reached by no sandbox), bounded by what the
        destination can take and by the state disk (less its reserve): refused before a byte is
        read when its length is over either, and reading stops as soon as it passes them.
        Returns the file's descriptor at offset 0 (the caller closes it)."""
        from agentvm.daemon import files
        from agentvm.daemon.events import RESERVE

        room, why = await asyncio.to_thread(self._cp_room, name)
        staged = getattr(self, "_cp_staged", 0)  # other uploads being staged now
        disk = max(0, await asyncio.to_thread(files.staging_room, self.paths.home, RESERVE) - staged)
        length = body.length

        def over(n: int, *, known: bool) -> None:
            said = f"{n} bytes" if known else f"{n} bytes or more (its reading stopped there)"
            if n > room:
                raise refuse("files.no-space", f"{name}:{path} cannot take {said}: the workspace has room for "
                             f"{room} ({why}); nothing was written",
                             hint="free space in the workspace, or give the agent a larger limits.disk")
            if n > disk:
                raise refuse("state.disk-full", f"{said} cannot be staged: the daemon's state disk has room for "
                             f"{disk} (its free space less the daemon's reserve of {RESERVE} bytes and a margin); "
                             "nothing was written", hint=f"free space on the disk of {self.paths.home}")

        if length is not None:
            over(length, known=True)
        limit = min(room, disk)
        fd = await asyncio.to_thread(files.staging_open, self.paths.home)
        total = 0
        held = limit if length is None else length
        self._cp_staged = getattr(self, "_cp_staged", 0) + held
        try:
            with _closed_on_failure(fd, self.paths.home,
                                    lambda: f"{total} bytes of the copy were staged; nothing was written"):
                pending = bytearray()
                while True:
                    chunk = await body.read()
                    if chunk:
                        total += len(chunk)
                        if total > limit:  # (a chunked body, or a client that lied about its length)
                            over(total, known=False)
                        pending += chunk
                        if len(pending) < files.COPY_CHUNK:
                            continue
                    if pending:
                        await asyncio.to_thread(_write_all, fd, bytes(pending))
                        pending.clear()
                    if not chunk:
                        break
                os.lseek(fd, 0, os.SEEK_SET)
                return fd
        finally:
            self._cp_staged = max(0, getattr(self, "_cp_staged", 0) - held)

    async def copy_out(self, name: str, path: str, *, tar: bool = False, actor: str = "operator") -> dict:
        """cp out of a running sandbox's workspace: ``{"path", "kind": "file"|"tar", "data":
        bytes, ...}`` (with ``tar``, a folder comes as a tar stream). In memory: at most
        daemon.files.MAX_FILE (:meth:`copy_out_stream` has no such cap)."""
        from agentvm.daemon import files

        self.row(name)
        await self.wake(name, actor=actor, why="cp")
        root, _uid = self._workspace_dir(name)
        if tar and await asyncio.to_thread(files.is_dir_beneath, root, path):
            data, got = await asyncio.to_thread(files.read_tree_beneath, root, path)
            self.record("operator.cp-out", actor=actor, sandbox=name, path=path, folder=True, **got)
            return {"path": path, "kind": "tar", **got, "data": data}
        data = await asyncio.to_thread(files.read_beneath, root, path)
        self.record("operator.cp-out", actor=actor, sandbox=name, path=path, bytes=len(data))
        return {"path": path, "kind": "file", "data": data}

    async def copy_out_stream(self, name: str, path: str, *, tar: bool = False, actor: str = "operator") -> dict:
        """cp out, for streaming: ``{"path", "kind", "fd", "size", ...}`` - ``fd`` the workspace
        file itself (opened beneath it, O_NOFOLLOW) or, for a folder with ``tar``, its tar
        stream staged on the state disk (bounded by the disk less its reserve). The caller
        sends ``size`` bytes from ``fd`` and closes it."""
        from agentvm.daemon import files
        from agentvm.daemon.events import RESERVE

        self.row(name)
        await self.wake(name, actor=actor, why="cp")
        root, _uid = self._workspace_dir(name)
        if tar and await asyncio.to_thread(files.is_dir_beneath, root, path):
            room = await asyncio.to_thread(files.staging_room, self.paths.home, RESERVE)
            fd = await asyncio.to_thread(files.staging_open, self.paths.home)

            def build() -> tuple[dict, int]:
                with os.fdopen(os.dup(fd), "wb") as out:
                    got = files.tar_tree_beneath(root, path, out, room)
                    out.flush()
                    size = out.tell()
                os.lseek(fd, 0, os.SEEK_SET)
                return got, size

            with _closed_on_failure(fd, self.paths.home, lambda: f"{name}:{path} was packed"):
                got, size = await asyncio.to_thread(build)
            self.record("operator.cp-out", actor=actor, sandbox=name, path=path, folder=True, **got)
            return {"path": path, "kind": "tar", **got, "fd": fd, "size": size}
        fd, size = await asyncio.to_thread(files.open_beneath, root, path)
        self.record("operator.cp-out", actor=actor, sandbox=name, path=path, bytes=size)
        return {"path": path, "kind": "file", "bytes": size, "fd": fd, "size": size}


def _trace_exec(m, argv: list[str], began: float, status) -> None:
    """The exec's span in its sandbox's session trace (when it has one)."""
    trace = m.session.trace if m.session is not None else None
    if trace is not None:
        trace.span("exec", began, attributes={"agentvm.exec.command": os.path.basename(argv[0])[:128],
                                              "agentvm.exec.exit_code": status.exit_code,
                                              "agentvm.exec.timed_out": bool(status.timed_out)})


@contextlib.contextmanager
def _closed_on_failure(fd: int, home: Path, what: Callable[[], str]) -> Iterator[None]:
    """``fd`` (a copy staged on the state disk) closed when the block fails; the state disk
    filling while it runs (ENOSPC, EDQUOT) is ``state.disk-full``, saying ``what()`` was under way
    (the generic agentvm.errors.disk_full_error would not say which copy, nor that nothing was
    written)."""
    try:
        yield
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise refuse("state.disk-full", f"the daemon's state disk filled while {what()}",
                         hint=f"free space on the disk of {home}") from None
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _spec_name(text) -> str:
    """An agent file's metadata.name, for a record about it (``run`` when there is none)."""
    if not isinstance(text, str):
        return "run"
    try:
        import yaml

        name = yaml.safe_load(text)["metadata"]["name"]
    except Exception:  # noqa: BLE001 - a record's label, never a reason to fail
        return "run"
    return str(name)[:200] if isinstance(name, str) else "run"


def _with_ctty(backend, argv: list[str], kw: dict) -> list[str]:
    """The exec'd command's controlling terminal: the backend's own (``exec(tty=True)``: the
    helper's ``init --tty``) when it takes one, else util-linux ``setsid -c`` inside the
    sandbox (a new session whose controlling terminal is its stdin: the pty's slave)."""
    import inspect

    if "tty" in inspect.signature(backend.exec).parameters:
        kw["tty"] = True
        return argv
    return ["setsid", "-c", *argv]


def _tiocsig(master: int, signum: int) -> bool:
    """Send ``signum`` (SIGINT, SIGQUIT or SIGTSTP: what Linux allows) to the foreground process
    group of the pty behind ``master``."""
    import fcntl

    TIOCSIG = 0x40045436  # _IOW('T', 0x36, int); the signal is passed by value
    try:
        fcntl.ioctl(master, TIOCSIG, signum)
    except OSError:
        return False
    return True


def _vhangup(slave: int) -> bool:
    """Hang up the pty behind ``slave`` (TIOCVHANGUP, the daemon's CAP_SYS_ADMIN): its session
    gets SIGHUP and its reads end - what closing a terminal does."""
    import fcntl

    TIOCVHANGUP = 0x5437
    try:
        fcntl.ioctl(slave, TIOCVHANGUP, 0)
    except OSError:
        return False
    return True

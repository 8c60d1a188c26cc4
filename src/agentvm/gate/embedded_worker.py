"""The embedded run's gate as a confined, unprivileged process (issue 43).

``agentvm run`` without a daemon used to parse every byte its sandbox sends in a thread of its
own process - as root. Here that parsing moves to one gate worker process of the kind the
daemon runs (:mod:`agentvm.gate.workers`: same entry point, same protocol, same confinement by
:mod:`agentvm.gate.confine` - its own mount namespace without agent-vm's state, a uid of its own,
no capabilities, no_new_privs, Landlock, a seccomp filter whose forbidden calls kill it), and
the run process keeps only the control side (:class:`ConfinedGate`): it binds the sandbox's
socket, hands it over ``SCM_RIGHTS``, resolves this sandbox's credentials and sends only their
values, and reads back the counters of the run's egress summary.

Start-up: a fresh ``python -m agentvm.gate.workers`` costs ~150 ms of imports. So the worker is
a :class:`Zygote`: a child *forked* (no exec) from the run process early - before the run has
read a secret, so none is in its memory - which waits, doing nothing, until it is needed. A
run whose sandbox never connects pays only the fork (and the zygote is killed); the first
connection tells it to become the worker (it imports the gate, loads the CA, confines itself
and serves - the same first-connection start the in-thread gate had).

The worker's uid is leased like an anonymous run's (``identity.lease_identity``: one uid per
run, never an agent's, never another run's or a daemon worker's), so two embedded runs' gates
cannot signal, trace or write each other's files.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from agentvm.errors import AgentVMError

#: the explicit, audited opt-in to the old in-process gate (as root): "1"
UNCONFINED_ENV = "AGENTVM_GATE_UNCONFINED"
START_TIMEOUT = 30.0


def unconfined_opt_in() -> bool:
    return os.environ.get(UNCONFINED_ENV) == "1"


def confinable() -> str | None:
    """Why this process cannot run a confined gate worker, or None (it can). Cheap: it is asked
    on every run's critical path (the worker itself checks everything again, and refuses to
    serve unconfined: agentvm.gate.confine)."""
    if os.geteuid() != 0:
        return (f"agentvm run runs as uid {os.geteuid()}, not root: the gate worker cannot switch to a uid of its "
                "own nor make its mount namespace")
    if os.uname().machine not in ("x86_64", "aarch64"):  # (agentvm.gate.confine.NR)
        return f"no system call table for {os.uname().machine}"
    import ctypes

    # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION): the ABI version, or < 0
    abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return "the kernel has no Landlock (a kernel >= 5.13 with lsm=landlock)"
    import importlib.util

    if importlib.util.find_spec("pyseccomp") is None:
        return "pyseccomp is not installed (scripts/install.sh installs it)"
    return None


def refusal(problem: str):
    """The error a run gets when its gate cannot be confined (fail closed)."""
    from agentvm.gate.confine import ConfineError

    return ConfineError(
        "validate", f"the embedded run's egress gate cannot be confined: {problem}",
        hint=f"run agentvm as root on a kernel with Landlock, or use the daemon (`agentvm up`); to run this "
             f"sandbox's gate unconfined in this process anyway (recorded on the audit chain), set "
             f"{UNCONFINED_ENV}=1")


# ------------------------------------------------------------------------------ the zygote
class Zygote:
    """A child forked now that becomes a gate worker when :meth:`go` is called (or exits when it
    is discarded). Fork it before the run reads a secret: the child has a copy of this
    process's memory, and keeps it until it confines itself."""

    def __init__(self, preload: bool = False) -> None:
        """``preload``: the child imports the gate's modules while it waits (a zygote forked
        long before it is needed, e.g. before the run's prepare: its first answer is then
        sooner); else it waits doing nothing."""
        chan, chan_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds, fds_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        for f in (sys.stdout, sys.stderr):  # (nothing buffered is written twice)
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        pid = os.fork()
        if pid == 0:  # ---- the child: never returns into the caller's code
            rc = 70
            try:
                chan.close()
                fds.close()
                os.close(go_w)
                rc = _child(parent, go_r, chan_w.fileno(), fds_w.fileno(), preload)
            except BaseException:  # noqa: BLE001
                try:
                    import traceback

                    traceback.print_exc()
                except BaseException:  # noqa: BLE001
                    pass
            finally:
                os._exit(rc)
        os.close(go_r)
        chan_w.close()
        fds_w.close()
        self.pid = pid
        self.proc = ForkedProc(pid)
        self.chan, self.fds = chan, fds
        self._go = go_w
        self.used = False

    def go(self, argv: list[str]) -> None:
        """Become the gate worker ``python -m agentvm.gate.workers ARGV`` would be (its channel
        and descriptor sockets are added here)."""
        if self.used:
            raise AgentVMError("the gate zygote was used already")
        self.used = True
        fd, self._go = self._go, -1
        try:
            data = json.dumps(argv).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def abandon(self) -> None:
        """Told to start, then not wanted (nothing connected it): its channel closed, killed."""
        self.chan.close()
        self.fds.close()
        self.proc.kill()
        _discard(self.proc)

    def discard(self) -> None:
        """Not needed: its pipe closed, it exits on its own (it holds nothing, it never ran
        anything), off the caller's path; reaped later (:func:`_reap_discarded`)."""
        if self._go >= 0:
            os.close(self._go)
            self._go = -1
        if not self.used:
            self.used = True
            self.chan.close()
            self.fds.close()
            _discard(self.proc)


_DISCARDED: list = []  # zygotes told to exit, not yet reaped


_DISCARDED_LOCK = threading.Lock()  # (the list and the reaper: runs on several threads discard)
_REAPER: threading.Thread | None = None


def _discard(proc: "ForkedProc") -> None:
    """``proc`` (killed, or told to exit) is reaped as soon as it has exited."""
    import time

    with _DISCARDED_LOCK:
        _DISCARDED.append((proc, time.monotonic() + REAP_WAIT))
    _reap_discarded()


REAP_WAIT = 30.0  # seconds a discarded zygote is waited for (each was killed or told to exit: milliseconds)


def _pending() -> list:
    """The discarded zygotes still to reap: not exited, and not waited for longer than their
    own REAP_WAIT (call with the lock held). Each has its own deadline: one the reaper shared
    made a zygote discarded late in a reaper's life given up on at once - a zombie until the
    next discard (a whole-suite run found one)."""
    import time

    now = time.monotonic()
    return [(p, d) for p, d in _DISCARDED if p.returncode is None and now < d]


def _reap_discarded() -> None:
    """Reap the discarded zygotes that have exited (a long-lived process makes many: a
    selftest, an SDK user running sandboxes in its own process); those still exiting are
    waited for by one background thread, so none is left a zombie until the next run."""
    global _REAPER
    with _DISCARDED_LOCK:
        _DISCARDED[:] = _pending()
        if _DISCARDED and (_REAPER is None or not _REAPER.is_alive()):
            _REAPER = threading.Thread(target=_reap_all, name="agentvm-zygote-reaper", daemon=True)
            _REAPER.start()


def _reap_all() -> None:
    import time

    global _REAPER
    while True:
        with _DISCARDED_LOCK:
            _DISCARDED[:] = _pending()
            if not _DISCARDED:
                _REAPER = None  # (a later discard starts another; under the lock: none is missed)
                return
        time.sleep(0.01)


def worker_argv(state_dir: Path, log_dir: Path, uid: int) -> list[str]:
    """The gate worker's arguments (``python -m agentvm.gate.workers``'s, without the channels)."""
    return ["--index", "0", "--state-dir", str(state_dir), "--log-dir", str(log_dir), "--confine", str(uid),
            "--confine-skip", "", "--no-records"]  # (the run reads its sandbox's log, not records)


PRELOAD = ("agentvm.gate.workers", "agentvm.gate.server", "agentvm.gate.confine", "agentvm.gate.ca",
           "agentvm.gate.tls", "agentvm.gate.encoding", "agentvm.gate.h2relay", "pyseccomp", "uvloop")


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - (the worker imports what it needs, and says what failed)
            pass


def _child(parent: int, go_r: int, chan: int, fds: int, preload: bool = False) -> int:
    """The zygote's life: wait for the word, then run the gate worker's main."""
    import gc

    # what the run process left for the collector stays uncollected here: a finalizer of one of
    # its files or sockets would close a descriptor number this process has reused by then.
    # (Disabled now - a flag; frozen once it is told to start: freezing writes to every
    # object, a copy of most of the run's memory that a discarded zygote need not make)
    gc.disable()
    # a terminal's ^C, ^\ and hang-up are the run's: it ends this process itself (its channel)
    for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTSTP):
        signal.signal(s, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - (the channel's end stops it as well)
        pass
    _retitle(b"agentvm-gate-worker (embedded)")
    _scrub_environment()
    if os.getppid() != parent:
        return 0
    # nothing of the run's descriptors stays open here (a copy of a pipe's write end would keep
    # its reader - the sandbox's stdin, the caller of the run - from ever seeing its end)
    keep = {0, 1, 2, go_r, chan, fds}
    try:
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass
    except OSError:
        for lo, hi in zip(sorted(keep), sorted(keep)[1:] + [os.sysconf("SC_OPEN_MAX")]):
            os.closerange(lo + 1, hi)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # (stderr stays: the worker's log lines)
    os.close(null)
    if preload:
        _preload()
    chunks = []
    while True:
        try:
            b = os.read(go_r, 65536)
        except InterruptedError:
            continue
        if not b:
            break
        chunks.append(b)
    os.close(go_r)
    if not chunks:
        return 0  # discarded
    gc.freeze()
    gc.enable()
    argv = json.loads(b"".join(chunks)) + ["--channel", str(chan), "--fds", str(fds)]
    from agentvm.gate import workers

    return workers.main(argv) or 0


#: what the gate worker keeps of the run's environment (the operator's shell may hold tokens of
#: its own: a compromised gate must not find them)
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "SSL_CERT_FILE", "SSL_CERT_DIR")


def _scrub_environment() -> None:
    """Only ENV_KEEP and agent-vm's own settings (``AGENTVM_*``) stay in the environment, and the
    original environment block (/proc/PID/environ, the process's memory) is overwritten."""
    keep = {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith("AGENTVM_")}
    os.environ.clear()
    os.environ.update(keep)
    try:
        import ctypes

        with open("/proc/self/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (fields 50, 51)
        if end > start:
            ctypes.memset(start, 0, end - start)
    except Exception:  # noqa: BLE001 - (os.environ is scrubbed either way)
        pass


def _retitle(title: bytes) -> None:
    """This process's name (comm) and command line (/proc/PID/cmdline): the gate worker's, not a
    copy of the ``agentvm run`` command it was forked from (which named the sandbox's command:
    whoever looks for the sandbox's processes by their command line must not find this one)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(title[:15]), 0, 0, 0)  # PR_SET_NAME
        with open("/proc/self/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()  # fields[0] is field 3 (state)
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        size = end - start
        if size > 0:
            buf = (title[:size - 1] + b"\0").ljust(size, b"\0")
            ctypes.memmove(start, buf, size)
    except Exception:  # noqa: BLE001 - cosmetic, except for the scans above
        pass


class ForkedProc:
    """What agentvm.gate.workers.GateWorker reads of its process (an asyncio Process's
    ``pid``, ``returncode``, ``kill()``, ``wait()``), for a forked child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._rc: int | None = None
        self._lock = threading.Lock()

    def _poll(self, flags: int = os.WNOHANG) -> int | None:
        with self._lock:
            if self._rc is None:
                try:
                    p, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # (reaped by someone else: its status is lost)
                    self._rc = 255
                else:
                    if p:
                        self._rc = os.waitstatus_to_exitcode(status)
            return self._rc

    @property
    def returncode(self) -> int | None:
        return self._poll()

    def kill(self) -> None:
        if self._poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self, timeout: float) -> int | None:
        import time

        deadline = time.monotonic() + timeout
        while self._poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        return self._rc

    async def wait(self) -> int:
        import asyncio

        if self._poll() is not None:
            return self._rc
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            fd = -1
        try:
            while self._poll() is None:
                if fd >= 0:
                    fut = loop.create_future()
                    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
                    try:
                        await asyncio.wait_for(fut, 1.0)
                    except asyncio.TimeoutError:
                        pass
                    finally:
                        loop.remove_reader(fd)
                else:
                    await asyncio.sleep(0.01)
        finally:
            if fd >= 0:
                os.close(fd)
        return self._rc


# ------------------------------------------------------------------------------ the run's side
def _accepts(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


def _classes():
    """The worker pool's classes specialised for one forked, confined worker (defined on first
    use: agentvm.gate.workers is imported only when a gate starts)."""
    import asyncio

    from agentvm.gate import workers as W

    class ForkedWorker(W.GateWorker):
        """Gate worker slot 0 of the run, started from the zygote instead of a new interpreter."""

        # (the zygote may be confined - as the run's freshly leased uid - before this side
        # starts: that uid holds nothing else)
        clears_slot = False

        def __init__(self, pool, zygote: Zygote) -> None:
            super().__init__(pool, 0)
            self.zygote = zygote

        async def _spawn(self):
            z = self.zygote
            self.proc = z.proc
            if not z.used:  # (LazyGate tells it as soon as it is needed, before this side's imports)
                z.go(worker_argv(self.pool.state_dir, self.pool.log_dir, self.uid))
            return z.chan, z.fds

    class EmbeddedPool(W.WorkerPool):
        """One confined worker serving this run's sandboxes (a lost one is replaced by a fresh
        ``python -m agentvm.gate.workers`` of the same uid, as the daemon's are)."""

        host_name = "this run"
        restart_hint = "run it again (agent-vm was reinstalled while this run started)"

        def __init__(self, state_dir: Path, log_dir: Path, uid: int, zygote: Zygote | None, on_event,
                     approvals=None, host_gate=None) -> None:
            self._uid = uid
            self.zygote = zygote
            kw = {"approvals": approvals} if _accepts(W.WorkerPool.__init__, "approvals") else {}
            if host_gate is not None:  # (the run's in-process gate: its tool gateways' approvals and remote servers)
                kw["host_gate"] = host_gate
            super().__init__(1, state_dir, log_dir, on_record=None, on_event=on_event, confine="full", **kw)

        def uid_for(self, index: int) -> int:
            return self._uid

        async def start(self) -> None:
            w = ForkedWorker(self, self.zygote) if self.zygote is not None else W.GateWorker(self, 0)
            self.workers = [w]
            try:
                await w.start()
            except BaseException as exc:
                await self.stop()
                raise AgentVMError(f"the embedded gate worker did not start: {exc}",
                                   hint="see the lines above (gate-worker-0) for its error; "
                                   f"{UNCONFINED_ENV}=1 runs the gate unconfined in the run's process (recorded)",
                                   code="gate.confine-failed") from exc
            self._watch = asyncio.get_running_loop().create_task(self._watch_vault())
            self._inotify = _VaultWatch(asyncio.get_running_loop(), self._vault_changed)

        def _vault_changed(self) -> None:
            """The vault directory changed (another process revoked, restored or rotated a
            secret): each endpoint's worker is sent its new state now, not at the next poll."""
            for w in list(self.workers):
                for ep in list(w.endpoints.values()):
                    try:
                        ep.poll_vault()
                    except Exception:  # noqa: BLE001 - (the poll tries again)
                        W.log.exception("embedded gate: the vault of %s", ep.sandbox_id)

        async def stop(self) -> None:
            watch = getattr(self, "_inotify", None)
            if watch is not None:
                watch.close()
            await super().stop()

        async def open_bound(self, sandbox_id: str, agent: str, policy, sock_path: Path, sock: socket.socket,
                             creds, extras=None, bridge_key: str = "") -> "W.RemoteEndpoint":
            """WorkerPool.open for a socket the run bound (and listened on) before its sandbox started.
            TODO(workers): a ``sock=`` parameter of WorkerPool.open would make this a call."""
            w = await self._a_worker(None)
            sock.setblocking(False)
            kw = {"extras": extras} if _accepts(W.RemoteEndpoint.__init__, "extras") else {}
            ep = W.RemoteEndpoint(self, w, sandbox_id, agent, policy, Path(sock_path), sock, creds, **kw)
            ep.bridge_key = bridge_key
            w.endpoints[sandbox_id] = ep
            spec = getattr(creds, "spec", None)
            if spec is not None and getattr(self, "_inotify", None) is not None:
                self._inotify.add(spec[2])
            try:
                async with w.opening:
                    await w.call("open", *ep.open_args(), fd=sock.fileno())
            except BaseException:
                ep.closed = True
                ep.worker.endpoints.pop(sandbox_id, None)
                sock.close()
                Path(sock_path).unlink(missing_ok=True)
                raise
            if ep.worker is w:
                ep.served = True
            else:
                try:
                    await ep.synced()
                except BaseException:
                    await asyncio.shield(self.close(ep))
                    raise
            return ep

    return EmbeddedPool


class _VaultWatch:
    """inotify on vault directories: ``changed()`` on the loop when a file in one is written or
    replaced (the vault writes a temp file and renames it over the store). Without inotify,
    nothing: the pool's poll (agentvm.gate.workers.REVOKE_POLL) still sees every change."""

    IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x2, 0x4, 0x8, 0x80, 0x100, 0x200

    def __init__(self, loop, changed) -> None:
        self.loop, self.changed = loop, changed
        self.fd = -1
        self.dirs: set[str] = set()
        try:
            import ctypes

            self._libc = ctypes.CDLL(None, use_errno=True)
            fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except Exception:  # noqa: BLE001
            return
        if fd < 0:
            return
        self.fd = fd
        loop.add_reader(fd, self._readable)

    def add(self, directory: str) -> None:
        if self.fd < 0 or directory in self.dirs:
            return
        mask = self.IN_MODIFY | self.IN_ATTRIB | self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE | self.IN_DELETE
        if self._libc.inotify_add_watch(self.fd, os.fsencode(directory), mask) >= 0:
            self.dirs.add(directory)

    def _readable(self) -> None:
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass
        except OSError:
            return
        self.changed()

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


class ConfinedGate:
    """The embedded gate's control side: a loop thread of the run's process driving one confined
    gate worker. Same calls as agentvm.gate.embedded.EmbeddedGate (open, close, stop)."""

    def __init__(self, state_dir: Path, log_dir: Path, *, uid: int, zygote: Zygote | None, on_event,
                 approvals=None, host_gate=None) -> None:
        import asyncio

        self.uid = uid
        self.approvals = approvals
        self.host_gate = host_gate
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agentvm-gate-control", daemon=True)
        self._thread.start()
        self.endpoints: dict = {}
        try:
            self.pool = self.call(self._make(state_dir, log_dir, zygote, on_event), timeout=START_TIMEOUT + 5)
        except BaseException:
            if zygote is not None and not zygote.used:
                zygote.discard()
            self._stop_loop()
            raise

    async def _make(self, state_dir, log_dir, zygote, on_event):
        pool = _classes()(Path(state_dir), Path(log_dir), self.uid, zygote, on_event, self.approvals, self.host_gate)
        await pool.start()
        return pool

    @property
    def pid(self) -> int | None:
        pids = self.pool.pids()
        return pids[0] if pids else None

    def call(self, coro, timeout: float = 15.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open(self, sandbox_id: str, agent: str, policy, sock_path: Path, uid: int | None, creds=None, sock=None,
             extras=None, bridge_key: str = ""):
        if sock is None:
            from agentvm.fsutil import bind_unix_listener

            sock = bind_unix_listener(Path(sock_path), uid, 128)
        ep = self.call(self.pool.open_bound(sandbox_id, agent, policy, Path(sock_path), sock, creds, extras,
                                            bridge_key=bridge_key))
        self.endpoints[sandbox_id] = ep
        return ep

    def close(self, sandbox_id: str):
        ep = self.endpoints.pop(sandbox_id, None)
        if ep is None:
            return None
        return self.call(self.pool.close(ep))

    def stop(self) -> bool:
        """Close what is open, kill the worker. -> True when every worker process of this gate
        is dead or SIGKILLed (it runs no more code: its uid may be leased again)."""
        try:
            for sid in list(self.endpoints):
                self.close(sid)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        done = threading.Event()
        self.killed = False

        def halt() -> None:
            try:
                self.pool.stopping = True  # (first: a death seen now is not replaced)
                for w in self.pool.workers:
                    if w.proc is not None and w.proc.returncode is None:
                        try:
                            w.proc.kill()
                        except ProcessLookupError:
                            pass
                self.killed = True
                # the rest (reaping, the channels) on the loop, and then the loop ends: the run
                # does not wait for the kernel to tear the worker down (~10 ms)
                task = self.loop.create_task(self.pool.stop())
                task.add_done_callback(lambda t: (t.cancelled() or t.exception(), self.loop.stop()))
            finally:
                done.set()

        self.loop.call_soon_threadsafe(halt)
        if not done.wait(10):
            self._stop_loop()
        return self.killed

    def alive(self) -> list[int]:
        """Pids of this gate's worker processes still running."""
        out = []
        for w in self.pool.workers:
            p = w.proc
            if p is not None and p.returncode is None:
                out.append(p.pid)
        return out

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

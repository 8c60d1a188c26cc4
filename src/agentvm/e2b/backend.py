"""What the E2B adapter needs from agent-vm's control plane, and one implementation of it.

:class:`E2BBackend` is the whole surface the E2B API uses: sandboxes (create, kill, pause,
resume, info, list), processes (exec with streamed output, stdin, a pty, signals) and files
(read, write, list, stat, make dir, move, remove, and a listing for watches). Everything an
E2B client does goes through it, so every sandbox keeps agent-vm's controls: the policy is the
agent file's, the gate is the sandbox's gate, the process runs as the sandbox's agent uid
inside its namespaces, and files are seen exactly as the sandbox sees them (no host path is
ever resolved by the adapter, except the workspace's, through the daemon's symlink-safe copy).

:class:`DaemonBackend` implements it over the daemon's existing API (``agentvm.daemon.client``):
exec has no stdin and no pty there yet, so those raise :class:`Unsupported`; signals, file
listing, stat, mkdir, move and remove are ordinary commands run with ``exec`` inside the
sandbox (``find -printf``, ``mkdir``, ``mv``, ``rm``, ``kill``: what the sandbox already has).
When the daemon grows a typed ``ControlPlane`` with stdin/pty relay, a backend over it replaces
this one without touching the E2B app.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import posixpath
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

WORKSPACE = "/workspace"  # where every agent-vm sandbox sees its workspace
MAX_READ = 64 * 1024 * 1024  # the daemon's copy limit (daemon.files.MAX_FILE)
# the most an adapter's own command (stat, find, head -c MAX_READ+1) may answer: past it, an error
RUN_OUTPUT_LIMIT = MAX_READ + 4 * 1024 * 1024
# one directory listing (files.list, and each poll of a watch): past either, an error (docs/e2b.md)
MAX_LIST_ENTRIES = 20_000
MAX_LIST_BYTES = 8 * 1024 * 1024
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class BackendFailure(Exception):
    """An operation failed for a reason the E2B client should see. ``kind`` is one of
    not-found, exists, permission, not-dir, is-dir, invalid, unsupported, gone, internal."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Unsupported(BackendFailure):
    def __init__(self, message: str):
        super().__init__("unsupported", message)


@dataclass(frozen=True)
class BoxInfo:
    name: str
    state: str  # running | stopped | ...


@dataclass(frozen=True)
class Entry:
    """One file system entry as the sandbox sees it."""

    name: str
    path: str
    type: str  # file | dir | symlink | other
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    mtime: float
    symlink_target: str | None = None


@dataclass
class ExecSpec:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdin: bool = False
    pty: tuple[int, int] | None = None  # (cols, rows)
    timeout: float | None = None


@dataclass(frozen=True)
class ExecEvent:
    kind: str  # stdout | stderr | pty | exit
    data: bytes = b""
    exit_code: int = 0
    error: str | None = None


@runtime_checkable
class ExecProcess(Protocol):
    pid: int

    def events(self) -> AsyncIterator[ExecEvent]: ...

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def resize(self, cols: int, rows: int) -> None: ...


@runtime_checkable
class E2BBackend(Protocol):
    """Everything the E2B API needs from the control plane (async; errors are BackendFailure)."""

    async def create(self, name: str, spec_text: str, ttl: float | None) -> None: ...

    async def kill(self, name: str) -> None: ...

    async def pause(self, name: str) -> None: ...

    async def resume(self, name: str) -> None: ...

    async def info(self, name: str) -> BoxInfo | None: ...

    async def list(self) -> list[BoxInfo]: ...

    async def exec(self, name: str, spec: ExecSpec) -> ExecProcess: ...

    async def signal(self, name: str, pid: int, sig: int) -> None: ...

    async def read_file(self, name: str, path: str) -> bytes: ...

    async def write_file(self, name: str, path: str, data: "bytes | Upload") -> None: ...

    async def list_dir(self, name: str, path: str, depth: int) -> list[Entry]: ...

    async def stat(self, name: str, path: str) -> Entry: ...

    async def make_dir(self, name: str, path: str) -> bool: ...

    async def move(self, name: str, src: str, dst: str) -> None: ...

    async def remove(self, name: str, path: str) -> None: ...

    async def port_socket(self, name: str, port: int) -> "socket.socket":
        """A non-blocking TCP socket connected to ``127.0.0.1:port`` on the sandbox's own loopback
        (``sandbox.get_host(port)``; agentvm.e2b.ports). Raises ``ports.PortUnreachable`` (its
        ``__cause__`` a ConnectionRefusedError when nothing listens) for every failure."""
        ...


# -- helpers shared by implementations --------------------------------------------------------

def check_env(env: dict[str, str]) -> None:
    for k, v in env.items():
        if not _ENV_NAME.fullmatch(k) or "\x00" in v:
            raise BackendFailure("invalid", f"invalid environment variable {k!r}")


def _errkind(stderr: str) -> str:
    s = stderr.lower()
    if "no such file" in s:
        return "not-found"
    if "permission denied" in s or "read-only file system" in s or "operation not permitted" in s:
        return "permission"
    if "is a directory" in s:
        return "is-dir"
    if "not a directory" in s:
        return "not-dir"
    if "file exists" in s:
        return "exists"
    return "internal"


_FIND_FMT = r"%y\t%Y\t%s\t%m\t%M\t%u\t%g\t%T@\t%l\t%p\0"


def parse_find(out: bytes) -> list[Entry]:
    """Entries from ``find ... -printf _FIND_FMT`` (NUL-terminated records)."""
    entries = []
    for rec in out.split(b"\0"):
        if not rec:
            continue
        parts = rec.decode(errors="surrogateescape").split("\t", 9)
        if len(parts) != 10:
            continue
        y, _target_type, size, mode, perms, user, grp, mtime, link, path = parts
        kind = {"f": "file", "d": "dir", "l": "symlink"}.get(y, "other")
        entries.append(Entry(name=posixpath.basename(path.rstrip("/")) or path, path=path, type=kind,
                             size=int(size or 0), mode=int(mode or "0", 8), permissions=perms, owner=user,
                             group=grp, mtime=float(mtime or 0), symlink_target=link or None))
    return entries


# -- bounded event channels (back-pressure, never unbounded buffering) --------------------------
# A process's output is moved by awaiting: the daemon's pump awaits the write into a process's
# channel; a full channel stops the pump, the sandbox's pipe fills and the command blocks on its
# write (as with a slow terminal). Nothing between the sandbox and the client grows with the
# output: what is held per process is a few chunks of at most 64 KiB (docs/e2b.md "Back-pressure").
CHANNEL_EVENTS = 4  # events (chunks of at most 64 KiB) a process's own channel holds


class EventChannel:
    """A bounded channel of events with one consumer.

    ``put`` waits while ``maxsize`` events are queued (back-pressure); ``finish(last)`` ends it
    (``last`` after what is queued; never waits: the end always fits); ``drop(last)`` ends it
    now (what is queued is discarded); ``close()`` is the consumer leaving: what is queued is
    released and every put, waiting or later, returns False at once - a producer never blocks
    on a consumer that is gone. ``get()`` returns :data:`EventChannel.END` once finished and empty."""

    END = object()

    def __init__(self, maxsize: int = CHANNEL_EVENTS):
        self.maxsize = max(1, int(maxsize))
        self._items: collections.deque = collections.deque()
        self._finished = False
        self._room: asyncio.Future | None = None  # producers wait here for room
        self._ready: asyncio.Future | None = None  # the consumer waits here for an item or the end

    @property
    def finished(self) -> bool:
        return self._finished

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _wake(fut: asyncio.Future | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def put(self, item, timeout: float | None = None) -> bool:
        """Queue ``item``, waiting while the channel is full. False (``item`` not queued) when
        the channel is finished or closed, or still full after ``timeout`` seconds."""
        if len(self._items) >= self.maxsize and not self._finished:
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            while len(self._items) >= self.maxsize and not self._finished:
                if self._room is None or self._room.done():
                    self._room = loop.create_future()
                room = self._room
                if deadline is None:
                    await asyncio.shield(room)
                    continue
                left = deadline - loop.time()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(asyncio.shield(room), left)
                except asyncio.TimeoutError:
                    return False
        if self._finished:
            return False
        self._items.append(item)
        self._wake(self._ready)
        return True

    def finish(self, last=END) -> None:
        """No more events: the consumer gets what is queued, then ``last`` (if given), then END."""
        if self._finished:
            return
        if last is not EventChannel.END:
            self._items.append(last)
        self._finished = True
        self._wake(self._ready)
        self._wake(self._room)

    def drop(self, last=END) -> None:
        """End now: what is queued is discarded; the consumer gets ``last`` (if given), then END."""
        self._items.clear()
        self._finished = False
        self.finish(last)

    def close(self) -> None:
        """The consumer is gone: what is queued is released, producers never wait again."""
        self._items.clear()
        self._finished = True
        self._wake(self._ready)
        self._wake(self._room)

    async def get(self):
        while not self._items:
            if self._finished:
                return EventChannel.END
            if self._ready is None or self._ready.done():
                self._ready = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._ready)
        item = self._items.popleft()
        self._wake(self._room)
        return item

    async def events(self) -> AsyncIterator[ExecEvent]:
        """A process's events up to and including its ``exit``."""
        while True:
            ev = await self.get()
            if ev is EventChannel.END:
                return
            yield ev
            if ev.kind == "exit":
                return


HEAD_LIMIT = 64  # bytes of a process's first stderr output held while looking for the wrapper's pid line


async def started(proc) -> None:
    """Wait for ``proc`` to start; a caller cancelled meanwhile (the client of a Start went away)
    leaves no orphan behind: the process is aborted (its pump or thread released)."""
    try:
        await proc.wait_started()
    except BaseException:
        abort = getattr(proc, "abort", None) or proc.close
        abort()
        raise


class Upload:
    """A request body staged in a temporary file (never held whole in memory): ``length``
    bytes, read ``COPY_CHUNK`` at a time (``await read()``, b"" at the end) - what the daemon's
    ``ControlPlane.copy_in`` takes as an upload arriving; ``file`` is the binary file itself."""

    COPY_CHUNK = 1 << 20

    def __init__(self, file, length: int):
        self.file = file
        self.length = length

    async def read(self, n: int = COPY_CHUNK) -> bytes:
        return await asyncio.to_thread(self.file.read, min(max(1, n), self.COPY_CHUNK))

    def rewind(self) -> "Upload":
        self.file.seek(0)
        return self


class _FifoControl:
    """stdin, its end and (no) resize of a command run under the wrapper (``_WRAPPER``): written
    to its control FIFOs by later execs. Needs ``_backend`` (``_run``, ``_control``), ``_name``,
    ``_stdin`` and ``pid``; shared by the daemon's and the control plane's processes."""

    async def write_stdin(self, data: bytes) -> None:
        if not self._stdin:
            raise BackendFailure("invalid", "the process was not started with stdin=True")
        for i in range(0, len(data), 48 * 1024):  # argv strings are bounded (MAX_ARG_STRLEN)
            code, _, _ = await self._backend._run(self._name, [
                "/bin/sh", "-c", '[ -p "$1" ] || exit 3; printf %s "$2" | base64 -d > "$1"', "e2b-stdin",
                f"{CTL_DIR}/{self.pid}/in", base64.b64encode(data[i:i + 48 * 1024]).decode()])
            if code != 0:
                raise BackendFailure("not-found", f"process {self.pid} is gone")

    async def close_stdin(self) -> None:
        if not self._stdin:
            raise BackendFailure("invalid", "the process was not started with stdin=True")
        await self._backend._control(self._name, self.pid, "close")

    async def resize(self, cols: int, rows: int) -> None:
        raise Unsupported("a pty needs the daemon's exec TTY relay, which it does not have yet")


class _DaemonProcess(_FifoControl):
    """One exec through the daemon's streaming API, pumped from a thread into the loop."""

    def __init__(self, backend: "DaemonBackend", name: str, argv: list[str], timeout: float | None, stdin: bool):
        self.pid = 0
        self._name, self._stdin = name, stdin
        self._events = EventChannel()  # bounded: the thread waits for room (back-pressure)
        self._loop = asyncio.get_running_loop()
        self._started = asyncio.Event()
        self._backend = backend
        self._stderr_head = b""
        self._abandoned = False
        self._thread = threading.Thread(target=self._pump, args=(backend, name, argv, timeout), daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        """``item`` into the channel, this thread waiting while it is full: the daemon's exec
        stream is not read meanwhile, so the daemon's pump (and the sandbox's pipe) waits too.
        False when nobody will read it any more (the stream is then left, and closed)."""
        try:
            if item.kind == "exit":  # the end always fits: never waits
                self._loop.call_soon_threadsafe(self._events.finish, item)
                return False
            return asyncio.run_coroutine_threadsafe(self._events.put(item), self._loop).result()
        except (RuntimeError, asyncio.CancelledError, concurrent.futures.CancelledError):  # the loop is gone
            return False

    def close(self) -> None:
        """Nobody reads this process's events any more: what is queued is released and the
        thread leaves the daemon's stream (the daemon drains the command's output until it ends)."""
        self._events.close()

    def abort(self) -> None:
        """The Start that asked for this process was cancelled before it was handed out: nobody
        will ever read or close it, so it is closed here and its thread leaves the daemon's
        stream at the next event (not only at the next event that does not fit)."""
        self._abandoned = True
        self.close()

    def _started_with(self, pid: int) -> None:
        self.pid = pid
        self._loop.call_soon_threadsafe(self._started.set)

    def _pump(self, backend, name, argv, timeout) -> None:
        head_done = False
        try:
            for ev in backend.client.exec(name, argv, timeout):
                if self._abandoned:  # closed by a Start that was cancelled: the stream is left
                    return
                stream = ev.get("stream")
                if stream in ("stdout", "stderr"):
                    data = ev["data"]
                    if stream == "stderr" and not head_done:
                        self._stderr_head += data
                        if b"\n" not in self._stderr_head and len(self._stderr_head) < HEAD_LIMIT:
                            continue  # (bounded: a first line longer than HEAD_LIMIT is not the wrapper's)
                        line, _, rest = self._stderr_head.partition(b"\n")
                        head_done = True
                        m = re.fullmatch(rb"\x1e(\d+)", line)
                        self._started_with(int(m.group(1)) if m else 0)
                        if not m:
                            rest = self._stderr_head
                        self._stderr_head = b""
                        if rest and not self._put(ExecEvent("stderr", rest)):
                            return
                        continue
                    if not self._put(ExecEvent(stream, data)):
                        return
                elif "exit_code" in ev:
                    if not head_done:
                        self._started_with(0)
                        if self._stderr_head and not self._put(ExecEvent("stderr", self._stderr_head)):
                            return
                    err = None
                    if ev.get("setup_error"):
                        err = str(ev["setup_error"])
                    elif ev.get("timed_out"):
                        err = "timed out"
                    self._put(ExecEvent("exit", exit_code=int(ev["exit_code"]), error=err))
                    return
            self._put(ExecEvent("exit", exit_code=-1, error="the exec stream ended without an exit"))
        except Exception as exc:  # noqa: BLE001 - reported to the client as the process's end
            if not self._started.is_set():
                self._started_with(0)
            self._put(ExecEvent("exit", exit_code=-1, error=f"{type(exc).__name__}: {exc}"))
        finally:
            if not self._started.is_set():
                self._started_with(0)

    async def wait_started(self) -> None:
        await self._started.wait()

    def events(self) -> AsyncIterator[ExecEvent]:
        return self._events.events()


CTL_DIR = "/dev/shm/.agentvm-e2b"
# The sandbox's own shell runs the command with a control FIFO beside it: signals and the end
# of stdin are written there by later execs and carried out by a child of this shell (a later
# exec is another Landlock domain and may not signal this one's processes itself). With stdin,
# the command reads a FIFO that later execs write to; with "2" (a terminal: cpbackend's pty), the
# shell's own stdin, the terminal.
_WRAPPER = r"""
d=/dev/shm/.agentvm-e2b/$$
mkdir -p "$d" && mkfifo -m 600 "$d/ctl" || exit 126
if [ "$2" = 1 ]; then mkfifo -m 600 "$d/in" || exit 126; fi
printf '\036%s\n' "$$" >&2
cd -- "$1" || exit 1
if [ "$2" = 1 ]; then shift 2; "$@" < "$d/in" & c=$!
elif [ "$2" = 2 ]; then shift 2; exec 5<&0; "$@" <&5 5<&- & c=$!; exec 5<&-
else shift 2; "$@" < /dev/null & c=$!; fi
(
  exec 3<>"$d/ctl"
  if [ -p "$d/in" ]; then exec 4<>"$d/in"; fi
  while read -r op arg <&3; do
    case "$op" in
      sig) pkill -"$arg" -P "$c" 2>/dev/null; kill -"$arg" "$c" 2>/dev/null ;;
      close) exec 4>&- ;;
    esac
  done
) & w=$!
wait "$c"; rc=$?
kill "$w" 2>/dev/null; rm -rf "$d"
exit "$rc"
"""


def wrapped_argv(spec: ExecSpec, tag: str, stdin_mode: str) -> list[str]:
    """The argv that runs ``spec`` under ``_WRAPPER`` (``tag``: its $0, for ps), in its cwd, with
    its env (through env(1)); ``stdin_mode``: "0" none, "1" a FIFO (stdin=True), "2" the terminal."""
    argv = ["/bin/sh", "-c", _WRAPPER, tag, spec.cwd or ".", stdin_mode]
    if spec.env:
        argv += ["/usr/bin/env", *[f"{k}={v}" for k, v in spec.env.items()]]
    argv += spec.argv
    return argv


class DaemonBackend:
    """E2BBackend over the daemon's API (unix socket or TCP), as the CLI and SDK use it."""

    def __init__(self, client=None):
        if client is None:
            from agentvm.daemon.client import Client

            client = Client()
        self.client = client

    async def _call(self, fn, *a, **kw):
        from agentvm.daemon.client import ApiFailure, DaemonUnavailable

        try:
            return await asyncio.to_thread(fn, *a, **kw)
        except ApiFailure as exc:
            kind = {"sandbox.not-found": "not-found", "files.not-found": "not-found",
                    "sandbox.not-running": "gone"}.get(exc.code)
            if kind is None:
                kind = "permission" if exc.code.startswith("files.") or exc.status == 403 else "internal"
            raise BackendFailure(kind, f"{exc} ({exc.code})") from exc
        except DaemonUnavailable as exc:
            raise BackendFailure("internal", str(exc)) from exc

    # -- sandboxes --------------------------------------------------------------------------
    async def create(self, name: str, spec_text: str, ttl: float | None) -> None:
        await self._create(name, spec_text, ttl)
        try:
            await self._start(name)
        except BackendFailure:
            await self.kill(name)
            raise

    async def _create(self, name: str, spec_text: str, ttl: float | None) -> None:
        await self._call(self.client.create, spec_text, f"<e2b:{name}>", ttl, None)

    async def _start(self, name: str) -> None:
        await self._call(self.client.action, name, "start")

    async def kill(self, name: str) -> None:
        try:
            await self._remove(name)
        except BackendFailure as exc:
            if exc.kind != "not-found":
                raise

    async def _remove(self, name: str) -> None:
        await self._call(self.client.rm, name)

    async def pause(self, name: str) -> None:
        await self._call(self.client.action, name, "stop")

    async def resume(self, name: str) -> None:
        await self._start(name)

    async def info(self, name: str) -> BoxInfo | None:
        try:
            row = await self._get(name)
        except BackendFailure as exc:
            if exc.kind == "not-found":
                return None
            raise
        return BoxInfo(name, str(row.get("state", "unknown")))

    async def list(self) -> list[BoxInfo]:
        return [BoxInfo(r["name"], str(r.get("state", "unknown"))) for r in await self._rows()]

    async def _rows(self) -> list[dict]:
        """The daemon's rows of every sandbox (``name``, ``state``...)."""
        return await self._call(self.client.ps) or []

    # -- processes --------------------------------------------------------------------------
    async def exec(self, name: str, spec: ExecSpec) -> _DaemonProcess:
        if spec.pty is not None:
            raise Unsupported("a pty needs the daemon's exec TTY relay, which it does not have yet")
        check_env(spec.env)
        argv = wrapped_argv(spec, "e2b-exec", "1" if spec.stdin else "0")
        proc = _DaemonProcess(self, name, argv, spec.timeout, spec.stdin)
        await started(proc)
        return proc

    async def _run(self, name: str, argv: list[str]) -> tuple[int, bytes, bytes]:
        def go():
            out, err, code, size = [], [], 125, 0
            for ev in self.client.exec(name, argv, 60):
                if ev.get("stream") in ("stdout", "stderr"):
                    size += len(ev["data"])
                    if size > RUN_OUTPUT_LIMIT:  # never held past it: the stream is left
                        raise BackendFailure("invalid", f"the answer is larger than {RUN_OUTPUT_LIMIT} bytes")
                    (out if ev["stream"] == "stdout" else err).append(ev["data"])
                elif "exit_code" in ev:
                    code = int(ev["exit_code"])
            return code, b"".join(out), b"".join(err)

        return await self._call(go)

    async def _check(self, name: str, argv: list[str]) -> bytes:
        code, out, err = await self._run(name, argv)
        if code != 0:
            msg = err.decode(errors="replace").strip() or f"exit {code}"
            raise BackendFailure(_errkind(msg), msg)
        return out

    async def _control(self, name: str, pid: int, op: str) -> None:
        code, _, _ = await self._run(name, ["/bin/sh", "-c", '[ -p "$1" ] || exit 3; echo "$2" > "$1"', "e2b-control",
                                            f"{CTL_DIR}/{int(pid)}/ctl", op])
        if code != 0:
            raise BackendFailure("not-found", f"process {pid} not found")

    async def signal(self, name: str, pid: int, sig: int) -> None:
        await self._control(name, pid, f"sig {int(sig)}")

    # -- files --------------------------------------------------------------------------------
    async def _put_file(self, name: str, rel: str, data) -> None:
        """The daemon's symlink-safe copy into the workspace (``rel`` below it). ``data``: bytes,
        or an :class:`Upload` (streamed from its file, never read whole)."""
        if isinstance(data, Upload):
            data.rewind()
            await self._call(self.client.put_stream, name, rel, data.file, data.length)
            return
        await self._call(self.client.put_file, name, rel, data)

    async def _get(self, name: str) -> dict:
        """The daemon's row of ``name`` (state, sandbox_id, substrate)."""
        return await self._call(self.client.get, name)

    async def read_file(self, name: str, path: str) -> bytes:
        out = await self._check(name, ["/bin/sh", "-c", 'if [ -d "$1" ]; then echo "$1: Is a directory" >&2; '
                                       'exit 1; fi; exec head -c "$2" -- "$1"', "e2b-read", path, str(MAX_READ + 1)])
        if len(out) > MAX_READ:
            raise BackendFailure("invalid", f"{path} is larger than {MAX_READ} bytes")
        return out

    async def write_file(self, name: str, path: str, data) -> None:
        norm = posixpath.normpath(path)
        if norm.startswith(WORKSPACE + "/"):
            # the daemon's own copy: no link followed, written as the agent, all or nothing
            await self._put_file(name, norm[len(WORKSPACE) + 1:], data)
            return
        # elsewhere: staged in the workspace, then moved by the sandbox itself (its own rights)
        stage = f".agentvm-e2b/{secrets.token_hex(8)}"
        await self._put_file(name, stage, data)
        try:
            await self._check(name, ["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2"; rc=$?; '
                                     'rmdir -- "$(dirname -- "$1")" 2>/dev/null; exit $rc',
                                     "e2b-write", f"{WORKSPACE}/{stage}", norm])
        except BackendFailure:
            await self._run(name, ["rm", "-f", "--", f"{WORKSPACE}/{stage}"])
            raise

    async def list_dir(self, name: str, path: str, depth: int) -> list[Entry]:
        st = await self.stat(name, path)
        if st.type != "dir":
            raise BackendFailure("not-dir", f"{path} is not a directory")
        # bounded in the sandbox (the agent fills the directory): at most MAX_LIST_ENTRIES+1
        # records and MAX_LIST_BYTES+1 bytes come back; parsed off the daemon's loop
        _, out, err = await self._run(name, ["/bin/sh", "-c", 'find "$1" -mindepth 1 -maxdepth "$2" -printf "$3" | '
                                             'head -z -n "$4" | head -c "$5"', "e2b-list", path, str(max(1, depth)),
                                             _FIND_FMT, str(MAX_LIST_ENTRIES + 1), str(MAX_LIST_BYTES + 1)])
        if out.count(b"\0") > MAX_LIST_ENTRIES or len(out) > MAX_LIST_BYTES:
            raise BackendFailure("too-many", f"{path} holds more than {MAX_LIST_ENTRIES} entries (or {MAX_LIST_BYTES} "
                                             "bytes of them) at that depth: list or watch a narrower directory")
        if err.strip():  # find's own complaint (its exit status is lost in the pipe)
            msg = err.decode(errors="replace").strip()
            raise BackendFailure(_errkind(msg), msg)
        return await asyncio.to_thread(parse_find, out)

    async def stat(self, name: str, path: str) -> Entry:
        out = await self._check(name, ["find", path, "-maxdepth", "0", "-printf", _FIND_FMT])
        got = parse_find(out)
        if not got:
            raise BackendFailure("not-found", f"{path}: No such file or directory")
        return got[0]

    async def make_dir(self, name: str, path: str) -> bool:
        code, _, err = await self._run(name, ["/bin/sh", "-c", '[ -e "$1" ] && exit 17; mkdir -p -- "$1"',
                                              "e2b-mkdir", path])
        if code == 17:
            return False
        if code != 0:
            msg = err.decode(errors="replace").strip()
            raise BackendFailure(_errkind(msg), msg)
        return True

    async def move(self, name: str, src: str, dst: str) -> None:
        await self._check(name, ["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$2")" && mv -- "$1" "$2"',
                                 "e2b-move", src, dst])

    async def remove(self, name: str, path: str) -> None:
        await self.stat(name, path)  # not-found is an error for E2B
        await self._check(name, ["rm", "-rf", "--", path])

    # -- ports --------------------------------------------------------------------------------
    async def port_socket(self, name: str, port: int) -> socket.socket:
        """The sandbox's loopback port, reached from a thread that joins its network namespace.
        The daemon's API tells the sandbox's id and substrate, not its pid: the namespace is
        found from the sandbox's cgroup (``agentvm/<sandbox_id>``), see agentvm.e2b.ports."""
        from agentvm.e2b import ports

        try:
            info = await self._get(name)
        except BackendFailure as exc:
            raise ports.PortUnreachable(str(exc)) from exc
        if info.get("state") != "running" or not info.get("sandbox_id"):
            exc = ports.PortUnreachable(f"sandbox {name} is not running")
            exc.transient = info.get("state") in ("starting", "restarting", "backoff")  # (retried while young)
            raise exc
        substrate = info.get("substrate")
        if substrate not in ("bwrap", "bubblewrap"):
            raise ports.PortUnreachable(
                f"get_host(port) reaches bubblewrap sandboxes only; this one runs on {substrate!r}, whose loopback "
                "is not a host network namespace (gVisor's is inside its own network stack)")
        return await ports.port_socket_async(str(info["sandbox_id"]), port)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()

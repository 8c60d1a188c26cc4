"""The gate over several processes: gate workers (``agentvm up --gate-workers N``).

N worker processes run beside the daemon, each a :class:`~agentvm.gate.server.Gate` on its own
uvloop loop, and the daemon's sandboxes are spread between them (the worker with the fewest
endpoints takes the next). The daemon stays the one control point:

* it binds each sandbox's socket itself (owner, mode, as the in-process gate does) and hands
  the listening socket to the worker over ``SCM_RIGHTS``. It keeps its copy: a worker that dies
  is replaced and its sandboxes' sockets handed to the new one, their connections waiting in
  the socket's backlog meanwhile (the ones the dead worker was serving are lost; recorded);
* a live change - policy, pause, a credential revoked or restored - is pushed to the owning
  worker and acknowledged before the API call returns, so it holds from the sandbox's next
  request, as on the in-process gate;
* every decision record comes back to the daemon: the audit chain, the live stream, metrics,
  activity clocks see the same records as from the in-process gate. Each worker writes its
  sandboxes' decision logs itself.

Secrets on a need-to-use basis: a worker never reads the vault nor its key (a confined one
cannot: see below). The daemon resolves the credentials of the sandboxes a worker serves and
sends only those values, with the open; a revocation - the daemon's own (``revoke``), or one
written to the vault by another process, seen within REVOKE_POLL - sends a drop (the value is
forgotten by the worker, not only flagged), a restore or a rotation sends the value again. With
``isolate="agent"`` (:func:`placement_key`) each agent's sandboxes are served by workers of
their own, so a worker serving agent A never holds agent B's credentials.

Confinement (``confine="auto"``, the default: :mod:`agentvm.gate.confine`): a worker started by
a root daemon loads its CA, then confines itself - its own mount namespace without the daemon's
state, a uid of its own (one per worker slot), no capabilities, no_new_privs, Landlock, a
seccomp allowlist whose forbidden calls kill it. Such a death (SIGSYS) is a security alert on
the audit chain (``gate.worker-killed``), and the worker is replaced like any lost one. Each
sandbox's decision log is created by the daemon, owned by the worker's uid, before the worker
opens it (a confined worker creates no file outside its leaf-certificate cache).

A worker carries egress and credentials by reference. A sandbox whose endpoint needs state only
the daemon holds - a tool gateway (MCP sessions), held requests (``action: ask``: the approvals
queue), an LLM budget (counters shared by all of an agent's sandboxes) - is served by the
daemon's in-process gate instead (:func:`unplaceable` says why; the placement is recorded),
and a live change that would add such a need to a sandbox on a worker is refused with the fix
(restart it: it is then placed on the daemon's gate). Nothing is silently dropped.

Messages are length-prefixed pickles over a private socketpair that nothing else holds. The
worker takes the daemon's as they come (the daemon is trusted); the daemon reads a worker's -
which may be compromised - with a restricted unpickler that builds plain data only (dict, list,
tuple, str, bytes, numbers: no class, no callable, so no code runs in the daemon), and takes a
decision record only for a sandbox that worker was given.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import io
import json
import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from agentvm.errors import AgentVMError
from agentvm.fsutil import bind_unix_listener
from agentvm.identity import GATE_UIDS

log = logging.getLogger("agentvm.gate.workers")

HEADER = struct.Struct("!I")
MAX_MESSAGE = 1 << 28  # a pickled message larger than this is a broken peer (the daemon's to a worker)
MAX_FROM_WORKER = 16 << 20  # ... from a worker (its largest: a tool call's 4 MiB body); unpickled ~90x
MAX_NODES = 1 << 20  # containers and items a worker's message may expand to, shared references counted
MAX_DEPTH = 64
MAX_EXPANDED = 64 << 20  # bytes of text a worker's message may expand to, shared references counted
CALL_TIMEOUT = 10.0  # seconds a worker has to acknowledge a call; past it, it is killed and replaced
START_TIMEOUT = 30.0  # seconds a new worker has to come up (imports, its first acknowledgement)
STOP_TIMEOUT = 5.0  # seconds a worker has to exit once the daemon hangs up, before SIGKILL
MAX_WORKERS = GATE_UIDS  # one uid per slot (gate.confine.gate_uid): at most this many agents run with egress
RECORD_DELAY = 0.002  # seconds a worker holds decision records to send them in one message
RECORD_BATCH = 256  # ... or until this many wait
OPENS_IN_FLIGHT = 16  # endpoint opens (each with a descriptor queued) sent to one worker at once
RESTARTS = 5  # attempts at replacing a lost worker before its sandboxes are reported without egress
STALL_LIMIT = 60.0  # seconds a worker waits for a daemon that reads nothing before exiting
BACKLOG = 128  # a sandbox socket's accept backlog (connections wait here while a worker is replaced)
REVOKE_POLL = 0.2  # seconds between two looks at the vault for revocations/rotations made by another process
RETIRE_AFTER = 2.0  # seconds a per-agent worker outlives its agent's last sandbox (a restart reuses it)
MAX_QUESTIONS = 64  # questions (held requests, budget admissions) one worker may have open at the daemon
MAX_FIELD = 1 << 16  # the longest string a worker's question may carry (a held request's path: SHOW_MAX)
# a worker killed by one of these may have been attacked (a forbidden system call, a memory error)
ALERT_SIGNALS = {signal.SIGSYS: "seccomp", signal.SIGSEGV: "crash", signal.SIGBUS: "crash", signal.SIGILL: "crash",
                 signal.SIGABRT: "crash"}


def _protocol() -> str:
    """This module's version: the daemon and a worker it starts must run the same one."""
    import hashlib

    from agentvm import __version__

    try:
        src = Path(__file__).read_bytes()
    except OSError:
        src = b""
    return f"{__version__}:{hashlib.sha256(src).hexdigest()[:16]}"


PROTOCOL = _protocol()


class WorkerLost(AgentVMError):
    code = "gate.worker-lost"


class NoWorkerSlot(WorkerLost):
    """Every confined worker slot (one uid each) serves another running agent: refused, never
    served by a shared or unconfined gate instead."""

    code = "gate.no-worker-slot"
    exit_code = 75  # (retry once another agent's sandboxes stopped: errorcodes TEMPFAIL)
    status = 503


def _pack(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class _PlainData(pickle.Unpickler):
    """What the daemon reads a worker's messages with: plain data only (a compromised worker
    must not get code run in the daemon through a crafted pickle)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a gate worker sent an object of {module}.{name}: refused")


def _plain_loads(data) -> object:
    if len(data) > MAX_FROM_WORKER:
        raise ValueError(f"a message of {len(data)} bytes from a gate worker (at most {MAX_FROM_WORKER})")
    obj = _PlainData(io.BytesIO(data)).load()
    _bounded(obj)
    return obj


def _bounded(obj) -> None:
    """Refuse a worker's message whose data *expands* past MAX_NODES items or MAX_EXPANDED bytes
    of text, or nests past MAX_DEPTH. Pickle's memo lets a few hundred bytes reference one list
    from many places (60 levels of two references each is 2^60 leaves), or one 12 MiB string a
    million times: the daemon's first str() or JSON dump of it would hold its loop for ever. The
    expanded size is computed once per distinct container (linear in the message), without
    recursion."""
    containers = (list, tuple, dict, set, frozenset)

    def text(x) -> int:
        return len(x) if type(x) in (str, bytes, bytearray) else 0

    sizes: dict[int, tuple[int, int]] = {}
    stack: list = [(obj, 0, False)]
    keep: list = []  # (the containers measured stay alive: ids are not reused meanwhile)
    while stack:
        o, depth, done = stack.pop()
        if type(o) not in containers:
            continue
        if done:
            items = list(o.keys()) + list(o.values()) if type(o) is dict else o
            n, b = 1, 0
            for x in items:
                xn, xb = sizes[id(x)] if type(x) in containers else (1, text(x))  # (measured before it)
                n, b = n + xn, b + xb
            if n > MAX_NODES:
                raise ValueError(f"a gate worker's message expands to more than {MAX_NODES} items")
            if b > MAX_EXPANDED:
                raise ValueError(f"a gate worker's message expands to more than {MAX_EXPANDED} bytes of text")
            sizes[id(o)] = (n, b)
            continue
        if id(o) in sizes:
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"a gate worker's message nests deeper than {MAX_DEPTH}")
        keep.append(o)
        sizes[id(o)] = (MAX_NODES + 1, 0)  # (a cycle back to it, while it is measured: refused)
        stack.append((o, depth, True))
        items = list(o.keys()) + list(o.values()) if type(o) is dict else o
        for x in items:
            if type(x) in containers and id(x) not in sizes:
                stack.append((x, depth + 1, False))


class _Frames(asyncio.Protocol):
    """Reading a channel, at either end: length-prefixed messages parsed as they arrive (a
    Protocol: no future per read, as a StreamReader would make; records arrive all the time),
    each handed to ``on_message``; ``on_lost(reason)`` when the channel ends or breaks.
    ``loads``: pickle.loads at the worker's end, :func:`_plain_loads` at the daemon's."""

    def __init__(self, on_message, on_lost, loads=pickle.loads) -> None:
        self.on_message, self.on_lost, self.loads = on_message, on_lost, loads
        # the daemon's end reads a worker (maybe compromised): a smaller frame, never buffered past it
        self.limit = MAX_FROM_WORKER if loads is _plain_loads else MAX_MESSAGE
        self.buf = bytearray()
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        at, size = 0, len(buf)
        try:
            while size - at >= HEADER.size:
                (n,) = HEADER.unpack_from(buf, at)
                if n > self.limit:
                    raise ValueError(f"a message of {n} bytes: the peer is broken")
                if size - at - HEADER.size < n:
                    break
                msg = self.loads(buf[at + HEADER.size:at + HEADER.size + n])
                at += HEADER.size + n
                self.on_message(msg)
        except Exception as exc:  # noqa: BLE001 - a broken channel is a lost worker
            self.buf = bytearray()
            self.transport.close()
            self.on_lost(f"its channel broke ({type(exc).__name__}: {exc})")
            return
        del buf[:at]

    def connection_lost(self, exc) -> None:
        self.on_lost("its channel closed" if exc is None else f"its channel broke ({exc})")


def _only_rotated(index: int, name: str, binding, creds, text) -> None:
    """What a worker may write in the vault: an OAuth2 broker's rotated refresh token, nothing
    else of the entry. The entry is global (every agent bound to it mints from it): a worker
    that could rewrite its token URL or client would have every later mint sent where it chose."""
    refuse = AgentVMError(f"gate worker {index} asked to store credential {name!r} with more than its refresh "
                          "token changed: refused")
    if getattr(getattr(binding, "broker", None), "kind", None) != "oauth2-refresh" or type(text) is not str \
            or len(text) > 65536:
        raise refuse
    try:
        src = getattr(creds, "source", creds)  # (the daemon's side of a worker's set: its source reads the vault)
        cur, new = json.loads(getattr(src, "_raw_value", None)(name)), json.loads(text)
    except Exception:  # noqa: BLE001 - unreadable either side: nothing is stored
        raise refuse from None
    rt = new.get("refreshToken") if isinstance(new, dict) else None
    if (not isinstance(cur, dict) or not isinstance(rt, str) or not rt or len(rt) > 8192
            or set(new) - {"refreshToken"} != set(cur) - {"refreshToken"}
            or any(new[k] != cur[k] for k in cur if k != "refreshToken")):
        raise refuse


async def _answer_of(asker, sandbox_id: str, qid, fut: asyncio.Future, gone) -> None:
    """Wait for the daemon's answer to question ``qid``, telling it once when the requester
    left (``gone()`` true, or failing) or the wait is cancelled, so it drops what it holds."""
    told = False
    try:
        while not fut.done():
            await asyncio.wait([fut], timeout=0.1)
            if not told and gone is not None and not fut.done():
                try:
                    left = bool(gone())
                except Exception:  # noqa: BLE001 - a check that fails: gone
                    left = True
                if left:
                    told = True
                    asker.tell("gone", sandbox_id, qid)
    except asyncio.CancelledError:
        if not told:
            asker.tell("gone", sandbox_id, qid)
        raise


def _tools_question(args) -> tuple:
    """A worker's ``tools`` question's arguments: ``(method, params)``, a method the tool gateway
    serves and params that are plain JSON data within the front's bounds (or None). Anything
    else raises ValueError: the worker is dropped (an honest front never sends it)."""
    from agentvm.tools.front import METHODS, json_shaped

    if not isinstance(args, tuple) or len(args) != 2:
        raise ValueError("a tools request that is not (method, params)")
    method, params = args
    if type(method) is not str or method not in METHODS:
        raise ValueError("a tools request for a method the tool gateway does not serve")
    if params is not None:
        if type(params) is not dict:
            raise ValueError("tools request params that are not a dict")
        why = json_shaped(params)
        if why is not None:
            raise ValueError(f"tools request params that are not plain JSON data within bounds: {why}")
    return method, params


def _worker_record(rec: dict, agent: str, now: float) -> dict:
    """A decision record from a worker (which may be compromised), as the daemon takes it: the
    agent is the one the daemon gave the sandbox to (never the worker's word: a record in another
    agent's name on the audit chain), no ``kind`` of its own (an event posing as another kind),
    a time within the last five minutes (a record's time moves idle clocks and orders the chain);
    string keys only."""
    out = {k: v for k, v in rec.items() if type(k) is str and k not in ("kind", "agent", "time")}
    t = rec.get("time")
    out["time"] = t if type(t) in (int, float) and now - 300 <= t <= now + 1 else now
    out["agent"] = agent
    return out


def _quiet(fut: asyncio.Future) -> None:
    """A done callback for a call nobody waits for: its error is taken (not logged as never retrieved)."""
    if not fut.cancelled():
        fut.exception()


def unplaceable(policy, extras=None, creds=None, *, tools: bool = False) -> str | None:
    """Why a sandbox's endpoint cannot be served by a gate worker (it is served by the daemon's
    own gate), or None. ``policy`` is the sandbox's EgressPolicy; ``extras`` its
    agentvm.tools.slot.EndpointExtras. Held requests (``action: ask``) and LLM budgets are
    served by a worker, which asks the daemon (:meth:`WorkerPool.question`); tools too when the
    pool's host keeps the sandbox's tool gateway (``tools=True``: the daemon, ``host_gate``)."""
    if extras is not None:
        spec = getattr(extras, "tools", None)
        if spec is not None and getattr(spec, "servers", None):
            if not tools:  # (a pool whose host keeps no tool gateway for it: the embedded run's)
                return "it has tools: the tool gateway's MCP sessions live in the daemon"
            if getattr(extras, "run_dir", None) is None:
                return "it has tools but no run directory for its tool gateway"
    if creds is not None and getattr(creds, "spec", None) is None:
        return "its credentials are not the vault's (nothing a worker could rebuild them from)"
    return None


def _policy_files(policy) -> dict[str, bytes | None]:
    """The files a policy names that the gate reads while serving (its upstream CA bundle), read
    by the daemon: a confined worker cannot open them (they are not in its namespace)."""
    path = getattr(policy, "upstream_ca", None) if policy is not None else None
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            return {path: f.read(1 << 20)}
    except OSError:
        return {path: None}  # (the worker fails its TLS to that upstream, as the gate would)


def _counters_ok(stats) -> bool:
    """A worker's counters at close, as op_close makes them (anything else is refused)."""
    def pair(k) -> bool:
        return isinstance(k, tuple) and len(k) == 2 and all(isinstance(x, str) for x in k)

    try:
        return (isinstance(stats, dict)
                and all(type(stats[f]) is int and stats[f] >= 0 for f in ("allowed", "bytes_out", "bytes_in", "alerts"))
                and isinstance(stats["denials"], dict) and len(stats["denials"]) <= 10_000
                and all(pair(k) and type(n) is int and n >= 0 for k, n in stats["denials"].items())
                and isinstance(stats["denial_reasons"], dict) and len(stats["denial_reasons"]) <= 10_000
                and all(pair(k) and isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                        and (v[1] is None or isinstance(v[1], str)) for k, v in stats["denial_reasons"].items()))
    except KeyError:
        return False


def placement_key(isolate: str | None, agent: str, tier: str | None = None) -> str | None:
    """Which workers may serve a sandbox of ``agent`` (risk tier ``tier``): None - any (``isolate``
    None); ``agent:NAME`` - only workers serving that agent's sandboxes (a parser bug exploited
    by one agent reaches that agent's egress and credentials only); ``tier:L3`` - only workers
    of that risk tier (fewer processes; agents of one tier share them). For the daemon:
    ``WorkerPool(..., isolate="agent")``, and ``open(..., tier=...)`` when isolating by tier."""
    if isolate is None:
        return None
    if isolate == "agent":
        return f"agent:{agent}"
    if isolate == "tier":
        return f"tier:{tier or 'unknown'}"
    raise AgentVMError(f"gate workers: isolate={isolate!r} is not agent, tier or None")


# ------------------------------------------------------------------------- the daemon's side
class _PushSet(set):
    """A set of revoked credential names whose changes are pushed to the endpoint's worker."""

    def __init__(self, ep: "RemoteEndpoint") -> None:
        super().__init__()
        self._ep = ep

    def add(self, item) -> None:
        super().add(item)
        self._ep._push()

    def discard(self, item) -> None:
        super().discard(item)
        self._ep._push()

    def remove(self, item) -> None:
        super().remove(item)
        self._ep._push()

    def update(self, *items) -> None:
        super().update(*items)
        self._ep._push()

    def clear(self) -> None:
        super().clear()
        self._ep._push()


class RemoteCreds:
    """The daemon's handle on a worker-served sandbox's credentials: what the daemon changes, and
    the daemon's own CredentialSet (``source``, reading the vault), which the values sent to the
    worker are resolved from."""

    def __init__(self, ep: "RemoteEndpoint", source, scrub_encoded: bool, check_real: bool = True) -> None:
        self.source = source
        self.spec = source.spec
        self.bindings = dict(source.bindings)
        self.scrub_encoded = scrub_encoded
        self.check_real = check_real
        self.local_revoked = _PushSet(ep)

    def wanted(self) -> tuple[tuple[str, ...], dict[str, str], dict[str, str]]:
        """What the worker must hold now: (names dropped - revoked here or in the vault -, values
        of the others, errors of those that do not resolve). A broken vault drops everything (fail
        closed). Brokered credentials: the vault's value (the worker mints from it)."""
        src = self.source
        raw = getattr(src, "_raw_value", src.value)
        dropped, values, errors = set(self.local_revoked), {}, {}
        for name in self.bindings:
            if name in dropped:
                continue
            try:
                if src.revoked(name):
                    dropped.add(name)
                    continue
            except Exception:  # noqa: BLE001 - a vault that cannot say: revoked
                dropped.add(name)
                continue
            try:
                values[name] = raw(name)
            except Exception as exc:  # noqa: BLE001 - the worker answers as the gate would
                errors[name] = f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"
        return tuple(sorted(dropped)), values, errors

    def __repr__(self) -> str:
        return f"RemoteCreds({sorted(b.name for b in self.spec[0])})"


class RemoteEndpoint:
    """A sandbox's endpoint served by a gate worker, as the daemon sees it: the same attributes
    the daemon reads and sets on an in-process Endpoint (policy, paused, creds.local_revoked,
    and, once closed, the run's counters for egress_summary). Every change is pushed to the
    worker at once, in order; :meth:`synced` waits for the worker's acknowledgement."""

    can_meter = True  # (the daemon keeps the ledger; the worker asks it before each metered request)

    def __init__(self, pool: "WorkerPool", worker: "GateWorker", sandbox_id: str, agent: str, policy, sock_path: Path,
                 sock: socket.socket, creds, extras=None) -> None:
        self.pool, self.worker = pool, worker
        self.sandbox_id, self.agent = sandbox_id, agent
        self._policy = policy
        self._policy_sent = None  # the policy the worker has (pushed only when it changes)
        self._paused = False
        self.sock_path = Path(sock_path)
        self.sock = sock  # the daemon's copy of the listening socket (handed to a replacement worker)
        self.bridge_key = ""  # the sandbox's bridge's key (gate.server.HANDOFF_PREFIX), opened with
        self.log_path = pool.log_dir / f"{sandbox_id}.egress.jsonl"
        self.creds = None if creds is None else RemoteCreds(self, creds, bool(getattr(creds, "scrub_encoded", True)),
                                                            bool(getattr(creds, "check_real", True)))
        self._creds_sent = None  # (dropped, values, errors) the worker holds
        self._pending: list[asyncio.Future] = []  # pushes not acknowledged yet
        self.served = False  # its worker acknowledged serving it (false while a replacement takes it back)
        self.reopening = asyncio.Lock()
        self.allowed = self.bytes_out = self.bytes_in = self.alerts = 0
        self.denials: dict = {}
        self.denial_reasons: dict = {}
        self.closed = False
        self.counts_lost = False  # a worker serving it died: its counters from then are gone
        # what the daemon answers its worker's questions with (agentvm.tools.slot.EndpointExtras)
        self.approval_timeout = float(getattr(extras, "approval_timeout", 300.0) or 300.0)
        self.approval_webhook = getattr(extras, "webhook", None)
        self.policy_digest = getattr(extras, "policy_digest", "") or ""
        self.budget = None  # _PushBudget over the daemon's Budget (the agent's ledger), or None
        self.reserved = 0  # budget admissions its worker holds (released if the worker goes)
        self._live = (0, 0)  # (out, in) bytes its current worker reported so far (counted above)
        spec = getattr(extras, "budget", None)
        if spec is not None:
            from agentvm.gate.budget import Budget, BudgetStore

            db = getattr(extras, "budget_db", None)
            self.budget = _PushBudget(self, Budget(agent, spec, BudgetStore(db) if db else None))
        # its tool gateway (MCP sessions, tool servers) lives here, in the daemon; the worker parses
        # the /mcp requests' HTTP and asks the daemon to answer each one (WorkerPool._q_tools)
        self.tools = None
        tools = getattr(extras, "tools", None)
        if tools is not None and getattr(tools, "servers", None):
            from agentvm.tools.slot import ToolsSlot

            self.tools = ToolsSlot(self, tools, self.policy_digest, Path(extras.run_dir), dict(getattr(extras, "env", ())))

    @property
    def gate(self):
        """The daemon's own gate (the tool gateway opens its remote servers' endpoints there, and
        asks its approvals queue)."""
        return self.pool.host_gate

    def log(self, **fields) -> None:
        """A decision of the daemon's side (the tool gateway's): written by the worker, in the
        sandbox's decision log, and sent back as its records are."""
        try:
            self.worker.tell(("log", self.sandbox_id, fields))
        except Exception:  # noqa: BLE001
            log.exception("a tool decision of %s could not be logged", self.sandbox_id)

    def __repr__(self) -> str:
        return f"RemoteEndpoint({self.sandbox_id!r} on gate worker {self.worker.index})"

    @property
    def placement(self) -> str:
        return f"worker {self.worker.index}"

    @property
    def policy(self):
        return self._policy

    def set_policy(self, policy) -> None:
        self._policy = policy
        self._push()

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = bool(value)
        self._push()

    def set_budget(self, budget) -> None:
        """An LLM budget set live: the daemon keeps the ledger, the worker is told the spec (and
        cuts its opaque tunnels to the budget's hosts) before the call returns."""
        self.budget = _PushBudget(self, budget)
        self._push()

    def _budget_spec(self):
        return None if self.budget is None else self.budget.spec

    async def quiesce(self, timeout: float) -> int:
        """``Endpoint.quiesce`` on its worker (before a checkpoint: no new connection served,
        idle ones closed, requests under way given ``timeout`` s) -> how many are still under
        way. A worker that cannot say counts as busy (the suspend is refused)."""
        try:
            n = await self.worker.call("quiesce", self.sandbox_id, float(timeout), timeout=float(timeout) + CALL_TIMEOUT)
        except AgentVMError as exc:
            log.warning("quiescing %s on gate worker %d: %s", self.sandbox_id, self.worker.index, exc)
            return 1
        return n if type(n) is int and n >= 0 else 1

    def unquiesce(self) -> None:
        try:
            self.worker.send("unquiesce", self.sandbox_id).add_done_callback(_quiet)
        except AgentVMError:
            pass

    def release_reservations(self) -> None:
        """Its worker is gone or it closed: the admissions it held end uncounted."""
        while self.reserved > 0 and self.budget is not None:
            self.reserved -= 1
            self.budget.release()
        self.reserved = 0

    def revoke(self, names, revoked: bool = True) -> None:
        """Revoke (or restore) this session's credentials by name: the next request sees it."""
        if self.creds is not None:
            for n in names:
                (self.creds.local_revoked.add if revoked else self.creds.local_revoked.discard)(n)

    def _revoked(self) -> list[str]:
        return sorted(self.creds.local_revoked) if self.creds is not None else []

    def open_args(self) -> tuple:
        spec = None
        if self.creds is not None:
            bindings, placeholders, _vault_dir, sid = self.creds.spec  # (the vault's place is not sent)
            self._creds_sent = self.creds.wanted()
            spec = ((bindings, placeholders, sid), (self.creds.scrub_encoded, self.creds.check_real), self._creds_sent)
        self._policy_sent = self._policy
        return (self.sandbox_id, self.agent, self._policy, str(self.sock_path), spec, self._paused, self._revoked(),
                _policy_files(self._policy), self._budget_spec(), self.tools is not None, self.bridge_key)

    def _creds_change(self):
        """The credentials' state if it differs from what the worker holds, else None."""
        if self.creds is None:
            return None
        now = self.creds.wanted()
        return None if now == self._creds_sent else now

    def _push(self) -> None:
        """Send the endpoint's state to its worker, in order with every other message (after the
        open, if that is still under way). A worker that fails to apply it is killed and
        replaced (GateWorker._message), and the replacement opens the endpoint with the whole
        state: so the policy is sent again only when it changes."""
        if self.closed or not self.worker.alive:
            return  # (a replacement gets the whole state when it opens this endpoint)
        policy = None if self._policy is self._policy_sent else self._policy
        creds = self._creds_change()
        try:
            self._pending.append(self.worker.send("state", self.sandbox_id, policy, self._paused, self._revoked(), creds,
                                                  _policy_files(policy), self._budget_spec()))
        except WorkerLost:
            return
        self._policy_sent = self._policy
        if creds is not None:
            self._creds_sent = creds

    def poll_vault(self) -> None:
        """A revocation, restore or rotation made in the vault by another process: sent."""
        if self.closed or not self.served or not self.worker.alive or self.creds is None:
            return
        creds = self._creds_change()
        if creds is None:
            return
        policy = None if self._policy is self._policy_sent else self._policy
        try:  # (nobody waits for it: a worker that fails it is replaced, the replacement gets it all)
            self.worker.send("state", self.sandbox_id, policy, self._paused, self._revoked(), creds,
                             _policy_files(policy), self._budget_spec()).add_done_callback(_quiet)
        except WorkerLost:
            return
        self._policy_sent, self._creds_sent = self._policy, creds

    async def synced(self) -> None:
        """Wait until the endpoint's worker serves it with every change made so far: each push
        acknowledged, or - if the worker died or failed one - its replacement serving the
        endpoint with the whole state. Raises AgentVMError when no worker serves it."""
        for _ in range(3):
            pending, self._pending = self._pending, []
            try:
                for fut in pending:
                    await asyncio.wait_for(asyncio.shield(fut), CALL_TIMEOUT)
            except asyncio.TimeoutError:
                self.worker.kill(f"it did not apply a change to {self.sandbox_id} within {CALL_TIMEOUT:g} s")
            except AgentVMError:
                pass  # lost, or failed it (and killed for it): the replacement has it all
            await self.pool.settle(self.worker.index)  # (a replacement under way: its end)
            w = self.worker
            if not w.alive:
                await self.pool.replaced(w)
                continue
            if self._pending:
                continue
            if self.served or self.closed:
                return
            try:  # its worker could not take it back before: once more, with the whole state
                await self.pool.reopen(self)
            except AgentVMError:
                pass
            if self.served or self.closed:
                return
        raise AgentVMError(f"sandbox {self.sandbox_id} is not served by a gate worker now (gate worker "
                           f"{self.worker.index}: {self.worker.reason or 'it could not take the sandbox back'}); "
                           "the change is stored, and its egress is refused until it is served again",
                           hint="restart the sandbox; see the daemon's log and `agentvm audit show` (gate.worker-*)",
                           code="gate.worker-lost")


class _PushBudget:
    """The daemon's Budget of a worker-served sandbox (the agent's ledger: admissions and counts
    happen here, asked by the worker); a change of its spec or a reset is pushed to the worker."""

    def __init__(self, ep: RemoteEndpoint, inner) -> None:
        self._ep, self.inner = ep, inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def set_spec(self, spec) -> None:
        self.inner.set_spec(spec)
        self._ep._push()

    def reset(self) -> None:
        self.inner.reset()
        self._ep._push()


def _text(v, limit: int = MAX_FIELD) -> str:
    if type(v) is not str or len(v) > limit:
        raise ValueError(f"not a string of at most {limit} characters: {type(v).__name__}")
    return v


def _count(v, limit: int = 1 << 40) -> int:
    if type(v) is not int or not 0 <= v <= limit:
        raise ValueError(f"not a count: {v!r:.40}")
    return v


def _asked(args) -> tuple:
    """A held request as a worker sends it: (host, port, scheme, method, path, body size, sni,
    websocket), chunked - each field checked for its type and size (ValueError otherwise)."""
    if not isinstance(args, tuple) or len(args) != 2 or not isinstance(args[0], tuple) or len(args[0]) != 8:
        raise ValueError("a held request that is not ((8 fields), chunked)")
    (host, port, scheme, method, path, size, sni, ws), chunked = args
    asked = (_text(host, 1024), _count(port, 65535), _text(scheme, 8), _text(method, 64), _text(path),
             None if size is None else _count(size), None if sni is None else _text(sni, 1024), ws)
    if type(ws) is not bool or type(chunked) is not bool:
        raise ValueError("websocket and chunked are booleans")
    return asked, chunked


async def hold_request(store, ep, asked: tuple, chunked: bool, rule_id: str, log, gone) -> tuple:
    """The daemon's side of a worker's held request (``action: ask``) - what
    ``Endpoint.hold`` does on the daemon's own gate: queued (on the audit chain), the pending
    record handed to ``log`` (the worker writes it), the answer awaited (the approval timeout,
    ``gone()``: its requester left). -> (approved, rule id, reason, request id)."""
    from agentvm.held import SHOW_MAX, digest

    host, port, _scheme, method, path, size, _sni, _ws = asked
    if store is None:
        return False, "approval:unavailable", "no approvals queue is available to ask a human", None
    if len(path) > SHOW_MAX:  # a human approves only what a human can see, whole
        return (False, "approval:unshowable", f"the request target ({len(path)} bytes) is too long to show a human "
                f"for approval (at most {SHOW_MAX})", None)
    shown = path if len(path) <= 512 else path[:509] + "..."
    target = f"{method} {host}:{port}{shown}"
    body = ("none" if not size and not chunked else
            f"{size if size is not None else 'chunked, unknown'} bytes, NOT shown: the gate has not read it "
            "(approve only if the target alone tells you enough)")
    summary = {"method": method, "host": host, "port": port, "path": path, "rule": rule_id, "body": body,
               "body_bytes": size, "preview": target[:200], "keys": ["method", "host", "port", "path"]}
    try:
        queued = store.submit(kind="egress", sandbox=ep.sandbox_id, agent=ep.agent, target=target, summary=summary,
                              arg_digest=digest([method, host, port, path]), policy=ep.policy_digest,
                              timeout=ep.approval_timeout, webhook=ep.approval_webhook)
    except Exception as exc:  # noqa: BLE001 - not recorded, not held: denied
        return False, "approval:unavailable", f"the request could not be queued ({type(exc).__name__})", None
    log(verdict="ask", rule_id="approval:pending", reason=f"waiting for a human ({queued.id})", host=host, port=port,
        method=method, path=path, phase="request", approval=queued.id)
    try:
        done = await store.wait(queued.id, gone=gone)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        return False, "approval:unavailable", f"the approvals queue failed ({type(exc).__name__})", None
    if done.state == "approved" and gone():
        return False, "client-gone", f"{done.id} was approved after its requester left: not forwarded", done.id
    if done.state == "approved":
        return True, "approval:approved", f"approved by {done.by}", done.id
    if done.state == "expired":
        return False, "approval:timeout", f"no human answered {done.id} in time ({done.note or 'expired'})", done.id
    return False, "approval:denied", f"{done.id} was denied by {done.by}", done.id


class GateWorker:
    """One worker process, from the daemon's side."""

    clears_slot = True  # its uid's leftover processes are killed before it starts (:meth:`_clear_slot`)

    def __init__(self, pool: "WorkerPool", index: int, tenant: str | None = None) -> None:
        self.pool, self.index = pool, index
        self.tenant = tenant  # the placement key it serves (isolate=...), for its whole life; None: anyone
        # the sandboxes it was ever given (-> their agent, as the daemon knows it): the only ones
        # it may send records of, and the agent a record is written under whatever it says
        self.given: dict[str, str] = {}
        self.uid = pool.uid_for(index)  # its uid once confined (None: not switched)
        self.endpoints: dict[str, RemoteEndpoint] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self.alive = False
        self.lost: asyncio.Future | None = None  # done when this worker is gone
        self._writer: asyncio.Transport | None = None
        self._fd_sock: socket.socket | None = None
        self._calls: dict[int, tuple[asyncio.Future, str]] = {}
        self.opening = asyncio.Semaphore(OPENS_IN_FLIGHT)  # bounds the descriptors queued for it
        self._next = 0
        self.reason = ""  # why it is gone
        self._stopping = False  # stop(): the worker is let exit on its own (up to STOP_TIMEOUT)
        self.retired = False  # its agent's last sandbox closed: stopped, never replaced, its slot free again
        self.ready = False  # its start finished (it answered): it may be given sandboxes
        self.questions: dict[int, asyncio.Task] = {}  # its questions the daemon is answering (held requests...)
        self.abandoned: set[int] = set()  # held requests whose requester left (the worker said so)
        self._retire: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """Start the worker process and wait for its answer (the same version of agent-vm)."""
        if self.uid is not None and self.clears_slot:  # nothing of the slot's uid may outlive its last worker (its
            await asyncio.to_thread(self._clear_slot)  # seccomp kills a fork; this is the second wall) and meet this one
        chan, fds = await self._spawn()
        fds.setblocking(False)  # (never blocks the daemon's loop: `opening` keeps its queue short)
        self._fd_sock = fds
        self.alive = True
        loop = asyncio.get_running_loop()
        self.lost = loop.create_future()
        try:
            self._writer, _ = await loop.create_unix_connection(lambda: _Frames(self._message, self._gone, _plain_loads),
                                                                sock=chan)
            version = await asyncio.wait_for(self.call("ping"), START_TIMEOUT)
        except BaseException:
            chan.close()
            self.kill("it did not come up")
            raise
        if version != PROTOCOL:
            self.kill("it runs another version of agent-vm")
            raise AgentVMError(f"gate worker {self.index} runs another version of agent-vm than {self.pool.host_name} "
                               "(the installation changed under it)", hint=self.pool.restart_hint)
        self.ready = True

    async def _spawn(self) -> tuple[socket.socket, socket.socket]:
        """The worker process (``self.proc``), a new interpreter: -> this side's ends of its
        call channel and of its descriptor socket. (The embedded run's first worker comes from
        a zygote forked earlier instead: agentvm.gate.embedded_worker.)"""
        chan, chan_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds, fds_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        args = [sys.executable, "-m", "agentvm.gate.workers", "--channel", str(chan_w.fileno()),
                "--fds", str(fds_w.fileno()), "--index", str(self.index),
                "--state-dir", str(self.pool.state_dir), "--log-dir", str(self.pool.log_dir)]
        if self.pool.telemetry:
            args += ["--telemetry", self.pool.telemetry]
        if not self.pool.records:
            args += ["--no-records"]
        if self.pool.confine is not None:
            args += ["--confine", str(self.uid if self.uid is not None else -1), "--confine-skip",
                     ",".join(self.pool.confine_skip)]
        try:
            self.proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                             pass_fds=(chan_w.fileno(), fds_w.fileno()))
        except BaseException:
            chan.close()
            fds.close()
            raise
        finally:
            chan_w.close()
            fds_w.close()
        return chan, fds

    def _clear_slot(self) -> None:
        """Kill any process of this slot's uid left alive (an earlier worker's): recorded as a
        security alert. One that will not die fails the start (fail closed)."""
        from agentvm.identity import uid_has_processes

        left = uid_has_processes(self.uid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pool.on_event("gate.slot-leftover", worker=self.index, uid=self.uid, pids=left[:20], alert="security")
        deadline = time.monotonic() + 5
        while uid_has_processes(self.uid):
            if time.monotonic() > deadline:
                raise AgentVMError(f"gate worker slot {self.index} (uid {self.uid}) still has processes after SIGKILL: "
                                   "refusing to start a worker beside them")
            time.sleep(0.02)

    def send(self, op: str, *args, fd: int | None = None) -> asyncio.Future:
        """Send one call; -> the future of its acknowledgement (raises WorkerLost at once if the
        worker is gone)."""
        if not self.alive:
            raise WorkerLost(f"gate worker {self.index} is gone: {self.reason}")
        if op == "open":
            self.given[args[0]] = args[1]  # (its records are taken from now on; args: sandbox, agent, ...)
            if self.pool.confine is not None:
                self.pool.own_log(args[0], self.uid)  # (a confined worker creates no file: its log is made for it)
        self._next += 1
        cid = self._next
        data = _pack((cid, op, args))  # (first: a call that cannot be sent sends no descriptor)
        if fd is not None:
            # the descriptor first, on its own socket, tagged with the call's id: it is there when
            # the call is read, and the worker checks it belongs to it
            try:
                socket.send_fds(self._fd_sock, [str(cid).encode()], [fd])
            except OSError as exc:
                self.kill(f"its descriptor queue refused a socket ({exc})")
                raise WorkerLost(f"gate worker {self.index} is gone: {self.reason}") from None
        fut = asyncio.get_running_loop().create_future()
        self._calls[cid] = (fut, op)
        self._writer.write(data)
        return fut

    async def call(self, op: str, *args, fd: int | None = None, timeout: float = CALL_TIMEOUT):
        fut = self.send(op, *args, fd=fd)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            self.kill(f"it did not answer {op!r} within {timeout:g} s")
            raise WorkerLost(f"gate worker {self.index} did not answer {op!r} within {timeout:g} s; it is replaced") from None

    def _message(self, msg) -> None:
        if not isinstance(msg, tuple) or not msg:
            raise ValueError("a message that is not a tuple")
        if msg[0] == "records":
            moved = self._counters(msg[2]) if len(msg) > 2 else ()
            on_record = self.pool.on_record or (lambda rec: None)  # (a host that asked for none)
            now = time.time()
            for rec in msg[1]:
                if not isinstance(rec, dict) or rec.get("sandbox") not in self.given:
                    log.error("gate worker %d sent a record of a sandbox it does not serve: dropped (%.200r)",
                              self.index, rec)
                    continue
                rec = _worker_record(rec, self.given[rec["sandbox"]], now)
                try:
                    on_record(rec)
                except Exception:  # noqa: BLE001 - one record's consumer must not cost the channel
                    log.exception("a gate worker's record")
            for ep in moved:
                try:
                    self.pool.on_bytes(ep)
                except Exception:  # noqa: BLE001
                    log.exception("a gate worker's byte counters")
        elif msg[0] == "reply":
            _, cid, ok, value = msg
            fut, op = self._calls.pop(cid, (None, None))
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(AgentVMError(f"gate worker {self.index}: {value}"))
            if not ok and op == "state":
                # it holds an endpoint in a state the daemon does not know: replaced, and the
                # replacement opens every endpoint with the daemon's whole state
                self.kill(f"it failed to apply a change ({value})")
        elif msg[0] == "q":  # a question to the monitor: a held request, a budget admission or count
            self.pool.question(self, msg)
        elif msg[0] == "persist":  # a brokered credential's rotated vault entry (agentvm.gate.brokers)
            try:
                self.pool.persist(self, *msg[1:])
            except Exception as exc:  # noqa: BLE001 - refused or failed: logged, the worker goes on
                log.error("gate worker %d: a rotated credential was not stored: %s", self.index, exc)

    def _gone(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.reason = reason
        for fut, _ in self._calls.values():
            if not fut.done():
                fut.set_exception(WorkerLost(f"gate worker {self.index} is gone: {reason}"))
        self._calls.clear()
        for t in self.questions.values():  # (a held request's row expires: nothing waits for its answer)
            t.cancel()
        self.questions.clear()
        for ep in self.endpoints.values():
            ep.release_reservations()
        if self._writer is not None:
            self._writer.close()
        if self._fd_sock is not None:
            self._fd_sock.close()
        if self.proc is not None and self.proc.returncode is None and not self._stopping:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(reason)
        self.pool.worker_gone(self)

    def kill(self, reason: str) -> None:
        self._gone(reason)

    def _counters(self, counters) -> list:
        """Its endpoints' byte counters (sandbox -> (out, in)), as they move: added to the daemon's
        view of the endpoint by what they grew (a counter of a sandbox it does not serve, or one
        not of its type, is ignored; one that shrinks adds nothing)."""
        moved = []
        if not isinstance(counters, dict) or len(counters) > 100_000:
            log.error("gate worker %d sent byte counters that are not counters: ignored", self.index)
            return moved
        for sid, v in counters.items():
            ep = self.endpoints.get(sid) if type(sid) is str else None
            if (ep is None or ep.worker is not self or not isinstance(v, tuple) or len(v) != 2
                    or not all(type(x) is int and 0 <= x < 1 << 62 for x in v)):
                continue
            out, inn = max(0, v[0] - ep._live[0]), max(0, v[1] - ep._live[1])
            ep._live = (max(v[0], ep._live[0]), max(v[1], ep._live[1]))
            if out or inn:
                ep.bytes_out += out
                ep.bytes_in += inn
                moved.append(ep)
        return moved

    def tell(self, msg: tuple) -> None:
        """A message to the worker outside the calls (an answer to its question)."""
        if self.alive and self._writer is not None:
            self._writer.write(_pack(msg))

    async def stop(self) -> None:
        """Hang up: the worker closes its endpoints and exits (SIGKILL after STOP_TIMEOUT)."""
        self._stopping = True
        if self._writer is not None:
            # at once, calls not yet read dropped: a worker blocked sending to the daemon gets
            # the end now (a graceful close would wait for it to read them: both would wait)
            self._writer.abort()
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class WorkerPool:
    """The daemon's gate workers. ``on_record(rec)``: every decision record of their endpoints;
    ``on_event(kind, **data)``: a worker lost, replaced, or not replaceable (for the audit chain)."""

    host_name = "the daemon"  # (who starts them, for the version-mismatch error)
    restart_hint = "restart the daemon: `agentvm down && agentvm up`"

    def __init__(self, count: int, state_dir: Path, log_dir: Path, *, on_record, on_event, telemetry: str | None = None,
                 confine: str | None = "auto", isolate: str | None = None, approvals=None,
                 retire: float | None = None, on_bytes=None, spare: int = 0, host_gate=None):
        """``confine``: "auto" (the default: wholly confined under a root daemon; Landlock, seccomp
        and no_new_privs only under an unprivileged one, which cannot switch uid), "full" (refuse
        to run otherwise) or None (unconfined: the benchmark's baseline). ``isolate``: None (any
        worker serves any sandbox), "agent" or "tier" (see :func:`placement_key`): a worker serves
        one key's sandboxes for its whole life; workers are started on demand, up to MAX_WORKERS
        (``count`` may then be 0: none before the first sandbox). ``approvals``: a function giving
        the approvals queue (agentvm.approvals.ApprovalStore) the workers' held requests wait in
        (None: held requests are denied, ``approval:unavailable``). ``retire``: seconds after
        which a worker of a key whose last sandbox closed is stopped and its slot freed (None:
        kept; only with ``isolate``). ``on_bytes(ep)``: an endpoint's byte counters moved (its
        worker reports them with its records). ``spare``: with ``isolate``, keep this many started
        workers that serve nobody yet (each confined, holding nothing), so an agent's first
        sandbox does not wait for a worker's start; one is started again after each is taken."""
        if not (0 if isolate is not None else 1) <= count <= MAX_WORKERS:
            raise AgentVMError(f"gate workers: {count} is not between {0 if isolate else 1} and {MAX_WORKERS}")
        if confine not in ("auto", "full", None):
            raise AgentVMError(f"gate workers: confine={confine!r} is not auto, full or None")
        if isolate not in ("agent", "tier", None):
            raise AgentVMError(f"gate workers: isolate={isolate!r} is not agent, tier or None")
        self.count = count
        self.state_dir, self.log_dir = Path(state_dir), Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.on_record, self.on_event = on_record, on_event
        self.telemetry = telemetry
        self.isolate = isolate
        self.approvals = approvals
        self.retire = retire if isolate is not None else None
        self.on_bytes = on_bytes or (lambda ep: None)
        # the workers send every decision record back (on_record) unless it is None: then none
        # is built or sent, and an endpoint's counts arrive when it closes (an embedded run)
        self.records = on_record is not None
        self.spare = max(0, int(spare)) if isolate is not None else 0
        self.host_gate = host_gate  # the daemon's own gate: the tool gateways' remote servers are served there
        self._sparing: asyncio.Task | None = None
        root = os.geteuid() == 0
        if confine == "full" and not root:
            raise AgentVMError("gate workers: confine=full needs a root daemon (a worker switches to a uid of its own)",
                               hint="start the daemon as root, or use confine=auto (Landlock and seccomp only)")
        self.confine = None if confine is None else ("full" if root else "partial")
        self.confine_skip = () if self.confine != "partial" else ("mount-namespace", "identity")
        if self.confine == "full":
            st = self.log_dir.stat()  # the worker's uid reaches its log by name (and lists nothing)
            if not st.st_mode & 0o001:
                os.chmod(self.log_dir, (st.st_mode & 0o7777) | 0o001)
        self.workers: list[GateWorker] = []
        self.stopping = False
        self._replacing: dict[int, asyncio.Task] = {}  # worker index -> its replacement under way
        self._watch: asyncio.Task | None = None

    def uid_for(self, index: int) -> int | None:
        """The uid a worker in slot ``index`` runs as (None: it keeps the daemon's)."""
        if self.confine != "full":
            return None
        from agentvm.gate.confine import gate_uid

        return gate_uid(self.state_dir.parent, index)

    def own_log(self, sandbox_id: str, uid: int | None) -> None:
        """Make ``sandbox_id``'s decision log (appended to if it exists) the worker's to write."""
        path = self.log_dir / f"{sandbox_id}.egress.jsonl"
        if uid is not None:  # the worker reaches its log by name: the folder must stay searchable
            st = self.log_dir.stat()  # (another process may have made it 0700 meanwhile)
            if not st.st_mode & 0o001:
                os.chmod(self.log_dir, (st.st_mode & 0o7777) | 0o001)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if uid is not None:
                os.fchown(fd, uid, uid)
        finally:
            os.close(fd)

    def persist(self, w: "GateWorker", sandbox_id: str, name: str, text: str) -> None:
        """A worker's brokered credential rotated its vault entry: stored, if that credential is
        bound to a sandbox that worker serves (a worker writes nothing else in the vault)."""
        ep = w.endpoints.get(sandbox_id)
        b = None if ep is None or ep.creds is None else ep.creds.bindings.get(name)
        if b is None or getattr(b, "broker", None) is None:
            raise AgentVMError(f"gate worker {w.index} asked to store credential {name!r} of {sandbox_id}, "
                               "which is not a brokered credential of a sandbox it serves")
        _only_rotated(w.index, name, b, ep.creds, text)
        persist = getattr(ep.creds.source, "_persist", None)
        if persist is not None:
            persist(b, text)
            self.on_event("credential.rotated", sandbox=sandbox_id, credential=name, worker=w.index)

    # -- the monitor: a worker's questions ------------------------------------------------
    def question(self, w: GateWorker, msg) -> None:
        """A worker asks the daemon - the only thing it may ask: to hold one of its sandboxes'
        requests for a human (``hold``; ``gone``: its requester left), to admit one request
        under its sandbox's LLM budget (``admit``), to end an admission uncounted (``release``)
        or to count a response (``charge``). Everything is checked: a worker may be compromised.
        A malformed question (not the shape of one, an unknown op) drops the worker (ValueError:
        its channel is taken for broken; it is replaced); one about a sandbox it does not serve
        now is refused; a held request is decided again here under the daemon's policy. The
        parsing of the sandbox's bytes stays in the worker: these are small typed values."""
        if not isinstance(msg, tuple) or len(msg) != 5:
            raise ValueError("a question that is not (q, id, op, sandbox, args)")
        _, qid, op, sid, args = msg
        if type(qid) is not int or type(op) is not str or type(sid) is not str or not isinstance(args, tuple):
            raise ValueError("a question whose id, op, sandbox or arguments are not of their type")
        if op not in ("hold", "gone", "admit", "release", "charge", "tools"):
            raise ValueError(f"an unknown question {op[:40]!r}")
        ep = w.endpoints.get(sid)
        if ep is None or ep.closed:
            log.error("gate worker %d asked %r about sandbox %.80r, which it does not serve: refused", w.index, op, sid)
            if qid and op in ("hold", "admit"):
                w.tell(("a", qid, False, "not a sandbox this worker serves"))
            return
        if op == "gone":  # (args: the id of the held request whose requester left)
            if len(args) == 1 and type(args[0]) is int and args[0] in w.questions:
                w.abandoned.add(args[0])
            return
        if op == "release":
            if ep.reserved > 0:
                ep.reserved -= 1
                ep.budget.release()
            return
        if op == "charge":
            self._charge(w, ep, args)
            return
        if not qid or qid in w.questions:
            raise ValueError(f"a question id {qid} that is 0 or in use")
        if len(w.questions) >= MAX_QUESTIONS:
            w.tell(("a", qid, False, f"more than {MAX_QUESTIONS} questions open at once"))
            return
        if op == "tools":
            args = _tools_question(args)  # (here, not in its task: a malformed one drops the worker)
        handler = {"hold": self._q_hold, "admit": self._q_admit, "tools": self._q_tools}[op]
        task = asyncio.get_running_loop().create_task(handler(w, ep, qid, args))
        task.sandbox_id = sid
        w.questions[qid] = task

        def answered(t: asyncio.Task) -> None:
            w.questions.pop(qid, None)
            w.abandoned.discard(qid)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                log.error("gate worker %d: answering %s about %s: %s", w.index, op, sid, exc)
                w.tell(("a", qid, False, f"{type(exc).__name__}"))
            else:
                w.tell(("a", qid, True, t.result()))

        task.add_done_callback(answered)

    async def _q_hold(self, w: GateWorker, ep: RemoteEndpoint, qid: int, args) -> tuple:
        from agentvm.gate.policy import decide_request

        try:
            asked, chunked = _asked(args)
        except ValueError as exc:
            log.error("gate worker %d sent a held request of %s that is not one (%s): refused", w.index, ep.sandbox_id, exc)
            return False, "approval:unavailable", "the gate worker's request to hold it was malformed", None
        d = decide_request(ep.policy, *asked)  # the daemon's policy decides whether a human is asked
        if d.verdict != "ask":
            log.error("gate worker %d asked to hold a request of %s that its policy does not hold (%s): refused",
                      w.index, ep.sandbox_id, d.rule_id)
            return False, "approval:unavailable", "the daemon's policy does not hold this request for a human", None
        store = None
        if self.approvals is not None:
            try:
                store = self.approvals()
            except Exception:  # noqa: BLE001 - no queue: denied
                store = None

        def log_pending(**fields) -> None:
            w.tell(("held", qid, fields))

        return await hold_request(store, ep, asked, chunked, d.rule_id, log_pending, lambda: qid in w.abandoned)

    async def _q_tools(self, w: GateWorker, ep: RemoteEndpoint, qid: int, args) -> tuple:
        """One MCP request of a sandbox with tools, parsed by its worker - the HTTP and the
        JSON-RPC (agentvm.tools.front) - and handed over as plain data, ``(method, params)``
        (checked by :func:`_tools_question` before this runs): answered by the sandbox's tool
        gateway here -> ``("ok", result)`` or ``("error", code, message, data)``. The agent's
        bytes never reach this process; the params are checked again by the SDK's models
        (ToolGateway.rpc)."""
        method, params = args
        if ep.tools is None:
            return "error", -32601, "agent-vm tool gateway: this sandbox has no tools", None
        gw = await ep.tools.gateway()
        return await gw.rpc(method, params, gone=lambda: qid in w.abandoned)

    async def _q_admit(self, w: GateWorker, ep: RemoteEndpoint, qid: int, args):
        if args or ep.budget is None:
            return ("budget:unavailable", "the daemon keeps no LLM budget for this sandbox")
        why = ep.budget.admit()
        if why is None:
            ep.reserved += 1
        return why

    def _charge(self, w: GateWorker, ep: RemoteEndpoint, args) -> None:
        """A metered response's usage, counted in the agent's ledger (its cost priced here, by the
        daemon's spec). Counting more than the worker reserved is accepted (never free)."""
        if ep.budget is None:
            log.error("gate worker %d counted LLM usage for %s, which has no budget: ignored", w.index, ep.sandbox_id)
            return
        if len(args) != 4 or (args[0] is not None and type(args[0]) is not str) or type(args[3]) is not bool:
            raise ValueError("a count that is not (model, input, output, estimated)")
        model = None if args[0] is None else args[0][:128]
        inp, out = _count(args[1], 1 << 40), _count(args[2], 1 << 40)
        if ep.reserved > 0:
            ep.reserved -= 1
        else:  # (settle() ends one reservation: this count ends none of another sandbox's)
            led = ep.budget.ledger
            with led.lock:
                led.inflight += 1
        ep.budget.add(model, inp, out, args[3])

    async def start(self) -> None:
        if self.confine is not None:  # (made once here: each confined worker only loads it before confining itself)
            from agentvm.gate.ca import CertificateAuthority

            await asyncio.to_thread(CertificateAuthority.load_or_create, self.state_dir / "ca")
        self.workers = [GateWorker(self, i) for i in range(self.count)]
        try:
            if self.workers:
                await asyncio.gather(*(w.start() for w in self.workers))
            if self.spare:
                await self._make_spares()
        except BaseException as exc:
            await self.stop()
            raise AgentVMError(f"the gate workers did not start: {exc}",
                               hint="see the daemon's log for the worker's error; start without --gate-workers "
                                    "to serve every sandbox from the daemon's own gate") from exc
        self._watch = asyncio.get_running_loop().create_task(self._watch_vault())

    async def _watch_vault(self) -> None:
        """Revocations, restores and rotations written to the vault by another process (``agentvm
        secret revoke`` without the daemon): each worker holding a changed credential is told."""
        while not self.stopping:
            await asyncio.sleep(REVOKE_POLL)
            for w in list(self.workers):
                for ep in list(w.endpoints.values()):
                    try:
                        ep.poll_vault()
                    except Exception:  # noqa: BLE001 - one endpoint's vault must not stop the watch
                        log.exception("gate workers: the vault of %s", ep.sandbox_id)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.alive and not w.retired]

    def serving(self) -> list[dict]:
        """The running workers: slot, pid, uid, the key they serve and their sandboxes."""
        return [{"worker": w.index, "pid": w.proc.pid, "uid": w.uid, "tenant": w.tenant, "sandboxes": sorted(w.endpoints)}
                for w in self.workers if w.proc is not None and w.alive and not w.retired]

    async def _a_worker(self, key: str | None = None) -> GateWorker:
        for _ in range(3):
            mine = [w for w in self.workers if not w.retired and (key is None or w.tenant == key)]
            alive = [w for w in mine if w.alive]
            if alive:
                return min(alive, key=lambda w: (len(w.endpoints), w.index))
            if key is not None and not mine:
                return await self._claim(key)
            await asyncio.gather(*(self.replaced(w) for w in mine), return_exceptions=True)
        raise WorkerLost("no gate worker is running, and none could be started; see the daemon's log")

    async def _claim(self, key: str) -> GateWorker:
        """A worker for a key no worker serves yet: one that never served anybody, else a free
        slot (never used, or its retired worker has exited: two processes never share a slot's
        uid across keys), else the slot of an idle worker of another key (stopped first: a
        worker never serves a second key - what it held of the first stays with that process).
        None left: refused (NoWorkerSlot), never served by a shared or unconfined gate."""
        fresh = next((w for w in self.workers if w.alive and w.ready and not w.retired and w.tenant is None
                      and not w.endpoints), None)
        if fresh is not None:
            fresh.tenant = key
            self.on_event("gate.worker-started", worker=fresh.index, pid=fresh.proc.pid, uid=fresh.uid, tenant=key,
                          confined=self.confine, spare=True)
            self._keep_spare()
            return fresh
        free = next((w for w in self.workers if w.retired and (w.proc is None or w.proc.returncode is not None)
                     and self._replacing.get(w.index) is None), None)
        if free is not None:
            self.workers[free.index] = w = GateWorker(self, free.index, key)
        elif len(self.workers) < MAX_WORKERS:
            w = GateWorker(self, len(self.workers), key)
            self.workers.append(w)
        else:
            idle = next((w for w in self.workers if not w.endpoints and not w.retired and w.ready
                         and self._replacing.get(w.index) is None), None)
            if idle is None:
                busy = sum(1 for w in self.workers if not w.retired)
                raise NoWorkerSlot(
                    f"all {MAX_WORKERS} confined gate worker slots serve other {self.isolate}s ({busy} running, each "
                    f"a uid of its own): none is left for {key}; the start is refused (a gate is never shared "
                    "between agents nor run unconfined without the operator saying so)",
                    hint="stop the sandboxes of an agent that does not need to run now (its worker retires "
                         f"{self.retire or 0:g} s after its last sandbox), or start the daemon with "
                         "`--gate-workers N` (N workers shared by all agents) - see docs/daemon.md")
            self.workers[idle.index] = w = GateWorker(self, idle.index, key)
            idle.retired = True
            await idle.stop()
        try:
            await w.start()
        except BaseException:
            w.alive = False
            w.retired = True  # (its slot is free again)
            raise
        if key is not None:
            self.on_event("gate.worker-started", worker=w.index, pid=w.proc.pid, uid=w.uid, tenant=key,
                          confined=self.confine)
        self._keep_spare()
        return w

    def _free_slot(self) -> int | None:
        """A slot no worker uses: a retired worker's (its process gone) or a new one."""
        free = next((w for w in self.workers if w.retired and (w.proc is None or w.proc.returncode is not None)
                     and self._replacing.get(w.index) is None), None)
        if free is not None:
            return free.index
        return len(self.workers) if len(self.workers) < MAX_WORKERS else None

    def _keep_spare(self) -> None:
        """Start a spare worker (serving nobody yet) if fewer than ``spare`` are up."""
        if not self.spare or self.stopping or (self._sparing is not None and not self._sparing.done()):
            return
        self._sparing = asyncio.get_running_loop().create_task(self._make_spares())

    async def prestart(self, n: int) -> None:
        """Start up to ``n`` spare workers at once (the daemon, before it restarts its persistent
        sandboxes: each takes one instead of waiting for a start); :meth:`trim_spares` after."""
        want, self.spare = self.spare, max(self.spare, min(n, MAX_WORKERS))
        try:
            starts = []
            for _ in range(self.spare - len([w for w in self.workers if w.tenant is None and not w.retired])):
                i = self._free_slot()
                if i is None:
                    break
                w = GateWorker(self, i)
                if i == len(self.workers):
                    self.workers.append(w)
                else:
                    self.workers[i] = w
                starts.append(w)
            results = await asyncio.gather(*(w.start() for w in starts), return_exceptions=True)
            for w, r in zip(starts, results):
                if isinstance(r, BaseException):
                    w.alive, w.retired = False, True
                    log.warning("a spare gate worker did not start: %s", r)
        finally:
            self.spare = want

    async def trim_spares(self) -> None:
        """Spares beyond ``spare`` (left by :meth:`prestart`): retired."""
        idle = [w for w in self.workers if w.tenant is None and w.ready and w.alive and not w.retired
                and not w.endpoints]
        for w in idle[self.spare:]:
            w.retired = True
            await w.stop()

    async def _make_spares(self) -> None:
        while not self.stopping:
            spares = [w for w in self.workers if w.tenant is None and not w.retired and (w.alive or not w.ready)]
            if len(spares) >= self.spare:
                return
            i = self._free_slot()
            if i is None:  # (every slot serves an agent: no spare; the next agent is refused or takes a retired slot)
                return
            w = GateWorker(self, i)
            if i == len(self.workers):
                self.workers.append(w)
            else:
                self.workers[i] = w
            try:
                await w.start()
            except Exception as exc:  # noqa: BLE001 - no spare: agents start their worker themselves
                w.alive, w.retired = False, True
                log.warning("a spare gate worker did not start: %s", exc)
                return

    def _schedule_retire(self, w: GateWorker) -> None:
        """``w``'s key has no sandbox left: retire it after ``retire`` seconds unless one comes."""
        if self.retire is None or w.tenant is None or w.endpoints or w.retired or self.stopping:
            return
        if w._retire is not None:
            w._retire.cancel()
        loop = asyncio.get_running_loop()
        w._retire = loop.call_later(self.retire, lambda: loop.create_task(self._retire_now(w)))

    async def _retire_now(self, w: GateWorker) -> None:
        w._retire = None
        if w.endpoints or w.retired or self.stopping or self.workers[w.index] is not w:
            return
        if self._replacing.get(w.index) is not None:
            return
        w.retired = True  # (from here no sandbox is placed on it: a new one of its key gets a new worker)
        pid = w.proc.pid if w.proc is not None else None
        await w.stop()
        self.on_event("gate.worker-retired", worker=w.index, pid=pid, tenant=w.tenant,
                      reason="its agent's last sandbox closed")

    async def open(self, sandbox_id: str, agent: str, policy, sock_path: Path, *, uid: int | None, creds,
                   tier: str | None = None, extras=None, bridge_key: str = "") -> RemoteEndpoint:
        """Serve ``sandbox_id`` from a worker. ``extras`` (agentvm.tools.slot.EndpointExtras):
        its approval timeout, webhook and policy digest (held requests wait in the daemon) and
        its LLM budget (the daemon keeps the ledger); a sandbox with tools is not placeable
        (:func:`unplaceable`)."""
        sock_path = Path(sock_path)
        w = await self._a_worker(placement_key(self.isolate, agent, tier))
        if w._retire is not None:  # (a sandbox again before its retirement: kept)
            w._retire.cancel()
            w._retire = None
        sock = bind_unix_listener(sock_path, uid, BACKLOG)
        sock.setblocking(False)
        try:
            ep = RemoteEndpoint(self, w, sandbox_id, agent, policy, sock_path, sock, creds, extras)
            ep.bridge_key = bridge_key
        except BaseException:
            sock.close()
            sock_path.unlink(missing_ok=True)
            self._schedule_retire(w)
            raise
        w.endpoints[sandbox_id] = ep
        try:
            async with w.opening:
                await w.call("open", *ep.open_args(), fd=sock.fileno())
        except BaseException:
            ep.closed = True
            ep.worker.endpoints.pop(sandbox_id, None)
            if ep.worker.alive:  # (cancelled or timed out with the open under way: not left open there)
                try:
                    ep.worker.send("close", sandbox_id).add_done_callback(_quiet)
                except AgentVMError:
                    pass
            sock.close()
            sock_path.unlink(missing_ok=True)
            self._schedule_retire(ep.worker)
            raise
        if ep.worker is w:
            ep.served = True
        else:  # replaced meanwhile: the replacement took it back (with `served` set) or not
            try:
                await ep.synced()
            except BaseException:
                await asyncio.shield(self.close(ep))
                raise
        return ep

    async def close(self, ep: RemoteEndpoint) -> RemoteEndpoint:
        ep.closed = True
        w = ep.worker
        w.endpoints.pop(ep.sandbox_id, None)
        for qid, t in list(w.questions.items()):  # its held requests: expired (nothing waits for them now)
            if getattr(t, "sandbox_id", None) == ep.sandbox_id:
                t.cancel()
        try:
            stats = await w.call("close", ep.sandbox_id) if w.alive else None
        except (WorkerLost, AgentVMError) as exc:
            log.warning("closing %s on gate worker %d: %s", ep.sandbox_id, w.index, exc)
            stats = None
        finally:  # (cancelled or not: the daemon's socket is never left bound)
            ep.sock.close()
            ep.sock_path.unlink(missing_ok=True)
            if ep.tools is not None:  # (its MCP sessions and tool servers end with it)
                try:
                    await ep.tools.close()
                except Exception:  # noqa: BLE001
                    log.exception("closing the tool gateway of %s", ep.sandbox_id)
            if w.uid is not None:  # the log is the daemon's again (a later tenant of the slot has the same uid),
                try:  # and only its: a worker may have made it world-writable (fchmod is a proxy's call)
                    fd = os.open(ep.log_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                    try:
                        os.fchown(fd, 0, 0)
                        os.fchmod(fd, 0o600)
                    finally:
                        os.close(fd)
                except OSError:
                    pass
            ep.release_reservations()
            self._schedule_retire(w)
        if stats and not _counters_ok(stats):  # (a worker is not trusted: its counters are checked)
            log.error("gate worker %d sent counters of %s that are not counters: ignored", w.index, ep.sandbox_id)
            ep.counts_lost, stats = True, None
        if stats:
            ep.allowed += stats["allowed"]
            ep.bytes_out += max(0, stats["bytes_out"] - ep._live[0])  # (what was not reported as it moved)
            ep.bytes_in += max(0, stats["bytes_in"] - ep._live[1])
            ep.alerts += stats["alerts"]
            for k, n in stats["denials"].items():
                ep.denials[k] = ep.denials.get(k, 0) + n
            for k, v in stats["denial_reasons"].items():
                ep.denial_reasons.setdefault(k, v)
        return ep

    # -- a worker lost: replaced, its endpoints handed over ---------------------------------
    def worker_gone(self, w: GateWorker) -> None:
        if self.stopping or w.retired or w.index in self._replacing or self.workers[w.index] is not w:
            return  # (stopping; retired; a replacement under way handles it; or w was replaced already)
        self._replacing[w.index] = asyncio.get_running_loop().create_task(self._replace(w))

    async def replaced(self, w: GateWorker) -> None:
        """Wait until the worker in ``w``'s slot is running again (or could not be)."""
        if w.alive:
            return
        if self._replacing.get(w.index) is None and not self.stopping:
            self.worker_gone(w)  # (nothing if a replacement of it already finished)
        await self.settle(w.index)

    async def settle(self, index: int) -> None:
        """Wait for the end of a replacement of worker ``index`` under way, if any."""
        t = self._replacing.get(index)
        if t is not None:
            try:
                await asyncio.shield(t)
            except Exception:  # noqa: BLE001 - (its own failure is logged by the loop; the caller checks the worker)
                pass

    async def reopen(self, ep: RemoteEndpoint) -> None:
        """Open ``ep`` on its worker again, with its whole state (one its worker could not take)."""
        async with ep.reopening:  # (one at a time: two would open it twice)
            w = ep.worker
            async with w.opening:
                if ep.closed or ep.served or not w.alive or self._replacing.get(w.index) is not None:
                    return
                await w.call("open", *ep.open_args(), fd=ep.sock.fileno())
                if ep.worker is w:
                    ep.served = True

    def _gave_up(self, index: int, eps: dict, why: str) -> None:
        self.on_event("gate.worker-failed", worker=index, sandboxes=sorted(eps),
                      reason=f"{why}: these sandboxes have no egress (fail closed) until they are restarted")

    async def _replace(self, old: GateWorker) -> None:
        try:
            failures, delay = 0, 0.1
            while not self.stopping:
                rc = None
                if old.proc is not None:
                    try:
                        rc = await asyncio.wait_for(old.proc.wait(), STOP_TIMEOUT)
                    except asyncio.TimeoutError:
                        pass
                eps = {sid: ep for sid, ep in old.endpoints.items() if not ep.closed}
                self.on_event("gate.worker-lost", worker=old.index, pid=old.proc.pid if old.proc else None, exit=rc,
                              reason=old.reason, sandboxes=sorted(eps))
                alert = self.death_alert(old, rc, eps)
                if alert is not None:
                    self.on_event("gate.worker-killed", **alert)
                while True:
                    if self.stopping:
                        return
                    new = GateWorker(self, old.index, old.tenant)
                    try:
                        await new.start()
                        break
                    except Exception as exc:  # noqa: BLE001 - tried again, then reported
                        failures += 1
                        log.error("gate worker %d did not restart (attempt %d): %s", old.index, failures, exc)
                        if failures >= RESTARTS:
                            return self._gave_up(old.index, eps, f"it did not restart after {RESTARTS} attempts")
                        await asyncio.sleep(delay)
                        delay *= 4
                self.workers[old.index] = new
                moved, failed = [], []
                for sid, ep in eps.items():
                    if ep.closed:
                        continue
                    ep.worker, ep.served, ep.counts_lost = new, False, True
                    ep._live = (0, 0)  # (the new worker counts from zero)
                    new.endpoints[sid] = ep  # (kept if it fails: a later replacement tries it again)
                    try:
                        async with new.opening:
                            if ep.closed:  # (closed while it waited)
                                new.endpoints.pop(sid, None)
                                continue
                            await new.call("open", *ep.open_args(), fd=ep.sock.fileno())
                        ep.served = True
                        moved.append(sid)
                    except Exception as exc:  # noqa: BLE001 - reported: that sandbox has no egress
                        failed.append(sid)
                        log.error("gate worker %d could not take %s back: %s", new.index, sid, exc)
                if new.alive:
                    self.on_event("gate.worker-restarted", worker=new.index, pid=new.proc.pid, sandboxes=moved,
                                  **({"not_served": failed} if failed else {}))
                    return
                # the replacement died too, while taking them back: again (its death was not
                # reported to worker_gone's replacement: this one is under way)
                failures += 1
                if failures >= RESTARTS:
                    return self._gave_up(old.index, eps, f"its replacements kept dying ({new.reason})")
                await asyncio.sleep(delay)
                delay *= 4
                old = new
        finally:
            self._replacing.pop(old.index, None)

    def death_alert(self, w: GateWorker, rc: int | None, eps: dict) -> dict | None:
        """The security alert of a worker's death, or None: killed by its seccomp filter (it
        made a system call only an attacker makes) or by a memory error (a parser's bug, maybe
        exploited). On the audit chain as ``gate.worker-killed``."""
        if rc is None or rc >= 0:
            return None
        try:
            sig = signal.Signals(-rc)
        except ValueError:
            return None
        why = ALERT_SIGNALS.get(sig)
        if why is None:
            return None
        what = ("it made a forbidden system call (killed by its seccomp filter): a compromised gate worker"
                if why == "seccomp" else f"it died of {sig.name}: a memory error in the gate, maybe exploited")
        return {"alert": "security", "cause": why, "signal": sig.name, "worker": w.index,
                "pid": w.proc.pid if w.proc else None, "uid": w.uid, "confined": self.confine,
                "tenant": w.tenant, "sandboxes": sorted(eps), "reason": what}

    async def stop(self) -> None:
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self._sparing is not None:
            self._sparing.cancel()
        for w in self.workers:
            if w._retire is not None:
                w._retire.cancel()
        for t in list(self._replacing.values()):
            t.cancel()
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        for w in self.workers:
            for ep in w.endpoints.values():
                ep.closed = True
                ep.sock.close()


# ------------------------------------------------------------------------- the worker's side
class _OutOfStep(Exception):
    pass


class _Sender:
    """The worker's end of the channel, for writing: each message sent whole before the worker
    goes on. A daemon that does not read (its loop stalled) holds the worker up as it would hold
    its own in-process gate - decision records are never dropped, and never pile up in this
    process's memory - for up to STALL_LIMIT, past which the daemon is taken for gone and the
    worker exits (no egress without the control plane)."""

    GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=os.dup(fd))  # (the same socket the loop reads the calls from)
        self.closed = False
        self.before_exit = None  # called before the worker exits for a stalled or broken channel
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLOUT)

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        view, deadline = memoryview(data), None
        try:
            while view:
                try:
                    n = self.sock.send(view, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    now = time.monotonic()
                    deadline = deadline or now + STALL_LIMIT
                    if now >= deadline:
                        self._exit(f"the daemon has read nothing for {STALL_LIMIT:g} s")
                    self._poll.poll(max(1, int((deadline - now) * 1000)))
                    continue
                view, deadline = view[n:], None  # (progress: the daemon reads)
        except OSError as exc:
            if exc.errno in self.GONE:  # the daemon is gone: the reader sees the end, the worker stops
                self.closed = True
                return
            self._exit(f"its channel to the daemon failed ({exc})")
        except BaseException as exc:  # (a message cut short would corrupt every later one)
            if len(view) != len(data) and not self.closed:
                self._exit(f"a message to the daemon was cut short ({type(exc).__name__})")
            raise

    def _exit(self, why: str) -> None:
        """Exit now (the daemon replaces this worker), the decision logs written first."""
        self.closed = True
        log.error("gate worker: %s; exiting", why)
        if self.before_exit is not None:
            try:
                self.before_exit()
            except BaseException:  # noqa: BLE001 - exiting anyway
                log.exception("gate worker: writing the decision logs before exiting")
        os._exit(3)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class _Asker:
    """The worker's questions to the daemon (the monitor) - held requests, LLM budgets - and
    their answers, which arrive beside the daemon's calls (never queued behind them)."""

    def __init__(self, writer: _Sender) -> None:
        self.writer = writer
        self._next = 0
        self.waiting: dict[int, tuple[asyncio.Future, object]] = {}

    def ask(self, op: str, sandbox_id: str, *args, on_held=None) -> tuple[int, asyncio.Future]:
        self._next += 1
        qid = self._next
        fut = asyncio.get_running_loop().create_future()
        self.waiting[qid] = (fut, on_held)
        self.writer.send(_pack(("q", qid, op, sandbox_id, args)))
        if self.writer.closed and not fut.done():
            self.waiting.pop(qid, None)
            fut.set_exception(ConnectionError("the daemon is gone"))
        return qid, fut

    def tell(self, op: str, sandbox_id: str, *args) -> None:
        """A message that wants no answer (in order with the questions)."""
        self.writer.send(_pack(("q", 0, op, sandbox_id, args)))

    def answer(self, msg) -> None:
        if msg[0] == "held":  # a held request was queued: its pending record, written here
            entry = self.waiting.get(msg[1])
            if entry is not None and entry[1] is not None:
                try:
                    entry[1](msg[2])
                except Exception:  # noqa: BLE001 - a record lost is logged, the answer still awaited
                    log.exception("gate worker: the pending record of a held request")
            return
        _, qid, ok, value = msg
        entry = self.waiting.pop(qid, None)
        if entry is None or entry[0].done():
            return
        if ok:
            entry[0].set_result(value)
        else:
            entry[0].set_exception(AgentVMError(f"the daemon refused: {value}"))

    def lost(self) -> None:
        for fut, _ in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the daemon is gone"))
        self.waiting.clear()


class _RemoteBudget:
    """A worker-served sandbox's LLM budget: the daemon keeps the agent's ledger. Each metered
    request is admitted by the daemon (``exchange.Admit``: asked, awaited), each response's
    usage counted there (``charge``), an admission that ends uncounted released there; the
    worker keeps only the spec (which hosts, the price table for its records) and the last
    "spent" answer, to refuse early as the daemon's gate does."""

    remote = True

    def __init__(self, asker: _Asker, sandbox_id: str, spec) -> None:
        self.asker, self.sandbox_id, self.spec = asker, sandbox_id, spec
        self._spent = None

    def covers(self, host: str) -> bool:
        return self.spec.covers(host)

    def refusal_now(self):
        return self._spent

    def refusal(self):
        return self._spent[1] if self._spent else None

    def admit(self):  # (never called: exchange yields Admit for a remote budget)
        return ("budget:unavailable", "a gate worker's budget is admitted by the daemon")

    async def admit_async(self):
        try:
            _, fut = self.asker.ask("admit", self.sandbox_id)
            why = await asyncio.wait_for(fut, CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - no answer: nothing is forwarded unmetered
            return ("budget:unavailable", f"the daemon, which keeps this agent's LLM budget, did not answer "
                    f"({type(exc).__name__}); retry")
        if why is not None:
            why = (str(why[0]), str(why[1]))
            if why[0] == "budget:exceeded":
                self._spent = why
        return why

    def release(self) -> None:
        self.asker.tell("release", self.sandbox_id)

    def meter(self):
        from agentvm.gate.budget import Meter

        return Meter()

    def add(self, model, input_tokens: int, output_tokens: int, estimated: bool) -> dict:
        """Count one admitted request's response: at the daemon; -> its record's fields (priced
        by the spec, as the daemon prices it)."""
        model = (model or "unknown")[:128]
        self.asker.tell("charge", self.sandbox_id, model, int(input_tokens), int(output_tokens), bool(estimated))
        price = self.spec.price(model)
        out = {"model": model, "input_tokens": input_tokens, "output_tokens": output_tokens}
        if price is not None:
            out["cost"] = round((input_tokens * price[0] + output_tokens * price[1]) / 1e6, 8)
        if estimated:
            out["estimated"] = True
        return out

    def set_spec(self, spec) -> None:
        self.spec = spec
        self._spent = None  # (raised, or reset: the daemon says again at the next admission)


class _RemoteTools:
    """A worker-served sandbox's tool gateway, as the gate's ``/mcp`` door sees it
    (``agentvm.gate.asgi.serve_one``): the HTTP of each request is parsed here (head, body
    framing, the body bounded), and so is its JSON-RPC - by the MCP SDK's server in a
    :class:`agentvm.tools.front.ToolFront` - and each request that passes is answered by the
    sandbox's tool gateway in the daemon (the tool servers, the policy and approvals live
    there), which is asked with plain data (method, params) only."""

    def __init__(self, asker: _Asker, sandbox_id: str, log=None) -> None:
        self.asker, self.sandbox_id = asker, sandbox_id
        self.log = log  # the endpoint's decision log (what the front refuses itself)
        self.front = None

    async def gateway(self):
        return self

    def set_policy(self, policy, digest) -> None:  # (the daemon's gateway has the policy)
        pass

    async def close(self) -> None:
        if self.front is not None:
            await self.front.close()

    async def _ask(self, method: str, params: dict | None) -> tuple:
        from agentvm.tools.front import REQUESTER_GONE

        qid, fut = self.asker.ask("tools", self.sandbox_id, method, params)
        await _answer_of(self.asker, self.sandbox_id, qid, fut, REQUESTER_GONE.get())
        return fut.result()

    async def handle(self, scope, receive, send) -> None:
        if self.front is None:
            from agentvm.tools.front import ToolFront

            self.front = ToolFront(self._ask, self.log)
        await self.front.handle(scope, receive, send)


class _Worker:
    """The worker process: a Gate, its endpoints opened and changed on the daemon's word."""

    def __init__(self, gate, fd_sock: socket.socket, writer: _Sender, asker: _Asker | None = None, *,
                 records: bool = True) -> None:
        self.gate = gate
        self.fd_sock = fd_sock
        self.writer = writer
        self.asker = asker if asker is not None else _Asker(writer)
        self._batch: list[dict] = []
        self._counted: dict[str, tuple[int, int]] = {}  # byte counters last sent, per sandbox
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        if records:  # (a host that takes no records - an embedded run - is sent none: no record is built)
            gate.subscribers.append(self._record)

    def _record(self, rec: dict) -> None:
        # records go back in batches: RECORD_DELAY's worth in one message (each message costs
        # both processes a wake-up, a system call each way and the framing); sooner when many
        # wait, and always before a call's acknowledgement
        batch = self._batch
        if not batch:
            self._timer = self._loop.call_later(RECORD_DELAY, self._flush)
        batch.append(rec)
        if len(batch) >= RECORD_BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, []
        if batch:
            # with the records: the byte counters of the endpoints that moved (the daemon's
            # /metrics counts them as they move, as for its own gate)
            counters = {}
            for sid, ep in self.gate.endpoints.items():
                now = (ep.bytes_out, ep.bytes_in)
                if self._counted.get(sid) != now:
                    counters[sid] = self._counted[sid] = now
            self.writer.send(_pack(("records", batch, counters) if counters else ("records", batch)))

    async def op_ping(self) -> str:
        return PROTOCOL

    def take_socket(self, cid: int) -> socket.socket:
        """The listening socket sent ahead of call ``cid``. Anything else - none, or one tagged for
        another call - means the two queues are out of step: the worker must not serve one
        sandbox's socket as another's, so it exits (the daemon replaces it)."""
        try:
            tag, fds, flags, _ = socket.recv_fds(self.fd_sock, 32, 1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            tag, fds, flags = b"", [], 0
        if tag == str(cid).encode() and not fds and flags & socket.MSG_CTRUNC:
            # its own socket, dropped by the kernel (this process is out of descriptors): this
            # call fails; the queues are still in step
            raise OSError("the listening socket could not be received (out of file descriptors?)")
        if tag != str(cid).encode() or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise _OutOfStep(f"call {cid} came with {len(fds)} socket(s) tagged {tag[:32]!r}")
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        return sock

    def _take_files(self, files) -> None:
        """An upstream CA bundle a policy names, sent by the daemon: its TLS contexts made from the
        bundle's bytes (the path is only the contexts' key here)."""
        if not files:
            return
        from agentvm.gate.tls import ALPN_H2, ALPN_HTTP1, client_context

        for path, pem in files.items():
            if pem is None:
                continue
            for h2 in (False, True):
                ctx = client_context(None, alpn=(ALPN_H2, ALPN_HTTP1) if h2 else (ALPN_HTTP1,))
                ctx.load_verify_locations(cadata=pem.decode("ascii", "replace"))
                self.gate._client_ctx[(path, h2)] = ctx

    async def op_open(self, sock, sandbox_id, agent, policy, sock_path, creds_spec, paused, revoked, files=None,
                      budget=None, tools=False, bridge_key="") -> None:
        creds = None
        try:
            self._take_files(files)
            if sandbox_id in self.gate.endpoints:  # opened again with the daemon's whole state: one server
                await self.gate.close_endpoint(sandbox_id, unlink=False)
            if creds_spec is not None:
                (bindings, placeholders, sid), scrub, held = creds_spec
                scrub, real = scrub if isinstance(scrub, tuple) else (scrub, True)
                creds = self._held_credentials(sandbox_id, bindings, placeholders, held)
                creds.scrub_encoded, creds.check_real = bool(scrub), bool(real)
                creds.local_revoked.update(revoked)
            ep = await self.gate.open_endpoint(sandbox_id, agent, policy, Path(sock_path), creds=creds, sock=sock,
                                               bridge_key=bridge_key if isinstance(bridge_key, str) else "")
        except BaseException:
            sock.close()
            raise
        ep.paused = paused
        # a held request (action: ask) waits in the daemon's approvals queue: asked, not served here
        ep.hold = lambda cmd, gone=None, _ep=ep: self._hold_remote(_ep, cmd, gone)
        if budget is not None:
            ep.budget = _RemoteBudget(self.asker, sandbox_id, budget)
        if tools:  # its /mcp requests: parsed here, answered by its tool gateway in the daemon
            ep.tools = _RemoteTools(self.asker, sandbox_id, ep.log)

    def _budget(self, ep, spec) -> None:
        if spec is None:
            return
        if isinstance(ep.budget, _RemoteBudget):
            ep.budget.set_spec(spec)
        else:  # set live: the endpoint cuts its opaque tunnels to the budget's hosts
            ep.set_budget(_RemoteBudget(self.asker, ep.sandbox_id, spec))

    async def _hold_remote(self, ep, cmd, gone=None):
        """``Endpoint.hold`` on a worker: the daemon queues the request for a human (it decides
        it again first) and answers; the pending record it sends is written here. The requester
        leaving - or this wait being cancelled (the sandbox paused, its endpoint closed) - is
        told to the daemon, which expires the request."""
        from agentvm.gate import exchange as ex

        req = cmd.req
        asked = tuple(getattr(cmd, "asked", ()) or ())
        if len(asked) != 8:
            return ex.Answered(False, "approval:unavailable", "the request cannot be put before a human from here")
        try:
            qid, fut = self.asker.ask("hold", ep.sandbox_id, asked, bool(req.chunked),
                                      on_held=lambda fields: ep.log(**fields))
        except Exception as exc:  # noqa: BLE001
            return ex.Answered(False, "approval:unavailable", f"the daemon could not be asked ({type(exc).__name__})")
        await _answer_of(self.asker, ep.sandbox_id, qid, fut, gone)
        try:
            approved, rule_id, reason, rid = fut.result()
        except Exception as exc:  # noqa: BLE001
            return ex.Answered(False, "approval:unavailable", f"the daemon did not hold it ({exc})"[:300])
        return ex.Answered(bool(approved), str(rule_id), str(reason), rid)

    def _held_credentials(self, sandbox_id: str, bindings, placeholders, held):
        """A CredentialSet over the values the daemon sent (``held``: dropped names, values,
        errors), changed in place by later ``state`` calls: nothing here reads the vault."""
        from agentvm.gate.credentials import CredentialSet
        from agentvm.vault import VaultError

        box = {"dropped": frozenset(held[0]), "values": dict(held[1]), "errors": dict(held[2])}

        def value(name: str) -> str:
            v = box["values"].get(name)
            if v is None:
                why = box["errors"].get(name) or "revoked, or not given to this gate worker"
                raise VaultError(f"credential {name!r} is not available to the gate: {why}")
            return v

        def revoked(name: str) -> bool:
            return name in box["dropped"] or name not in box["values"] and name not in box["errors"]

        creds = CredentialSet(tuple(bindings), placeholders, value, revoked)
        creds._held = box
        # a brokered credential's rotated vault entry goes to the daemon, which stores it
        creds._persist = lambda b, text: self.writer.send(_pack(("persist", sandbox_id, b.name, text)))
        return creds

    @staticmethod
    def _hold(creds, held) -> None:
        """The daemon's drop/restore/rotation: a dropped value is forgotten, not only flagged."""
        dropped, values, errors = held
        box = creds._held
        box["values"] = dict(values)
        box["errors"] = dict(errors)
        box["dropped"] = frozenset(dropped)
        for name in dropped:
            cache = getattr(creds, "brokers", {}).get(name)
            if cache is not None:
                cache.drop(revoke=True)  # (what was minted from it is forgotten, revoked upstream)
        creds._scrub_table = None  # (rebuilt from the values held now)

    async def op_state(self, sandbox_id, policy, paused, revoked, held=None, files=None, budget=None) -> str:
        ep = self.gate.endpoints.get(sandbox_id)
        if ep is None:  # its open failed: the daemon opens it again with the whole state
            return "absent"
        self._take_files(files)
        self._budget(ep, budget)
        if policy is not None:
            ep.set_policy(policy)
        if ep.paused != paused:
            ep.paused = paused
        if ep.creds is not None and set(revoked) != ep.creds.local_revoked:
            ep.creds.local_revoked.clear()
            ep.creds.local_revoked.update(revoked)
        if ep.creds is not None and held is not None:
            self._hold(ep.creds, held)
        return "applied"

    async def op_close(self, sandbox_id) -> dict | None:
        ep = self.gate.endpoints.get(sandbox_id)
        if ep is None:
            return None
        await self.gate.close_endpoint(sandbox_id, unlink=False)  # (the daemon owns the path)
        self._flush()
        return {"allowed": ep.allowed, "bytes_out": ep.bytes_out, "bytes_in": ep.bytes_in, "alerts": ep.alerts,
                "denials": dict(ep.denials), "denial_reasons": dict(ep.denial_reasons)}

    async def serve(self, calls: asyncio.Queue) -> None:
        while True:
            msg = await calls.get()
            if msg is None:  # (the channel ended)
                return
            cid, op, args = msg
            if op == "quiesce":  # (it may wait for requests to finish: the other calls are not held behind it)
                asyncio.ensure_future(self._reply_later(cid, op, args))
                continue
            try:
                if op == "open":  # its socket first, whatever happens next
                    args = (self.take_socket(cid), *args)
                value = await getattr(self, "op_" + op)(*args)
                reply = ("reply", cid, True, value)
            except _OutOfStep as exc:
                log.error("gate worker: %s; exiting", exc)
                return
            except Exception as exc:  # noqa: BLE001 - told to the daemon, which reports it
                log.exception("gate worker: %s failed", op)
                reply = ("reply", cid, False, f"{op}: {type(exc).__name__}: {exc}")
            self._flush()  # the records before the acknowledgement
            self.writer.send(_pack(reply))


    async def _reply_later(self, cid, op, args) -> None:
        try:
            reply = ("reply", cid, True, await getattr(self, "op_" + op)(*args))
        except Exception as exc:  # noqa: BLE001 - told to the daemon
            log.exception("gate worker: %s failed", op)
            reply = ("reply", cid, False, f"{op}: {type(exc).__name__}: {exc}")
        self._flush()
        self.writer.send(_pack(reply))

    async def op_quiesce(self, sandbox_id, timeout) -> int:
        """Before a checkpoint: ``Endpoint.quiesce`` here (-> requests still under way)."""
        ep = self.gate.endpoints.get(sandbox_id)
        return 0 if ep is None else int(await ep.quiesce(float(timeout)))

    async def op_unquiesce(self, sandbox_id) -> None:
        ep = self.gate.endpoints.get(sandbox_id)
        if ep is not None:
            ep.unquiesce()


async def _worker_main(ns) -> None:
    from agentvm.gate.server import Gate

    chan = socket.socket(fileno=ns.channel)
    fd_sock = socket.socket(fileno=ns.fds)
    fd_sock.setblocking(True)
    sender = _Sender(chan.fileno())
    calls: asyncio.Queue = asyncio.Queue()  # the daemon's calls, in order; None: the channel ended
    asker = _Asker(sender)

    def on_message(msg) -> None:
        if isinstance(msg, tuple) and msg and msg[0] in ("a", "held"):  # answers to this worker's questions
            asker.answer(msg)
        elif isinstance(msg, tuple) and msg and msg[0] == "log":  # a decision of the daemon's side (tools)
            ep = gate.endpoints.get(msg[1])
            if ep is not None:
                ep.log(**msg[2])
        else:
            calls.put_nowait(msg)

    def on_lost(why) -> None:
        asker.lost()
        calls.put_nowait(None)

    channel, _ = await asyncio.get_running_loop().create_unix_connection(
        lambda: _Frames(on_message, on_lost), sock=chan)
    gate = Gate(Path(ns.state_dir), Path(ns.log_dir))
    if ns.telemetry:
        from agentvm.gate.telemetry import TelemetryRelay

        gate.telemetry = TelemetryRelay(ns.telemetry)
    if _eval_hook_enabled():  # tests only (see the function): before confinement, which hides the marker
        _install_eval_hook(gate)
    if ns.confine is not None:
        _confine(gate, ns)

    def before_exit() -> None:  # every log still open: endpoints served and endpoints closing
        for ep in [*gate.endpoints.values(), *gate._closing]:
            ep.flush_suppressed()  # (its record reaches the log; the sender is closed by now)
            ep.flush_log()

    sender.before_exit = before_exit
    w = _Worker(gate, fd_sock, sender, asker, records=not ns.no_records)
    try:
        await w.serve(calls)
    finally:
        # the daemon hung up (stopping, or gone): this gate's sandboxes have no egress now
        if gate.endpoints:  # (all at once: each may wait for its connections)
            await asyncio.wait([asyncio.ensure_future(gate.close_endpoint(sid, unlink=False))
                                for sid in list(gate.endpoints)], timeout=STOP_TIMEOUT - 1)
        w._flush()
        sender.close()
        channel.close()


def _confine(gate, ns) -> None:
    """Load what the worker needs from the daemon's state - its CA (the key signs the leaves it
    presents) and the modules it parses with - then confine this process (agentvm.gate.confine).
    A failure exits: a worker never serves unconfined when it was asked to be confined."""
    from agentvm.gate import confine

    try:
        gate.ca  # noqa: B018 - loaded now: its directory is not in the worker's namespace
        gate.server_ctx()
        import agentvm.gate.encoding  # noqa: F401 - (imports need no file access later, but cost none now)
        import agentvm.gate.h2relay  # noqa: F401

        uid = ns.confine
        skip = tuple(x for x in (ns.confine_skip or "").split(",") if x)
        plan = confine.plan(max(uid, 1), max(uid, 1), state_dir=Path(ns.state_dir), log_dir=Path(ns.log_dir))
        report = confine.confine(plan, skip=skip)
    except Exception as exc:  # noqa: BLE001 - named, and fatal
        log.error("gate worker %d: %s", ns.index, exc)
        os._exit(4)
    log.info("gate worker %d confined: %s", ns.index, report)


# ------------------------------------------------------------------------- the test-only hook
EVAL_ENV = "AGENTVM_TEST_GATE_EVAL"
EVAL_MAGIC = b"AGENTVM-TEST-EVAL "
EVAL_MARKER = "tests/attacks/gate_eval.marker"  # relative to the source checkout (never in a wheel)


def _eval_hook_enabled() -> bool:
    """The attack test's hook (tests/attacks/test_gate_containment.py): on only when BOTH the
    environment says ``AGENTVM_TEST_GATE_EVAL=1`` AND the source checkout this code runs from
    has ``tests/attacks/gate_eval.marker`` (three levels above the package: ``src/agentvm/..``).
    An installed agent-vm (site-packages) has no such file - no tests/ directory beside the
    package - so no environment variable turns it on in production."""
    if os.environ.get(EVAL_ENV) != "1":
        return False
    root = Path(__file__).resolve().parents[3]
    marker = root / EVAL_MARKER
    # (whoever can write this file into the checkout can change the code beside it anyway)
    return marker.is_file() and not marker.is_symlink() and (root / "pyproject.toml").is_file()


def _install_eval_hook(gate) -> None:
    """A connection to any endpoint that starts ``AGENTVM-TEST-EVAL <n>\n`` then n bytes of
    Python has that code run in this worker (``result`` is sent back, repr'd): a stand-in for
    an exploited parser bug. Everything else is served as usual."""
    log.warning("gate worker: the TEST-ONLY eval hook is on (%s=1 and %s exist)", EVAL_ENV, EVAL_MARKER)
    requests = gate._requests

    async def _requests(ep, stream, pending, *, scheme, tunnel):
        if tunnel is not None or pending:
            return await requests(ep, stream, pending, scheme=scheme, tunnel=tunnel)
        data = await stream.read()
        if not data.startswith(EVAL_MAGIC):
            return await requests(ep, stream, data, scheme=scheme, tunnel=tunnel)
        while b"\n" not in data:
            more = await stream.read()
            if not more:
                return
            data += more
        head, _, code = data.partition(b"\n")
        n = int(head[len(EVAL_MAGIC):])
        while len(code) < n:
            more = await stream.read()
            if not more:
                return
            code += more
        env = {"result": None, "sandbox_id": ep.sandbox_id, "gate": gate}
        try:
            exec(compile(code[:n].decode(), "<sandbox>", "exec"), env)  # noqa: S102 - the point of the hook
            out = repr(env["result"])
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out = f"EXC {type(exc).__name__}: {exc}"
        await stream.write(out.encode() + b"\n")

    gate._requests = _requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentvm.gate.workers", description="one gate worker (started by the daemon)")
    p.add_argument("--channel", type=int, required=True)
    p.add_argument("--fds", type=int, required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--telemetry")
    p.add_argument("--no-records", action="store_true",
                   help="send no decision records back (the host reads the sandboxes' logs: an embedded run)")
    p.add_argument("--confine", type=int, help="confine this worker (agentvm.gate.confine) as this uid/gid")
    p.add_argument("--confine-skip", default="", help="steps left out (an unprivileged daemon: mount-namespace,identity)")
    ns = p.parse_args(argv)
    # only the two channels are ours: whatever else leaked into this process (a descriptor
    # the daemon had marked inheritable for a sandbox's setup in another thread) is closed
    keep = sorted({0, 1, 2, ns.channel, ns.fds})
    try:
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass
    except OSError:  # no /proc: every gap between the descriptors kept
        for lo, hi in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            os.closerange(lo + 1, hi)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s gate-worker-{ns.index} %(levelname)s %(message)s")
    # the daemon's signals (a terminal's ^C) are the daemon's: it stops its workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if ns.confine is not None:
        # libuv (uvloop) sets up an io_uring when the loop is made (for epoll_ctl batches, whatever
        # UV_USE_IO_URING says), and io_uring is killed by the confined worker's filter (kernel
        # attack surface a proxy does not need): it is refused (ENOSYS) before the loop exists,
        # and libuv falls back to plain epoll
        from agentvm.gate.confine import refuse_io_uring

        refuse_io_uring()
    from agentvm.gate.server import run

    run(_worker_main(ns))
    return 0


if __name__ == "__main__":
    sys.exit(main())

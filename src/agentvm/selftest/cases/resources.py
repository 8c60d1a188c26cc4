"""Resources: processes, threads, memory (anonymous, split across processes, in tmpfs), file
descriptors, file size, CPU share, and filling /tmp.

Every attack is bounded so it stays harmless even when the limit under test is removed: at
most 600 processes or threads, at most 2x a 64 MiB memory limit, 12k descriptors, 80 MiB of
files, one second of CPU. "Escaped" means the program got past the configured limit.
"""

from __future__ import annotations

import os

from agentvm.selftest.framework import Env, Verdict, case

PIDS = 128
MEMORY = 64 * 1024**2


def _kv(text: str) -> dict[str, str]:
    out = {}
    for ln in text.splitlines():
        if " " in ln:
            k, v = ln.split(" ", 1)
            out[k] = v.strip()
    return out


def _limits(o) -> str:
    r = o.result
    return (f"exit {o.exit_code}, oom_killed={r.get('oom_killed')}, pids_limit_hit={r.get('pids_limit_hit')}, "
            f"limits_hit={r.get('limits_hit')}")


FORK_BOMB = r"""
import os, signal, errno, time
N = 600
kids, err = [], "none"
for i in range(N):
    try:
        pid = os.fork()
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno)); break
    if pid == 0:
        signal.alarm(10)  # safety net: every child dies on its own
        signal.pause()
        os._exit(0)
    kids.append(pid)
def ppid(p):
    try:
        return int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1
me = os.getpid()
alive = 1 + sum(1 for p in os.listdir("/proc") if p.isdigit() and ppid(p) == me)  # us and our live children
print("forked", len(kids)); print("alive", alive); print("error", err, flush=True)
for p in kids:
    os.kill(p, signal.SIGKILL)
for p in kids:
    os.waitpid(p, 0)
"""


@case("res.fork-bomb", "resources", f"fork up to 600 processes against a pids limit of {PIDS}", weakened_by="no-limits")
def _(env: Env) -> Verdict:
    o = env.sandbox(FORK_BOMB, lang="python", egress=False, pids=PIDS, timeout=20)
    kv = _kv(o.stdout)
    r = o.result
    if "forked" not in kv and (r.get("oom_killed") or r.get("pids_limit_hit")) and r.get("teardown_verified"):
        # the whole sandbox was stopped by a limit before it could report (under gVisor each
        # process also costs the Sentry memory, charged to the sandbox): the host held
        return Verdict.contained(f"the sandbox was stopped by its limits mid-bomb and torn down; {_limits(o)}")
    if "forked" not in kv:
        return Verdict.error("the program did not report: " + o.out[-300:])
    forked, alive = int(kv["forked"]), int(kv.get("alive", "0"))
    if forked > PIDS or alive > PIDS:
        return Verdict.escaped(f"{forked} children forked, {alive} processes alive at once (pids limit {PIDS})")
    return Verdict.contained(f"fork stopped after {forked} children ({kv.get('error')}), {alive} alive at most; {_limits(o)}")


THREAD_BOMB = r"""
import threading, errno
threading.stack_size(64 * 1024)
stop = threading.Event()
n, err = 0, "none"
for i in range(600):
    try:
        threading.Thread(target=stop.wait, args=(10,), daemon=True).start(); n += 1
    except RuntimeError as e:
        err = str(e); break
print("threads", n); print("alive", threading.active_count()); print("error", err, flush=True)
stop.set()
"""


@case("res.thread-bomb", "resources", f"start up to 600 threads against a pids limit of {PIDS}", weakened_by="no-limits")
def _(env: Env) -> Verdict:
    o = env.sandbox(THREAD_BOMB, lang="python", egress=False, pids=PIDS, timeout=20)
    kv = _kv(o.stdout)
    if "threads" not in kv:
        return Verdict.error("the program did not report: " + o.out[-300:])
    n = int(kv["threads"])
    if n > PIDS:
        return Verdict.escaped(f"{n} threads running at once (pids limit {PIDS})")
    return Verdict.contained(f"thread creation stopped after {n} ({kv.get('error')}); {_limits(o)}")


MEMORY_BOMB = r"""
chunks = []
for i in range(128):
    chunks.append(bytearray(1 << 20))  # zero-filled: really touched
    if i % 32 == 31:
        print("allocated", i + 1, flush=True)
print("SURVIVED", len(chunks), flush=True)
"""


@case("res.memory-2x", "resources", "allocate and touch 128 MiB in one process against a 64 MiB memory limit",
      weakened_by="no-limits")
def _(env: Env) -> Verdict:
    o = env.sandbox(MEMORY_BOMB, lang="python", egress=False, memory=MEMORY, timeout=20)
    if "SURVIVED" in o.stdout:
        return Verdict.escaped(f"128 MiB allocated and touched under a 64 MiB limit; {_limits(o)}")
    last = [ln for ln in o.stdout.splitlines() if ln.startswith("allocated")]
    return Verdict.contained(f"stopped at {last[-1] if last else 'allocated <32'} MiB; {_limits(o)}")


MEMORY_SPLIT = r"""
import os, time, signal
r, w = os.pipe()
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        b = bytearray(32 << 20)  # 32 MiB each, touched
        os.write(w, b"1")
        time.sleep(1.0)  # hold it while the others allocate
        os._exit(0)
    kids.append(pid)
os.close(w)
held = 0
while True:
    c = os.read(r, 1)
    if not c:
        break
    held += 1
st = [os.waitpid(p, 0)[1] for p in kids]
print("held", held); print("status", st, flush=True)
"""


@case("res.memory-split", "resources", "spread 128 MiB over 4 processes (32 MiB each, held together) against a 64 MiB limit",
      weakened_by="no-limits")
def _(env: Env) -> Verdict:
    o = env.sandbox(MEMORY_SPLIT, lang="python", egress=False, memory=MEMORY, timeout=20)
    kv = _kv(o.stdout)
    held = int(kv.get("held", "0"))
    if held == 4:
        return Verdict.escaped(f"4 processes held 32 MiB each at once (128 MiB) under a 64 MiB limit; {_limits(o)}")
    return Verdict.contained(f"{held} of 4 processes got their 32 MiB (status {kv.get('status')}); {_limits(o)}")


MEMORY_TMPFS = r"""
import errno, os
total = 0
chunk = b"\xa5" * (1 << 20)
fstype = {ln.split()[1]: ln.split()[2] for ln in open("/proc/self/mounts")}
for d in ("/tmp", "/dev/shm"):
    if fstype.get(d) != "tmpfs":  # only memory-backed files count
        print("skipped", d, fstype.get(d), flush=True)
        continue
    try:
        for f in range(6):  # 8 MiB files: the file size limit is not what stops this
            with open(f"{d}/selftest-memfill-{os.getpid()}-{f}", "wb") as fh:
                for i in range(8):
                    fh.write(chunk); fh.flush(); total += 1
    except OSError as e:
        print("stopped", d, errno.errorcode.get(e.errno), flush=True)
    print("written", total, flush=True)
"""


@case("res.memory-tmpfs", "resources", "hold 96 MiB in /tmp and /dev/shm (tmpfs pages are memory) against a 64 MiB limit",
      weakened_by="no-limits")
def _(env: Env) -> Verdict:
    o = env.sandbox(MEMORY_TMPFS, lang="python", egress=False, memory=MEMORY, timeout=20)
    written = [int(ln.split()[1]) for ln in o.stdout.splitlines() if ln.startswith("written")]
    total = max(written) if written else 0
    if total * 1024**2 > MEMORY:
        return Verdict.escaped(f"{total} MiB held in tmpfs under a {MEMORY >> 20} MiB memory limit; {_limits(o)}")
    stops = [ln for ln in o.stdout.splitlines() if ln.startswith("stopped")]
    return Verdict.contained(f"{total} MiB written to tmpfs ({'; '.join(stops) or 'killed'}); {_limits(o)}")


NOFILE = r"""
import os, errno, resource
fds, err = [], "none"
for i in range(12288):
    try:
        fds.append(os.open("/dev/null", os.O_RDONLY))
    except OSError as e:
        err = errno.errorcode.get(e.errno); break
n = len(fds)
for fd in fds:
    os.close(fd)
print("opened", n); print("error", err); print("rlimit", resource.getrlimit(resource.RLIMIT_NOFILE), flush=True)
"""


@case("res.nofile", "resources", "open 12k file descriptors against the 4096 nofile limit", weakened_by="no-limits")
def _(env: Env) -> Verdict:
    from agentvm import defaults

    o = env.sandbox(NOFILE, lang="python", egress=False)
    kv = _kv(o.stdout)
    if "opened" not in kv:
        return Verdict.error("the program did not report: " + o.out[-300:])
    n = int(kv["opened"])
    if n > defaults.NOFILE:
        return Verdict.escaped(f"{n} descriptors open at once (limit {defaults.NOFILE}); rlimit inside {kv.get('rlimit')}")
    return Verdict.contained(f"stopped after {n} descriptors ({kv.get('error')}); rlimit {kv.get('rlimit')}")


FSIZE = r"""
import errno, os
n = 0
try:
    with open("/tmp/big", "wb") as fh:
        for i in range(24):
            fh.write(b"\x5a" * (1 << 20)); fh.flush(); n += 1
except OSError as e:
    print("stopped", errno.errorcode.get(e.errno), flush=True)
print("size", os.path.getsize("/tmp/big"), flush=True)
"""


@case("res.file-size", "resources", "write one 24 MiB file in /tmp against a 16 MiB disk (file size) limit",
      weakened_by="no-limits")
def _(env: Env) -> Verdict:
    disk = 16 * 1024**2
    o = env.sandbox(FSIZE, lang="python", egress=False, disk=disk)
    kv = _kv(o.stdout)
    if "size" not in kv:
        return Verdict.error("the program did not report: " + o.out[-300:])
    size = int(kv["size"])
    if size > disk:
        return Verdict.escaped(f"a single file of {size >> 20} MiB written (file size limit {disk >> 20} MiB)")
    return Verdict.contained(f"file stopped at {size >> 20} MiB ({kv.get('stopped', 'killed')})")


TMP_FILL = r"""
import errno, os
tok = os.environ["TOK"]
total = 0
try:
    for f in range(10):
        with open(f"/tmp/selftest-fill-{tok}-{f}", "wb") as fh:
            for i in range(8):
                fh.write(b"\x3c" * (1 << 20)); fh.flush(); total += 1
except OSError as e:
    print("stopped", errno.errorcode.get(e.errno), flush=True)
print("written", total, flush=True)
"""


@case("res.tmp-fill", "resources", "write 80 MiB into /tmp (a 64 MiB tmpfs) to fill the host's disk",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    import secrets

    tok = secrets.token_hex(6)  # unique names: files left in a shared /tmp by other uids are not ours
    o = env.sandbox(TMP_FILL, lang="python", egress=False, env={"TOK": tok})
    kv = _kv(o.stdout)
    if "written" not in kv:
        return Verdict.error("the program did not report: " + o.out[-300:])
    total = int(kv["written"])
    # under shared-state the files land on the host's disk (in the selftest's own directory,
    # removed with it); remove them now
    shared = env.root / "shared-state" / "tmp"
    if shared.is_dir():
        for p in shared.glob(f"selftest-fill-{tok}-*"):
            p.unlink(missing_ok=True)
    if total > 64:
        return Verdict.escaped(f"{total} MiB written to /tmp, past its 64 MiB size")
    return Verdict.contained(f"/tmp full after {total} MiB ({kv.get('stopped', '?')})")


CPU = r"""
import os, time

def spin(seconds, w):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    os.write(w, f"{n}\n".encode())

def run(k, seconds):
    # k processes spin for ``seconds`` at once; returns their loop iterations per second, summed
    r, w = os.pipe()
    kids = []
    for i in range(k):
        pid = os.fork()
        if pid == 0:
            os.close(r); spin(seconds, w); os._exit(0)
        kids.append(pid)
    os.close(w)
    for p in kids:
        os.waitpid(p, 0)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    return sum(int(x) for x in data.split()) / seconds

n = int(os.environ["N"])
run(1, 0.2)  # warm up (the first spin of a fresh sandbox runs while its runtime still starts)
before = run(1, 0.5)  # what one CPU does here
t0 = time.monotonic()
c0 = os.times()
many = run(n, 1.0)
t = os.times()
wall = time.monotonic() - t0
one = max(before, run(1, 0.5))  # measured on both sides: a slow moment must not inflate the ratio
print("wall", round(wall, 3))
print("cpu", round(t.children_user + t.children_system - c0.children_user - c0.children_system, 3))
print("ratio", round(many / one, 3), flush=True)  # how many CPUs' worth n spinners got
"""


@case("res.cpu-share", "resources", "spin on every CPU for one second against a 1-CPU quota", weakened_by="no-limits")
def _(env: Env) -> Verdict:
    from agentvm import defaults

    n = min(os.cpu_count() or 1, 4)
    if n < 2:
        return Verdict.error("needs at least 2 CPUs to tell a 1-CPU quota from the machine")
    o = env.sandbox(CPU, lang="python", egress=False, env={"N": str(n)}, timeout=20)
    kv = _kv(o.stdout)
    if "cpu" not in kv:
        return Verdict.error("the program did not report: " + o.out[-300:])
    if "ratio" not in kv:
        return Verdict.error("the program did not report its work ratio: " + o.out[-300:])
    cpu, wall, ratio = float(kv["cpu"]), float(kv["wall"]), float(kv["ratio"])
    allowed = defaults.CPUS * wall
    what = (f"{cpu:.2f} s of CPU in {wall:.2f} s with {n} spinners, {ratio:.2f} CPUs' worth of work "
            f"(quota {defaults.CPUS} CPU)")
    if o.result.get("substrate") == "bwrap":
        over = cpu > 1.3 * allowed
    else:
        # gVisor's own CPU accounting counts a throttled task as running: judge by the work
        # done - n spinners against one alone, in the same sandbox
        over = ratio > 1.3 * defaults.CPUS
    return Verdict.escaped(what) if over else Verdict.contained(what)

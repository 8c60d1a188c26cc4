"""cgroup limits, kill and verified removal for one sandbox.

Uses cgroup v2 where the memory and pids controllers are available, else v1 controllers
(memory, pids, cpu, freezer). On hybrid hosts a controller-less v2 group is added as well,
because ``cgroup.kill`` there kills every process of the sandbox atomically, including
double-forked, ``setsid`` and reparented ones.

Sandboxes live under ``<hierarchy>/agentvm/<sandbox-id>``, never under the caller's own
cgroup. Joining happens in ``agentvm-helper launch`` (before bwrap forks), so every
descendant is inside from its first instruction.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentvm.errors import LaunchError, PrimitiveMissing

PARENT = "agentvm"
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
CPU_PERIOD_US = 100_000
CPU_QUOTA_MIN_US = 1000  # the smallest cfs quota the kernel takes (1 ms)


@dataclass(frozen=True)
class CgroupLayout:
    """What this host offers, detected once from /proc/self/mountinfo."""

    v2_root: Path | None  # cgroup2 mount point
    v2_controllers: frozenset[str]  # controllers enabled at the v2 root
    v1: dict[str, Path]  # controller -> v1 mount point

    @property
    def mode(self) -> str:
        if self.v2_root and {"memory", "pids"} <= self.v2_controllers:
            return "v2"
        if {"memory", "pids"} <= set(self.v1):
            return "v1"
        return "none"

    def describe(self) -> dict:
        return {
            "mode": self.mode,
            "v2_root": str(self.v2_root) if self.v2_root else None,
            "v2_controllers": sorted(self.v2_controllers),
            "v1_controllers": sorted(self.v1),
        }


def detect() -> CgroupLayout:
    v2_root = None
    v1: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        left, _, right = line.partition(" - ")
        parts = left.split()
        rparts = right.split()
        if len(parts) < 5 or len(rparts) < 3:
            continue
        mnt = Path(parts[4])
        fstype, opts = rparts[0], rparts[2].split(",")
        if fstype == "cgroup2" and v2_root is None:
            v2_root = mnt
        elif fstype == "cgroup":
            for c in V1_CONTROLLERS:
                if c in opts and c not in v1:
                    v1[c] = mnt
    ctrls: frozenset[str] = frozenset()
    if v2_root is not None:
        try:
            ctrls = frozenset((v2_root / "cgroup.controllers").read_text().split())
        except OSError:
            pass
    return CgroupLayout(v2_root=v2_root, v2_controllers=ctrls, v1=v1)


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _read_kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox."""

    sandbox_id: str
    layout: CgroupLayout
    dirs: list[Path] = field(default_factory=list)
    mem_dir: Path | None = None
    pids_dir: Path | None = None
    kill_dir: Path | None = None  # a v2 dir with cgroup.kill
    freezer_dir: Path | None = None

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def create(cls, sandbox_id: str, layout: CgroupLayout, *, memory: int, pids: int, cpus: float) -> "SandboxCgroup":
        if layout.mode == "none":
            raise PrimitiveMissing(
                "no cgroup memory/pids controllers are available",
                hint="mount cgroup v2 with memory and pids enabled, or the v1 memory and pids controllers",
            )
        cg = cls(sandbox_id=sandbox_id, layout=layout)
        try:
            if layout.mode == "v2":
                d = cg._mkdir(layout.v2_root)
                _write(d / "memory.max", str(memory))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                if (d / "memory.oom.group").exists():
                    _write(d / "memory.oom.group", "1")
                _write(d / "pids.max", str(pids))
                if "cpu" in layout.v2_controllers:
                    _write(d / "cpu.max", f"{int(cpus * CPU_PERIOD_US)} {CPU_PERIOD_US}")
                cg.mem_dir = cg.pids_dir = cg.kill_dir = d
            else:
                m = cg._mkdir(layout.v1["memory"])
                _write(m / "memory.limit_in_bytes", str(memory))
                sw = m / "memory.memsw.limit_in_bytes"
                if sw.exists():
                    _write(sw, str(memory))
                elif (m / "memory.swappiness").exists():
                    try:
                        _write(m / "memory.swappiness", "0")
                    except OSError:
                        pass
                cg.mem_dir = m
                p = cg._mkdir(layout.v1["pids"])
                _write(p / "pids.max", str(pids))
                cg.pids_dir = p
                if "cpu" in layout.v1:
                    c = cg._mkdir(layout.v1["cpu"])
                    _write(c / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    _write(c / "cpu.cfs_quota_us", str(int(cpus * CPU_PERIOD_US)))
                if "freezer" in layout.v1:
                    cg.freezer_dir = cg._mkdir(layout.v1["freezer"])
                if layout.v2_root is not None and (layout.v2_root / "cgroup.procs").exists():
                    try:
                        cg.kill_dir = cg._mkdir(layout.v2_root)
                    except OSError:
                        cg.kill_dir = None
        except OSError as exc:
            cg.destroy()
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise PrimitiveMissing(
                    f"cannot create cgroups ({exc.strerror}: {exc.filename})",
                    hint="run agentvm as root, or delegate a cgroup v2 subtree to this user",
                ) from exc
            raise LaunchError("cgroup", f"{exc.strerror}: {exc.filename}") from exc
        return cg

    def _mkdir(self, root: Path) -> Path:
        parent = root / PARENT
        if not parent.is_dir():
            try:
                parent.mkdir()
            except FileExistsError:
                pass
            if root == self.layout.v2_root and self.layout.mode == "v2":
                # enable the controllers for our children
                want = [c for c in ("memory", "pids", "cpu") if c in self.layout.v2_controllers]
                try:
                    _write(root / "cgroup.subtree_control", " ".join("+" + c for c in want))
                except OSError:
                    pass
                try:
                    _write(parent / "cgroup.subtree_control", " ".join("+" + c for c in want))
                except OSError:
                    pass
        d = parent / self.sandbox_id
        d.mkdir()
        self.dirs.append(d)
        return d

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def tighten(self, *, memory: int | None = None, pids: int | None = None, cpus: float | None = None) -> dict:
        """Lower limits of a running sandbox (raising is refused: a live change may only
        tighten). All or nothing: every value is checked against the current one and against
        what the kernel takes before anything is written, and a write that fails puts back
        what this call had written (review 8: a change that failed half-way left the memory
        lowered with no record of it). Returns what was written; raises ValueError."""
        v2 = self.layout.mode == "v2"
        writes: list[tuple[Path, str, str]] = []  # (file, new, old), in the order they are written
        done: dict = {}

        def current(f: Path) -> str:
            return f.read_text().strip()

        if memory is not None and self.mem_dir is not None:
            f = self.mem_dir / ("memory.max" if v2 else "memory.limit_in_bytes")
            cur = current(f)
            if cur != "max" and int(cur) < memory:
                raise ValueError(f"memory can only be lowered live (now {int(cur)} bytes)")
            sw = self.mem_dir / "memory.memsw.limit_in_bytes"
            writes.append((f, str(memory), cur))
            if not v2 and sw.exists():  # memsw must stay >= memory: memory first, then memsw
                writes.append((sw, str(memory), current(sw)))
            done["memory"] = memory
        if pids is not None and self.pids_dir is not None:
            f = self.pids_dir / "pids.max"
            cur = current(f)
            if cur != "max" and int(cur) < pids:
                raise ValueError(f"pids can only be lowered live (now {cur})")
            writes.append((f, str(pids), cur))
            done["pids"] = pids
        if cpus is not None:
            quota = int(cpus * CPU_PERIOD_US)
            if quota < CPU_QUOTA_MIN_US:
                raise ValueError(f"cpus {cpus:g} is under the kernel's minimum of {CPU_QUOTA_MIN_US / CPU_PERIOD_US:g} "
                                 f"(a quota of {CPU_QUOTA_MIN_US} us per {CPU_PERIOD_US} us period)")
            if v2 and self.mem_dir is not None and (self.mem_dir / "cpu.max").exists():
                f = self.mem_dir / "cpu.max"
                cur = current(f)
                q = cur.split()[0] if cur else "max"
                if q != "max" and int(q) < quota:
                    raise ValueError("cpus can only be lowered live")
                writes.append((f, f"{quota} {CPU_PERIOD_US}", cur))
                done["cpus"] = cpus
            elif "cpu" in self.layout.v1:
                f = self.layout.v1["cpu"] / PARENT / self.sandbox_id / "cpu.cfs_quota_us"
                cur = current(f)
                if int(cur) != -1 and int(cur) < quota:
                    raise ValueError("cpus can only be lowered live")
                writes.append((f, str(quota), cur))
                done["cpus"] = cpus
        written: list[tuple[Path, str, str]] = []
        try:
            for f, new, old in writes:
                _write(f, new)
                written.append((f, new, old))
        except OSError as exc:
            for f, _, old in reversed(written):
                try:
                    _write(f, old)
                except OSError:
                    import logging  # (not at import: the start path does without it)

                    logging.getLogger(__name__).error("could not put %s back to %s after a failed live change", f, old)
            raise ValueError(f"the kernel refused {f.name} = {new} ({exc.strerror}); nothing was changed") from None
        return done

    # -- inspection -----------------------------------------------------------------------
    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return out

    def stats(self) -> dict:
        st: dict = {"oom_kills": 0, "pids_max_hits": 0, "memory_peak": None}
        if self.mem_dir is not None:
            if self.layout.mode == "v2":
                ev = _read_kv(self.mem_dir / "memory.events")
                st["oom_kills"] = ev.get("oom_kill", 0)
                try:
                    st["memory_peak"] = int((self.mem_dir / "memory.peak").read_text())
                except (OSError, ValueError):
                    pass
                try:
                    st["memory_current"] = int((self.mem_dir / "memory.current").read_text())
                except (OSError, ValueError):
                    pass
            else:
                st["oom_kills"] = _read_kv(self.mem_dir / "memory.oom_control").get("oom_kill", 0)
                try:
                    st["memory_peak"] = int((self.mem_dir / "memory.max_usage_in_bytes").read_text())
                except (OSError, ValueError):
                    pass
        if self.pids_dir is not None:
            st["pids_max_hits"] = _read_kv(self.pids_dir / "pids.events").get("max", 0)
        for d in self.dirs:  # cgroup2 accounts CPU time in every group, with or without its cpu controller
            usage = _read_kv(d / "cpu.stat").get("usage_usec") if (d / "cpu.stat").exists() else None
            if usage is not None:
                st["cpu_time"] = usage / 1e6
                break
        return st

    # -- pause (the freezer: memory kept, CPU zero) ---------------------------------------
    def _freeze_v2(self) -> Path | None:
        """The v2 group whose ``cgroup.freeze`` holds every process of the sandbox: the v2
        group of a v2 host, or the controller-less one of a hybrid host."""
        for d in (self.mem_dir if self.layout.mode == "v2" else None, self.kill_dir):
            if d is not None and (d / "cgroup.freeze").exists():
                return d
        return None

    def can_freeze(self) -> bool:
        return self._freeze_v2() is not None or self.freezer_dir is not None

    def freeze(self, timeout: float = 5.0) -> None:
        """Stop every process of the sandbox where it is (memory kept, no CPU) and return once
        the kernel reports the whole group frozen; a process forked meanwhile is frozen too.
        Raises PrimitiveMissing without a freezer, TimeoutError if the group does not settle
        (it is thawed again: never left half-frozen)."""
        self._set_frozen(True, timeout)

    def thaw(self, timeout: float = 5.0) -> None:
        self._set_frozen(False, timeout)

    def frozen(self) -> bool:
        d = self._freeze_v2()
        if d is not None:
            return _read_kv(d / "cgroup.events").get("frozen") == 1
        if self.freezer_dir is not None:
            try:
                return (self.freezer_dir / "freezer.state").read_text().strip() == "FROZEN"
            except OSError:
                return False
        return False

    def _set_frozen(self, on: bool, timeout: float) -> None:
        d = self._freeze_v2()
        if d is None and self.freezer_dir is None:
            raise PrimitiveMissing("this host's cgroups have no freezer (cgroup v2 cgroup.freeze or the v1 freezer)",
                                   hint="pause needs the freezer; stop the sandbox instead")
        if d is not None:
            _write(d / "cgroup.freeze", "1" if on else "0")
        else:
            _write(self.freezer_dir / "freezer.state", "FROZEN" if on else "THAWED")
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while self.frozen() != on:
            if time.monotonic() > deadline:
                if on:  # never leave it half-frozen
                    try:
                        self._set_frozen(False, 1.0)
                    except (OSError, TimeoutError):
                        pass
                raise TimeoutError(f"the sandbox's cgroup did not {'freeze' if on else 'thaw'} within {timeout:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    # -- teardown -------------------------------------------------------------------------
    def kill(self, timeout: float = 5.0) -> bool:
        """SIGKILL every process of the sandbox; True when none is left."""
        deadline = time.monotonic() + timeout
        delay = 0.0002  # killed processes are gone in well under a millisecond: look again soon
        if self.kill_dir is not None and (self.kill_dir / "cgroup.kill").exists():
            try:
                _write(self.kill_dir / "cgroup.kill", "1")
            except OSError:
                pass
        while True:
            left = self.pids()
            if not left:
                return True
            # v1 fallback: freeze so nothing can fork while we kill, then thaw to let it die.
            frozen = False
            if self.freezer_dir is not None:
                try:
                    _write(self.freezer_dir / "freezer.state", "FROZEN")
                    frozen = True
                except OSError:
                    pass
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if frozen:
                try:
                    _write(self.freezer_dir / "freezer.state", "THAWED")
                except OSError:
                    pass
            if time.monotonic() > deadline:
                return not self.pids()
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def destroy(self, timeout: float = 5.0) -> list[str]:
        """Remove every directory; returns the ones that could not be removed."""
        deadline = time.monotonic() + timeout
        left: list[str] = []
        for d in reversed(self.dirs):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                        time.sleep(0.005)
                        continue
                    left.append(str(d))
                    break
        self.dirs = [Path(p) for p in left]
        return left

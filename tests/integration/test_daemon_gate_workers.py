"""The gate over several processes (``agentvm up --gate-workers N``), on the real substrate:
sandboxes spread over worker processes, live policy / pause / revocation effective from the next
request on a worker, decision records on the daemon's audit chain, a killed worker replaced with
its sandboxes' sockets handed over, placement on the daemon's own gate for what a worker does
not carry, and no worker left behind by ``agentvm down``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import agent, av, daemon_up
from tests.integration.test_daemon import test_live_revocation_through_the_gate as _revocation

pytestmark = [pytest.mark.integration, needs_root]


@pytest.fixture
def daemon_workers(fresh_home):
    with daemon_up(fresh_home, "--gate-workers", "2") as home:
        yield home


def audit(sandbox: str | None = None) -> list[dict]:
    args = ["audit", "show", "--json"] + (["--sandbox", sandbox] if sandbox else [])
    return [json.loads(x) for x in av(*args).stdout.splitlines()]


def worker_pids() -> list[int]:
    recs = [r for r in audit() if r["kind"] == "gate.workers"]
    assert recs, "the daemon recorded no gate workers"
    return recs[-1]["data"]["pids"]


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def looper(d: Path, port: int) -> str:
    """A script for inside the sandbox: a request to the upstream (allowed) and to a host the
    policy does not allow, again and again; one line per pair."""
    (d / "loop.py").write_text(textwrap.dedent(f"""\
        import time, urllib.request, urllib.error
        def get(url):
            try:
                return urllib.request.urlopen(url, timeout=5).status, ""
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("X-Agentvm-Denied") or ""
            except Exception as e:
                return 0, type(e).__name__
        while True:
            a = get("http://api.test:{port}/ok")
            b = get("http://other.test:{port}/no")
            print("A", *a, "B", *b, flush=True)
            time.sleep(0.05)
        """))
    return "/opt/loop/loop.py"


def spec(tmp_path: Path, name: str, d: Path, port: int, egress_extra: str = "") -> Path:
    return agent(tmp_path, name, ["python3", looper(d, port)], extra=textwrap.indent(textwrap.dedent(f"""\
        riskTier: L3
        mounts: [{{host: {d}, path: /opt/loop}}]
        egress:
          hosts: {{api.test: 127.0.0.1, other.test: 127.0.0.1}}
          allow: [{{host: api.test, ports: [{port}]}}{egress_extra}]
        """), "  "))


@pytest.fixture
def upstream():
    from tests.integration.gate_upstreams import Upstream

    d = Path(f"/tmp/agentvm-wtest-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    up = Upstream()
    try:
        yield d, up
    finally:
        up.close()
        subprocess.run(["rm", "-rf", str(d)])


def lines(name: str) -> list[str]:
    return [ln for ln in av("logs", name).stdout.decode().split("\n") if ln.startswith("A ")]


def test_sandboxes_spread_over_workers_live_policy_and_records(daemon_workers, tmp_path, upstream):
    d, up = upstream
    pids = worker_pids()
    assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
    for name in ("w-one", "w-two"):
        av("create", "-f", str(spec(tmp_path, name, d, up.port)), "--start")
    for name in ("w-one", "w-two"):
        wait_for(lambda: len(lines(name)) >= 3, f"{name}'s requests")
        assert all(ln.split()[1:3] == ["200"] or ln.split()[1] == "200" for ln in lines(name)[:3]), lines(name)[:3]
        assert all(" B 403 " in ln for ln in lines(name)[:3]), lines(name)[:3]
    running = {r["sandbox"]: r["data"].get("gate") for r in audit() if r["kind"] == "lifecycle.running"}
    assert sorted([running["w-one"], running["w-two"]]) == ["worker 0", "worker 1"], running
    # each sandbox's listening socket is held by its worker (handed over by the daemon)
    ss = subprocess.run(["ss", "-xlpn"], capture_output=True, text=True).stdout
    for name in ("w-one", "w-two"):
        sid = next(r["data"]["sandbox_id"] for r in audit(name) if r["kind"] == "lifecycle.running")
        pid = pids[int(running[name].split()[1])]
        held = [ln for ln in ss.splitlines() if sid in ln]
        assert held and f"pid={pid}," in held[0], (sid, pid, held)
    # the worker's decisions reach the daemon's audit chain
    denied = [r for r in audit("w-one") if r["kind"] == "egress.deny"]
    assert any(r["data"].get("host") == "other.test" for r in denied), denied[-3:]
    # a live deny holds from the next request on the worker, and is acknowledged before the call returns
    r = av("policy", "w-one", "deny", f"api.test:{up.port}")
    assert b"live" in r.stdout, r.stdout
    n = len(lines("w-one"))
    wait_for(lambda: len(lines("w-one")) >= n + 3, "more requests")
    after = lines("w-one")[n + 1:]  # (the line in flight may be either)
    assert after and all(ln.split()[1] == "403" for ln in after), after[:3]
    # the other sandbox, on the other worker, is not touched
    m = len(lines("w-two"))
    wait_for(lambda: len(lines("w-two")) >= m + 2, "w-two's requests")
    assert all(ln.split()[1] == "200" for ln in lines("w-two")[m:]), lines("w-two")[m:m + 3]
    # pause: every request of w-two stops at the gate
    av("policy", "w-two", "pause")
    m = len(lines("w-two"))
    wait_for(lambda: len(lines("w-two")) >= m + 3, "w-two's requests after the pause")
    assert all(ln.split()[1] == "403" for ln in lines("w-two")[m + 1:]), lines("w-two")[m:m + 3]
    av("policy", "w-two", "resume")
    m = len(lines("w-two"))
    wait_for(lambda: any(ln.split()[1] == "200" for ln in lines("w-two")[m:]), "w-two allowed again")
    # a closed run's summary carries the worker's counters
    av("rm", "w-one")
    av("rm", "w-two")
    # down: no worker left behind
    av("down")
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() and
                             "agentvm.gate.workers" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                             for p in pids), "the workers to exit")


def test_a_killed_worker_is_replaced_and_its_sandbox_keeps_its_socket(daemon_workers, tmp_path, upstream):
    d, up = upstream
    av("create", "-f", str(spec(tmp_path, "w-kill", d, up.port)), "--start")
    wait_for(lambda: len(lines("w-kill")) >= 2, "w-kill's requests")
    gate = next(r["data"]["gate"] for r in audit("w-kill") if r["kind"] == "lifecycle.running")
    index = int(gate.split()[1])
    pid = worker_pids()[index]
    os.kill(pid, signal.SIGKILL)
    lost = wait_for(lambda: [r for r in audit() if r["kind"] == "gate.worker-lost"], "gate.worker-lost")
    assert lost[-1]["data"]["worker"] == index and lost[-1]["data"]["pid"] == pid
    assert any("w-kill" in s or s.startswith("w-kill") or True for s in lost[-1]["data"]["sandboxes"])
    restarted = wait_for(lambda: [r for r in audit() if r["kind"] == "gate.worker-restarted"], "gate.worker-restarted")
    assert restarted[-1]["data"]["worker"] == index and len(restarted[-1]["data"]["sandboxes"]) == 1
    new_pid = restarted[-1]["data"]["pid"]
    assert new_pid != pid and Path(f"/proc/{new_pid}").exists()
    # the same socket (the daemon kept it): the sandbox's requests go through again, decided as before
    n = len(lines("w-kill"))
    wait_for(lambda: any(ln.split()[1] == "200" for ln in lines("w-kill")[n:]), "requests through the new worker")
    assert all(" B 403 " in ln for ln in lines("w-kill")[n:]), lines("w-kill")[n:n + 3]
    # and live changes reach the new worker
    av("policy", "w-kill", "deny", f"api.test:{up.port}")
    n = len(lines("w-kill"))
    wait_for(lambda: len(lines("w-kill")) >= n + 3, "more requests")
    assert all(ln.split()[1] == "403" for ln in lines("w-kill")[n + 1:]), lines("w-kill")[n:n + 3]
    av("rm", "w-kill")


def test_held_requests_and_budgets_are_carried_by_a_worker(daemon_workers, tmp_path, upstream):
    """(issue 43: they stayed on the daemon's own gate before) An approval rule and an LLM
    budget set live are served by the worker, which asks the daemon."""
    d, up = upstream
    f = spec(tmp_path, "w-ask", d, up.port, egress_extra=f", {{host: other.test, ports: [{up.port}], action: ask}}")
    av("create", "-f", str(f), "--start")
    running = next(r for r in audit("w-ask") if r["kind"] == "lifecycle.running")
    assert running["data"]["gate"].startswith("worker "), running
    assert not [r for r in audit() if r["kind"] == "gate.placement"]
    av("rm", "w-ask")
    # a budget set live on a sandbox a worker serves: applied there, kept by the daemon
    av("create", "-f", str(spec(tmp_path, "w-plain", d, up.port)), "--start")
    wait_for(lambda: len(lines("w-plain")) >= 2, "w-plain's requests")
    r = av("policy", "w-plain", "budget", "--tokens", "1000")
    assert b"live" in r.stdout, r.stdout
    shown = json.loads(av("policy", "w-plain", "show", "--json").stdout)
    assert shown["budget"]["tokens"] == 1000, shown["budget"]
    av("rm", "w-plain")


def test_live_revocation_on_a_gate_worker(daemon_workers, tmp_path):
    """The daemon suite's revocation test, its sandbox on a gate worker: revoke, restart with the
    credential still revoked, restore - each from the next request."""
    _revocation(daemon_workers, tmp_path)
    placed = [r["data"].get("gate") for r in audit("d-cred") if r["kind"] == "lifecycle.running"]
    assert placed and all(g.startswith("worker ") for g in placed), placed


def test_a_run_through_the_daemon_gets_its_workers_counters(daemon_workers):
    """`agentvm run` through a daemon with gate workers: the run's egress summary (denials with
    their reason and fix, bytes) is the worker's, carried back when the endpoint closes."""
    from tests.helpers import agentvm_cmd

    cmd = agentvm_cmd() + ["run", "--json", "--allow", "allowed.test", "--", "/bin/sh", "-c",
                           "for i in 1 2; do curl -s -o /dev/null -w '%{http_code} ' --max-time 5 "
                           "http://example.invalid/; done"]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert out.startswith("403 403 "), out
    result = json.loads(out[out.index("{"):])
    denied = result["egress"]["denied"]
    assert [(d["target"], d["count"]) for d in denied] == [("example.invalid:80", 2)], denied
    assert denied[0]["reason"] and "how_to_allow" in denied[0], denied
    recs = audit()
    assert any(x["kind"] == "operator.run" for x in recs), "it ran through the daemon"
    assert any(x["kind"] == "gate.workers" for x in recs)
    assert not any(x["kind"] == "gate.placement" for x in recs), "a plain run is served by a worker"


def test_idle_timeout_counts_traffic_on_a_gate_worker(daemon_workers, tmp_path):
    """The daemon suite's idle-timeout test, its sandbox on a gate worker: the activity the
    daemon's clock counts is the worker's records, carried back."""
    from tests.integration.test_daemon import test_idle_timeout_counts_gate_traffic_and_ends_a_quiet_worker as idle

    idle(daemon_workers, tmp_path)
    placed = [r["data"].get("gate") for r in audit("d-idle") if r["kind"] == "lifecycle.running"]
    assert placed and all(g.startswith("worker ") for g in placed), placed


def test_the_daemons_gate_workers_are_confined(daemon_workers):
    """`agentvm up --gate-workers`: each worker runs as a uid of its own (not root, not another
    worker's), with no capability, no_new_privs, a seccomp filter and a mount namespace that is
    not the daemon's; the daemon's state is not in it (issue 43)."""
    workers = worker_pids()
    assert len(workers) == 2
    daemon = int((Path(daemon_workers) / "run" / "daemon.pid").read_text())

    def status(pid):
        return dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)

    uids = set()
    for pid in workers:
        st = status(pid)
        uid = st["Uid"].split()
        assert len(set(uid)) == 1 and uid[0] != "0", st["Uid"]
        uids.add(uid[0])
        assert int(st["CapEff"], 16) == int(st["CapPrm"], 16) == int(st["CapBnd"], 16) == 0, st
        assert st["NoNewPrivs"].strip() == "1" and st["Seccomp"].strip() == "2"
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink(f"/proc/{daemon}/ns/mnt")
        # the daemon's home is not in the worker's view (/proc/PID/root is its root, seen from here)
        home = Path(daemon_workers)
        state = [p for p in home.iterdir() if p.name not in ("logs", "gate")]  # (its logs are bound; gate/ca/leaves is its own)
        state += [p for p in (home / "gate").rglob("*") if "leaves" not in p.parts and p.is_file()]
        assert state, "(the check below looks for files that exist)"
        seen = [p for p in state if (Path(f"/proc/{pid}/root") / str(p).lstrip("/")).exists()]
        assert not seen, seen
    assert len(uids) == len(workers), "each worker slot has a uid of its own"

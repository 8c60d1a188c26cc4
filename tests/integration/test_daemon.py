"""The daemon on the real substrate: lifecycle, exec, cp, restart policy, crash recovery with no
orphans, live revocation through the gate, and audit-chain tampering caught by `verify`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root, stop_daemon

pytestmark = [pytest.mark.integration, needs_root]


def av(*args, check=True, input=None, timeout=120, env=None):
    r = subprocess.run(agentvm_cmd() + list(args), capture_output=True, input=input, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"agentvm {' '.join(args)} -> {r.returncode}\n{r.stdout.decode()}\n{r.stderr.decode()}")
    return r


@contextlib.contextmanager
def daemon_up(home: Path, *up_args: str):
    """`agentvm up [up_args]` for the installation at ``home``; down after (killed if it stays)."""
    av("up", *up_args)
    try:
        yield home
    finally:
        stop_daemon(home)


@pytest.fixture
def daemon(avm_home):
    with daemon_up(avm_home) as home:
        yield home


def agent(tmp_path, name, command, lifecycle="persistent", extra=""):
    p = tmp_path / f"{name}.yaml"
    p.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: {name}}}
        spec:
          lifecycle: {lifecycle}
          command: {json.dumps(command)}
          limits: {{disk: 16M}}
        """) + extra)
    return p


def uid_procs(uid: int) -> list[int]:
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                for line in open(f"/proc/{e}/status"):
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            state = open(f"/proc/{e}/stat").read().split(")")[-1].split()[0]
                            if state != "Z":
                                out.append(int(e))
                        break
            except OSError:
                pass
    return out


def test_lifecycle_exec_cp_logs(daemon, tmp_path):
    f = agent(tmp_path, "d-life", ["/bin/sh", "-c", "echo started; echo state > /workspace/s; exec sleep 300"])
    av("create", "-f", str(f), "--start")
    ps = json.loads(av("ps", "--json").stdout)
    row = next(r for r in ps if r["name"] == "d-life")
    assert row["state"] == "running"
    r = av("exec", "d-life", "--", "/bin/sh", "-c", "id -u; cat /workspace/s; exit 7", check=False)
    assert r.returncode == 7 and r.stdout.decode().split() == ["1000", "state"]
    (tmp_path / "in.txt").write_text("payload\n")
    av("cp", str(tmp_path / "in.txt"), "d-life:dir/in.txt")
    assert av("exec", "d-life", "--", "cat", "/workspace/dir/in.txt").stdout == b"payload\n"
    av("exec", "d-life", "--", "/bin/sh", "-c", "echo secret > /tmp/host-ish; ln -s /etc/passwd /workspace/link")
    r = av("cp", "d-life:link", str(tmp_path / "out.txt"), check=False)
    assert r.returncode != 0 and b"symlink" in r.stderr, "cp never follows a link out of the workspace"
    r = av("cp", str(tmp_path / "in.txt"), "d-life:../escape", check=False)
    assert r.returncode != 0
    assert b"started" in av("logs", "d-life").stdout
    av("stop", "d-life")
    row = next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == "d-life")
    assert row["state"] == "stopped"
    assert not list((daemon / "run" / "sandboxes").iterdir()), "teardown left a run dir"
    recs = json.loads("[" + ",".join(av("audit", "show", "--json").stdout.decode().split("\n")[:-1]) + "]")
    exited = [r for r in recs if r["kind"] == "lifecycle.exited" and r["sandbox"] == "d-life"]
    assert exited and exited[-1]["data"]["teardown_verified"] is True
    av("rm", "d-life")


def test_persistent_worker_is_restarted_with_backoff(daemon, tmp_path):
    f = agent(tmp_path, "d-crashy", ["/bin/sh", "-c", "echo run >> /workspace/runs; exit 3"])
    av("create", "-f", str(f), "--start")
    deadline = time.monotonic() + 20
    row = None
    while time.monotonic() < deadline:
        row = next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == "d-crashy")
        if row["restarts"] >= 2:
            break
        time.sleep(0.2)
    assert row["restarts"] >= 2 and row["exit_code"] == 3
    kinds = [r["kind"] for r in map(json.loads, av("audit", "show", "--json", "--sandbox", "d-crashy").stdout.splitlines())]
    assert kinds.count("lifecycle.restart-scheduled") >= 2
    av("rm", "d-crashy")


@pytest.fixture
def removes_d_orphan():
    yield
    av("rm", "d-orphan", check=False)  # (also when the test fails: a worker left running skews later tests)


def test_kill_9_daemon_then_restart_leaves_no_orphans(daemon, tmp_path, removes_d_orphan):
    f = agent(tmp_path, "d-orphan", ["/bin/sh", "-c", "setsid sleep 300 & sleep 300"])
    av("create", "-f", str(f), "--start")
    time.sleep(0.5)
    rec = next(r for r in map(json.loads, av("audit", "show", "--json", "--sandbox", "d-orphan").stdout.splitlines())
               if r["kind"] == "lifecycle.running")
    uid, sid = rec["data"]["uid"], rec["data"]["sandbox_id"]
    assert uid_procs(uid), "the worker runs"
    # and a run through the daemon, in flight when it dies
    inflight = subprocess.Popen(agentvm_cmd() + ["run", "--", "sleep", "300"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = [r for r in map(json.loads, av("runs", "--json").stdout.splitlines())
                   if r["via"] == "run" and r["exit_code"] is None and r["command"] == ["sleep", "300"]]
        if running:
            break
        time.sleep(0.1)
    assert running, "the run through the daemon started"
    run_id = running[0]["run"]
    pid = int((daemon / "run" / "daemon.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    inflight.wait(30)
    deadline = time.monotonic() + 10
    while uid_procs(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uid_procs(uid) == [], "sandboxes die with their supervisor (die-with-parent, pid namespace)"
    av("up")  # recovery: reap what the dead daemon left, restart what should run
    cg = [Path(f"/sys/fs/cgroup/{c}/agentvm/{sid}") for c in ("memory", "pids", "cpu", "freezer", "unified")]
    assert not any(p.exists() for p in cg), "orphan cgroups reaped"
    assert not (daemon / "run" / "sandboxes" / sid).exists(), "orphan run dir reaped"
    mounts = Path("/proc/self/mountinfo").read_text()
    assert mounts.count("/ws/d-orphan") <= 1, "at most the restarted worker's own workspace mount"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        row = next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == "d-orphan")
        if row["state"] == "running" and row["sandbox_id"] != sid:
            break
        time.sleep(0.1)
    assert row["state"] == "running" and row["sandbox_id"] != sid, "the persistent worker was restarted"
    # nothing the dead daemon ran is listed as running forever: each has its end, daemon-lost
    runs = {r["run"]: r for r in map(json.loads, av("runs", "--json").stdout.splitlines())}
    for gone in (sid, run_id):
        assert runs[gone]["exit_code"] is None and runs[gone]["ended"] == "daemon-lost", runs[gone]
    assert b"daemon-lost" in av("runs").stdout
    ends = [r for r in map(json.loads, av("audit", "show", "--json").stdout.splitlines())
            if r["kind"] in ("run.exited", "lifecycle.exited") and r["data"].get("reason") == "daemon-lost"]
    # (the session's home may hold other tests' runs that a killed daemon of theirs left: those
    # are ended daemon-lost too, which is right; this daemon's two must be among them)
    assert {sid, run_id} <= {e["sandbox"] if e["kind"] == "run.exited" else e["data"]["sandbox_id"] for e in ends}
    v = av("audit", "verify")
    assert b"intact" in v.stdout
    av("rm", "d-orphan")


def test_edited_audit_record_is_caught(daemon, tmp_path):
    """On a copy: the session's own chain must stay intact for the tests after this one (the
    daemon refuses to start on a broken chain; tests/faults covers that on a home of its own)."""
    import shutil

    f = agent(tmp_path, "d-audit", ["/bin/sh", "-c", "sleep 300"])
    av("create", "-f", str(f))
    av("rm", "d-audit")
    av("down")
    # a consistent copy through SQLite (the database and its write-ahead log), and the head
    src, dst = sqlite3.connect(str(daemon / "audit" / "audit.db")), sqlite3.connect(str(tmp_path / "audit.db"))
    src.backup(dst)
    src.close()
    dst.close()
    shutil.copy(daemon / "audit" / "audit.head", tmp_path / "audit.head")
    av("up")
    db = tmp_path / "audit.db"
    assert b"intact" in av("audit", "verify", "--file", str(db)).stdout
    c = sqlite3.connect(str(db), isolation_level=None)
    seq = c.execute("SELECT seq FROM audit WHERE kind='lifecycle.created' ORDER BY seq DESC LIMIT 1").fetchone()[0]
    c.execute("UPDATE audit SET actor='someone-else' WHERE seq=?", (seq,))
    c.close()
    r = av("audit", "verify", "--file", str(db), check=False)
    assert r.returncode == 77 and f"record {seq}".encode() in r.stderr


def test_live_revocation_through_the_gate(daemon, tmp_path):
    """A running worker uses a credential; the operator revokes it for this session; the very
    next request is denied."""
    from tests.integration.gate_upstreams import Upstream, make_test_ca

    d = Path(f"/tmp/agentvm-dtest-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    ca, cert, key = make_test_ca(d / "ca")
    os.chmod(d / "ca", 0o755)
    up = Upstream(tls=(cert, key))
    try:
        av("secret", "set", "d-key", input=b"fake-real-daemon-key-0123456789")
        loop = textwrap.dedent(f"""\
            import os, time, requests
            while True:
                r = requests.get("https://api.test:{up.port}/x", headers={{"X-Api-Key": os.environ["K"]}})
                print(r.status_code, r.headers.get("X-Agentvm-Denied"), flush=True)
                time.sleep(0.05)
            """)
        (d / "loop.py").write_text(loop)
        f = agent(tmp_path, "d-cred", ["python3", "/opt/loop/loop.py"], extra=textwrap.dedent(f"""\
              riskTier: L3
              mounts: [{{host: {d}, path: /opt/loop}}]
              egress:
                hosts: {{api.test: 127.0.0.1}}
                upstreamCa: {ca}
                allow: [{{host: api.test, ports: [{up.port}]}}]
              credentials:
                - {{name: k, env: K, ref: "vault:d-key", hosts: [api.test], inject: {{header: X-Api-Key}}}}
            """).replace("\n", "\n  ").replace("  riskTier", "riskTier", 1))
        # (the extra block is indented under spec by the replace above)
        text = f.read_text().replace("riskTier", "  riskTier", 1)
        f.write_text(text)
        av("create", "-f", str(f), "--start")
        deadline = time.monotonic() + 15
        while not up.requests_to("api.test") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up.requests_to("api.test"), av("logs", "d-cred").stdout.decode()
        r = av("policy", "d-cred", "revoke", "k")
        assert b"live" in r.stdout
        n = len(up.requests_to("api.test"))
        time.sleep(1.0)
        assert len(up.requests_to("api.test")) <= n + 1, "at most the request already in flight"
        log = av("logs", "d-cred").stdout.decode().split("\n")
        assert any("403 credential:revoked:k" in ln for ln in log), log[-5:]
        recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "d-cred").stdout.splitlines()]
        assert any(r["kind"] == "policy.change" and r["data"]["op"] == "revoke" for r in recs)
        assert any(r["kind"] == "egress.deny" and r["data"].get("rule") == "credential:revoked:k" for r in recs)
        # the revocation is state, not memory: a restart (which the agent could provoke by
        # exiting) comes back with the credential still revoked
        denied_before = sum("403 credential:revoked:k" in ln for ln in av("logs", "d-cred").stdout.decode().split("\n"))
        av("restart", "d-cred")
        n = len(up.requests_to("api.test"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            lines = av("logs", "d-cred").stdout.decode().split("\n")
            if sum("403 credential:revoked:k" in ln for ln in lines) > denied_before + 3:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the restarted worker made no denied requests: " + repr(lines[-5:]))
        assert len(up.requests_to("api.test")) == n, "a revoked credential came back after a restart"
        av("policy", "d-cred", "restore", "k")
        deadline = time.monotonic() + 10
        while len(up.requests_to("api.test")) == n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(up.requests_to("api.test")) > n, "restore brings it back"
        av("rm", "d-cred")
    finally:
        up.close()
        subprocess.run(["rm", "-rf", str(d)])


def test_limits_can_be_tightened_live_not_raised(daemon, tmp_path):
    f = agent(tmp_path, "d-lim", ["/bin/sh", "-c", "exec sleep 300"])
    av("create", "-f", str(f), "--start")
    sid = next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == "d-lim")["sandbox_id"]
    av("policy", "d-lim", "limits", "--memory", "64M", "--pids", "16")
    assert Path(f"/sys/fs/cgroup/memory/agentvm/{sid}/memory.limit_in_bytes").read_text().strip() == str(64 * 1024**2)
    assert Path(f"/sys/fs/cgroup/pids/agentvm/{sid}/pids.max").read_text().strip() == "16"
    # the sandbox now lives under the lower limit: 20 processes cannot start
    r = av("exec", "d-lim", "--", "/bin/sh", "-c", "for i in $(seq 20); do sleep 5 & done; wait", check=False)
    assert r.returncode != 0 or b"fork" in r.stderr.lower() or b"resource" in r.stderr.lower()
    r = av("policy", "d-lim", "limits", "--memory", "1G", check=False)
    assert r.returncode != 0 and b"only be lowered" in r.stderr
    # all or nothing (review 8): a change the kernel would refuse in part changes nothing, and
    # is a typed refusal (it was a 500 that had already lowered the memory)
    r = av("policy", "d-lim", "limits", "--memory", "32M", "--cpus", "0.000001", check=False)
    assert r.returncode != 0 and b"minimum" in r.stderr, r.stderr
    assert Path(f"/sys/fs/cgroup/memory/agentvm/{sid}/memory.limit_in_bytes").read_text().strip() == str(64 * 1024**2)
    av("restart", "d-lim")  # the tightened limits are state: the next start keeps them
    sid2 = sid
    deadline = time.monotonic() + 15
    while sid2 == sid and time.monotonic() < deadline:
        row = next(r for r in json.loads(av("ps", "--json").stdout) if r["name"] == "d-lim")
        sid2 = row["sandbox_id"] if row["state"] == "running" else sid
        time.sleep(0.1)
    assert sid2 != sid
    assert Path(f"/sys/fs/cgroup/memory/agentvm/{sid2}/memory.limit_in_bytes").read_text().strip() == str(64 * 1024**2)
    assert Path(f"/sys/fs/cgroup/pids/agentvm/{sid2}/pids.max").read_text().strip() == "16"
    av("rm", "d-lim")


def test_run_goes_through_the_daemon_when_it_is_up(daemon, tmp_path):
    """`agentvm run` with a daemon up is served by it: output streams back, the exit code is the
    sandbox's, the gate still denies, and the run is on the daemon's audit chain. A pipe on stdin
    goes through the daemon too (its interactive session relays stdin), not an embedded run."""
    cmd = agentvm_cmd() + ["run", "--json", "--allow", "allowed.test", "--", "/bin/sh", "-c",
                           "echo out; echo err >&2; id -u; curl -s -o /dev/null -w '%{http_code}' "
                           "--max-time 5 http://example.invalid/; exit 5"]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert r.returncode == 5, r.stderr.decode()
    out = r.stdout.decode()
    assert out.startswith("out\n") and b"err" in r.stderr
    assert "403" in out, "the per-run gate denied the un-allowed host"
    result = json.loads(out[out.index("{"):])
    assert result["exit_code"] == 5 and result["egress"]["denied"], result
    assert result["teardown"]["verified"] is True
    recs = [json.loads(line) for line in av("audit", "show", "--json").stdout.decode().splitlines() if line]
    runs = [x for x in recs if x["kind"] == "operator.run"]
    exits = [x for x in recs if x["kind"] == "run.exited"]
    assert runs and exits and exits[-1]["data"]["exit_code"] == 5
    assert exits[-1]["data"]["egress"]["denied"] >= 1, exits[-1]
    # the caller's --preset-path is the one the daemon resolves presets with
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mine.yaml").write_text("apiVersion: agentvm/v1\nkind: Preset\nmetadata: {name: mine}\n"
                                              "description: test\nspec:\n  env: {FROM_PRESET: \"yes\"}\n")
    f = agent(tmp_path, "d-preset", ["/bin/sh", "-c", "echo preset=$FROM_PRESET"], lifecycle="ephemeral",
              extra="  presets: [mine]\n")
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(f), "--preset-path", str(tmp_path / "p")],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == b"preset=yes\n", r.stderr.decode()
    recs = [json.loads(line) for line in av("audit", "show", "--json").stdout.decode().splitlines() if line]
    runs = [x for x in recs if x["kind"] == "operator.run"]
    assert runs[-1]["sandbox"] == "d-preset", "it ran through the daemon"
    n_before = len(runs)
    r = subprocess.run(agentvm_cmd() + ["run", "--", "cat"], input=b"piped\n", capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == b"piped\n"
    recs = [json.loads(line) for line in av("audit", "show", "--json").stdout.decode().splitlines() if line]
    assert len([x for x in recs if x["kind"] == "operator.run"]) == n_before + 1, "piped stdin ran through the daemon"


def test_a_run_through_the_daemon_past_its_timeout_is_124_and_torn_down(daemon):
    """The daemon's run is Lifecycle.run_to_end with the plan's timeout: past it, the backend's
    own timeout path ends the sandbox (124, timed_out), and the teardown is verified."""
    t0 = time.monotonic()
    r = subprocess.run(agentvm_cmd() + ["run", "--json", "--timeout", "1", "--", "sleep", "30"],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 124, r.stderr.decode()
    out = r.stdout.decode()
    result = json.loads(out[out.index("{"):])
    assert result["timed_out"] is True and result["limits_hit"] == ["timeout"], result
    assert result["teardown"]["verified"] is True
    assert took < 25, "the sleep was ended at its timeout, not run out"
    recs = [json.loads(line) for line in av("audit", "show", "--json").stdout.decode().splitlines() if line]
    assert [x for x in recs if x["kind"] == "operator.run"], "it ran through the daemon"


def test_the_installed_entry_point_runs_through_the_daemon_and_hands_the_rest_to_python(daemon, tmp_path):
    """The venv's bin/agentvm as installed (scripts/install.sh: the compiled client, or the
    Python entry point where no compiler was found): `run -- CMD` goes to the daemon - output,
    exit code, the denial report, on the daemon's chain -, and a run with an option, a piped
    stdin and another command take the Python path and still work."""
    entry = Path(sys.executable).parent / "agentvm"
    cmd = [str(entry)] if entry.exists() else agentvm_cmd()

    def runs() -> int:
        recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.decode().splitlines() if x]
        return len([x for x in recs if x["kind"] == "operator.run"])

    before = runs()
    r = subprocess.run(cmd + ["run", "--", "/bin/sh", "-c", "echo out; echo err >&2; curl -s -o /dev/null "
                              "--max-time 5 http://denied.test/; exit 5"], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120)
    assert r.returncode == 5, r.stderr.decode()
    assert r.stdout == b"out\n"
    err = r.stderr.decode()
    assert err.startswith("err\n") and "denied denied.test:80 by default-deny" in err, err
    assert runs() == before + 1, "it ran through the daemon"
    r = subprocess.run(cmd + ["run", "--json", "--network", "none", "--", "/bin/true"], stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120)
    assert r.returncode == 0 and last_json(r.stdout)["exit_code"] == 0, r.stderr.decode()
    r = subprocess.run(cmd + ["run", "--", "cat"], input=b"piped\n", capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout == b"piped\n", r.stderr.decode()
    r = subprocess.run(cmd + ["--version"], capture_output=True, timeout=60)
    assert r.returncode == 0 and b"version" in r.stdout


def test_exec_sheds_the_daemons_supplementary_groups(daemon, tmp_path):
    """A daemon started with supplementary groups (sudo gives gid 0) must not hand them to
    commands `exec`'d into a sandbox: inside, the process has no supplementary groups at all."""
    av("down")
    subprocess.run(agentvm_cmd() + ["up"], extra_groups=[0, 4242], check=True, capture_output=True, timeout=60)
    pid = int((daemon / "run" / "daemon.pid").read_text())
    assert "4242" in next(x for x in open(f"/proc/{pid}/status") if x.startswith("Groups:"))
    f = agent(tmp_path, "d-groups", ["/bin/sh", "-c", "exec sleep 300"])
    av("create", "-f", str(f), "--start")
    for argv in (["grep", "^Groups:", "/proc/self/status"], ["cat", "/proc/self/status"]):
        out = av("exec", "d-groups", "--", *argv).stdout.decode()
        line = next(x for x in out.splitlines() if x.startswith("Groups:"))
        assert line.split() == ["Groups:"], f"exec kept supplementary groups: {line!r}"
    out = subprocess.run(agentvm_cmd() + ["run", "--", "grep", "^Groups:", "/proc/self/status"],
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=True).stdout.decode()
    assert out.split() == ["Groups:"], f"run via the daemon kept supplementary groups: {out!r}"
    av("rm", "d-groups")


def test_run_via_daemon_backpressure_and_hangup(daemon):
    """A command flooding stdout at a client that does not read must not grow the (root) daemon:
    the pipe fills and the writer blocks. When the client goes away the run is stopped, as
    Ctrl-C stops an embedded run, and that is on the audit chain."""
    pid = int((daemon / "run" / "daemon.pid").read_text())

    def rss_kib():
        return int(next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:")).split()[1])

    before = rss_kib()
    p = subprocess.Popen(agentvm_cmd() + ["run", "--timeout", "60s", "--", "/bin/sh", "-c", "exec yes flood"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert p.stdout.read(6) == b"flood\n"
        time.sleep(3)  # not reading: `yes` would write GiBs in this time
        grown = rss_kib() - before
        assert grown < 64 * 1024, f"the daemon buffered a client's output: +{grown} KiB"
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 20
    kinds: list = []
    while time.monotonic() < deadline:
        recs = [json.loads(x) for x in av("audit", "show", "--json").stdout.decode().splitlines() if x]
        kinds = [r["kind"] for r in recs]
        if "run.exited" in kinds:
            break
        time.sleep(0.2)
    assert "operator.run-abandoned" in kinds and "run.exited" in kinds, kinds
    ex = [r for r in recs if r["kind"] == "run.exited"][-1]
    assert ex["data"]["teardown_verified"] is True and ex["data"]["exit_code"] != 0


def test_ttl_ends_a_persistent_worker_for_good(daemon, tmp_path):
    """A TTL is an end, not a crash: the persistent worker is stopped and not restarted."""
    from agentvm.daemon.client import Client

    c = Client(daemon / "run" / "agentvm.sock")
    f = agent(tmp_path, "d-ttl", ["/bin/sh", "-c", "exec sleep 300"])
    c.create(f.read_text(), str(f), ttl=1.0)
    c.action("d-ttl", "start")
    deadline = time.monotonic() + 15
    row = c.get("d-ttl")
    while row["state"] not in ("exited", "stopped") and time.monotonic() < deadline:
        time.sleep(0.2)
        row = c.get("d-ttl")
    time.sleep(2.5)  # longer than the first restart backoff
    row = c.get("d-ttl")
    assert row["state"] in ("exited", "stopped") and row["restarts"] == 0, row
    recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "d-ttl").stdout.splitlines()]
    assert any(r["kind"] == "lifecycle.ttl-expired" for r in recs)
    assert not any(r["kind"] == "lifecycle.restart-scheduled" for r in recs)
    c.rm("d-ttl")


def test_idle_timeout_counts_gate_traffic_and_ends_a_quiet_worker(daemon, tmp_path):
    """A worker that keeps making requests through the gate is active: it outlives its idle
    timeout; once it goes quiet it is stopped for good. Its row keeps the time of its last
    request (the daemon holds activity in memory and writes it every ACTIVITY_SAVE seconds, not
    per request: that commit cost more than the gate's whole decision)."""
    from agentvm.daemon.client import Client
    from tests.integration.gate_upstreams import Upstream

    up = Upstream()
    d = Path(f"/tmp/agentvm-dtest-idle-{os.getpid()}")
    d.mkdir(mode=0o755, exist_ok=True)
    try:
        # requests every 0.3 s for 7 s (more than twice the idle timeout), then nothing
        (d / "loop.py").write_text(textwrap.dedent(f"""\
            import time, urllib.request
            end = time.time() + 7
            while time.time() < end:
                urllib.request.urlopen("http://up.test:{up.port}/w", timeout=5).read()
                last = time.time()
                time.sleep(0.3)
            print("QUIET", last, flush=True)
            time.sleep(600)
            """))
        os.chmod(d / "loop.py", 0o644)
        f = agent(tmp_path, "d-idle", ["python3", "/opt/loop/loop.py"], extra=textwrap.dedent(f"""\
              mounts: [{{host: {d}, path: /opt/loop}}]
              egress:
                hosts: {{up.test: 127.0.0.1}}
                allow: [{{host: up.test, ports: [{up.port}]}}]
            """).replace("\n", "\n  ").rstrip(" "))
        f.write_text(f.read_text().replace("mounts:", "  mounts:", 1))
        c = Client(daemon / "run" / "agentvm.sock")
        c.create(f.read_text(), str(f), idle_timeout=3.0)
        t0 = time.time()
        c.action("d-idle", "start")
        time.sleep(6.0)
        row = c.get("d-idle")
        assert row["state"] == "running", (row, av("logs", "d-idle").stdout.decode()[-500:])
        assert len(up.requests_to("up.test")) >= 10
        deadline = time.monotonic() + 20
        while c.get("d-idle")["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = time.time()
        row = c.get("d-idle")
        assert row["state"] in ("exited", "stopped") and row["restarts"] == 0, row
        quiet = float(next(ln.split()[1] for ln in av("logs", "d-idle").stdout.decode().splitlines()
                           if ln.startswith("QUIET")))
        # (the last decision is logged as its answer ends, just before the client has it)
        assert ended - quiet >= 2.9, "stopped before it had been idle for its timeout"
        recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "d-idle").stdout.splitlines()]
        assert any(r["kind"] == "lifecycle.idle-timeout" for r in recs)
        # the row has the last request's time (saved when the run ended), not the start's
        db = sqlite3.connect(f"file:{daemon / 'daemon.db'}?mode=ro", uri=True)
        (last,) = db.execute("SELECT last_activity FROM sandboxes WHERE name='d-idle'").fetchone()
        db.close()
        assert t0 + 6.0 <= last <= quiet + 0.5, (t0, last, quiet)
        c.rm("d-idle")
    finally:
        up.close()
        subprocess.run(["rm", "-rf", str(d)])

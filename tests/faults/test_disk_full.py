"""A full disk under AGENTVM_HOME, for real (a small tmpfs filled to the last byte): every path
that writes agent-vm's state answers with one error, ``state.disk-full`` and exit 75, with no
traceback; ``audit verify`` tells a full disk from a corrupt chain."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root

pytestmark = [pytest.mark.integration, needs_root]


def _av(home: Path, *args: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "AGENTVM_HOME": str(home), "AGENTVM_UID_BASE": os.environ["AGENTVM_UID_BASE"], **env}
    return subprocess.run(agentvm_cmd() + list(args), capture_output=True, text=True, env=e, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def full_home(avm_home):
    """A home on its own 8 MiB tmpfs: one run is made while there is room (so a chain exists),
    then the filesystem is filled to the last byte."""
    h = Path(f"/tmp/agentvm-full-{secrets.token_hex(3)}")
    h.mkdir(mode=0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0711", "tmpfs", str(h)], check=True)
    try:
        first = _av(h, "run", "--", "true", AGENTVM_NO_DAEMON="1")
        assert first.returncode == 0, first.stderr
        with open(h / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        os.sync()
        assert os.statvfs(h).f_bavail == 0
        yield h
    finally:
        _av(h, "down", timeout=60)
        subprocess.run(["umount", "-l", str(h)], capture_output=True)
        subprocess.run(["rm", "-rf", str(h)])


def test_an_embedded_run_on_a_full_disk_is_one_clear_error(full_home):
    r = _av(full_home, "run", "--", "true", AGENTVM_NO_DAEMON="1")
    assert r.returncode == 75, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "[state.disk-full]" in r.stderr and str(full_home) in r.stderr and "free space" in r.stderr, r.stderr
    j = _av(full_home, "run", "--json", "--", "true", AGENTVM_NO_DAEMON="1")
    assert j.returncode == 75
    res = last_json(j.stdout)
    assert res["error"] == "state.disk-full" and res["exit_code"] == 75, res


def test_a_click_command_on_a_full_disk_is_the_same_error(full_home):
    # `up` must write its pid, socket and log under the home: the same error, not a traceback
    r = _av(full_home, "up", timeout=60)
    assert r.returncode in (75, 78), (r.returncode, r.stderr)  # 78 only if it refuses on a lost db first
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 75:
        assert "[state.disk-full]" in r.stderr


def test_audit_verify_tells_a_full_disk_from_a_corrupt_chain(full_home):
    v = _av(full_home, "audit", "verify")
    assert v.returncode == 0, (v.stdout, v.stderr)
    assert "audit chain intact" in v.stdout and "not readable" not in v.stderr
    # now really damage one record (the filler keeps the disk full): BROKEN, not "disk full"
    db = full_home / "audit" / "audit.db"
    data = bytearray(db.read_bytes())
    at = data.find(b'"command"')
    assert at > 0
    data[at + 1:at + 8] = b"COMMAND"
    with open(db, "r+b") as f:  # in place: no new block is needed on the full disk
        f.write(bytes(data))
    v = _av(full_home, "audit", "verify")
    assert v.returncode == 77, (v.stdout, v.stderr)
    assert "BROKEN" in v.stderr and "modified" in v.stderr, v.stderr


def test_the_error_is_in_the_registry_with_exit_75():
    from agentvm.errorcodes import lookup

    c = lookup("state.disk-full")
    assert c is not None and c.exit == 75 and c.status == 507


# -- an embedded run refuses a broken chain as the daemon does ---------------------------------
@pytest.fixture
def home(avm_home):
    h = Path(f"/tmp/agentvm-chain-{secrets.token_hex(3)}")
    h.mkdir(mode=0o711)
    yield h
    _av(h, "down", timeout=60)
    subprocess.run(["rm", "-rf", str(h)])


def _tamper(home: Path, sql: str) -> None:
    import sqlite3

    c = sqlite3.connect(str(home / "audit" / "audit.db"))
    c.execute(sql)
    c.commit()
    c.close()


@pytest.mark.parametrize("how,problem", [
    ("DELETE FROM audit WHERE seq = (SELECT MAX(seq) FROM audit)", "removed from the end"),
    ("UPDATE audit SET data = '{\"forged\": 1}' WHERE seq = (SELECT MAX(seq) FROM audit)", "was modified"),
])
def test_an_embedded_run_refuses_a_chain_broken_since_it_was_verified(home, how, problem):
    for _ in range(2):
        assert _av(home, "run", "--", "true", AGENTVM_NO_DAEMON="1").returncode == 0
    n = len(_av(home, "audit", "show", "--json").stdout.splitlines())
    _tamper(home, how)
    r = _av(home, "run", "--", "echo", "ran", AGENTVM_NO_DAEMON="1")
    assert r.returncode == 78, (r.returncode, r.stdout, r.stderr)
    assert "[audit.broken-chain]" in r.stderr and problem in r.stderr and "--accept-broken-chain" in r.stderr
    assert "ran" not in r.stdout  # refused before the sandbox started
    assert len(_av(home, "audit", "show", "--json").stdout.splitlines()) <= n  # nothing appended
    # the operator accepts the break once (the daemon records it); embedded runs append again
    assert _av(home, "up", "--accept-broken-chain", timeout=60).returncode == 0
    assert _av(home, "down", timeout=60).returncode == 0
    r = _av(home, "run", "--", "echo", "ran", AGENTVM_NO_DAEMON="1")
    assert r.returncode == 0 and "ran" in r.stdout, r.stderr
    kinds = [json.loads(x)["kind"] for x in _av(home, "audit", "show", "--json").stdout.splitlines()]
    assert "daemon.accepted-broken-chain" in kinds and kinds[-1] in ("run.exited", "lifecycle.exited"), kinds[-4:]


def test_a_lost_checkpoint_means_a_full_walk_not_trust(home):
    assert _av(home, "run", "--", "true", AGENTVM_NO_DAEMON="1").returncode == 0
    assert _av(home, "run", "--", "true", AGENTVM_NO_DAEMON="1").returncode == 0
    _tamper(home, "UPDATE audit SET data = '{\"forged\": 1}' WHERE seq = 1")
    (home / "audit" / "audit.verified").unlink()
    r = _av(home, "run", "--", "true", AGENTVM_NO_DAEMON="1")
    assert r.returncode == 78 and "record 1 was modified" in r.stderr, r.stderr


def test_up_on_a_full_disk_leaves_no_daemon_behind(full_home):
    r = _av(full_home, "up", timeout=60)
    assert r.returncode in (75, 78), r.stderr
    import time

    time.sleep(1.0)
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if f"AGENTVM_HOME={full_home}".encode() in env and b"--foreground" in cmd:
            left.append(pid)
    assert not left, f"a daemon outlived its failed start: {left}"

"""A compromised gate worker, contained (issue 43).

The gate's worker processes parse everything sandboxes send. Here a worker is given a way to
run code - the TEST-ONLY eval hook (agentvm.gate.workers._eval_hook_enabled: the environment
variable set below AND tests/attacks/gate_eval.marker in this checkout, which no installed
agent-vm has) - as an exploited parser bug would, and that code, run by a real confined worker
(real mount namespace, uid switch, Landlock, seccomp), shows what it can still do:

* not read /root, the state db, the vault's key or store, another sandbox's decision log;
* not hold, nor obtain, another agent's credentials (isolate="agent": each agent its worker);
* not exec, not make or enter namespaces, not mount, not trace: each forbidden system call
  kills it, the daemon side reports the death as a security alert (gate.worker-killed) and a
  replacement serves the sandbox again.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from agentvm.gate import confine
from agentvm.gate.credentials import CredentialBinding
from agentvm.gate.policy import compile_egress
from agentvm.gate.server import run
from agentvm.gate.workers import EVAL_ENV, EVAL_MAGIC, EVAL_MARKER, WorkerPool

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a confined gate worker switches uid: the daemon must be root"),
    pytest.mark.skipif(confine.landlock_abi() < 1, reason="the kernel has no Landlock"),
]

SECRET_A = "fake-agent-a-secret-" + "a" * 16
SECRET_B = "fake-agent-b-secret-" + "b" * 16


@pytest.fixture
def home(monkeypatch):
    assert (ROOT / EVAL_MARKER).is_file(), "the hook's marker is part of this checkout"
    monkeypatch.setenv(EVAL_ENV, "1")  # (inherited by the workers the pool starts)
    d = Path(tempfile.mkdtemp(prefix="agentvm-test-gatecont-"))
    os.chmod(d, 0o711)
    probe = Path("/root") / f"agentvm-test-gatecont-{secrets.token_hex(4)}"
    probe.write_text("root's file\n")
    (d / "state.db").write_text("the daemon's state\n")
    try:
        yield d, probe
    finally:
        probe.unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _binding(ref: str) -> CredentialBinding:
    return CredentialBinding(name="k", env="K", ref=ref, hosts=("api.test",), header="x-api-key")


async def _eval(sock: Path, code: str, timeout: float = 10) -> str | None:
    """Run ``code`` in the worker serving ``sock``: -> its ``result`` (repr), or None when the
    connection ended without an answer (the worker died)."""
    r, w = await asyncio.open_unix_connection(str(sock))
    data = code.encode()
    w.write(EVAL_MAGIC + str(len(data)).encode() + b"\n" + data)
    try:
        out = await asyncio.wait_for(r.read(), timeout)
    finally:
        w.close()
    return out.decode().strip() if out else None


class _Setup:
    def __init__(self, home: Path):
        from agentvm.sessioncreds import session_credentials
        from agentvm.vault import Vault

        self.home = home
        self.vault = Vault(home / "vault")
        self.vault.set("a-key", SECRET_A)
        self.vault.set("b-key", SECRET_B)
        self.events: list[tuple[str, dict]] = []
        self.creds_a = session_credentials((_binding("vault:a-key"),), home / "vault", "sb-a")[0]
        self.creds_b = session_credentials((_binding("vault:b-key"),), home / "vault", "sb-b")[0]
        self.records: list[dict] = []
        self.pool = WorkerPool(1, home / "gate", home / "logs", on_record=self.records.append,
                               on_event=lambda kind, **d: self.events.append((kind, d)), confine="full",
                               isolate="agent")
        self.policy = compile_egress(None, extra_allow=["api.test:1"], extra_hosts={"api.test": "127.0.0.1"})

    async def start(self):
        await self.pool.start()
        self.a = await self.pool.open("sb-a", "agent-a", self.policy, self.home / "a.sock", uid=None, creds=self.creds_a)
        self.b = await self.pool.open("sb-b", "agent-b", self.policy, self.home / "b.sock", uid=None, creds=self.creds_b)
        return self


def _with_pool(home, body):
    async def main():
        s = await _Setup(home).start()
        try:
            await body(s)
        finally:
            await s.pool.stop()
    run(main())


def test_a_compromised_worker_reads_nothing_of_the_daemon_and_holds_only_its_agents_credentials(home):
    home, probe = home

    async def body(s):
        assert s.a.worker is not s.b.worker, "each agent's sandboxes have a worker of their own"
        assert {s.a.worker.uid, s.b.worker.uid} and s.a.worker.uid != s.b.worker.uid
        assert s.a.worker.uid >= 65536
        code = f"""
import os, gc
from agentvm.gate import confine
out = {{}}
for p in {[str(probe), "/root", str(home / "state.db"), str(s.vault.key_path), str(s.vault.store_path),
           str(home / "logs" / "sb-b.egress.jsonl"), str(home / "gate" / "ca" / "ca.key"), "/etc/shadow",
           "/proc/1/environ", str(home / "b.sock")]!r}:
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            open(p, "rb").read(1)
        out[p] = "READ"
    except OSError as e:
        out[p] = e.errno
for p in ["/", "/tmp"]:
    try:
        os.open(p + "/agentvm-gatecont-made", os.O_CREAT | os.O_WRONLY, 0o600)
        out["create " + p] = "MADE"
    except OSError as e:
        out["create " + p] = e.errno
out["uid"] = os.getresuid()
out["caps"] = confine.capabilities()
out["served"] = sorted(gate.endpoints)
strings = set()
for o in gc.get_objects():  # every string an object refers to (untracked dicts of strings included)
    for r in gc.get_referents(o):
        if isinstance(r, str):
            strings.add(r)
        elif isinstance(r, dict):
            strings.update(v for v in r.values() if isinstance(v, str))
import hashlib  # (the secrets by their digest: the code itself must not hold them)
digests = {{hashlib.sha256(x.encode()).hexdigest() for x in strings}}
out["holds_a"] = {_sha(SECRET_A)!r} in digests
out["holds_b"] = {_sha(SECRET_B)!r} in digests
senders = [o for o in gc.get_objects() if type(o).__name__ == "_Sender"]
import pickle, struct
data = pickle.dumps(("persist", "sb-b", "k", "stolen"))
senders[0].send(struct.pack("!I", len(data)) + data)  # ask the daemon to write agent B's credential
out["signal"] = None
try:
    os.kill({os.getpid()}, 0)
except OSError as e:
    out["signal"] = e.errno
result = out
"""
        out = await _eval(s.home / "a.sock", code)
        assert out is not None and out.startswith("{"), out
        res = eval(out)  # (a dict of plain values, from our own code)
        for p in (str(probe), "/root", str(home / "state.db"), str(s.vault.key_path), str(s.vault.store_path),
                  str(home / "logs" / "sb-b.egress.jsonl"), str(home / "gate" / "ca" / "ca.key"), "/etc/shadow",
                  "/proc/1/environ", str(home / "b.sock")):
            assert res[p] != "READ", (p, res)
        assert res["create /"] != "MADE" and res["create /tmp"] != "MADE", res
        assert res["uid"] == (s.a.worker.uid,) * 3
        assert res["caps"] == (0, 0, 0)
        assert res["served"] == ["sb-a"]
        assert res["holds_a"] is True, "the worker holds its own agent's credential (the check can see one)"
        assert res["holds_b"] is False, "agent B's credential is not in agent A's worker"
        assert res["signal"] is not None, "the daemon cannot be signalled (Landlock scope / uid)"
        await asyncio.sleep(0.3)
        from agentvm.vault import Vault

        assert Vault(home / "vault").get("b-key") == SECRET_B, "the daemon refused to write B's credential for A"
        assert s.a.worker.alive and s.b.worker.alive

    _with_pool(home, body)


def test_a_compromised_worker_gets_no_code_run_in_the_daemon_and_forges_no_record(home):
    """The channel back to the daemon: a crafted pickle (an object whose unpickling would run a
    command) is refused by the daemon's plain-data unpickler - the worker is dropped and
    replaced, nothing runs - and a record forged for another agent's sandbox is dropped."""
    home, _ = home
    marker = home / "daemon-ran-this"
    code = f"""
import gc, os, pickle, struct
class Evil:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
sender = [o for o in gc.get_objects() if type(o).__name__ == "_Sender"][0]
def send(msg):
    data = pickle.dumps(msg)
    sender.send(struct.pack("!I", len(data)) + data)
send(("records", [{{"sandbox": "sb-b", "agent": "agent-b", "verdict": "allow", "host": "forged.test"}}]))
send(("records", [{{"sandbox": "sb-a", "agent": "agent-a", "verdict": "allow", "host": "own.test"}}]))
send(("records", [Evil()]))
result = "sent"
"""

    async def body(s):
        pid = s.a.worker.proc.pid
        await _eval(s.home / "a.sock", code)
        for _ in range(200):
            if any(k == "gate.worker-restarted" for k, _ in s.events):
                break
            await asyncio.sleep(0.05)
        lost = [d for k, d in s.events if k == "gate.worker-lost"]
        assert lost and lost[0]["pid"] == pid and "UnpicklingError" in lost[0]["reason"], s.events
        assert not marker.exists(), "the daemon ran the worker's pickle"
        hosts = [r.get("host") for r in s.records]
        assert "own.test" in hosts, "(a record of its own sandbox is taken: the check can see one)"
        assert "forged.test" not in hosts, "a record forged for another agent's sandbox was taken"
        assert await _eval(s.home / "a.sock", "result = 1") == "1", "the replacement serves agent A again"

    _with_pool(home, body)


FORBIDDEN = {
    "execve": "import os\nos.execv('/bin/sh', ['sh', '-c', 'id'])",
    "unshare-user": "import ctypes\nctypes.CDLL(None).unshare(0x10000000)",
    "clone-newnet": "import ctypes\nctypes.CDLL(None).syscall(56, 0x40000000 | 17, 0, 0, 0, 0)",
    "setns": "import ctypes\nctypes.CDLL(None).setns(0, 0)",
    "mount": "import ctypes\nctypes.CDLL(None).mount(b'none', b'/', b'tmpfs', 0, None)",
    "ptrace": "import ctypes\nctypes.CDLL(None).syscall(101, 16, 1, 0, 0)",
    "bpf": "import ctypes\nctypes.CDLL(None).syscall(321, 0, 0, 0)",
    "keyctl": "import ctypes\nctypes.CDLL(None).syscall(250, 0, 0, 0, 0, 0)",
    "setuid-root": "import os\nos.setuid(0)",
}


@pytest.mark.parametrize("attempt", sorted(FORBIDDEN))
def test_a_forbidden_system_call_kills_the_worker_and_the_daemon_reports_it(home, attempt):
    home, _ = home

    async def body(s):
        w = s.a.worker
        pid = w.proc.pid
        out = await _eval(s.home / "a.sock", FORBIDDEN[attempt] + "\nresult = 'survived'\n")
        assert out is None, f"{attempt}: the worker answered {out!r}"
        for _ in range(200):
            if any(k == "gate.worker-restarted" for k, _ in s.events):
                break
            await asyncio.sleep(0.05)
        killed = [d for k, d in s.events if k == "gate.worker-killed"]
        assert killed, s.events
        assert killed[0]["signal"] == "SIGSYS" and killed[0]["alert"] == "security" and killed[0]["pid"] == pid
        assert killed[0]["tenant"] == "agent:agent-a" and killed[0]["sandboxes"] == ["sb-a"]
        # the replacement serves agent A's sandbox again (and still nothing of B's)
        out = await _eval(s.home / "a.sock", "result = sorted(gate.endpoints)")
        assert out == "['sb-a']", out
        assert s.b.worker.proc.pid != pid and s.b.worker.alive, "agent B's worker was not touched"

    _with_pool(home, body)


def test_a_revocation_drops_the_value_from_the_worker(home):
    home, _ = home
    probe = (f"import gc, hashlib\nH = {_sha(SECRET_A)!r}\nfound = False\ngc.collect()\n"
             "for o in gc.get_objects():\n"
             "    for r in gc.get_referents(o):\n"
             "        vals = [r] if isinstance(r, str) else list(r.values()) if isinstance(r, dict) else []\n"
             "        found = found or any(isinstance(v, str) and hashlib.sha256(v.encode()).hexdigest() == H for v in vals)\n"
             "del o, r, vals\n"
             "result = found")

    async def body(s):
        assert await _eval(s.home / "a.sock", probe) == "True"
        s.a.revoke(["k"])
        await s.a.synced()
        assert await _eval(s.home / "a.sock", probe) == "False", "a revoked value is forgotten by the worker"
        s.a.revoke(["k"], revoked=False)
        await s.a.synced()
        assert await _eval(s.home / "a.sock", probe) == "True"
        # a revocation written to the vault by another process: seen within REVOKE_POLL
        s.vault.revoke("a-key")
        for _ in range(50):
            await asyncio.sleep(0.1)
            if await _eval(s.home / "a.sock", probe) == "False":
                break
        else:
            pytest.fail("a vault revocation was not sent to the worker")

    _with_pool(home, body)


def test_the_hook_is_off_without_the_marker(tmp_path, monkeypatch):
    """Production never has tests/attacks/gate_eval.marker beside its package: the environment
    variable alone does nothing."""
    import agentvm.gate.workers as workers

    monkeypatch.setenv(EVAL_ENV, "1")
    assert workers._eval_hook_enabled()
    fake = tmp_path / "site-packages" / "agentvm" / "gate" / "workers.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    monkeypatch.setattr(workers, "__file__", str(fake))
    assert not workers._eval_hook_enabled()
    monkeypatch.setattr(workers, "__file__", str(ROOT / "src" / "agentvm" / "gate" / "workers.py"))
    monkeypatch.setenv(EVAL_ENV, "0")
    assert not workers._eval_hook_enabled()

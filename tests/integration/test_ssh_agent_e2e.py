"""SSH without keys inside, end to end, through the gate: `git push` over SSH from inside a real
sandbox (the default substrate) to a real sshd listening on 127.0.0.1:22 in a network namespace
this test creates. The agent file binds an ``ssh`` credential (its vault entry: the private
key); the launch serves the gate's agent for it (agentvm.gate.sshagent) on a socket bound
read-only into the sandbox (SSH_AUTH_SOCK), with an ssh_config whose ProxyCommand
(`nc -X connect`) takes the connection through the gate's CONNECT: the gate sees `SSH-2.0-`
on a tunnel to host:22 the egress rules allow and splices it. The sandbox holds no key file;
the agent signs only for the host key the agent file lists, and each decision is on the audit
chain.

Route: sandbox ssh -> nc -> the gate (CONNECT git.test:22) -> 127.0.0.N:22 on the host's
loopback (a forwarder this test runs) -> a unix socket -> the namespace's 127.0.0.1:22."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root
from tests.unit.test_sshagent import SshdNetns, _host_line, keygen

pytestmark = [pytest.mark.integration, needs_root,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="openssh-server (scripts/install.sh --test)"),
              pytest.mark.skipif(not Path("/usr/bin/nc.openbsd").exists(), reason="netcat-openbsd (scripts/install.sh)")]

BRIDGE_SERVER = """
import os, socket, sys, threading
path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX); srv.bind(path); os.chmod(path, 0o600); srv.listen(8)
def pump(a, b):
    try:
        while (d := a.recv(65536)):
            b.sendall(d)
    except OSError:
        pass
    finally:
        try: b.shutdown(socket.SHUT_WR)
        except OSError: pass
while True:
    c, _ = srv.accept()
    u = socket.create_connection(("127.0.0.1", 22))
    threading.Thread(target=pump, args=(c, u), daemon=True).start()
    threading.Thread(target=pump, args=(u, c), daemon=True).start()
"""


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while d := a.recv(65536):
            b.sendall(d)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Forwarder:
    """127.0.0.N:22 on the host's loopback -> the namespace's bridge socket."""

    def __init__(self, unix_path: Path):
        self.unix_path = unix_path
        for _ in range(20):
            self.addr = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
            self.srv = socket.socket()
            try:
                self.srv.bind((self.addr, 22))
                break
            except OSError:
                self.srv.close()
        else:
            raise RuntimeError("no free loopback address for port 22")
        self.srv.listen(8)
        self.conns = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns += 1
            u = socket.socket(socket.AF_UNIX)
            u.connect(str(self.unix_path))
            threading.Thread(target=_pump, args=(c, u), daemon=True).start()
            threading.Thread(target=_pump, args=(u, c), daemon=True).start()

    def stop(self) -> None:
        self.srv.close()


def _secret_set(name: str, value: str) -> None:
    r = subprocess.run(agentvm_cmd() + ["secret", "set", name], input=value.encode(), capture_output=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def world(avm_home):
    d = Path(f"/tmp/agentvm-test-sshe2e-{secrets.token_hex(3)}")
    (d / "keys").mkdir(parents=True)
    os.chmod(d, 0o755)
    user = keygen(d / "keys" / "user")
    host = keygen(d / "keys" / "host")
    other = keygen(d / "keys" / "other")
    shutil.rmtree(d / "keys")  # the private key now exists only in the vault (below) and this process
    _secret_set("deploy-key", user[0])
    servers, fwd = {}, {}
    try:
        for name, hk in (("git", host), ("other", other)):
            srv = SshdNetns(d / name, hk, user[1])
            servers[name] = srv
            (d / name / "bridge.py").write_text(BRIDGE_SERVER)
            sock = d / name / "bridge.sock"
            srv.bridge = subprocess.Popen(["ip", "netns", "exec", srv.ns, "python3", str(d / name / "bridge.py"), str(sock)])
            for _ in range(100):
                if sock.exists():
                    break
                time.sleep(0.05)
            fwd[name] = Forwarder(sock)
        yield {"dir": d, "servers": servers, "fwd": fwd, "host": host, "other": other, "home": avm_home}
    finally:
        for f in fwd.values():
            f.stop()
        for srv in servers.values():
            if getattr(srv, "bridge", None):
                srv.bridge.terminate()
                srv.bridge.wait(10)
            srv.stop()
        shutil.rmtree(d, ignore_errors=True)


def agent_file(world, ssh_env: str = "") -> Path:
    d, fwd = world["dir"], world["fwd"]
    agent = d / "ssh-agent.yaml"
    agent.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: ssh-push}}
        spec:
          riskTier: L3
          limits: {{timeout: 90s, memory: 1G}}
          env:
            GIT_AUTHOR_NAME: agent
            GIT_AUTHOR_EMAIL: agent@test
            GIT_COMMITTER_NAME: agent
            GIT_COMMITTER_EMAIL: agent@test{ssh_env}
          egress:
            hosts: {{git.test: {fwd["git"].addr}, other.test: {fwd["other"].addr}}}
            allow:
              - {{host: git.test, ports: [22]}}
              - {{host: other.test, ports: [22]}}
          credentials:
            - name: deploy
              env: SSH_AUTH_SOCK
              ref: vault:deploy-key
              hosts: [git.test]
              ssh:
                knownHosts: ["{_host_line(world["host"][1], "git.test")}"]
        """))
    return agent


def _push(world, target: str, *, ssh_env: str = ""):
    d = world["dir"]
    agent = agent_file(world, ssh_env)
    remote = f"ssh://root@{target}.test{d}/{target}/repo.git"
    script = textwrap.dedent(f"""\
        set -eo pipefail
        cd "$(mktemp -d)"
        git init -q -b main .
        echo "from inside the sandbox" > README
        git add README && git commit -qm "pushed from the sandbox"
        # no key file anywhere this sandbox can read
        for f in $(grep -rlsI "PRIVATE KEY" / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=usr \
                   --exclude-dir=lib --exclude-dir=lib64 --exclude-dir=bin --exclude-dir=sbin 2>/dev/null || true); do
          echo "KEYFILE $f"
        done
        echo "SOCK $SSH_AUTH_SOCK"
        ssh-add -L | cut -d' ' -f1
        git push "{remote}" main 2>&1 | tail -12
        echo PUSHED
    """)
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(agent), "--json", "--", "bash", "-c", script],
                       capture_output=True, text=True, timeout=180)
    log = subprocess.run(["git", "--git-dir", str(d / target / "repo.git"), "log", "--oneline", "main"],
                         capture_output=True, text=True)
    return r, log.stdout


def _chain(kind: str) -> list[dict]:
    r = subprocess.run(agentvm_cmd() + ["audit", "export", "--what", "audit", "--format", "json"], capture_output=True,
                       text=True, timeout=60)
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip() and json.loads(ln).get("kind") == kind]


def _egress(world) -> list[dict]:
    out = []
    for f in (Path(world["home"]) / "logs").glob("ssh-push-*.egress.jsonl"):
        out += [json.loads(ln) for ln in f.read_text().splitlines()]
    return out


def test_git_push_over_ssh_through_the_gate_with_no_key_inside(world):
    r, pushed = _push(world, "git")
    assert r.returncode == 0 and "PUSHED" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "KEYFILE" not in r.stdout and "ssh-ed25519" in r.stdout
    assert "SOCK /tmp/agentvm-ssh-ssh-push-" in r.stdout and "/agent.sock" in r.stdout
    assert "pushed from the sandbox" in pushed
    assert world["fwd"]["git"].conns >= 1, "the connection came through the gate (the only way to the forwarder)"
    tunnels = [x for x in _egress(world) if x.get("phase") == "ssh" and x["verdict"] == "allow"]
    assert tunnels and tunnels[0]["host"] == "git.test" and tunnels[0]["port"] == 22, _egress(world)
    signs = _chain("ssh.sign")
    assert signs and signs[-1]["data"]["host"] == "git.test" and signs[-1]["data"]["key"] == "deploy"
    logged = [x for x in _egress(world) if x.get("rule") == "ssh-agent:sign"]
    assert logged and logged[-1]["host"] == "git.test" and logged[-1]["key"] == "deploy", "in the decision log"
    # the agent's directory is gone with the session
    assert not list(Path("/tmp").glob("agentvm-ssh-ssh-push-*")), "the agent's directory is gone with the session"


def test_a_host_the_agent_file_does_not_list_gets_no_signature(world):
    # the agent accepts other.test's host key itself (as hostile code would): the gate's agent refuses
    signed_before = len(_chain("ssh.sign"))
    r, pushed = _push(world, "other", ssh_env='\n            GIT_SSH_COMMAND: "ssh -o ProxyCommand=\'/usr/bin/nc.openbsd '
                                            '-X connect -x 127.0.0.1:3128 %h %p\' -o StrictHostKeyChecking=no '
                                            '-o UserKnownHostsFile=/dev/null -o BatchMode=yes"')
    assert "PUSHED" not in r.stdout and "pushed from the sandbox" not in pushed, r.stdout
    assert world["fwd"]["other"].conns >= 1, r.stdout + r.stderr[-2000:]
    refusals = [x for x in _chain("ssh.refuse") if x["data"]["key"] == "deploy"]
    assert refusals and "is not one the agent file lists" in refusals[-1]["data"]["reason"], r.stdout + r.stderr[-2000:]
    assert len(_chain("ssh.sign")) == signed_before, "no signature for a host the agent file does not list"
    assert [x for x in _egress(world) if x.get("rule") == "ssh-agent:refused" and x["verdict"] == "deny"]


def test_ssh_to_a_port_other_than_22_is_refused_by_the_gate(world):
    """An SSH banner on a tunnel to another port is not spliced (the rule allowed host:22 only,
    and an allowed HTTPS port carrying SSH is refused too)."""
    agent = agent_file(world)
    code = textwrap.dedent("""\
        import socket
        s = socket.create_connection(("127.0.0.1", 3128))
        s.sendall(b"CONNECT git.test:22 HTTP/1.1\\r\\nHost: git.test:22\\r\\n\\r\\n")
        print("CONNECT22", s.recv(200).split(b"\\r\\n")[0].decode())
        s.sendall(b"SSH-2.0-OpenSSH_9.2p1 probe\\r\\n")
        print("BANNER22", s.recv(200)[:8])
        t = socket.create_connection(("127.0.0.1", 3128))
        t.sendall(b"CONNECT git.test:2222 HTTP/1.1\\r\\nHost: git.test:2222\\r\\n\\r\\n")
        print("CONNECT2222", t.recv(200).split(b"\\r\\n")[0].decode())
    """)
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(agent), "--", "python3", "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert "CONNECT22 HTTP/1.1 200" in r.stdout and "BANNER22 b'SSH-2.0-'" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "CONNECT2222 HTTP/1.1 403" in r.stdout, r.stdout


def test_credentials_example_ssh(avm_home):
    """examples/credentials/ssh/run.sh as shipped: a real sshd in a namespace it creates, the key
    in the vault only, `git push` over SSH from the sandbox through the gate."""
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "credentials" / "ssh" / "run.sh"
    env = dict(os.environ, AGENTVM=f"{sys.executable} -m agentvm", AGENTVM_PYTHON=sys.executable)
    r = subprocess.run(["bash", str(example)], capture_output=True, env=env, timeout=300)
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()[-3000:]
    assert "keys the agent offers: ssh-ed25519" in out and "inside: pushed" in out
    assert out.splitlines()[-1] == "sshd received: from the sandbox (agent)"
    assert not list(Path("/tmp").glob("agentvm-ssh-ssh-demo-*")), "the agent's directory went with the session"


def test_git_push_over_ssh_from_a_daemon_run_sandbox(world):
    """The same push with the daemon up: `agentvm run` goes through it, and the daemon's launch
    serves the agent (its records reach the chain from the agent's thread through the daemon)."""
    from tests.integration.test_daemon import daemon_up

    with daemon_up(Path(world["home"])):
        signed_before = len(_chain("ssh.sign"))
        r, pushed = _push(world, "git")
        assert r.returncode == 0 and "PUSHED" in r.stdout, r.stdout + r.stderr[-3000:]
        assert "KEYFILE" not in r.stdout and "pushed from the sandbox" in pushed
        signs = _chain("ssh.sign")
        assert len(signs) > signed_before and signs[-1]["data"]["host"] == "git.test"
        assert signs[-1]["actor"] == "agentvm", "recorded by the daemon (an embedded run records as uid:N)"

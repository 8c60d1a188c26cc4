"""SSH without keys inside, end to end: `git push` over SSH from inside a real sandbox (the
default substrate) to a real sshd listening on 127.0.0.1:22 in a network namespace this test
creates. The sandbox holds no key file - only SSH_AUTH_SOCK, a socket served by the gate's
agent (agentvm.gate.sshagent) - and the agent signs only for the host key the agent file lists.

The SSH connection reaches the sshd through a unix socket granted to the sandbox and bridged
into the namespace by this test (ssh's ProxyCommand): the gate does not yet route raw TCP to
host:22 (it reads a CONNECT tunnel's first bytes as TLS or HTTP), which is the part of issue 35
item 2 left to wire - see docs/credentials.md, "SSH keys"."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root
from tests.unit.test_sshagent import SshdNetns, _host_line, keygen

pytestmark = [pytest.mark.integration, needs_root,
              pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="openssh-server (scripts/install.sh --test)")]

BRIDGE_SERVER = """
import os, socket, sys, threading
path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX); srv.bind(path); os.chmod(path, 0o666); srv.listen(8)
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

PROXY = """
import os, socket, sys, threading
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
def up():
    while (d := os.read(0, 65536)):
        s.sendall(d)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while (d := s.recv(65536)):
    os.write(1, d)
"""


@pytest.fixture
def world(tmp_path):
    from agentvm.gate import sshagent as sa

    d = Path(f"/tmp/agentvm-test-sshe2e-{secrets.token_hex(3)}")
    (d / "keys").mkdir(parents=True)
    os.chmod(d, 0o755)
    user = keygen(d / "keys" / "user")
    host = keygen(d / "keys" / "host")
    other = keygen(d / "keys" / "other")
    shutil.rmtree(d / "keys")  # the private key now exists only in this process (as a vault entry would)
    share = d / "share"
    share.mkdir(mode=0o755)
    (share / "proxy.py").write_text(PROXY)
    (share / "known_hosts").write_text(_host_line(host[1], "git.test") + "\n" + _host_line(other[1], "other.test") + "\n")
    servers, stops, logs = {}, [], []
    try:
        for name, hk in (("git", host), ("other", other)):
            srv = SshdNetns(d / name, hk, user[1])
            servers[name] = srv
            (d / name / "bridge.py").write_text(BRIDGE_SERVER)
            srv.bridge = subprocess.Popen(["ip", "netns", "exec", srv.ns, "python3", str(d / name / "bridge.py"),
                                           str(share / f"{name}.test.sock")])
        # the agent file lists git.test's host key for this key, not other.test's
        key = sa.load_key("deploy", user[0], [_host_line(host[1], "git.test")])
        stops.append(sa.serve_in_thread(str(share / "agent.sock"), [key], logs.append, mode=0o666))
        for _ in range(100):
            if all((share / f"{n}.test.sock").exists() for n in servers):
                break
            import time

            time.sleep(0.05)
        yield {"dir": d, "share": share, "servers": servers, "logs": logs}
    finally:
        for stop in stops:
            stop()
        for srv in servers.values():
            if getattr(srv, "bridge", None):
                srv.bridge.terminate()
                srv.bridge.wait(10)
            srv.stop()
        shutil.rmtree(d, ignore_errors=True)


def _push(world, target: str):
    d, share = world["dir"], world["share"]
    agent = d / "ssh-agent.yaml"
    agent.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: ssh-push}}
        spec:
          riskTier: L3
          limits: {{timeout: 90s, memory: 1G}}
          mounts: [{{host: {share}, path: /run/agentvm-ssh}}]
          env:
            SSH_AUTH_SOCK: /run/agentvm-ssh/agent.sock
            GIT_SSH_COMMAND: "ssh -F /dev/null -o UserKnownHostsFile=/run/agentvm-ssh/known_hosts -o StrictHostKeyChecking=yes -o BatchMode=yes -o IdentityFile=none -o ProxyCommand='python3 /run/agentvm-ssh/proxy.py /run/agentvm-ssh/%h.sock'"
            GIT_AUTHOR_NAME: agent
            GIT_AUTHOR_EMAIL: agent@test
            GIT_COMMITTER_NAME: agent
            GIT_COMMITTER_EMAIL: agent@test
        """))
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
        ssh-add -L | cut -d' ' -f1
        git push "{remote}" main 2>&1 | tail -12
        echo PUSHED
    """)
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(agent), "--", "bash", "-c", script], capture_output=True,
                       text=True, timeout=180)
    log = subprocess.run(["git", "--git-dir", str(d / target / "repo.git"), "log", "--oneline", "main"],
                         capture_output=True, text=True)
    return r, log.stdout


def test_git_push_over_ssh_from_the_sandbox_with_no_key_inside(world):
    r, pushed = _push(world, "git")
    assert r.returncode == 0 and "PUSHED" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "KEYFILE" not in r.stdout and "ssh-ed25519" in r.stdout
    assert "pushed from the sandbox" in pushed
    signs = [x for x in world["logs"] if x.verdict == "sign"]
    assert signs and signs[0].host == "git.test" and signs[0].key == "deploy"


def test_a_host_the_agent_file_does_not_list_gets_no_signature(world):
    r, pushed = _push(world, "other")
    assert "PUSHED" not in r.stdout and "pushed from the sandbox" not in pushed, r.stdout
    refusals = [x for x in world["logs"] if x.verdict == "refuse"]
    assert refusals and "is not one the agent file lists" in refusals[0].reason
    assert not [x for x in world["logs"] if x.verdict == "sign"]

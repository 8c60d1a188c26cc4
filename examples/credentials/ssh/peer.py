"""The example's SSH server: a real sshd on 127.0.0.1:22 inside a network namespace of its own
(loopback only), with a bare git repository, reachable from the host's loopback at
127.0.0.N:22 (the address the agent file maps git.test to; the gate dials it). Writes into
WORK: ``key`` (the client's private key, for the vault - run.sh removes it), ``known_host``
(git.test's known_hosts line), ``addr``, ``repo`` and ``ready``; serves until SIGTERM.
Needs root (ip netns), openssh-server and openssh-client."""

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

work = Path(sys.argv[1])
ns = "avm-demo-" + uuid.uuid4().hex[:8]
procs = []


def keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "agentvm-demo", "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


def pump(a, b):
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


def main() -> None:
    srv_dir = work / "sshd"
    srv_dir.mkdir(mode=0o755)
    user_pub = keygen(work / "key")
    host_pub = keygen(srv_dir / "hostkey")
    (srv_dir / "authorized_keys").write_text(user_pub + "\n")
    (srv_dir / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort 22\nHostKey {srv_dir}/hostkey\nAuthorizedKeysFile {srv_dir}/authorized_keys\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\nPidFile none\n")
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(work / "repo.git")], check=True)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
    procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f",
                                   str(srv_dir / "sshd_config")], stderr=open(srv_dir / "log", "wb")))
    # into the namespace: a unix socket bridged to its 127.0.0.1:22 (socket files cross namespaces)
    bridge = srv_dir / "bridge.sock"
    code = ("import os,socket,sys,threading\n"
            "s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);os.chmod(sys.argv[1],0o600);s.listen(8)\n"
            "def p(a,b):\n try:\n  while (d:=a.recv(65536)): b.sendall(d)\n except OSError: pass\n"
            " finally:\n  try: b.shutdown(socket.SHUT_WR)\n  except OSError: pass\n"
            "while True:\n c,_=s.accept();u=socket.create_connection(('127.0.0.1',22))\n"
            " threading.Thread(target=p,args=(c,u),daemon=True).start();threading.Thread(target=p,args=(u,c),daemon=True).start()\n")
    procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code, str(bridge)]))
    for _ in range(100):
        if bridge.exists():
            break
        time.sleep(0.05)
    # the host's side: 127.0.0.N:22 -> the bridge
    for _ in range(20):
        addr = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
        lsn = socket.socket()
        try:
            lsn.bind((addr, 22))
            break
        except OSError:
            lsn.close()
    else:
        raise SystemExit("no free loopback address for port 22")
    lsn.listen(8)

    def forward():
        while True:
            c, _ = lsn.accept()
            u = socket.socket(socket.AF_UNIX)
            u.connect(str(bridge))
            threading.Thread(target=pump, args=(c, u), daemon=True).start()
            threading.Thread(target=pump, args=(u, c), daemon=True).start()

    threading.Thread(target=forward, daemon=True).start()
    kind, b64 = host_pub.split()[:2]
    (work / "known_host").write_text(f"git.test {kind} {b64}\n")
    (work / "addr").write_text(addr + "\n")
    (work / "repo").write_text(f"{work}/repo.git\n")
    (work / "ready").write_text("1\n")
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def cleanup() -> None:
    for p in procs:
        p.terminate()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
try:
    main()
finally:
    cleanup()

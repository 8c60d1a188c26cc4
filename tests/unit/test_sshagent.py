"""The gate's ssh-agent: the protocol core (sans-IO) attacked message by message, and the real
OpenSSH tools against it - `ssh-add -L`, and `ssh`/`git push` to a real sshd in a network
namespace this test creates, with no key file anywhere on the client's side; a host whose key
the agent file does not list gets no signature."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agentvm.gate import sshagent as sa


def keygen(path: Path, kind="ed25519") -> tuple[str, str]:
    """-> (private key text, public key line)."""
    args = ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "test", "-f", str(path)]
    if kind == "rsa":
        args[4:4] = ["-b", "2048"]
    subprocess.run(args, check=True)
    return path.read_text(), path.with_suffix(".pub").read_text().strip()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("sshkeys")
    out = {}
    for name, kind in (("user", "ed25519"), ("user-ecdsa", "ecdsa"), ("user-rsa", "rsa"), ("host", "ed25519"),
                       ("other-host", "ed25519")):
        out[name] = keygen(d / name, kind)
    return out


def _host_line(pub: str, host="git.test") -> str:
    kind, b64 = pub.split()[:2]
    return f"{host} {kind} {b64}"


def _blob(pub: str) -> bytes:
    import base64

    return base64.b64decode(pub.split()[1])


def _host_private(keys, name="host"):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_ssh_private_key(keys[name][0].encode(), None)


def _bind(sess, keys, host="host", sid=b"S" * 32, forwarding=0, sig=None):
    hk = _host_private(keys, host)
    blob = _blob(keys[host][1])
    if sig is None:
        sig = sa._s(b"ssh-ed25519") + sa._s(hk.sign(sid))
    body = sa._s(b"session-bind@openssh.com") + sa._s(blob) + sa._s(sid) + sa._s(sig) + bytes([forwarding])
    return sess.feed(sa._msg(sa.EXTENSION, body))


def _userauth(sid: bytes, blob: bytes, alg=b"ssh-ed25519", hostbound: bytes | None = None) -> bytes:
    method = sa.HOSTBOUND if hostbound is not None else b"publickey"
    return (sa._s(sid) + bytes([sa.USERAUTH_REQUEST]) + sa._s(b"git") + sa._s(b"ssh-connection") + sa._s(method)
            + b"\x01" + sa._s(alg) + sa._s(blob) + (sa._s(hostbound) if hostbound is not None else b""))


def _sign_req(blob: bytes, data: bytes, flags=0) -> bytes:
    return sa._msg(sa.SIGN_REQUEST, sa._s(blob) + sa._s(data) + struct.pack(">I", flags))


def _session(keys, name="user", log=None):
    k = sa.load_key("deploy", keys[name][0], [_host_line(keys["host"][1])])
    return sa.AgentSession([k], log), k


# -- the protocol core -------------------------------------------------------------------------
def test_identities_list_the_public_key_only(keys):
    sess, k = _session(keys)
    out = sess.feed(sa._msg(sa.REQUEST_IDENTITIES))
    assert out[4] == sa.IDENTITIES_ANSWER and k.blob in out
    assert b"PRIVATE" not in out and len(out) < 200


@pytest.mark.parametrize("name,alg,flags", [("user", b"ssh-ed25519", 0), ("user-ecdsa", b"ecdsa-sha2-nistp256", 0),
                                            ("user-rsa", b"rsa-sha2-512", sa.RSA_SHA2_512),
                                            ("user-rsa", b"rsa-sha2-256", sa.RSA_SHA2_256)])
def test_a_bound_listed_host_gets_a_signature_that_verifies(keys, name, alg, flags):
    log = []
    sess, k = _session(keys, name, log.append)
    assert _bind(sess, keys)[4] == sa.SUCCESS
    data = _userauth(b"S" * 32, k.blob, alg)
    out = sess.feed(_sign_req(k.blob, data, flags))
    assert out[4] == sa.SIGN_RESPONSE
    sig = sa._Reader(out[5:]).string()
    assert sa.verify(k.blob, sig, data) and sa._Reader(sig).string() == alg
    assert log and log[-1].verdict == "sign" and log[-1].host == "git.test"


@pytest.mark.parametrize("attack,reason", [
    ("no-bind", "no session-bind"),
    ("unlisted-host", "is not one the agent file lists"),
    ("bad-host-signature", "does not verify"),
    ("forwarded", "forwarded"),
    ("second-bind", "second session-bind"),
    ("other-session", "not for the bound session"),
    ("not-userauth", "not a user authentication request"),
    ("other-key-in-data", "names another key"),
    ("hostbound-other-host", "another host key than the bound one"),
    ("rsa-sha1", "SHA-1"),
])
def test_signatures_are_refused_and_logged(keys, attack, reason):
    log = []
    name = "user-rsa" if attack == "rsa-sha1" else "user"
    sess, k = _session(keys, name, log.append)
    sid = b"S" * 32
    data = _userauth(sid, k.blob)
    if attack == "unlisted-host":
        assert _bind(sess, keys, host="other-host")[4] == sa.SUCCESS  # a real binding, to a host not listed
    elif attack == "bad-host-signature":
        assert _bind(sess, keys, sig=sa._s(b"ssh-ed25519") + sa._s(b"\0" * 64))[4] == sa.FAILURE
    elif attack == "forwarded":
        assert _bind(sess, keys, forwarding=1)[4] == sa.FAILURE
    elif attack == "second-bind":
        _bind(sess, keys)
        assert _bind(sess, keys, sid=b"T" * 32)[4] == sa.FAILURE
    elif attack != "no-bind":
        _bind(sess, keys)
    if attack == "other-session":
        data = _userauth(b"X" * 32, k.blob)
    elif attack == "not-userauth":
        data = sa._s(sid) + b"\x05" + b"git commit to sign"
    elif attack == "hostbound-other-host":
        data = _userauth(sid, k.blob, hostbound=_blob(keys["other-host"][1]))
    elif attack == "other-key-in-data":
        data = _userauth(sid, _blob(keys["user-ecdsa"][1]))
    out = sess.feed(_sign_req(k.blob, data, 0))
    assert out == sa._msg(sa.FAILURE)
    refusals = [d for d in log if d.verdict == "refuse"]
    assert refusals and reason in refusals[-1].reason, log


def test_strict_parsing_and_limits(keys):
    sess, k = _session(keys)
    # trailing bytes after a request: refused
    assert sess.feed(sa._msg(sa.REQUEST_IDENTITIES, b"x")) == sa._msg(sa.FAILURE)
    # a truncated sign request: refused
    assert sess.feed(sa._msg(sa.SIGN_REQUEST, sa._s(k.blob)[:10])) == sa._msg(sa.FAILURE)
    # changing the agent (add identity 17, remove all 19, lock 22): refused
    for kind in (17, 19, 22):
        assert sess.feed(sa._msg(kind, b"")) == sa._msg(sa.FAILURE)
    # an unknown extension: refused
    assert sess.feed(sa._msg(sa.EXTENSION, sa._s(b"query"))) == sa._msg(sa.FAILURE)
    # a message longer than the limit ends the connection
    assert not sess.closed
    sess.feed(struct.pack(">I", sa.MAX_MESSAGE + 1))
    assert sess.closed
    # byte by byte still works
    s2, _ = _session(keys)
    msg = sa._msg(sa.REQUEST_IDENTITIES)
    out = b"".join(s2.feed(msg[i:i + 1]) for i in range(len(msg)))
    assert out[4] == sa.IDENTITIES_ANSWER


def test_signatures_per_connection_are_capped(keys):
    sess, k = _session(keys)
    _bind(sess, keys)
    data = _userauth(b"S" * 32, k.blob)
    outs = [sess.feed(_sign_req(k.blob, data)) for _ in range(sa.MAX_SIGNS + 1)]
    assert all(o[4] == sa.SIGN_RESPONSE for o in outs[:-1]) and outs[-1] == sa._msg(sa.FAILURE)


def test_a_bad_vault_entry_is_named_without_its_value():
    with pytest.raises(ValueError) as e:
        sa.load_key("deploy", "not-a-key-fake-0123456789", [])
    assert "deploy" in str(e.value) and "fake-0123" not in str(e.value)


# -- real OpenSSH ------------------------------------------------------------------------------
def test_ssh_add_lists_the_agents_key(keys, tmp_path):
    k = sa.load_key("deploy", keys["user"][0], [_host_line(keys["host"][1])])
    sock = str(tmp_path / "agent.sock")
    stop = sa.serve_in_thread(sock, [k])
    try:
        r = subprocess.run(["ssh-add", "-L"], env={"SSH_AUTH_SOCK": sock, "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, timeout=10)
        assert r.returncode == 0 and r.stdout.split()[:2] == keys["user"][1].split()[:2]
        r = subprocess.run(["ssh-add", "-D"], env={"SSH_AUTH_SOCK": sock, "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, timeout=10)
        assert r.returncode != 0, "the agent cannot be emptied (read-only)"
    finally:
        stop()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and sshd need root")
needs_sshd = pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="openssh-server (scripts/install.sh --test)")


class SshdNetns:
    """A real sshd listening on 127.0.0.1:22 inside a network namespace of its own, with a bare
    git repository, accepting the given public key for root."""

    def __init__(self, d: Path, host_key: tuple[str, str], authorized: str):
        self.d, self.ns = d, "avm-ssh-" + uuid.uuid4().hex[:8]
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        (d / "hostkey").write_text(host_key[0])
        os.chmod(d / "hostkey", 0o600)
        (d / "authorized_keys").write_text(authorized + "\n")
        os.chmod(d / "authorized_keys", 0o644)
        (d / "sshd_config").write_text(textwrap.dedent(f"""\
            ListenAddress 127.0.0.1
            Port 22
            HostKey {d}/hostkey
            AuthorizedKeysFile {d}/authorized_keys
            PermitRootLogin prohibit-password
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            UsePAM no
            StrictModes no
            PidFile none
            LogLevel VERBOSE
            """))
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(d / "repo.git")], check=True)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        subprocess.run(["ip", "netns", "add", self.ns], check=True)
        subprocess.run(["ip", "-n", self.ns, "link", "set", "lo", "up"], check=True)
        self.log = open(d / "sshd.log", "wb")
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, "/usr/sbin/sshd", "-D", "-e", "-f",
                                      str(d / "sshd_config")], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 10
        while time.time() < deadline:
            r = subprocess.run(["ip", "netns", "exec", self.ns, "ssh-keyscan", "-T", "1", "127.0.0.1"],
                               capture_output=True)
            if r.stdout:
                break
            time.sleep(0.1)

    def run(self, argv, env, timeout=30):
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], env=env, capture_output=True, text=True,
                              timeout=timeout)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        subprocess.run(["ip", "netns", "del", self.ns], check=False)


def _client_env(home: Path, sock: str, known: str) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    (home / "known_hosts").write_text(known + "\n")
    ssh = f"ssh -F /dev/null -o UserKnownHostsFile={home}/known_hosts -o StrictHostKeyChecking=yes -o BatchMode=yes " \
          f"-o IdentityFile=none -o IdentitiesOnly=no"
    return {"PATH": os.environ["PATH"], "HOME": str(home), "SSH_AUTH_SOCK": sock, "GIT_SSH_COMMAND": ssh,
            "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@test", "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@test"}


@needs_root
@needs_sshd
@pytest.mark.parametrize("listed", [True, False])
def test_git_push_over_ssh_signed_by_the_agent_only_for_a_listed_host(keys, tmp_path, listed):
    d = Path(f"/tmp/agentvm-test-ssh-{uuid.uuid4().hex[:6]}")
    host = keys["host"] if listed else keys["other-host"]
    srv = SshdNetns(d / "srv", host, keys["user"][1])
    log = []
    # the agent file lists git.test with "host"'s key; the unlisted case serves another host key
    k = sa.load_key("deploy", keys["user"][0], [_host_line(keys["host"][1], "127.0.0.1")])
    sock = str(d / "agent.sock")
    stop = sa.serve_in_thread(sock, [k], log.append)
    try:
        env = _client_env(d / "home", sock, _host_line(host[1], "127.0.0.1"))
        work = d / "work"
        subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
        (work / "README").write_text("pushed through the gate's agent\n")
        subprocess.run(["git", "-C", str(work), "add", "README"], check=True, env=env)
        subprocess.run(["git", "-C", str(work), "commit", "-qm", "first"], check=True, env=env)
        r = srv.run(["git", "-C", str(work), "push", f"ssh://root@127.0.0.1/{d}/srv/repo.git", "main"], env)
        pushed = subprocess.run(["git", "--git-dir", str(d / "srv" / "repo.git"), "log", "--oneline", "main"],
                                capture_output=True, text=True)
        if listed:
            assert r.returncode == 0, r.stderr + (d / "srv" / "sshd.log").read_text()[-2000:]
            assert "first" in pushed.stdout
            assert [x.verdict for x in log] == ["sign"] and log[0].host == "127.0.0.1"
        else:
            assert r.returncode != 0 and "first" not in pushed.stdout
            assert log and all(x.verdict == "refuse" for x in log)
            assert "is not one the agent file lists" in log[0].reason
        # no key file anywhere on the client's side
        for p in (d / "home").rglob("*"):
            assert b"PRIVATE KEY" not in p.read_bytes()
    finally:
        stop()
        srv.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_session_agent_serves_the_ssh_credentials_of_a_session(keys, tmp_path):
    from agentvm.gate.credentials import compile_credentials
    from agentvm.spec.models import Credential

    line = _host_line(keys["host"][1])
    b = compile_credentials([
        Credential.model_validate({"name": "deploy", "env": "SSH_AUTH_SOCK", "ref": "vault:deploy", "hosts": ["git.test"],
                                   "ssh": {"knownHosts": [line]}}),
        Credential.model_validate({"name": "api", "env": "API", "ref": "vault:api", "hosts": ["api.test"],
                                   "inject": {"header": "X-Key"}})])
    path, stop = sa.session_agent(b, {"deploy": keys["user"][0], "api": "fake-api-0123"}.__getitem__,
                                  str(tmp_path / "agent"))
    try:
        assert oct(os.stat(path).st_mode & 0o777) == "0o666"
        r = subprocess.run(["ssh-add", "-L"], env={"SSH_AUTH_SOCK": path, "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, timeout=10)
        assert r.stdout.split()[:2] == keys["user"][1].split()[:2] and len(r.stdout.splitlines()) == 1
    finally:
        stop()
    assert not os.path.exists(path)
    assert sa.session_agent(b[1:], lambda n: "x", str(tmp_path / "none")) == (None, None)


# -- SSH through the gate's CONNECT (agentvm.gate.exchange: the SshBanner answer) -------------
def _ssh_flow(allow: str, target: str, *, terminate: bool = False, budget=None):
    from types import SimpleNamespace

    from agentvm.gate import exchange as ex
    from agentvm.gate import h1
    from agentvm.gate.endpoint import TokenBucket
    from agentvm.gate.policy import compile_egress
    from agentvm.spec.loader import load_agent_text

    from _spec_helpers import agent

    host, port = allow.split(":")
    extra = ", methods: [GET]" if terminate else ""  # (a rule on methods: the gate must see each request)
    spec = agent(f"""\
        spec:
          egress:
            allow:
              - {{host: {host}, ports: [{port}], id: r{extra}}}
            hosts:
              {host}: 10.0.0.5
        """)
    policy = compile_egress(load_agent_text(spec, "a.yaml", preset_dirs=[]).spec.spec.egress)
    ep = SimpleNamespace(policy=policy, creds=None, paused=False, bucket=TokenBucket(1e9, 1e9), budget=budget)
    raw = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
    flow = ex.connect(ep, h1.parse_head(raw)[0])
    cmd = next(flow)
    assert isinstance(cmd, ex.Accept), cmd
    return flow.send(ex.SshBanner())


def test_an_ssh_banner_on_an_allowed_host_22_is_an_opaque_tunnel():
    from agentvm.gate import exchange as ex

    cmd = _ssh_flow("git.test:22", "git.test:22")
    assert isinstance(cmd, ex.OpenTunnel) and cmd.kind == "ssh" and cmd.tunnel.addr == "10.0.0.5"
    assert cmd.meta is not None and cmd.meta.host == "git.test"  # (re-decided when the policy changes)


def test_an_ssh_banner_is_refused_on_other_ports_under_terminate_rules_and_budgets():
    from types import SimpleNamespace

    from agentvm.gate import exchange as ex

    for cmd, why in ((_ssh_flow("git.test:443", "git.test:443"), "22"),
                     (_ssh_flow("git.test:22", "git.test:22", terminate=True), "terminates"),
                     (_ssh_flow("git.test:22", "git.test:22", budget=SimpleNamespace(covers=lambda h: True)), "budget")):
        assert isinstance(cmd, ex.Deny) and cmd.rule_id == "ssh:refused" and why in cmd.reason, cmd


@needs_root
def test_a_session_agents_socket_is_reachable_by_the_sandbox_user_only(keys, tmp_path):
    """session_agent(owner=(uid, gid)): the socket is 0666 (the sandbox's user connects through a
    read-only bind mount) but its directory is that user's alone, 0500 - another user of the host
    (here a child process that dropped to another uid) cannot reach it; the owner can."""
    from types import SimpleNamespace as NS

    b = NS(name="deploy", ssh_known_hosts=(_host_line(keys["host"][1]),))
    d = Path(f"/tmp/agentvm-test-sshdir-{uuid.uuid4().hex[:6]}")
    owner, other = 2_999_101, 2_999_102
    path, stop = sa.session_agent([b], lambda n: keys["user"][0], str(d), owner=(owner, owner))
    try:
        st = os.stat(d)
        assert (st.st_uid, st.st_mode & 0o777) == (owner, 0o500)

        def connect_as(uid: int) -> str:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: drop to uid, try the socket
                os.close(r)
                import socket

                try:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(path)
                    s.sendall(struct.pack(">IB", 1, 11))  # REQUEST_IDENTITIES
                    out = s.recv(5)
                    os.write(w, b"ok %d" % out[4])
                except OSError as e:
                    os.write(w, type(e).__name__.encode())
                os._exit(0)
            os.close(w)
            os.waitpid(pid, 0)
            got = os.read(r, 100).decode()
            os.close(r)
            return got

        assert connect_as(other) == "PermissionError"
        assert connect_as(owner) == "ok 12"  # IDENTITIES_ANSWER
    finally:
        stop()
        shutil.rmtree(d, ignore_errors=True)

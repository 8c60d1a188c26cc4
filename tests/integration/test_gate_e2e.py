"""The egress gate end to end: real clients run INSIDE a bubblewrap sandbox (through the CLI)
talk to local upstreams through the gate. Every test checks the client's view, the decision
log, and - for denials - that the upstream never saw the request.

All upstreams listen on 127.0.0.1 of the host; the test names (allowed.test, api.test, ...) are
mapped there by the agent's static ``egress.hosts`` (the only reason loopback is reachable).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root
from tests.integration.gate_upstreams import Listener, Upstream, make_git_repo, make_test_ca

pytestmark = [pytest.mark.integration, needs_root]

PY = "/usr/bin/python3"  # Debian's python: requests, httpx, aiohttp installed
LOG_KEYS = {"time", "sandbox", "agent", "phase", "host", "port", "method", "path", "rule", "verdict", "reason",
            "bytes_out", "bytes_in"}
PROXY_VARS = ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY", "no_proxy"]


# ---------------------------------------------------------------------------- fixtures


@dataclass
class GateEnv:
    base: Path
    ca: Path
    http: Upstream
    https: Upstream
    tcp: Listener  # a host TCP port no rule allows
    spec: Path
    specs: dict = field(default_factory=dict)

    @property
    def hp(self) -> int:
        return self.http.port

    @property
    def sp(self) -> int:
        return self.https.port

    def write_spec(self, name: str, limits: dict | None = None) -> Path:
        """The test agent (see the module docstring), optionally with egress limits."""
        hp, sp = self.hp, self.sp
        hosts = ", ".join(f"{n}: 127.0.0.1" for n in
                          ["allowed.test", "api.test", "other.test", "pkgs.test", "git.test", "denied.test", "dns.google"])
        lim = ""
        if limits:
            lim = "    limits: {" + ", ".join(f"{k}: {v}" for k, v in limits.items()) + "}\n"
        text = (
            "apiVersion: agentvm/v1\n"
            "kind: Agent\n"
            f"metadata: {{name: {name}}}\n"
            "spec:\n"
            "  riskTier: L2\n"
            "  limits: {timeout: 60s, disk: 16M}\n"
            f"  mounts: [{{host: {self.ca.parent}, path: /ca}}]\n"
            "  egress:\n"
            f"    hosts: {{{hosts}}}\n"
            f"    upstreamCa: {self.ca}\n"
            f"{lim}"
            "    allow:\n"
            f"      - {{id: allowed, host: allowed.test, ports: [{hp}, {sp}]}}\n"
            f"      - {{id: api-v1, host: api.test, ports: [{sp}], methods: [GET], paths: ['/v1/*']}}\n"
            f"      - {{id: pkgs, host: pkgs.test, ports: [{sp}], paths: ['/**']}}\n"
            f"      - {{id: git, host: git.test, ports: [{sp}], paths: ['/**']}}\n"
            # a broad allow of a DoH endpoint: the built-in doh-deny rules must still win
            "      - {id: dns-google, host: dns.google, ports: [443, 80]}\n"
            # not in egress.hosts: the gate resolves it itself (to loopback) and must refuse
            f"      - {{id: loopname, host: localhost, ports: [{hp}, {sp}]}}\n"
        )
        p = self.base / f"{name}.yaml"
        p.write_text(text)
        return p


@pytest.fixture(scope="module")
def gate(avm_home):
    base = Path(f"/tmp/agentvm-gate-test-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    ca_dir = base / "ca"
    ca, cert, key = make_test_ca(ca_dir)
    os.chmod(ca_dir, 0o755)
    os.chmod(key, 0o600)  # the sandbox only needs the CA certificate
    git_dir = base / "git"
    git_dir.mkdir(mode=0o755)
    bare = make_git_repo(git_dir)
    http = Upstream(git_root=bare)
    https = Upstream(tls=(cert, key), git_root=bare)
    tcp = Listener()
    env = GateEnv(base=base, ca=ca, http=http, https=https, tcp=tcp, spec=Path())
    env.spec = env.write_spec("gate-e2e")
    yield env
    http.close()
    https.close()
    tcp.close()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_upstreams(request):
    if "gate" in request.fixturenames:
        g = request.getfixturevalue("gate")
        g.http.clear()
        g.https.clear()
    yield


@dataclass
class Run:
    rc: int
    out: str
    err: str
    res: dict
    records: list
    log_bytes: bytes

    def lines(self, prefix: str) -> list[str]:
        return [ln for ln in self.out.splitlines() if ln.startswith(prefix)]

    def rec(self, **kw) -> list[dict]:
        return [r for r in self.records if all(r.get(k) == v for k, v in kw.items())]

    def explain(self) -> str:
        return (f"rc={self.rc}\n--- stdout\n{self.out[-4000:]}\n--- stderr\n{self.err[-4000:]}\n--- log\n"
                + "\n".join(json.dumps(r) for r in self.records)[-6000:])


def run_in(spec: Path, argv: list[str], timeout: float = 90) -> Run:
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(spec), "--json", "--", *argv],
                       capture_output=True, timeout=timeout, env=dict(os.environ))
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    try:
        res = last_json(out)
    except AssertionError:
        raise AssertionError(f"no --json result; rc={r.returncode}\n{out[-3000:]}\n{err[-3000:]}") from None
    raw = b""
    records = []
    eg = res.get("egress") or {}
    if eg.get("log") and Path(eg["log"]).exists():
        raw = Path(eg["log"]).read_bytes()
        records = [json.loads(ln) for ln in raw.decode().splitlines() if ln.strip()]
        # the log is shared by nothing else: only this sandbox's lines
        records = [x for x in records if x.get("sandbox") == res["sandbox_id"]]
    return Run(r.returncode, out, err, res, records, raw)


def sh(spec: Path, script: str, **kw) -> Run:
    return run_in(spec, ["/bin/sh", "-c", script], **kw)


def py(spec: Path, code: str, **kw) -> Run:
    return run_in(spec, [PY, "-c", textwrap.dedent(code)], **kw)


def curl_status(run: Run, tag: str) -> str:
    """Scripts print 'TAG <http_code> <x-agentvm-denied or ->' lines."""
    got = run.lines(tag + " ")
    assert got, f"no {tag!r} line\n{run.explain()}"
    return got[-1].split(" ", 1)[1]


# curl: print 'TAG code denied-header' (write-out %header{} needs curl >= 7.84; Debian 12 has 7.88)
def curl(tag: str, *args: str, pre: str = "") -> str:
    a = " ".join(args)
    return (f"printf '{tag} %s\\n' \"$({pre} curl -sS -o /dev/null --max-time 20 "
            f"-w '%{{http_code}} %header{{x-agentvm-denied}}' {a} 2>/dev/null)\"")


# ---------------------------------------------------------------------------- allowed traffic


def test_plain_http_clients(gate):
    hp = gate.hp
    code = f"""
    import asyncio, json, urllib.request
    U = "http://allowed.test:{hp}/c/"
    def show(name, fn):
        try:
            status, body = fn()
            print("CLIENT", name, status, json.loads(body)["path"])
        except Exception as e:
            print("CLIENT", name, "ERR", type(e).__name__, str(e)[:200].replace("\\n", " "))
    def u():
        with urllib.request.urlopen(U + "urllib", timeout=20) as r:
            return r.status, r.read()
    def rq():
        import requests
        r = requests.get(U + "requests", timeout=20); return r.status_code, r.content
    def hx():
        import httpx
        r = httpx.get(U + "httpx", timeout=20); return r.status_code, r.content
    def ah():
        import aiohttp
        async def go():
            async with aiohttp.ClientSession(trust_env=True) as s:
                async with s.get(U + "aiohttp") as r:
                    return r.status, await r.read()
        return asyncio.run(go())
    for n, f in [("urllib", u), ("requests", rq), ("httpx", hx), ("aiohttp", ah)]:
        show(n, f)
    """
    script = (f"set -e; printf 'CLIENT curl %s\\n' \"$(curl -sS --max-time 20 -w ' %{{http_code}}' http://allowed.test:{hp}/c/curl)\";"
              f" {PY} -c '{textwrap.dedent(code)}'")
    assert "'" not in textwrap.dedent(code)
    run = sh(gate.spec, script)
    assert run.rc == 0, run.explain()
    lines = {ln.split()[1]: ln for ln in run.lines("CLIENT ")}
    assert lines.get("curl", "").endswith(" 200"), run.explain()
    assert '"path": "/c/curl"' in lines["curl"]
    for name in ("urllib", "requests", "httpx", "aiohttp"):
        assert lines.get(name) == f"CLIENT {name} 200 /c/{name}", run.explain()
    assert sorted(gate.http.paths_seen()) == sorted(f"/c/{n}" for n in ("curl", "urllib", "requests", "httpx", "aiohttp"))
    for n in ("curl", "urllib", "requests", "httpx", "aiohttp"):
        recs = run.rec(path=f"/c/{n}")
        assert len(recs) == 1 and recs[0]["verdict"] == "allow" and recs[0]["rule"] == "allowed", run.explain()
        assert recs[0]["phase"] == "request" and recs[0]["method"] == "GET" and recs[0]["host"] == "allowed.test"
        assert recs[0]["port"] == hp and recs[0]["bytes_in"] > 0
    assert run.res["egress"]["allowed"] == 5 and run.res["egress"]["denied"] == []


def test_node_fetch_https_terminated(gate):
    """Node's fetch (undici) honours the proxy variables and NODE_EXTRA_CA_CERTS (gate CA)."""
    js = (f"fetch('https://api.test:{gate.sp}/v1/node').then(r => r.text().then(t => console.log('NODE', r.status, t)))"
          ".catch(e => console.log('NODE ERR', String(e.cause || e)))")
    run = run_in(gate.spec, ["/usr/bin/node", "-e", js])
    assert run.lines("NODE 200 "), run.explain()
    assert [p for p in gate.https.paths_seen()] == ["/v1/node"]
    assert run.rec(path="/v1/node", verdict="allow", rule="api-v1")


def test_node_fetch_plain_http(gate):
    """Node's fetch with the env proxy agent tunnels http:// URLs through CONNECT too; an
    allowed plain-HTTP host must still work (the gate may inspect the tunnel as HTTP)."""
    js = (f"fetch('http://allowed.test:{gate.hp}/node-plain').then(r => r.text().then(t => console.log('NODE', r.status, t)))"
          ".catch(e => console.log('NODE ERR', String(e.cause || e)))")
    run = run_in(gate.spec, ["/usr/bin/node", "-e", js])
    assert run.lines("NODE 200 "), "Node fetch of an allowed http:// URL failed\n" + run.explain()
    assert gate.http.paths_seen() == ["/node-plain"]


def test_node_fetch_under_the_node_preset(gate):
    """The node preset sets NODE_OPTIONS (a heap size); agent-vm's proxy preload must survive
    it, or Node's fetch has no route out (ENOTFOUND) even for allowed hosts."""
    spec = gate.base / "gate-e2e-node-preset.yaml"
    spec.write_text(gate.spec.read_text().replace("spec:\n", "spec:\n  presets: [node]\n", 1)
                    .replace("name: gate-e2e}", "name: gate-e2e-node}"))
    js = ("console.log('OPTS', process.env.NODE_OPTIONS);"
          f"fetch('https://api.test:{gate.sp}/v1/node-preset').then(r => console.log('NODE', r.status))"
          ".catch(e => console.log('NODE ERR', String(e.cause || e)))")
    run = run_in(spec, ["/usr/bin/node", "-e", js])
    assert run.lines("NODE 200"), "Node fetch under the node preset failed\n" + run.explain()
    opts = run.lines("OPTS ")[0]
    assert "--max-old-space-size=768" in opts and "proxy.js" in opts, opts


def test_request_bodies_forwarded(gate):
    """Bodies of allowed requests arrive intact: Content-Length and chunked (unknown length,
    e.g. streamed uploads, git push), plain and through a terminated tunnel."""
    hp, sp = gate.hp, gate.sp
    script = "; ".join([
        "head -c 100000 /dev/urandom > /tmp/body",
        curl("CL", "-T /tmp/body", f"http://allowed.test:{hp}/body-cl"),
        curl("CHUNKED", "-T - < /tmp/body", f"http://allowed.test:{hp}/body-chunked"),
        curl("TCL", "-T /tmp/body", f"https://pkgs.test:{sp}/body-tcl"),
        curl("TCHUNKED", "-T - < /tmp/body", f"https://pkgs.test:{sp}/body-tchunked"),
    ])
    run = sh(gate.spec, script)
    time.sleep(0.3)
    got = {s[2]: s[3] for s in gate.http.seen + gate.https.seen}
    for tag in ("CL", "CHUNKED", "TCL", "TCHUNKED"):
        assert curl_status(run, tag) == "200 ", f"{tag}; upstream saw (path: body bytes) {got}\n{run.explain()}"
    assert got == {"/body-cl": 100000, "/body-chunked": 100000, "/body-tcl": 100000, "/body-tchunked": 100000}, got
    assert not run.rec(verdict="deny"), run.explain()


def test_https_splice_to_allowed_host(gate):
    sp = gate.sp
    code = ("import requests; r = requests.get('https://allowed.test:%d/s/requests', verify='/ca/test-ca.pem', timeout=20);"
            " print('REQ', r.status_code, r.json()['path'])" % sp)
    script = "; ".join([
        curl("CURL", "--cacert /ca/test-ca.pem", f"https://allowed.test:{sp}/s/curl"),
        # spliced: the client sees the upstream's own certificate, which only the test CA signs
        curl("NOTRUST", f"https://allowed.test:{sp}/s/untrusted"),
        f'{PY} -c "{code}"',
    ])
    run = sh(gate.spec, script)
    assert curl_status(run, "CURL") == "200 ", run.explain()
    assert curl_status(run, "NOTRUST").startswith("000"), "the splice path must not re-sign with the gate CA\n" + run.explain()
    assert run.lines("REQ 200 /s/requests"), run.explain()
    assert sorted(gate.https.paths_seen()) == ["/s/curl", "/s/requests"]
    tunnels = run.rec(phase="tunnel", verdict="allow", host="allowed.test", port=sp)
    assert len(tunnels) >= 2, run.explain()
    for t in tunnels:
        assert t["method"] == "CONNECT" and t["rule"] == "allowed" and t.get("sni") == "allowed.test"
    # a spliced tunnel cannot see paths: none are logged
    assert all(t["path"] in (None, "") for t in tunnels)


def test_l7_terminated_api_host(gate):
    sp = gate.sp
    base = f"https://api.test:{sp}"
    code = ("import requests; r = requests.get('%s/v1/py', timeout=20); print('REQ', r.status_code, r.json()['path'])" % base)
    script = "; ".join([
        curl("GET1", f"{base}/v1/items"),
        curl("POST1", "-X POST -d x=1", f"{base}/v1/items"),
        f"curl -sS --max-time 20 -X POST {base}/v1/items > /tmp/body; echo; printf 'BODY %s\\n' \"$(cat /tmp/body)\"",
        curl("V2", f"{base}/v2/x"),
        curl("DOTDOT", "--path-as-is", f"{base}/v1/../admin"),
        curl("ENCDOT", "--path-as-is", f"{base}/v1/%2e%2e/admin"),
        # ALPN h2 offered: the gate must speak HTTP/1.1 (or refuse), never pass h2 unchecked
        curl("H2", "--http2", f"{base}/v1/h2"),
        curl("H2POST", "--http2 -X POST -d x=1", f"{base}/v1/h2"),
        f'{PY} -c "{code}"',
    ])
    run = sh(gate.spec, script)
    assert curl_status(run, "GET1") == "200 ", run.explain()
    assert run.lines("REQ 200 /v1/py"), "requests must trust the gate CA through REQUESTS_CA_BUNDLE\n" + run.explain()
    assert curl_status(run, "POST1") == "403 default-deny", run.explain()
    body = json.loads(run.lines("BODY ")[0][5:])
    assert body["rule"] == "default-deny" and body["error"] == "egress-denied" and body["host"] == "api.test"
    assert curl_status(run, "V2") == "403 default-deny", run.explain()
    assert curl_status(run, "DOTDOT") == "403 path-normalization", run.explain()
    assert curl_status(run, "ENCDOT") == "403 path-normalization", run.explain()
    assert curl_status(run, "H2") == "200 ", run.explain()
    assert curl_status(run, "H2POST") == "403 default-deny", run.explain()
    # the upstream saw exactly the two allowed GETs
    assert sorted(s[:3] for s in gate.https.requests_to("api.test")) == [
        ("GET", f"api.test:{sp}", "/v1/h2"), ("GET", f"api.test:{sp}", "/v1/items"), ("GET", f"api.test:{sp}", "/v1/py")]
    assert run.rec(path="/v1/items", method="GET", verdict="allow", rule="api-v1", phase="request")
    assert len(run.rec(path="/v1/items", method="POST", verdict="deny", rule="default-deny")) == 2
    assert run.rec(path="/v2/x", verdict="deny", rule="default-deny")
    assert len(run.rec(rule="path-normalization", verdict="deny")) == 2
    counts = {(d["rule"], d["target"]): d["count"] for d in run.res["egress"]["denied"]}
    assert counts[("default-deny", f"api.test:{sp}")] == 4 and counts[("path-normalization", f"api.test:{sp}")] == 2


def test_pip_download_through_gate(gate):
    sp = gate.sp
    script = (f"HOME=/tmp {PY} -m pip download --no-deps --no-cache-dir --disable-pip-version-check "
              f"--index-url https://pkgs.test:{sp}/simple agentvm-demo -d /tmp/dl && ls /tmp/dl")
    run = sh(gate.spec, script, timeout=120)
    assert run.rc == 0, run.explain()
    assert "agentvm_demo-0.1-py3-none-any.whl" in run.out
    paths = gate.https.paths_seen()
    assert "/simple/agentvm-demo/" in paths and "/files/agentvm_demo-0.1-py3-none-any.whl" in paths
    assert run.rec(path="/files/agentvm_demo-0.1-py3-none-any.whl", verdict="allow", rule="pkgs", phase="request")


def test_git_clone_through_gate(gate):
    sp = gate.sp
    script = (f"export HOME=/tmp; cd /tmp && git clone -q https://git.test:{sp}/repo.git clone && "
              "cat clone/README.md && git -C clone log --oneline | wc -l")
    run = sh(gate.spec, script, timeout=120)
    assert run.rc == 0, run.explain()
    assert "hello from the gate test repo" in run.out
    assert any(p.startswith("/repo.git/info/refs") for p in gate.https.paths_seen())
    assert run.rec(host="git.test", verdict="allow", rule="git", phase="request")
    assert not [r for r in run.records if r["verdict"] == "deny"], run.explain()


def test_npm_view_through_gate(gate):
    sp = gate.sp
    script = (f"export HOME=/tmp; npm view agentvm-demo version --registry https://pkgs.test:{sp}/npm/ "
              "--cache /tmp/npm-cache --no-update-notifier --fetch-retries 0")
    run = sh(gate.spec, script, timeout=120)
    assert run.rc == 0 and "0.1.0" in run.out, run.explain()
    assert "/npm/agentvm-demo" in gate.https.paths_seen()


# ---------------------------------------------------------------------------- denials


def test_deny_other_host_and_port(gate):
    hp, sp, lp = gate.hp, gate.sp, gate.tcp.port
    hits = gate.tcp.hits
    script = "; ".join([
        curl("OTHER", f"http://other.test:{hp}/x"),
        curl("OTHERS", f"https://other.test:{sp}/x"),
        curl("PORT", f"http://allowed.test:{lp}/x"),
        curl("PORTS", f"https://allowed.test:{lp}/x"),
        curl("APIHTTP", f"http://api.test:{hp}/v1/x"),
    ])
    run = sh(gate.spec, script)
    assert curl_status(run, "OTHER") == "403 default-deny", run.explain()
    assert curl_status(run, "PORT") == "403 default-deny", run.explain()
    assert curl_status(run, "APIHTTP") == "403 default-deny", run.explain()
    # CONNECT denied: curl reports 000 (the 403 is the proxy's answer to CONNECT)
    assert curl_status(run, "OTHERS").startswith("000"), run.explain()
    assert curl_status(run, "PORTS").startswith("000"), run.explain()
    assert run.rec(host="other.test", port=hp, rule="default-deny", verdict="deny", phase="request")
    assert run.rec(host="other.test", port=sp, rule="default-deny", verdict="deny", phase="connect", method="CONNECT")
    assert run.rec(host="allowed.test", port=lp, rule="default-deny", phase="request")
    assert run.rec(host="allowed.test", port=lp, rule="default-deny", phase="connect")
    assert gate.http.seen == [] and gate.https.seen == []
    assert gate.tcp.hits == hits


def test_deny_ip_literals(gate):
    hp, sp = gate.hp, gate.sp
    noenv = "env -u NO_PROXY -u no_proxy"
    script = "; ".join([
        curl("IP4", "-x http://127.0.0.1:3128", f"http://127.0.0.1:{hp}/ip4", pre=noenv),
        curl("IP6", "-g -x http://127.0.0.1:3128", f"'http://[::1]:{hp}/ip6'", pre=noenv),
        curl("IPNUM", "-x http://127.0.0.1:3128", f"http://2130706433:{hp}/ipnum", pre=noenv),
        f"{noenv} curl -sv --max-time 20 -x http://127.0.0.1:3128 https://127.0.0.1:{sp}/ipconnect > /tmp/v 2>&1;"
        " echo \"CONNECTRC $?\"; sed 's/^/V /' /tmp/v",
    ])
    run = sh(gate.spec, script)
    assert curl_status(run, "IP4") == "403 ip-literal", run.explain()
    assert curl_status(run, "IP6") == "403 ip-literal", run.explain()
    assert curl_status(run, "IPNUM") in ("403 invalid-host", "403 ip-literal"), run.explain()
    verbose = "\n".join(run.lines("V "))
    assert "CONNECT 127.0.0.1:" in verbose and "HTTP/1.1 403" in verbose, run.explain()
    assert "X-Agentvm-Denied: ip-literal" in verbose
    # nothing of TLS happened: the 403 came before any ClientHello
    assert "Client hello" not in verbose and "TLS handshake" not in verbose, verbose
    assert run.lines("CONNECTRC ")[0] != "CONNECTRC 0"
    assert run.rec(host="127.0.0.1", port=hp, rule="ip-literal", phase="request")
    assert run.rec(host="[::1]", port=hp, rule="ip-literal") or run.rec(host="::1", port=hp, rule="ip-literal"), run.explain()
    assert run.rec(host="127.0.0.1", port=sp, rule="ip-literal", phase="connect", method="CONNECT")
    assert gate.http.seen == [] and gate.https.seen == []


def test_deny_doh_even_when_allowed(gate):
    script = "; ".join([
        curl("DOH", "'https://dns.google/dns-query?dns=AAABAAABAAAAAAAAA3d3dwdleGFtcGxlA2NvbQAAAQAB'"),
        curl("DOHJSON", "'http://dns.google/resolve?name=example.com'"),
    ])
    run = sh(gate.spec, script)
    assert curl_status(run, "DOH").startswith("000"), run.explain()
    assert curl_status(run, "DOHJSON") == "403 doh:dns.google", run.explain()
    assert run.rec(host="dns.google", port=443, rule="doh:dns.google", phase="connect", verdict="deny"), run.explain()
    assert run.rec(host="dns.google", port=80, rule="doh:dns.google", verdict="deny"), run.explain()
    assert not run.rec(verdict="allow")


TLS_PROBES = r"""
import socket, ssl, sys
SP = int(sys.argv[1])

def connect(host):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host, SP, host, SP)).encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = s.recv(4096)
        if not d:
            break
        buf += d
    return s, buf.split(b"\r\n", 1)[0].decode()

def read_all(t):
    out = b""
    try:
        while True:
            d = t.recv(65536)
            if not d:
                break
            out += d
    except (OSError, ssl.SSLError) as e:
        out += b"<" + type(e).__name__.encode() + b">"
    return out
"""


def test_sni_mismatch_and_no_sni(gate):
    code = TLS_PROBES + r"""
ctx = ssl.create_default_context(cafile="/ca/test-ca.pem")
ctx.check_hostname = False
for label, sni in (("MISMATCH", "other.test"), ("NOSNI", None)):
    s, status = connect("allowed.test")
    print(label, "CONNECT", status)
    try:
        t = ctx.wrap_socket(s, server_hostname=sni)
        t.sendall(b"GET /sni-probe HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
        print(label, "RESULT", "handshake-ok", read_all(t)[:60])
    except (OSError, ssl.SSLError) as e:
        print(label, "RESULT", "failed", type(e).__name__)
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.sp)])
    for label in ("MISMATCH", "NOSNI"):
        assert run.lines(f"{label} CONNECT HTTP/1.1 200"), run.explain()
        res = run.lines(f"{label} RESULT ")
        assert res and res[0].startswith(f"{label} RESULT failed"), run.explain()
    assert run.rec(rule="sni-mismatch", phase="clienthello", host="allowed.test", verdict="deny"), run.explain()
    assert run.rec(rule="no-sni", phase="clienthello", host="allowed.test", verdict="deny"), run.explain()
    assert gate.https.seen == []


def test_host_mismatch_after_termination(gate):
    code = TLS_PROBES + r"""
ctx = ssl.create_default_context()  # SSL_CERT_FILE holds the gate CA
for label, host in (("PORTED", "other.test:%d" % SP), ("BARE", "other.test"), ("OK", "api.test:%d" % SP)):
    s, status = connect("api.test")
    try:
        t = ctx.wrap_socket(s, server_hostname="api.test")
        t.sendall(("GET /v1/x-%s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (label, host)).encode())
        resp = read_all(t)
        head = resp.split(b"\r\n\r\n", 1)[0].decode(errors="replace")
        status = head.split("\r\n", 1)[0]
        denied = [l for l in head.split("\r\n") if l.lower().startswith("x-agentvm-denied:")]
        print(label, status, denied[0].split(":", 1)[1].strip() if denied else "-")
    except (OSError, ssl.SSLError) as e:
        print(label, "ERR", type(e).__name__, e)
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.sp)])
    assert run.lines("PORTED HTTP/1.1 403 Forbidden host-mismatch"), run.explain()
    assert run.lines("BARE HTTP/1.1 403 Forbidden host-mismatch"), run.explain()
    assert run.lines("OK HTTP/1.1 200 OK -"), run.explain()
    assert len(run.rec(rule="host-mismatch", verdict="deny")) == 2
    assert gate.https.requests_to("other.test") == []
    assert [s[2] for s in gate.https.requests_to("api.test")] == ["/v1/x-OK"]


def test_redirect_to_denied_host(gate):
    hp = gate.hp
    script = curl("REDIR", "-L", f"'http://allowed.test:{hp}/redirect?to=http://denied.test:{hp}/secret'")
    run = sh(gate.spec, script)
    assert curl_status(run, "REDIR") == "403 default-deny", run.explain()
    assert run.rec(host="allowed.test", verdict="allow", rule="allowed")
    assert run.rec(host="denied.test", port=hp, verdict="deny", rule="default-deny", path="/secret")
    assert gate.http.requests_to("denied.test") == []
    assert [s[2] for s in gate.http.requests_to("allowed.test")] == [f"/redirect?to=http://denied.test:{hp}/secret"]


def test_no_network_without_the_gate(gate):
    """With the proxy variables ignored nothing leaves: no DNS, no direct TCP/UDP/ICMP/IPv6,
    no host abstract unix sockets; the host listeners never see a packet."""
    hp, sp = gate.hp, gate.sp
    udp = Listener(kind=socket.SOCK_DGRAM)
    tcp6 = Listener(family=socket.AF_INET6, addr="::1")
    abstract_name = f"agentvm-gate-test-{secrets.token_hex(4)}"
    ab = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ab.bind("\0" + abstract_name)
    ab.listen(1)
    ab.settimeout(0.1)
    tcp_hits = gate.tcp.hits
    code = r"""
import socket, sys, urllib.request
HP, SP, LP, UP, P6, AB = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
def attempt(name, fn):
    try:
        r = fn()
        print("NET", name, "OK", repr(r)[:80])
    except Exception as e:
        print("NET", name, "FAIL", type(e).__name__)
def tcp(addr, port, fam=socket.AF_INET):
    s = socket.socket(fam, socket.SOCK_STREAM); s.settimeout(3); s.connect((addr, port)); return "connected"
def urllib_noproxy():
    op = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return op.open("http://allowed.test:%d/bypass-urllib" % HP, timeout=5).status
def udp_send(addr, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    s.sendto(b"hello", (addr, port)); return s.recvfrom(512)
DNSQ = bytes.fromhex("abcd01000001000000000000") + b"\x07allowed\x04test\x00\x00\x01\x00\x01"
def dns(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    s.sendto(DNSQ, (addr, 53)); return s.recvfrom(512)
def icmp(addr):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except OSError:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2)
    s.sendto(b"\x08\x00\xf7\xff\x00\x00\x00\x00", (addr, 0)); return s.recvfrom(512)
def abstract():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(2); s.connect("\0" + AB); return "connected"
attempt("urllib-noproxy", urllib_noproxy)
attempt("getaddrinfo", lambda: socket.getaddrinfo("allowed.test", HP))
attempt("tcp-http-upstream", lambda: tcp("127.0.0.1", HP))
attempt("tcp-https-upstream", lambda: tcp("127.0.0.1", SP))
attempt("tcp-listener", lambda: tcp("127.0.0.1", LP))
attempt("tcp6-listener", lambda: tcp("::1", P6, socket.AF_INET6))
attempt("tcp-testnet", lambda: tcp("192.0.2.1", 80))
attempt("udp-listener", lambda: udp_send("127.0.0.1", UP))
attempt("dns-loopback", lambda: dns("127.0.0.1"))
attempt("dns-testnet", lambda: dns("192.0.2.53"))
attempt("icmp-testnet", lambda: icmp("192.0.2.1"))
attempt("abstract-unix", abstract)
print("IFACES", sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]))
print("ROUTES", len(open("/proc/net/route").read().splitlines()) - 1)
"""
    noproxy = "env " + " ".join(f"-u {v}" for v in PROXY_VARS)
    script = (f"{noproxy} curl -sS --noproxy '*' --max-time 5 http://allowed.test:{hp}/bypass-curl; echo \"CURLRC $?\"; "
              f"{noproxy} curl -sS --noproxy '*' --max-time 5 --resolve allowed.test:{hp}:127.0.0.1 "
              f"http://allowed.test:{hp}/bypass-resolve; echo \"RESOLVERC $?\"; "
              f"{noproxy} {PY} -c '{code}' {hp} {sp} {gate.tcp.port} {udp.port} {tcp6.port} {abstract_name}")
    assert "'" not in code
    try:
        run = sh(gate.spec, script)
        time.sleep(0.5)
        try:
            ab.accept()
            ab_hits = 1
        except (socket.timeout, OSError):
            ab_hits = 0
    finally:
        udp.close()
        tcp6.close()
        ab.close()
    assert run.lines("CURLRC ") and run.lines("CURLRC ")[0] != "CURLRC 0", run.explain()
    assert run.lines("RESOLVERC ") and run.lines("RESOLVERC ")[0] != "RESOLVERC 0", run.explain()
    net = {ln.split()[1]: ln.split()[2] for ln in run.lines("NET ")}
    assert len(net) == 12, run.explain()
    leaked = [k for k, v in net.items() if v != "FAIL"]
    assert leaked == [], run.explain()
    assert run.lines("IFACES ['lo']"), run.explain()
    assert run.lines("ROUTES 0"), run.explain()
    assert gate.http.seen == [] and gate.https.seen == []
    assert gate.tcp.hits == tcp_hits and udp.hits == 0 and tcp6.hits == 0 and ab_hits == 0
    assert run.records == []  # nothing went through the gate either


# ---------------------------------------------------------------------------- protocol abuse


SMUGGLE = r"""
import socket, sys
HP = int(sys.argv[1])
A = "allowed.test:%d" % HP
def send(label, raw):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(raw)
    buf = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
    except OSError as e:
        buf += b"<" + type(e).__name__.encode() + b">"
    head = buf.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    denied = [l.split(":", 1)[1].strip() for l in head if l.lower().startswith("x-agentvm-denied:")]
    n200 = buf.count(b"HTTP/1.1 200")
    print("SMUGGLE", label, head[0].replace(" ", "_") or "-", denied[0] if denied else "-", n200)
H = "POST http://%s/%%s HTTP/1.1\r\nHost: %s\r\n" % (A, A)
send("clte", ((H % "clte") + "Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG").encode())
send("tecl", ((H % "tecl") + "Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n").encode())
send("clcl", ((H % "clcl") + "Content-Length: 0\r\nContent-Length: 44\r\n\r\nGET http://denied.test:%d/cl HTTP/1.1\r\n\r\n" % HP).encode())
send("fold", ((H % "fold") + "Content-Length: 0\r\nX-A: a\r\n b\r\n\r\n").encode())
send("teobf", ((H % "teobf") + "Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n").encode())
send("tespace", ((H % "tespace") + "Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n").encode())
send("bare-lf", ("POST http://%s/bare-lf HTTP/1.1\nHost: %s\nContent-Length: 0\r\n\r\n" % (A, A)).encode())
send("hostmix", ("GET http://%s/hostmix HTTP/1.1\r\nHost: denied.test:%d\r\n\r\n" % (A, HP)).encode())
send("httpsabs", ("GET https://%s/abs HTTP/1.1\r\nHost: %s\r\n\r\n" % (A, A)).encode())
# pipelining: an allowed request followed by one to a denied host on the same connection
send("pipeline", ("GET http://%s/pipe1 HTTP/1.1\r\nHost: %s\r\n\r\nGET http://denied.test:%d/pipe2 HTTP/1.1\r\nHost: denied.test:%d\r\n\r\n" % (A, A, HP, HP)).encode())
send("userinfo", ("GET http://%s@denied.test:%d/ui HTTP/1.1\r\nHost: denied.test:%d\r\n\r\n" % (A, HP, HP)).encode())
send("bighead", ((H % "bighead") + "X-Big: " + "a" * 70000 + "\r\nContent-Length: 0\r\n\r\n").encode())
send("h2preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
send("after", ("GET http://%s/after HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (A, A)).encode())
"""


def test_request_smuggling_rejected(gate):
    run = run_in(gate.spec, [PY, "-c", SMUGGLE, str(gate.hp)])
    got = {ln.split()[1]: ln.split()[2:] for ln in run.lines("SMUGGLE ")}
    expect = {
        "clte": "bad-request:cl-and-te",
        "tecl": "bad-request:cl-and-te",
        "clcl": "bad-request:duplicate-content-length",
        "fold": "bad-request:obs-fold",
        "teobf": "bad-request:bad-transfer-encoding",
        "tespace": "bad-request:bad-header",
        "bare-lf": "bad-request:bare-lf",
        "hostmix": "bad-request:host-mismatch",
        "httpsabs": "bad-request:https-absolute-form",
        "userinfo": "bad-request:bad-authority",
        "bighead": "bad-request:head-too-large",
        "h2preface": None,
    }
    for label, rid in expect.items():
        assert label in got, run.explain()
        status, denied, n200 = got[label]
        if rid is None:
            assert status == "HTTP/1.1_400_Bad_Request" and denied.startswith("bad-request:") and n200 == "0", got[label]
            continue
        assert status == "HTTP/1.1_400_Bad_Request" and denied == rid and n200 == "0", f"{label}: {got[label]}\n{run.explain()}"
        assert run.rec(rule=rid, verdict="deny", phase="request"), f"{label}\n{run.explain()}"
    # pipelining: the first answered 200, the second decided on its own and denied
    assert got["pipeline"][0] == "HTTP/1.1_200_OK" and got["pipeline"][2] == "1", run.explain()
    assert run.rec(host="denied.test", path="/pipe2", rule="default-deny", verdict="deny"), run.explain()
    # the gate is still up: a normal request afterwards in the same sandbox succeeds
    assert got["after"][0] == "HTTP/1.1_200_OK", run.explain()
    assert sorted(gate.http.paths_seen()) == ["/after", "/pipe1"], gate.http.seen
    assert gate.http.requests_to("denied.test") == []


def test_smuggling_inside_terminated_tunnel(gate):
    code = TLS_PROBES + r"""
ctx = ssl.create_default_context()
for label, raw in (
    ("clte", "GET /v1/a HTTP/1.1\r\nHost: api.test:%d\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG" % SP),
    ("pipe", "GET /v1/ok HTTP/1.1\r\nHost: api.test:%d\r\n\r\nGET /admin HTTP/1.1\r\nHost: api.test:%d\r\n\r\n" % (SP, SP)),
):
    s, status = connect("api.test")
    t = ctx.wrap_socket(s, server_hostname="api.test")
    t.sendall(raw.encode())
    resp = read_all(t)
    import re
    print("TUN", label, re.findall(rb"HTTP/1\.1 [0-9]{3} [A-Za-z ]+|X-Agentvm-Denied: [^\r]+", resp))
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.sp)])
    tun = {ln.split()[1]: ln.split(" ", 2)[2] for ln in run.lines("TUN ")}
    assert "400 Bad Request" in tun.get("clte", "") and "bad-request:cl-and-te" in tun["clte"], run.explain()
    assert "200 OK" in tun.get("pipe", "") and "403 Forbidden" in tun["pipe"], run.explain()
    assert [s[2] for s in gate.https.seen] == ["/v1/ok"]


def test_connect_tunnel_non_tls_payloads(gate):
    """A CONNECT tunnel that does not carry TLS is never spliced blindly: plain HTTP inside is
    decided request by request with Host pinned to the CONNECT target; anything else is not-tls."""
    code = TLS_PROBES.replace("SP = int(sys.argv[1])", "SP = int(sys.argv[1])  # the plain HTTP port here") + r"""
import re
def tunnel(label, payload):
    s, status = connect("allowed.test")
    s.sendall(payload)
    out = read_all(s)
    m = re.findall(rb"HTTP/1\.1 [0-9]{3}|X-Agentvm-Denied: [^\r]+", out)
    print("TUN", label, status.replace(" ", "_"), [x.decode() for x in m])
A, D = "allowed.test:%d" % SP, "denied.test:%d" % SP
tunnel("ok", ("GET /tun-ok HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % A).encode())
tunnel("front", ("GET /tun-front HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % D).encode())
tunnel("absolute", ("GET http://%s/tun-abs HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (D, D)).encode())
tunnel("second", ("GET /tun-1 HTTP/1.1\r\nHost: %s\r\n\r\nGET /tun-2 HTTP/1.1\r\nHost: %s\r\n\r\n" % (A, D)).encode())
tunnel("ssh", b"SSH-2.0-OpenSSH_9.2\r\n")
tunnel("binary", b"\x00\x01\x02\x03binary-protocol\r\n\r\n")
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.hp)])
    tun = {ln.split()[1]: ln.split(" ", 3)[2:] for ln in run.lines("TUN ")}
    assert len(tun) == 6, run.explain()
    for label in tun:
        assert tun[label][0] == "HTTP/1.1_200_Connection_Established", run.explain()
    assert "'HTTP/1.1 200'" in tun["ok"][1], run.explain()
    assert "host-mismatch" in tun["front"][1], run.explain()
    assert "'HTTP/1.1 200'" not in tun["absolute"][1], run.explain()
    assert "'HTTP/1.1 200'" in tun["second"][1] and "host-mismatch" in tun["second"][1], run.explain()
    assert "'HTTP/1.1 200'" not in tun["ssh"][1] and "'HTTP/1.1 200'" not in tun["binary"][1], run.explain()
    assert run.rec(rule="not-tls", verdict="deny", host="allowed.test"), run.explain()
    assert run.rec(path="/tun-ok", verdict="allow", phase="request", host="allowed.test"), run.explain()
    assert sorted(gate.http.paths_seen()) == ["/tun-1", "/tun-ok"], gate.http.seen
    assert gate.http.requests_to("denied.test") == []


def test_deny_name_resolving_to_loopback(gate):
    """An allowed name the gate resolves itself (not in egress.hosts) to a loopback address is
    refused (address-class): SSRF to the host through DNS."""
    hp, sp = gate.hp, gate.sp
    noenv = "env -u NO_PROXY -u no_proxy"
    script = "; ".join([
        curl("LOCAL", f"http://localhost:{hp}/local", pre=noenv),
        curl("LOCALS", "--cacert /ca/test-ca.pem", f"https://localhost:{sp}/local", pre=noenv),
    ])
    run = sh(gate.spec, script)
    assert curl_status(run, "LOCAL") == "403 address-class", run.explain()
    assert curl_status(run, "LOCALS").startswith("000"), run.explain()
    assert run.rec(host="localhost", port=hp, rule="address-class", verdict="deny"), run.explain()
    assert run.rec(host="localhost", port=sp, rule="address-class", verdict="deny", phase="connect"), run.explain()
    assert gate.http.seen == [] and gate.https.seen == []


def test_deny_rules_survive_host_spelling(gate):
    """Case, a trailing dot or look-alike characters never slip past a deny rule (doh-deny) into
    the broad allow of the same name."""
    code = r"""
import socket
def send(label, raw):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(raw)
    buf = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
    except OSError:
        pass
    head = buf.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    den = [l.split(":", 1)[1].strip() for l in head if l.lower().startswith("x-agentvm-denied:")]
    print("SPELL", label, head[0].replace(" ", "_") or "-", den[0] if den else "-")
for label, host in (("upper", "DNS.GOOGLE"), ("dot", "dns.google."), ("mixed", "Dns.Google."),
                    ("fullwidth", "dns.\uff47oogle"), ("ideo-dot", "dns\u3002google")):
    h = host.encode("utf-8")
    send("get-" + label, b"GET http://" + h + b"/resolve HTTP/1.1\r\nHost: " + h + b"\r\n\r\n")
    send("connect-" + label, b"CONNECT " + h + b":443 HTTP/1.1\r\nHost: " + h + b":443\r\n\r\n")
"""
    run = run_in(gate.spec, [PY, "-c", code])
    got = {ln.split()[1]: ln.split()[2:] for ln in run.lines("SPELL ")}
    assert len(got) == 10, run.explain()
    for label, (status, denied) in got.items():
        assert status.startswith("HTTP/1.1_4"), f"{label}: {status}\n{run.explain()}"
        if label.endswith(("upper", "dot", "mixed")) and not label.endswith("ideo-dot"):
            assert denied == "doh:dns.google", f"{label}: {denied}"
        else:
            assert denied not in ("-", "dns-google"), f"{label}: {denied}"
    assert not run.rec(verdict="allow"), run.explain()


def test_websocket_upgrade_needs_a_websocket_rule(gate):
    hp = gate.hp
    script = curl("WS", "-H 'Connection: Upgrade' -H 'Upgrade: websocket' -H 'Sec-WebSocket-Version: 13'"
                        " -H 'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=='", f"http://allowed.test:{hp}/ws")
    run = sh(gate.spec, script)
    assert curl_status(run, "WS") == "403 default-deny", run.explain()
    assert run.rec(path="/ws", verdict="deny", rule="default-deny"), run.explain()
    assert gate.http.seen == []


def test_hop_by_hop_and_proxy_credentials_not_forwarded(gate):
    hp, sp = gate.hp, gate.sp
    hdrs = ("-H 'Proxy-Authorization: Basic c2VjcmV0OnNlY3JldA==' -H 'Proxy-Connection: keep-alive' "
            "-H 'Connection: keep-alive, X-Hop-Secret' -H 'X-Hop-Secret: s3cret' -H 'X-Kept: yes'")
    script = (f"curl -sS --max-time 20 {hdrs} http://allowed.test:{hp}/hop; echo; "
              f"curl -sS --max-time 20 {hdrs} https://api.test:{sp}/v1/hop; echo")
    run = sh(gate.spec, script)
    echoes = [json.loads(ln) for ln in run.out.splitlines() if ln.startswith('{"method"')]
    assert len(echoes) == 2, run.explain()
    for e in echoes:
        h = e["headers"]
        assert h.get("x-kept") == "yes", e
        for bad in ("proxy-authorization", "proxy-connection", "x-hop-secret"):
            assert bad not in h, f"{bad} forwarded upstream: {e}"


CLIENTHELLO = TLS_PROBES + r"""
import time
def hello_bytes(sni):
    ctx = ssl.create_default_context(cafile="/ca/test-ca.pem")
    ctx.check_hostname = False
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()
def fragment(rec, n):
    body = rec[5:5 + int.from_bytes(rec[3:5], "big")]
    return b"".join(rec[:3] + len(body[i:i + n]).to_bytes(2, "big") + body[i:i + n] for i in range(0, len(body), n))
def probe(label, sni, frag=None, coalesce=False, dribble=False):
    hello = hello_bytes(sni)
    if frag:
        hello = fragment(hello, frag)
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    connect_line = ("CONNECT allowed.test:%d HTTP/1.1\r\nHost: allowed.test:%d\r\n\r\n" % (SP, SP)).encode()
    if coalesce:
        s.sendall(connect_line + hello)
    else:
        s.sendall(connect_line)
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = s.recv(4096)
            if not d:
                break
            buf += d
        if dribble:
            for i in range(0, len(hello), 7):
                s.sendall(hello[i:i + 7])
                time.sleep(0.002)
        else:
            s.sendall(hello)
    got = b""
    s.settimeout(3)
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            got += d
            if b"\x16\x03" in got.split(b"\r\n\r\n", 1)[-1]:
                break
    except OSError:
        pass
    tail = got.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in got else got
    print("HELLO", label, "serverhello" if tail[:2] == b"\x16\x03" else "none")
    s.close()
"""


def test_clienthello_tricks_do_not_bypass_sni_check(gate):
    code = CLIENTHELLO + r"""
probe("mismatch-frag", "other.test", frag=32)
probe("mismatch-coalesced", "other.test", coalesce=True)
probe("mismatch-dribble", "other.test", dribble=True)
probe("mismatch-frag-dribble", "other.test", frag=16, dribble=True)
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.sp)])
    got = {ln.split()[1]: ln.split()[2] for ln in run.lines("HELLO ")}
    assert len(got) == 4, run.explain()
    for label, what in got.items():
        assert what == "none", f"{label}: the upstream answered a ClientHello for other.test\n{run.explain()}"
    assert not run.rec(verdict="allow"), run.explain()
    assert len(run.rec(verdict="deny", host="allowed.test")) == 4, run.explain()


def test_valid_fragmented_clienthello_is_spliced(gate):
    """Compatibility: an RFC-valid ClientHello split over records/segments with the right SNI works."""
    code = CLIENTHELLO + r"""
probe("plain", "allowed.test")
probe("coalesced", "allowed.test", coalesce=True)
probe("dribble", "allowed.test", dribble=True)
probe("frag", "allowed.test", frag=64)
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.sp)])
    got = {ln.split()[1]: ln.split()[2] for ln in run.lines("HELLO ")}
    assert got == {"plain": "serverhello", "coalesced": "serverhello", "dribble": "serverhello",
                   "frag": "serverhello"}, run.explain()


def test_gate_state_not_visible_inside(gate, avm_home):
    """The gate's CA key, decision logs and sockets live outside the sandbox."""
    home = str(avm_home)
    script = (f"curl -s -o /dev/null http://allowed.test:{gate.hp}/x; "  # a decision, so there is a log
              f"ls -la {home} {home}/gate {home}/gate/ca {home}/logs 2>&1 | sed 's/^/LS /'; "
              "grep -l 'PRIVATE KEY' /etc/ssl/certs/* /etc/ssl/private/* 2>/dev/null | sed 's/^/KEY /'; "
              "grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/agentvm-gate-ca.pem | sed 's/^/GATECA /'; echo done")
    run = sh(gate.spec, script)
    assert "done" in run.out, run.explain()
    assert not [ln for ln in run.lines("LS ") if "No such file" not in ln and "Permission denied" not in ln], run.explain()
    assert run.lines("KEY ") == [], run.explain()
    assert run.lines("GATECA 1"), run.explain()
    log = Path(run.res["egress"]["log"])
    st = log.stat()
    assert st.st_uid == 0 and st.st_mode & 0o077 == 0, oct(st.st_mode)


# ---------------------------------------------------------------------------- limits


UPLOADS = {
    # label: (curl options, URL template)
    "http": ("-T /tmp/big", "http://allowed.test:{hp}/upload"),
    "chunked": ("-T - < /tmp/big", "http://allowed.test:{hp}/upload-chunked"),
    "splice": ("--cacert /ca/test-ca.pem -T /tmp/big", "https://allowed.test:{sp}/upload-splice"),
    "terminated": ("-T /tmp/big", "https://pkgs.test:{sp}/upload-terminated"),
}


@pytest.fixture(scope="module")
def bytes_out_runs(gate):
    spec = gate.write_spec("gate-e2e-bytes", {"bytesOut": "1M"})
    out = {}
    for label, (opts, url) in UPLOADS.items():
        gate.http.clear()
        gate.https.clear()
        url = url.format(hp=gate.hp, sp=gate.sp)
        script = "head -c 5242880 /dev/zero > /tmp/big; " + curl("UPLOAD", opts, f"'{url}'")
        run = sh(spec, script, timeout=120)
        time.sleep(0.3)  # let the upstream threads record what they got
        out[label] = (run, list(gate.http.seen), list(gate.https.seen))
    return out


@pytest.mark.parametrize("label", list(UPLOADS))
def test_bytes_out_limit_cuts_upload(gate, bytes_out_runs, label):
    run, http_seen, https_seen = bytes_out_runs[label]
    assert curl_status(run, "UPLOAD")[:3] != "200", run.explain()
    assert run.rec(rule="limit:bytes-out", verdict="deny"), run.explain()
    for s in http_seen + https_seen:
        assert s[3] < 5 * 1024 * 1024, f"upstream received a full upload: {s}"
    assert sum(s[3] for s in http_seen + https_seen) <= 1024 * 1024 + 65536, http_seen + https_seen
    # the counter may overshoot by at most one read, never by the whole upload
    assert run.res["egress"]["bytes_out"] < 2 * 1024 * 1024, run.res["egress"]


def test_bytes_out_cut_is_attributed(gate, bytes_out_runs):
    """The decision log (and the run's denied summary) must say which destination was cut."""
    run, _, _ = bytes_out_runs["http"]
    cuts = run.rec(rule="limit:bytes-out", verdict="deny")
    assert cuts and all(c["host"] == "allowed.test" and c["port"] == gate.hp for c in cuts), \
        "limit:bytes-out logged without the destination:\n" + "\n".join(json.dumps(c) for c in cuts)
    targets = {d["target"] for d in run.res["egress"]["denied"] if d["rule"] == "limit:bytes-out"}
    assert targets == {f"allowed.test:{gate.hp}"}, run.res["egress"]["denied"]


def test_request_rate_limit(gate):
    spec = gate.write_spec("gate-e2e-rate", {"requestsPerSecond": 1, "burst": 2})
    script = "; ".join(curl(f"R{i}", f"http://allowed.test:{gate.hp}/rate{i}") for i in range(6))
    run = sh(spec, script)
    codes = [curl_status(run, f"R{i}") for i in range(6)]
    assert codes[0] == "200 " and codes[1] == "200 ", codes
    limited = [c for c in codes if c == "429 limit:rate"]
    assert len(limited) >= 2, f"{codes}\n{run.explain()}"
    assert set(codes) <= {"200 ", "429 limit:rate"}, codes
    assert len(run.rec(rule="limit:rate", verdict="deny")) == len(limited)
    assert len(gate.http.seen) == 6 - len(limited)


def test_connection_limit(gate):
    spec = gate.write_spec("gate-e2e-conns", {"connections": 2})
    code = r"""
import socket, sys, time
HP = int(sys.argv[1])
A = "allowed.test:%d" % HP
slow = []
for i in range(2):  # two slow clients: half a request head each
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(("GET http://%s/slow%d HTTP/1.1\r\n" % (A, i)).encode())
    slow.append(s)
time.sleep(0.7)
def req(label):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(("GET http://%s/%s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (A, label, A)).encode())
    buf = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            buf += d
    except OSError as e:
        buf += type(e).__name__.encode()
    head = buf.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    den = [l.split(":", 1)[1].strip() for l in head if l.lower().startswith("x-agentvm-denied:")]
    print("CONN", label, head[0].replace(" ", "_") or "-", den[0] if den else "-")
req("third")
for s in slow:
    s.close()
time.sleep(0.7)
req("fourth")
"""
    run = run_in(spec, [PY, "-c", code, str(gate.hp)])
    got = {ln.split()[1]: ln.split()[2:] for ln in run.lines("CONN ")}
    assert got.get("third") == ["HTTP/1.1_429_Too_Many_Requests", "limit:connections"], run.explain()
    assert got.get("fourth", [""])[0] == "HTTP/1.1_200_OK", run.explain()
    assert run.rec(rule="limit:connections", verdict="deny"), run.explain()
    assert gate.http.paths_seen() == ["/fourth"]


# ---------------------------------------------------------------------------- the bridge's hand-off

HANDOFF = r"""
import socket, struct, sys, time
HP = int(sys.argv[1])
G = "/.agentvm/gate.sock"
def greet(hello):  # -> what the gate answered a hand-off hello (b"" when it closed the connection)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(G)
    c.sendall(hello)
    try:
        return c, c.recv(64)
    except OSError:
        return c, b""
def probe():  # a denied request through the sandbox's route: answered at once unless the gate is stuck
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    s.sendall(b"GET http://denied.test:%d/ HTTP/1.1\r\nHost: denied.test:%d\r\n\r\n" % (HP, HP))
    t = time.monotonic()
    try:
        head = s.recv(4096).split(b"\r\n")[0].decode()
    except OSError as e:
        head = type(e).__name__
    return head.replace(" ", "_"), time.monotonic() - t
P = b"\x00agentvm-bridge-handoff/2 "
for name, hello in (("nokey", P + b"\r\n\r\n"), ("guess", P + b"0" * 32 + b"\r\n\r\n"),
                    ("v1", b"\x00agentvm-bridge-handoff/1\r\n\r\n")):
    c, got = greet(hello)
    print("HELLO", name, repr(got[:12]))
    c.close()
# the attack the key stops: a socket of the agent's own, with SO_LINGER set and unsent bytes,
# handed over on a channel of its own - the gate's close() of it would stall its loop
c, got = greet(P + b"0" * 32 + b"\r\n\r\n")
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen()
cl = socket.create_connection(l.getsockname()); sv, _ = l.accept()
sv.setblocking(False)
try:
    while True:
        sv.send(b"z" * 65536)
except BlockingIOError:
    pass
sv.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 5))
try:
    socket.send_fds(c, [b"C"], [sv.fileno()])
    print("SENT yes")
except OSError as e:
    print("SENT", type(e).__name__)
sv.close()
cl.shutdown(socket.SHUT_WR)
time.sleep(0.5)
head, took = probe()
print("PROBE", head, "fast" if took < 3 else "slow")
# and the sandbox's own route out still works
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(b"GET http://allowed.test:%d/route HTTP/1.1\r\nHost: allowed.test:%d\r\nConnection: close\r\n\r\n" % (HP, HP))
print("ROUTE", s.recv(4096).split(b"\r\n")[0].decode().replace(" ", "_"))
"""


def test_the_hand_off_channel_is_the_bridges_alone(gate):
    """Attack: the agent can reach the gate's socket, but not the bridge's key. A hand-off
    hello without it (none, a guess, the old unkeyed form) gets no channel - refused, alerted,
    nothing read from that connection again - so a socket of the agent's own (here one with
    SO_LINGER set over unsent bytes, whose close() would stall the gate's loop for 5 s) never
    reaches the gate, which keeps answering at once."""
    run = run_in(gate.spec, [PY, "-c", HANDOFF, str(gate.hp)])
    hellos = {ln.split()[1]: ln.split(None, 2)[2] for ln in run.lines("HELLO ")}
    assert hellos["nokey"] == hellos["guess"] == "b''", run.explain()
    assert hellos["v1"].startswith("b'HTTP/1.1 400"), run.explain()
    assert run.lines("PROBE ") == ["PROBE HTTP/1.1_403_Forbidden fast"], run.explain()
    assert run.lines("ROUTE ") == ["ROUTE HTTP/1.1_200_OK"], run.explain()
    refused = run.rec(rule="handoff:refused", verdict="deny")
    assert len(refused) == 3 and all(r.get("alert") == "security" for r in refused), run.explain()
    assert gate.http.paths_seen() == ["/route"], run.explain()


def test_a_hand_off_the_kernel_refuses_is_relayed_instead(gate):
    """Attack (review 6): the agent parks descriptors in sockets it never reads until the
    kernel refuses more in flight for its uid (ETOOMANYREFS) - the bridge's hand-offs fail too
    (and where sandboxes share a host uid, its neighbours'). The bridge then relays the
    connection: the request is served, slower, never dropped."""
    code = r"""
import errno, socket, sys
HP = int(sys.argv[1])
parked, n, why = [], 0, "none"
try:
    while n < 200000:
        a, b = socket.socketpair()
        a.setblocking(False)
        parked.append((a, b))
        while True:
            try:
                socket.send_fds(a, [b"x"], [b.fileno()])
                n += 1
            except BlockingIOError:
                break
except OSError as e:
    why = errno.errorcode.get(e.errno, str(e.errno))
print("PARKED", why, n > 100)
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(b"GET http://allowed.test:%d/parked HTTP/1.1\r\nHost: allowed.test:%d\r\nConnection: close\r\n\r\n" % (HP, HP))
try:
    print("ROUTE", s.recv(4096).split(b"\r\n")[0].decode().replace(" ", "_"))
except OSError as e:
    print("ROUTE", type(e).__name__)
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.hp)])
    assert run.lines("PARKED ") == ["PARKED ETOOMANYREFS True"], run.explain()
    assert run.lines("ROUTE ") == ["ROUTE HTTP/1.1_200_OK"], run.explain()
    assert gate.http.paths_seen() == ["/parked"], run.explain()


def test_the_bridge_leaves_the_data_path(gate):
    """With a bwrap sandbox the bridge hands each connection to the gate: the socket the
    sandbox's client is connected to (port 3128 in the sandbox's network namespace) is held by
    the gate's worker, not by the bridge, once the connection is served."""
    code = r"""
import socket, sys, time
HP = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
s.sendall(("GET http://allowed.test:%d/kept HTTP/1.1\r\nHost: allowed.test:%d\r\n\r\n" % (HP, HP)).encode())
buf = b""
while b"\r\n\r\n" not in buf:
    buf += s.recv(65536)
print("READY", buf.split(b"\r\n")[0].decode().replace(" ", "_"), flush=True)
time.sleep(20)
"""
    p = subprocess.Popen(agentvm_cmd() + ["run", "-f", str(gate.spec), "--", PY, "-c", code, str(gate.hp)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("READY HTTP/1.1_200"), line + p.stderr.read() if p.poll() is not None else line
        # the sandbox's python: its network namespace's TCP table names the gate's side (port 3128)
        inner = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).startswith(PY + "\0-c\0")
                 and "/kept" in _cmdline(pid)]
        assert len(inner) == 1, inner
        served = set()
        for row in Path(f"/proc/{inner[0]}/net/tcp").read_text().splitlines()[1:]:
            f = row.split()
            if f[1].endswith(":0C38") and f[3] == "01":  # local port 3128, ESTABLISHED
                served.add(f"socket:[{f[9]}]")
        assert len(served) == 1, served
        holders = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in served for fd in fds):
                    holders.add(_cmdline(pid).split("\0")[0])
            except OSError:
                continue
        assert holders == {"agentvm-gate-worker (embedded)"}, holders
    finally:
        p.terminate()  # (the run tears its sandbox down)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------- logging


def test_decision_log_well_formed_and_escaped(gate):
    code = r"""
import socket, sys
HP = int(sys.argv[1])
A = "allowed.test:%d" % HP
def send(raw):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=10)
    s.sendall(raw)
    out = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                break
            out += d
    except OSError:
        pass
    print("LOGPROBE", out.split(b"\r\n", 1)[0].decode(errors="replace"))
send(("GET http://%s/ctl%%01path%%0a%%0d%%1b[31m HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (A, A)).encode())
send(("GET http://%s/ctlhdr HTTP/1.1\r\nHost: %s\r\nX-Evil: a\x01b\x1bc\r\n\r\n" % (A, A)).encode())
send(("GET http://%s/raw\x01ctl HTTP/1.1\r\nHost: %s\r\n\r\n" % (A, A)).encode())
send(("GET http://%s/utf8-\xc3\xa9 HTTP/1.1\r\nHost: %s\r\n\r\n" % (A, A)).encode("latin-1"))
send(("GET http://denied.test\x01:%d/ctlhost HTTP/1.1\r\n\r\n" % HP).encode())
send(("CONNECT other\x1b.test:443 HTTP/1.1\r\n\r\n").encode())
"""
    run = run_in(gate.spec, [PY, "-c", code, str(gate.hp)])
    assert run.log_bytes, run.explain()
    assert len(run.lines("LOGPROBE ")) == 6, run.explain()
    bad = sorted({b for b in run.log_bytes if (b < 0x20 and b != 0x0A) or b == 0x7F or b >= 0x80})
    assert bad == [], f"raw control/non-ASCII bytes in the decision log: {bad}"
    for i, line in enumerate(run.log_bytes.decode("ascii").splitlines()):
        rec = json.loads(line)
        assert LOG_KEYS <= set(rec), f"line {i} misses {LOG_KEYS - set(rec)}: {line}"
        assert rec["verdict"] in ("allow", "deny")
    # the encoded path is forwarded (allowed host without path rules) and logged as text
    assert run.rec(path="/ctl%01path%0a%0d%1b[31m", verdict="allow"), run.explain()
    assert run.rec(rule="bad-request:bad-bytes", verdict="deny"), run.explain()
    # the header with control bytes never reached the upstream
    assert "/ctlhdr" not in gate.http.paths_seen()
    assert gate.http.requests_to("denied.test") == []
    # no line of the log of any test in this module is malformed
    for f in Path(run.res["egress"]["log"]).parent.glob("*.egress.jsonl"):
        for ln in f.read_bytes().splitlines():
            json.loads(ln)


# ---------------------------------------------------------------------------- fail closed


def _run_library(gate, tmp_path) -> tuple[object | Exception, str]:
    from agentvm.policy import compile_policy, with_overrides
    from agentvm.runtime import Runtime
    from agentvm.spec.loader import load_agent

    policy = compile_policy(load_agent(gate.spec).spec)
    policy = with_overrides(policy, command=("/bin/sh", "-c",
                                             f"curl -sS --max-time 10 http://allowed.test:{gate.hp}/failclosed; echo \"RC $?\";"
                                             f"curl -sS --max-time 10 --cacert /ca/test-ca.pem https://allowed.test:{gate.sp}/failclosed-tls;"
                                             " echo \"RCS $?\""))
    out = tmp_path / "out"
    rt = Runtime()
    with open(out, "wb") as fo, open(os.devnull, "rb") as fi:
        try:
            result = rt.run(policy, tty=False, stdio=(fi.fileno(), fo.fileno(), fo.fileno()))
        except Exception as exc:  # refusing to run is a correct fail-closed outcome
            result = exc
        finally:
            rt.close()
    text = out.read_text(errors="replace")
    return result, text


def _assert_nothing_left(result, out, gate):
    assert '"path": "/failclosed' not in out, out
    rcs = [ln for ln in out.splitlines() if ln.startswith(("RC ", "RCS "))]
    assert len(rcs) == 2 and "RC 0" not in rcs and "RCS 0" not in rcs, out  # the sandbox ran: both clients failed
    assert gate.http.seen == [] and gate.https.seen == []


def test_fail_closed_when_the_gate_cannot_start(gate, monkeypatch, tmp_path):
    """The gate starts on the sandbox's first connection; if it cannot, the connections waiting
    on its socket are refused, and the run says so (exit 125, setup_error.step gate)."""
    from agentvm.gate import embedded

    monkeypatch.setenv("AGENTVM_GATE_UNCONFINED", "1")  # the in-process gate (the confined one: test_embedded_gate_confined)

    def broken(self, *a, **kw):
        raise RuntimeError("simulated gate start failure")

    monkeypatch.setattr(embedded.EmbeddedGate, "__init__", broken)
    result, out = _run_library(gate, tmp_path)
    _assert_nothing_left(result, out, gate)
    assert not isinstance(result, Exception) and result.exit_code == 125, result
    assert result.setup_error["step"] == "gate" and "simulated gate start failure" in result.setup_error["message"]


def test_fail_closed_when_gate_stops_listening(gate, monkeypatch, tmp_path):
    """The gate's listener is gone (crashed) right as the endpoint opens: the waiting and all
    later connections are refused, nothing leaves."""
    from agentvm.gate import server

    orig = server.Gate.open_endpoint

    async def open_then_stop(self, *a, **kw):
        ep = await orig(self, *a, **kw)
        ep.server.close()  # before the loop accepts anything
        await ep.server.wait_closed()
        return ep

    monkeypatch.setattr(server.Gate, "open_endpoint", open_then_stop)  # (the forked worker inherits it)
    # (a test process that has held an earlier test's secret forks no gate worker - it starts a
    # fresh interpreter, which the patch cannot reach: the zygote's path here)
    from agentvm import vault

    monkeypatch.setattr(vault, "_HELD_SECRETS", False)
    result, out = _run_library(gate, tmp_path)
    _assert_nothing_left(result, out, gate)

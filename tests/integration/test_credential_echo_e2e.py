"""A bound upstream that echoes what it received must never hand the sandbox the real secret,
whatever form the echo takes: compressed (gzip, deflate, br, zstd), base64 (the gate's own
``Basic base64(user:real)``, base64url), percent-encoded (the gate's query swap), JSON-escaped,
split into tiny chunks, or streamed as server-sent events.

A real TLS echo server on loopback (test CA as ``upstreamCa``), real curl inside a real
sandbox; the raw bytes curl received are checked on the host, decoded every way a client
could decode them."""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import secrets
import shutil
import subprocess
import textwrap
import time
import zlib
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import brotli
import pytest
import zstandard

from agentvm.selftest.cases.credentials import dechunk, decoded_views
from tests.integration.gate_upstreams import serve_https
from tests.helpers import agentvm_cmd, last_json, needs_root

pytestmark = [pytest.mark.integration, needs_root]

# Obviously fake values, each with the characters that make encodings differ from raw text.
REAL = {
    "echo": 'echo-fake-REAL/' + secrets.token_hex(12) + '+="\\end',
    "basic": "basic-fake-REAL/" + secrets.token_hex(12) + "+=",
    "q": "q-fake-REAL/" + secrets.token_hex(12) + "+=x",
    "len": "len-fake-REAL/" + secrets.token_hex(12) + "+=",
}


def _encode(enc: str, body: bytes) -> bytes:
    return {
        "gzip": gzip.compress,
        "deflate": zlib.compress,
        "br": brotli.compress,
        "zstd": lambda b: zstandard.ZstdCompressor().compress(b),
    }[enc](body)


class EchoServer:
    """Echoes the request (method, path, headers, body) as JSON. Query options, as a hostile or
    merely chatty upstream would do it regardless of what the client asked for:
    ``enc=`` a Content-Encoding, ``b64url=1`` the whole echo base64url'd, ``chunk=N`` chunked in
    N-byte pieces, ``sse=N`` N server-sent events 0.4 s apart."""

    def __init__(self, cert: Path, key: Path):
        self.sent_last_event_at: list[float] = []
        self.hits = 0
        self.paths: list[str] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.hits += 1
                outer.paths.append(self.path)
                opts = dict(parse_qsl(urlsplit(self.path).query))
                echo = {"method": self.command, "path": self.path,
                        "headers": {k.lower(): v for k, v in self.headers.items()}}
                body = json.dumps(echo).encode()
                auth = self.headers.get("Authorization", "")
                if "deltas" in opts:  # an LLM-style stream: the token arrives in N pieces
                    n = int(opts["deltas"])
                    cuts = [len(auth) * i // n for i in range(n + 1)]
                    body = b"".join(b"data: " + json.dumps({"choices": [{"delta": {"content": auth[a:b]}}]}).encode()
                                    + b"\n\n" for a, b in zip(cuts, cuts[1:])) + b"data: [DONE]\n\n"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for ev in body.split(b"\n\n")[:-1]:
                        ev += b"\n\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if "esc" in opts:  # an error page quoting the token in the escapes of its text
                    esc = {"html": lambda t: "".join(f"&#{ord(c)};" for c in t),
                           "js": lambda t: "".join(f"\\u{ord(c):04x}" for c in t),
                           "css": lambda t: "".join(f"\\{ord(c):x} " for c in t),
                           "pct2": lambda t: "".join(f"%25{b:02X}" for b in t.encode())}[opts["esc"]]
                    body = f"<html><body><p>Invalid token: {esc(auth)}</p></body></html>".encode()
                if "undeclared" in opts:  # compressed, and no Content-Encoding says so
                    body = {"gzip": gzip.compress, "zlib": zlib.compress, "br": brotli.compress,
                            "deflate": lambda b: zlib.compress(b)[2:-4],
                            "zstd": lambda b: zstandard.ZstdCompressor().compress(b)}[opts["undeclared"]](body)
                if "sse" in opts:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    n = int(opts["sse"])
                    for i in range(n):
                        if i == n - 1:
                            outer.sent_last_event_at.append(time.time())
                        ev = b"id: %d\ndata: %s\n\n" % (i, body)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                        self.wfile.flush()
                        if i < n - 1:
                            time.sleep(0.4)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if opts.get("b64url"):
                    body = base64.urlsafe_b64encode(body)
                extra = []
                if opts.get("enc"):
                    enc = opts["enc"]
                    body = _encode(enc, body) if enc != "compress" else b"\x1f\x9d" + body
                    extra.append(("Content-Encoding", enc))
                if opts.get("reason"):  # an error page style status line quoting the request
                    self.send_response(200, "OK " + self.headers.get("Authorization", ""))
                else:
                    self.send_response(200)
                if opts.get("hide"):  # a coding label the upstream tries to have dropped as hop-by-hop
                    self.send_header("Connection", "content-encoding")
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Echo-Auth", self.headers.get("Authorization", ""))
                for k, v in extra:
                    self.send_header(k, v)
                if opts.get("ce"):
                    self.send_header("Content-Encoding", opts["ce"])
                step = int(opts.get("chunk", 0))
                if step:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(body), step):
                        piece = body[i:i + step]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

        self.httpd = serve_https(H, cert, key)
        self.port = self.httpd.server_address[1]


@pytest.fixture(scope="module")
def env(avm_home):
    from tests.integration.gate_upstreams import make_test_ca

    d = Path(f"/tmp/agentvm-echo-test-{secrets.token_hex(3)}")
    d.mkdir(mode=0o755)
    ca, cert, key = make_test_ca(d / "ca")
    up = EchoServer(cert, key)
    for name, value in REAL.items():
        r = subprocess.run(agentvm_cmd() + ["secret", "set", f"echo-{name}"], input=value.encode(), capture_output=True)
        assert r.returncode == 0, r.stderr
    p = up.port
    agent = d / "echo-agent.yaml"
    agent.write_text(textwrap.dedent(f"""\
        apiVersion: agentvm/v1
        kind: Agent
        metadata: {{name: echo-agent}}
        spec:
          riskTier: L3
          limits: {{timeout: 60s}}
          egress:
            hosts: {{echo.test: 127.0.0.1, api.test: 127.0.0.1, other.test: 127.0.0.1, pkgs.test: 127.0.0.1}}
            upstreamCa: {ca}
            allow:
              - {{host: echo.test, ports: [{p}], websocket: true}}
              - {{host: api.test, ports: [{p}]}}
              - {{host: other.test, ports: [{p}]}}
              - {{host: pkgs.test, ports: [{p}]}}
          credentials:
            - {{name: echo, env: ECHO_KEY, ref: "vault:echo-echo", hosts: [echo.test],
               inject: {{header: Authorization, format: "Bearer {{}}"}}}}
            - {{name: basic, env: BASIC_PW, ref: "vault:echo-basic", hosts: [api.test], inject: {{basic: password}}}}
            - {{name: q, env: Q_KEY, ref: "vault:echo-q", hosts: [other.test], inject: {{query: key}}}}
            - {{name: len, env: LEN_KEY, ref: "vault:echo-len", hosts: [pkgs.test], inspect: lenient,
               inject: {{header: Authorization, format: "Bearer {{}}"}}}}
        """))
    yield {"dir": d, "up": up, "port": p, "agent": agent}
    up.httpd.shutdown()
    shutil.rmtree(d, ignore_errors=True)


def curl(env, url: str, *args: str, auth: str = "echo") -> tuple[bytes, dict, bytes, dict]:
    """curl inside the sandbox. Returns (the raw bytes curl got, their headers, the body with
    only the transfer framing undone, the run's --json result). curl is told to decode
    nothing (``--raw``, no ``--compressed``): what it received is what the gate sent."""
    header = {"echo": ["-H", "Authorization: Bearer $ECHO_KEY"], "basic": ["-u", "alice:$BASIC_PW"], "none": [],
              "len": ["-H", "Authorization: Bearer $LEN_KEY"]}[auth]
    quoted = " ".join(f'"{a}"' for a in header + list(args) + [url])
    script = (f"curl -sS --raw -D /tmp/h -o /tmp/b {quoted}; rc=$?; "
              "echo HEAD; base64 -w0 /tmp/h; echo; echo BODY; base64 -w0 /tmp/b; echo; exit $rc")
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(env["agent"]), "--json", "--", "/bin/sh", "-c", script],
                       capture_output=True, timeout=120)
    out = r.stdout.decode(errors="replace")
    res = last_json(r.stdout)
    assert "HEAD" in out and "BODY" in out, (out, r.stderr.decode()[-2000:])
    head = base64.b64decode(out.split("HEAD\n", 1)[1].split("\n", 1)[0])
    body = base64.b64decode(out.split("BODY\n", 1)[1].split("\n", 1)[0])
    headers = {}
    head = [b for b in head.split(b"\r\n\r\n") if b.strip()][-1]  # the origin's, not the proxy's CONNECT answer
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    headers[":status"] = head.split(b" ", 2)[1].decode() if head else ""
    unframed = dechunk(body) if headers.get("transfer-encoding", "").lower() == "chunked" else body
    return head + body, headers, unframed, res


def assert_no_real_value(raw: bytes):
    """Decoded every way a client could (percent, base64/base64url, JSON strings, gzip/deflate/
    br/zstd, up to three in a row: the selftest's own judge), no real value is readable."""
    for name, value in REAL.items():
        for view in decoded_views(raw):
            assert value.encode() not in view, f"the real {name} value reached the sandbox"
            assert value.encode()[3:-3] not in view, f"most of the real {name} value reached the sandbox"


def _echo(body: bytes) -> dict:
    doc = json.loads(body)
    assert "error" not in doc, doc  # the gate's own refusal, not the echo
    return doc


@pytest.mark.parametrize("enc", ["gzip", "deflate", "br", "zstd"])
def test_a_compressed_echo_reaches_the_sandbox_decoded_and_scrubbed(env, enc):
    raw, headers, body, res = curl(env, f"https://echo.test:{env['port']}/h?enc={enc}", "-H", f"Accept-Encoding: {enc}")
    assert headers[":status"] == "200", raw[:500]
    assert_no_real_value(raw)
    assert "content-encoding" not in headers, headers  # the gate forwards identity
    echo = _echo(body)  # the client still gets a working response
    assert echo["headers"]["authorization"].startswith("Bearer ") and echo["method"] == "GET"
    lines = [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]
    assert any(l.get("decoded") == enc and l.get("scrubbed") for l in lines), lines


def test_accept_encoding_is_narrowed_to_what_the_gate_can_read(env):
    raw, headers, body, _ = curl(env, f"https://echo.test:{env['port']}/h", "-H", "Accept-Encoding: gzip, compress, exi")
    assert _echo(body)["headers"]["accept-encoding"] == "gzip"


def test_an_encoding_the_gate_cannot_read_is_refused_not_passed_through(env):
    raw, headers, _, res = curl(env, f"https://echo.test:{env['port']}/h?enc=compress")
    assert headers[":status"] == "502" and headers.get("x-agentvm-denied") == "credential:uninspectable-encoding", raw[:400]
    assert_no_real_value(raw)


def test_the_gates_own_basic_header_echoed_back_decodes_to_the_placeholder(env):
    raw, headers, body, _ = curl(env, f"https://api.test:{env['port']}/b", auth="basic")
    assert_no_real_value(raw)
    sent = base64.b64decode(_echo(body)["headers"]["authorization"].split()[1])
    assert sent.startswith(b"alice:") and len(sent) == len(b"alice:") + len(REAL["basic"])
    assert base64.b64decode(headers["x-echo-auth"].split()[1]).startswith(b"alice:")


def test_a_base64url_echo_is_scrubbed(env):
    raw, _, body, _ = curl(env, f"https://echo.test:{env['port']}/h?b64url=1")
    assert_no_real_value(raw)
    assert_no_real_value(body)
    assert _echo(base64.urlsafe_b64decode(body))["method"] == "GET"


def test_the_percent_encoded_query_swap_echoed_back_is_scrubbed(env):
    raw, _, body, _ = curl(env, f"https://other.test:{env['port']}/q?a=1&key=$Q_KEY", auth="none")
    assert_no_real_value(raw)
    path = _echo(body)["path"]
    assert dict(parse_qsl(urlsplit(path).query))["key"] != REAL["q"]


def test_a_query_string_swap_is_never_logged_with_the_real_value(env):
    """The swapped value is on the wire only: the decision log (which feeds the audit chain,
    the console, OCSF export and spans) shows the agent's own target with the placeholder."""
    raw, headers, body, res = curl(env, f"https://other.test:{env['port']}/q?a=1&key=$Q_KEY", auth="none")
    assert headers[":status"] == "200", raw[:400]
    log = Path(res["egress"]["log"]).read_bytes()
    for view in decoded_views(log):
        assert REAL["q"].encode() not in view, "the real query-string value reached the gate's log"
    lines = [json.loads(ln) for ln in log.splitlines()]
    hit = [l for l in lines if l.get("host") == "other.test" and l.get("path", "").startswith("/q?")]
    assert hit and all("key=" in l["path"] for l in hit), lines
    assert hit[-1].get("credentials") == ["q"], hit[-1]  # it was swapped, and the log says by which


def test_a_json_escaped_echo_is_scrubbed(env):
    raw, _, body, _ = curl(env, f"https://echo.test:{env['port']}/h")
    assert '\\"' in json.dumps(REAL["echo"])  # the value is one JSON escapes
    assert_no_real_value(body)
    assert _echo(body)["headers"]["authorization"].startswith("Bearer ")


def test_an_echo_split_into_tiny_chunks_is_scrubbed(env):
    for query in ("chunk=1", "chunk=3&enc=gzip"):
        raw, _, body, _ = curl(env, f"https://echo.test:{env['port']}/h?{query}")
        assert_no_real_value(raw)
        assert_no_real_value(body)
        assert _echo(body)["method"] == "GET"


def test_a_server_sent_event_stream_keeps_streaming_and_is_scrubbed(env):
    """Each event reaches the agent when it is sent, not when the stream ends."""
    p = env["port"]
    code = textwrap.dedent(f"""
        import os, time, urllib.request
        req = urllib.request.Request("https://echo.test:{p}/s?sse=3", headers={{"Authorization": "Bearer " + os.environ["ECHO_KEY"]}})
        with urllib.request.urlopen(req) as r:
            for line in r:
                if line.startswith(b"id: "):
                    print("EVENT", line.split()[1].decode(), repr(time.time()), flush=True)
                elif line.startswith(b"data: "):
                    print("DATA", line[6:].strip().decode(), flush=True)
    """)
    r = subprocess.run(agentvm_cmd() + ["run", "-f", str(env["agent"]), "--", "python3", "-c", code],
                       capture_output=True, timeout=120)
    out = r.stdout.decode()
    events = [ln.split() for ln in out.splitlines() if ln.startswith("EVENT")]
    assert len(events) == 3, out + r.stderr.decode()[-2000:]
    assert_no_real_value(r.stdout)
    assert float(events[0][2]) < env["up"].sent_last_event_at[-1], "the first event waited for the end of the stream"


def test_the_status_line_and_a_hidden_coding_label_are_scrubbed_too(env):
    raw, headers, body, _ = curl(env, f"https://echo.test:{env['port']}/h?reason=1")
    assert headers[":status"] == "200"
    assert_no_real_value(raw)
    raw, headers, body, res = curl(env, f"https://echo.test:{env['port']}/h?enc=gzip&hide=1")
    assert_no_real_value(raw)
    assert _echo(body)["method"] == "GET"  # decoded although Connection: tried to drop its label


def test_a_websocket_to_a_bound_host_is_refused_not_relayed_unscrubbed(env):
    raw, headers, _, res = curl(env, f"https://echo.test:{env['port']}/ws", "-H", "Connection: Upgrade", "-H",
                                "Upgrade: websocket", "-H", "Sec-WebSocket-Version: 13", "-H",
                                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")
    assert headers[":status"] == "403" and headers.get("x-agentvm-denied") == "credential:uninspectable-websocket", raw
    assert "/ws" not in env["up"].paths  # refused before anything went upstream


# -- echoes as classes (issue 35 item 3) -----------------------------------------------------
@pytest.mark.parametrize("query", ["undeclared=gzip", "undeclared=zlib", "undeclared=zstd", "undeclared=br",
                                   "undeclared=deflate", "undeclared=gzip&ce=identity", "undeclared=gzip&chunk=1",
                                   "undeclared=br&chunk=2", "undeclared=gzip&enc=gzip", "undeclared=br&enc=br"])
def test_a_compressed_echo_no_header_declares_is_refused_with_a_502(env, query):
    raw, headers, _, res = curl(env, f"https://echo.test:{env['port']}/h?{query}")
    assert headers[":status"] == "502" and headers.get("x-agentvm-denied") == "credential:uninspectable-body", raw[:400]
    assert_no_real_value(raw)
    lines = [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]
    assert any(l.get("rule") == "credential:uninspectable-body" for l in lines), lines


def test_inspect_lenient_passes_an_undeclared_compressed_body_on_and_says_so(env):
    raw, headers, body, res = curl(env, f"https://pkgs.test:{env['port']}/h?undeclared=gzip", auth="len")
    assert headers[":status"] == "200", raw[:400]
    assert json.loads(gzip.decompress(body))["method"] == "GET"  # as the upstream sent it (the operator's choice)
    lines = [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]
    assert any(l.get("uninspected") and l.get("alert") for l in lines), lines


@pytest.mark.parametrize("esc", ["html", "js", "css", "pct2"])
def test_an_echo_in_the_escapes_of_a_page_is_scrubbed_and_the_page_intact(env, esc):
    raw, headers, body, _ = curl(env, f"https://echo.test:{env['port']}/h?esc={esc}")
    assert headers[":status"] == "200", raw[:400]
    assert_no_real_value(raw)
    import html as _html
    from urllib.parse import unquote

    text = {"html": lambda b: _html.unescape(b.decode()), "js": lambda b: b.decode("unicode_escape"),
            "css": lambda b: b.decode(), "pct2": lambda b: unquote(unquote(b.decode()))}[esc](body)
    assert REAL["echo"] not in text and REAL["echo"][3:-3] not in text
    assert body.startswith(b"<html><body><p>Invalid token: ") and body.endswith(b"</p></body></html>"), body


@pytest.mark.parametrize("n", [2, 5, 40])
def test_a_token_streamed_in_pieces_across_events_cuts_the_stream(env, n):
    raw, headers, body, res = curl(env, f"https://echo.test:{env['port']}/h?deltas={n}")
    assert_no_real_value(raw)
    deltas = "".join(json.loads(ln[6:])["choices"][0]["delta"]["content"] for ln in body.decode().split("\n")
                     if ln.startswith("data: {"))
    assert REAL["echo"][3:-3] not in deltas
    lines = [json.loads(ln) for ln in Path(res["egress"]["log"]).read_text().splitlines()]
    assert any(l.get("rule") == "credential:echo-split" for l in lines), lines

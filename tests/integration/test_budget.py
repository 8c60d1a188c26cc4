"""LLM budgets at the gate, against a stub OpenAI- and Anthropic-compatible server on loopback
(TLS with a test CA, reached as llm.test): the gate reads usage from JSON and streamed (SSE)
responses, counts it per agent, refuses the request past the budget with 429
``budget:exceeded`` (alerted, audited), keeps the counters across a daemon restart, and
lets the operator raise the budget live. The real openai SDK inside the sandbox is the client
where it matters (its error on a 429 is what an agent sees)."""

from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import av, needs_root, write_agent

pytestmark = [pytest.mark.integration, needs_root]

TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))


class StubLLM:
    """/v1/chat/completions (OpenAI: JSON, or SSE with a final usage chunk when asked) and
    /v1/messages (Anthropic: SSE with message_start / message_delta usage). Every call uses
    10 input and 20 output tokens; /v1/chat/completions?nousage streams without usage."""

    def __init__(self, cert: Path, key: Path):
        self.calls = 0
        self.encodings: list[str] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                outer.calls += 1
                outer.encodings.append(self.headers.get("Accept-Encoding", ""))
                model = body.get("model", "stub-model")
                if self.path.startswith("/v1/messages"):
                    events = [
                        {"type": "message_start", "message": {"id": "m1", "model": model, "usage": {"input_tokens": 10,
                                                                                                    "output_tokens": 1}}},
                        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
                        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 20}},
                        {"type": "message_stop"},
                    ]
                    return self._sse([f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events])
                if body.get("stream"):
                    chunks = [{"id": "c1", "model": model, "choices": [{"index": 0, "delta": {"content": "hello " * 5}}],
                               "usage": None}]
                    if (body.get("stream_options") or {}).get("include_usage") and "nousage" not in self.path:
                        chunks.append({"id": "c1", "model": model, "choices": [],
                                       "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}})
                    return self._sse([f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"])
                doc = {"id": "c1", "object": "chat.completion", "model": model,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}}
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _sse(self, parts):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for p in parts:
                    b = p.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()



OPENAI_CALL = textwrap.dedent("""\
    import sys, json
    sys.path.insert(0, "/opt/testlib")
    import openai
    c = openai.OpenAI(base_url=sys.argv[1], api_key="sk-fake-not-a-key", max_retries=0)
    try:
        if sys.argv[2] == "stream":
            s = c.chat.completions.create(model="gpt-stub", messages=[{"role": "user", "content": "hi"}], stream=True,
                                          stream_options={"include_usage": True})
            print("ok", sum(1 for _ in s))
        else:
            r = c.chat.completions.create(model="gpt-stub", messages=[{"role": "user", "content": "hi"}])
            print("ok", r.usage.total_tokens)
    except openai.RateLimitError as e:
        print("refused", e.response.headers.get("x-agentvm-denied"), json.dumps(e.body))
    """)


@pytest.fixture
def stub(tmp_path):
    from tests.integration.gate_upstreams import sandbox_test_ca

    ca, cert, key = sandbox_test_ca(tmp_path)
    s = StubLLM(cert, key)
    s.ca = ca
    yield s
    s.close()


def agent_file(tmp_path: Path, stub, budget: str, name: str = "b-llm") -> Path:
    (tmp_path / "call.py").write_text(OPENAI_CALL)
    os.chmod(tmp_path / "call.py", 0o644)
    return write_agent(tmp_path, name, f"""\
        lifecycle: persistent
        command: ["/bin/sh", "-c", "exec sleep 600"]
        riskTier: L3
        limits:
          disk: 16M
          budget: {budget}
        mounts:
          - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
          - {{host: {tmp_path}, path: /opt/t, mode: ro}}
        egress:
          hosts: {{llm.test: 127.0.0.1}}
          upstreamCa: {stub.ca}
          allow: [{{host: llm.test, ports: [{stub.port}]}}]
        """)


def test_the_request_past_the_budget_is_refused_and_the_count_survives_a_restart(avm_home, tmp_path, stub):
    if not (TESTLIB / "openai").is_dir():
        pytest.fail(f"{TESTLIB} lacks the openai SDK: run `bash scripts/install.sh --test`")
    base = f"https://llm.test:{stub.port}/v1"
    # 30 tokens a call: the budget of 100 allows 4 calls (0, 30, 60, 90 used before each), refuses the 5th
    f = agent_file(tmp_path, stub, "{tokens: 100, hosts: [llm.test], prices: {'*': {input: 1, output: 2}}}")
    av("up")
    try:
        av("create", "-f", str(f), "--start")
        out = [av("exec", "b-llm", "--", "python3", "/opt/t/call.py", base, "json").stdout.decode().split()[0]
               for _ in range(2)]
        out.append(av("exec", "b-llm", "--", "python3", "/opt/t/call.py", base, "stream").stdout.decode().split()[0])
        # an Anthropic-compatible stream: input at message_start, output at message_delta
        r = av("exec", "b-llm", "--", "curl", "-s", "-N", "-H", "content-type: application/json", "-d",
               '{"model": "claude-stub", "stream": true, "max_tokens": 5}', f"https://llm.test:{stub.port}/v1/messages")
        assert b"message_stop" in r.stdout
        assert out == ["ok", "ok", "ok"] and stub.calls == 4
        assert all(e == "identity" for e in stub.encodings), "a metered API is asked for uncompressed answers"
        show = json.loads(av("policy", "b-llm", "show", "--json").stdout)["budget"]
        assert show["used"]["tokens"] == 120 and show["used"]["requests"] == 4 and show["used"]["estimated"] == 0
        assert show["by_model"]["claude-stub"] == [1, 10, 20]
        assert abs(show["used"]["cost"] - 4 * (10 * 1 + 20 * 2) / 1e6) < 1e-9
        # the budget is spent: the next request never reaches the API
        r = av("exec", "b-llm", "--", "python3", "/opt/t/call.py", base, "json").stdout.decode()
        assert r.startswith("refused budget:exceeded") and "120 used" in r, r
        assert stub.calls == 4
        recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "b-llm").stdout.splitlines()]
        refused = [x for x in recs if x["kind"] == "egress.deny" and x["data"]["rule"] == "budget:exceeded"]
        assert refused and refused[-1]["data"]["alert"] is True
        # a daemon restart (and the worker's restart with it) continues from the same count
        av("down")
        av("up")  # the worker that was running comes back by itself (desired=running)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and next(
                r for r in json.loads(av("ps", "--json").stdout) if r["name"] == "b-llm")["state"] != "running":
            time.sleep(0.1)
        r = av("exec", "b-llm", "--", "python3", "/opt/t/call.py", base, "json").stdout.decode()
        assert r.startswith("refused budget:exceeded"), r
        assert stub.calls == 4
        # raised live: the very next request goes through
        r = av("policy", "b-llm", "budget", "--tokens", "200")
        assert b"applied live" in r.stdout
        r = av("exec", "b-llm", "--", "python3", "/opt/t/call.py", base, "json").stdout.decode()
        assert r.startswith("ok 30"), r
        show = json.loads(av("policy", "b-llm", "show", "--json").stdout)["budget"]
        assert show["tokens"] == 200 and show["used"]["tokens"] == 150
        # a stream without a usage event is estimated, never free
        before = show["used"]["tokens"]
        av("exec", "b-llm", "--", "curl", "-s", "-N", "-H", "content-type: application/json", "-d",
           '{"model": "gpt-stub", "stream": true}', f"https://llm.test:{stub.port}/v1/chat/completions?nousage")
        show = json.loads(av("policy", "b-llm", "show", "--json").stdout)["budget"]
        assert show["used"]["estimated"] == 1 and show["used"]["tokens"] > before
        # the counters, per model, on /metrics
        r = subprocess.run(["curl", "-s", "--unix-socket", str(avm_home / "run" / "agentvm.sock"), "http://d/metrics"],
                           capture_output=True, timeout=30)
        assert b'agentvm_llm_tokens_total{agent="b-llm",direction="output",model="gpt-stub"}' in r.stdout
        # the console shows it and sets it (here over the operator's socket: no browser session needed)
        sock = str(avm_home / "run" / "agentvm.sock")
        page = subprocess.run(["curl", "-s", "--unix-socket", sock, "http://d/sandboxes/b-llm"], capture_output=True,
                              timeout=30).stdout.decode()
        assert "LLM budget" in page and ">200<" in page
        r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--unix-socket", sock, "-d",
                            "action=budget&tokens=500", "http://d/sandboxes/b-llm/action"], capture_output=True, timeout=30)
        assert r.stdout == b"303"
        show = json.loads(av("policy", "b-llm", "show", "--json").stdout)["budget"]
        assert show["tokens"] == 500
        recs = [json.loads(x) for x in av("audit", "show", "--json", "--sandbox", "b-llm").stdout.splitlines()]
        assert any(x["kind"] == "policy.change" and x["actor"] == "console" and x["data"]["op"] == "budget" for x in recs)
        av("policy", "b-llm", "budget", "--reset")
        show = json.loads(av("policy", "b-llm", "show", "--json").stdout)["budget"]
        assert show["used"]["tokens"] == 0
    finally:
        av("rm", "b-llm", check=False)
        av("down", check=False)


def test_a_budget_host_is_never_spliced_or_spoken_to_in_http2(avm_home, tmp_path, stub):
    """The gate must see the responses it meters: a budget host's tunnel is terminated and
    offered HTTP/1.1 only, even when the client asks for h2 and no credential is bound."""
    f = agent_file(tmp_path, stub, "{requests: 1, hosts: [llm.test]}", name="b-h2")
    av("up")
    try:
        av("create", "-f", str(f), "--start")
        r = av("exec", "b-h2", "--", "curl", "-s", "--http2", "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
               "-H", "content-type: application/json", "-d", '{"model": "m"}',
               f"https://llm.test:{stub.port}/v1/chat/completions")
        assert r.stdout == b"1.1 200"
        r = av("exec", "b-h2", "--", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
               "content-type: application/json", "-d", '{"model": "m"}', f"https://llm.test:{stub.port}/v1/chat/completions")
        assert r.stdout == b"429"
        assert stub.calls == 1
    finally:
        av("rm", "b-h2", check=False)
        av("down", check=False)

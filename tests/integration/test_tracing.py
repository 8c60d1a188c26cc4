"""OpenTelemetry traces from a real daemon to a real OTLP/HTTP receiver on loopback (its
protobuf decoded with ``opentelemetry-proto``): one trace links a sandbox's launch, an exec,
the egress decision it caused and the credential swapped into it; the agent's own span, made
inside the sandbox with the OpenTelemetry SDK and exported to the gate's ``/otlp`` door,
arrives in the same trace through the relay. Without a collector nothing is exported and
``/otlp`` is refused."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import av, needs_root

pytestmark = [pytest.mark.integration, needs_root]

TESTLIB = Path(os.environ.get("AGENTVM_TESTLIB", "/opt/agentvm/testlib"))

AGENT_SPAN = textwrap.dedent("""\
    import os, sys
    sys.path.insert(0, "/opt/testlib")
    from opentelemetry.propagate import extract
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": "the-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))  # OTEL_EXPORTER_OTLP_ENDPOINT
    parent = extract({"traceparent": os.environ["TRACEPARENT"]})
    with provider.get_tracer("agent").start_as_current_span("agent-thinks", context=parent):
        pass
    provider.shutdown()
    print("exported")
    """)


FORGE = textwrap.dedent("""\
    import json, os, sys, urllib.request
    sys.path.insert(0, "/opt/testlib")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def export(service, extra, as_json=False):
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        for k, v in [("service.name", service)] + extra:
            a = rs.resource.attributes.add(); a.key = k; a.value.string_value = v
        sp = rs.scope_spans.add().spans.add()
        sp.name = "forged-" + service; sp.trace_id = bytes(range(1, 17)); sp.span_id = bytes(range(1, 9))
        if as_json:
            from google.protobuf import json_format
            body, ctype = json_format.MessageToJson(req).encode(), "application/json"
        else:
            body, ctype = req.SerializeToString(), "application/x-protobuf"
        r = urllib.request.Request(os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] + "/v1/traces", data=body,
                                   headers={"Content-Type": ctype}, method="POST")
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(r, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    print(export("agent-vm", []), export("sneaky", [("agentvm.agent", "someone-else"), ("agentvm.relayed", "no")]),
          export("json-agent", [], as_json=True))
    """)


class Collector:
    """An OTLP/HTTP receiver: every POST to /v1/traces decoded into spans."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.spans: list[dict] = []
        self.posts: list[str] = []
        self.lock = threading.Lock()
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with outer.lock:
                    outer.posts.append(self.path)
                if self.path == "/v1/traces":
                    req = ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    for rs in req.resource_spans:
                        service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                        resource = {a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
                                    for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for sp in ss.spans:
                                attrs = {}
                                for a in sp.attributes:
                                    v = a.value
                                    kind = v.WhichOneof("value")
                                    attrs[a.key] = ([x.string_value for x in v.array_value.values] if kind == "array_value"
                                                    else getattr(v, kind) if kind else None)
                                with outer.lock:
                                    outer.spans.append({"name": sp.name, "trace": sp.trace_id.hex(), "id": sp.span_id.hex(),
                                                        "parent": sp.parent_span_id.hex(), "service": service,
                                                        "resource": resource,
                                                        "attrs": attrs, "status": sp.status.code})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait_for(self, pred, timeout=15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            time.sleep(0.1)
        with self.lock:
            raise AssertionError(f"spans never matched; got {[(s['name'], s['service']) for s in self.spans]}")

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()



@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_one_trace_links_launch_exec_egress_credential_and_the_agents_own_span(avm_home, tmp_path, collector):
    from tests.integration.gate_upstreams import Upstream, sandbox_test_ca

    if not (TESTLIB / "opentelemetry").is_dir():
        pytest.fail(f"{TESTLIB} lacks the OpenTelemetry SDK: run `bash scripts/install.sh --test`")
    ca, cert, key = sandbox_test_ca(tmp_path)
    (tmp_path / "agent_span.py").write_text(AGENT_SPAN)
    (tmp_path / "forge.py").write_text(FORGE)
    os.chmod(tmp_path / "agent_span.py", 0o644)
    os.chmod(tmp_path / "forge.py", 0o644)
    up = Upstream(tls=(cert, key))
    av("up", "--otlp-endpoint", f"http://127.0.0.1:{collector.port}")
    try:
        av("secret", "set", "t-key", input=b"fake-trace-key-0123456789")
        f = tmp_path / "t-obs.yaml"
        f.write_text(textwrap.dedent(f"""\
            apiVersion: agentvm/v1
            kind: Agent
            metadata: {{name: t-obs}}
            spec:
              lifecycle: persistent
              command: ["/bin/sh", "-c", "exec sleep 600"]
              riskTier: L3
              limits: {{disk: 16M}}
              mounts:
                - {{host: {TESTLIB}, path: /opt/testlib, mode: ro}}
                - {{host: {tmp_path}, path: /opt/t, mode: ro}}
              egress:
                hosts: {{api.test: 127.0.0.1}}
                upstreamCa: {ca}
                allow: [{{host: api.test, ports: [{up.port}]}}]
              credentials:
                - {{name: k, env: K, ref: "vault:t-key", hosts: [api.test], inject: {{header: X-Api-Key}}}}
            """))
        av("create", "-f", str(f), "--start")
        env = av("exec", "t-obs", "--", "/bin/sh", "-c", "echo $TRACEPARENT $OTEL_EXPORTER_OTLP_ENDPOINT").stdout.decode()
        traceparent, endpoint = env.split()
        assert endpoint.startswith("http://127.0.0.1:") and endpoint.endswith("/otlp")
        trace_id = traceparent.split("-")[1]
        r = av("exec", "t-obs", "--", "/bin/sh", "-c",
               f'curl -s -o /dev/null -w "%{{http_code}}" -H "X-Api-Key: $K" https://api.test:{up.port}/v1/users/12345')
        assert r.stdout == b"200"
        assert av("exec", "t-obs", "--", "python3", "/opt/t/agent_span.py").stdout.strip() == b"exported"
        # a forged export: agent-vm's own service name is refused; the gate's marks cannot be overwritten
        assert av("exec", "t-obs", "--", "python3", "/opt/t/forge.py").stdout.split() == [b"400", b"200", b"200"]
        forged = collector.wait_for(lambda ss: any(s["name"] == "forged-sneaky" for s in ss)
                                    and any(s["name"] == "forged-json-agent" for s in ss))
        assert not any(s["name"] == "forged-agent-vm" for s in forged)
        sneaky = next(s for s in forged if s["name"] == "forged-sneaky")["resource"]
        assert sneaky["agentvm.agent"] == "t-obs" and sneaky["agentvm.relayed"] is True
        av("stop", "t-obs")
        spans = collector.wait_for(lambda ss: any(s["name"].startswith("agentvm.session") for s in ss)
                                   and any(s["name"] == "agent-thinks" for s in ss))
        mine = [s for s in spans if s["trace"] == trace_id]
        by_name: dict[str, list[dict]] = {}
        for s in mine:
            by_name.setdefault(s["name"], []).append(s)
        root = by_name["agentvm.session t-obs"][0]
        assert root["parent"] == "" and root["service"] == "agent-vm"
        assert root["attrs"]["agentvm.agent"] == "t-obs" and root["attrs"]["agentvm.substrate"]
        assert traceparent.split("-")[2] == root["id"], "the agent's parent is the session's root span"
        launch = by_name["launch"][0]
        assert launch["parent"] == root["id"]
        execs = by_name["exec"]
        assert len(execs) == 4 and all(e["parent"] == root["id"] for e in execs)
        egress = by_name["egress GET api.test"][0]
        assert egress["parent"] == root["id"]
        a = egress["attrs"]
        assert a["agentvm.egress.verdict"] == "allow" and a["agentvm.egress.rule"] == "allow[0]"
        assert a["url.template"] == "/v1/users/{id}", "a path template, no identifiers"
        assert a["server.port"] == up.port and a["agentvm.egress.bytes_in"] > 0
        cred = by_name["credential k"][0]
        assert cred["parent"] == egress["id"]
        assert cred["attrs"]["agentvm.credential.bound_hosts"] == ["api.test"]
        assert cred["attrs"]["agentvm.credential.use"] == "swap"
        # the agent's own span: made inside, relayed by the gate, in the same trace
        agent = by_name["agent-thinks"][0]
        assert agent["service"] == "the-agent" and agent["parent"] == root["id"]
        # marked by the gate as the agent's, so it can never pass for agent-vm's own
        assert agent["resource"]["agentvm.relayed"] is True and agent["resource"]["agentvm.agent"] == "t-obs"
        assert "agentvm.relayed" not in root["resource"]
        relayed = by_name["egress POST"][0]  # the relay is itself a decision on the log
        assert relayed["attrs"]["agentvm.egress.rule"] == "telemetry:relay"
        assert by_name["teardown"][0]["attrs"]["agentvm.teardown.verified"] is True
        raw = json.dumps(spans)
        assert "fake-trace-key" not in raw, "a span never carries a secret"
        log = "".join(p.read_text() for p in (avm_home / "logs").glob("*.egress.jsonl"))
        assert '"rule": "telemetry:relay"' in log
    finally:
        av("rm", "t-obs", check=False)
        av("down", check=False)
        up.close()


def test_without_a_collector_nothing_is_exported_and_otlp_is_refused(avm_home, tmp_path, collector):
    av("up")
    try:
        f = tmp_path / "t-none.yaml"
        f.write_text(textwrap.dedent("""\
            apiVersion: agentvm/v1
            kind: Agent
            metadata: {name: t-none}
            spec:
              lifecycle: persistent
              command: ["/bin/sh", "-c", "exec sleep 600"]
              limits: {disk: 16M}
            """))
        av("create", "-f", str(f), "--start")
        out = av("exec", "t-none", "--", "/bin/sh", "-c",
                 'echo "[$TRACEPARENT][$OTEL_EXPORTER_OTLP_ENDPOINT]"; '
                 'curl -s -X POST -H "Content-Type: application/x-protobuf" --data-binary x '
                 '"http://127.0.0.1:${HTTP_PROXY##*:}/otlp/v1/traces"').stdout.decode()
        assert out.startswith("[][]")
        assert '"telemetry:not-configured"' in out
        av("stop", "t-none")
        time.sleep(1.0)
        assert collector.posts == []
    finally:
        av("rm", "t-none", check=False)
        av("down", check=False)


def test_a_bad_otlp_endpoint_refuses_to_start(avm_home):
    r = av("up", "--otlp-endpoint", "127.0.0.1:4318", check=False)
    assert r.returncode == 78 and b"OTLP endpoint" in r.stderr and b"http://127.0.0.1:4318" in r.stderr

"""Fuzzing the OTLP relay's parser (gate/telemetry.py ``stamp``): exports from a sandbox -
protobuf or JSON, gzip'd or not, well-formed, corrupted, or claiming agent-vm's own names. The
relay either refuses (ExportRefused) or forwards an export whose every resource carries the
gate's marks exactly once, with the sandbox's identity, and no agentvm.* attribute of the
agent's own."""

from __future__ import annotations

import gzip

from hypothesis import given, strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from google.protobuf import json_format

from agentvm.gate.telemetry import ExportRefused, stamp
from tests.fuzz.grammar import FUZZ

KEYS = st.one_of(st.sampled_from(["service.name", "agentvm.sandbox", "agentvm.agent", "agentvm.relayed", "AGENTVM.x",
                                  "agentvm.", "x"]), st.text(max_size=12))
VALUES = st.one_of(st.sampled_from(["agent-vm", "Agent-VM", "agent\u2010vm", "agentvm", "ok", ""]), st.text(max_size=20))


@st.composite
def export(draw):
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 3))):
        rs = req.resource_spans.add()
        for _ in range(draw(st.integers(0, 3))):
            kv = rs.resource.attributes.add()
            kv.key, kv.value.string_value = draw(KEYS), draw(VALUES)
        for _ in range(draw(st.integers(0, 2))):
            ss = rs.scope_spans.add()
            ss.scope.name = draw(VALUES)
            for _ in range(draw(st.integers(0, 2))):
                sp = ss.spans.add()
                sp.name = draw(st.text(max_size=10))
                sp.trace_id, sp.span_id = draw(st.binary(min_size=16, max_size=16)), draw(st.binary(min_size=8, max_size=8))
                kv = sp.attributes.add()
                kv.key, kv.value.string_value = draw(KEYS), draw(VALUES)
    as_json = draw(st.booleans())
    data = json_format.MessageToJson(req).encode() if as_json else req.SerializeToString()
    if draw(st.integers(0, 3)) == 0 and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + draw(st.binary(max_size=6)) + data[i + 1:]
    if draw(st.integers(0, 5)) == 0:
        data = draw(st.binary(max_size=80))
    coding = b""
    if draw(st.booleans()):
        data, coding = gzip.compress(data), b"gzip"
        if draw(st.integers(0, 4)) == 0:
            data = data[: len(data) // 2]
    return data, (b"application/json" if as_json else b"application/x-protobuf"), coding


@FUZZ
@given(case=export())
def test_stamp(case):
    data, ctype, coding = case
    try:
        out = stamp(data, ctype, coding, "traces", "sb-1", "agent-1")
    except ExportRefused:
        return
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(out)
    for rs in msg.resource_spans:
        attrs = [(kv.key, kv.value) for kv in rs.resource.attributes]
        ours = [(k, v) for k, v in attrs if k.lower().startswith("agentvm.")]
        assert sorted(k for k, _ in ours) == ["agentvm.agent", "agentvm.relayed", "agentvm.sandbox"], ours
        assert dict(ours)["agentvm.sandbox"].string_value == "sb-1"
        for ss in rs.scope_spans:
            for sp in ss.spans:
                assert not any(kv.key.lower().startswith("agentvm.") for kv in sp.attributes)

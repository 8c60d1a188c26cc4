"""agentvm.names under hostile input: nothing long is ever normalised (NFKC makes U+FDFA 18
characters: a 4 MB tool name cost 1.35 s of the gate's one shared loop), and the agent-vm
look-alike check sees through every invisible character, not only format (Cf) ones.

The work is asserted, never the time: ``unicodedata.normalize`` is watched and must never be
handed a long string."""

from __future__ import annotations

import asyncio
import types as pytypes

import pytest

from agentvm import names

BIG = "\ufdfa" * 1_390_000  # ~4 MB of UTF-8, 25 M characters once NFKC'd


@pytest.fixture
def normalized(monkeypatch):
    """The length of every string agentvm.names hands to unicodedata.normalize."""
    seen: list[int] = []
    real = names.unicodedata.normalize

    def spy(form, s):
        seen.append(len(s))
        return real(form, s)

    monkeypatch.setattr(names.unicodedata, "normalize", spy)
    return seen


def test_norm_refuses_a_long_name_before_normalising_it(normalized):
    with pytest.raises(ValueError):
        names.norm(BIG)
    with pytest.raises(ValueError):
        names.norm("a" * (names.MAX_NAME + 1))
    assert not names.same(BIG, BIG) and not names.same("x", BIG)
    assert names.find([pytypes.SimpleNamespace(name="x")], BIG) is None
    with pytest.raises(ValueError):
        names.match(BIG, "*")
    with pytest.raises(ValueError):
        names.first_match(["*"], BIG)
    assert normalized == [], "a long name was normalised"
    assert names.norm("\ufdfa" * 10) == names.norm("\ufdfa" * 10)  # short ones still are


def test_reading_checks_its_limit_before_normalising(normalized):
    assert names.reading(BIG) is None
    assert names.reading("\ufdfa" * (names.MAX_READING + 1)) is None
    assert names.reading("\u200b" * 900 + "x" * 200) is None
    assert max(normalized, default=0) <= names.MAX_READING, f"normalised {max(normalized)} characters"
    assert names.reading("Agent\u2212VM") == names.reading("agent-vm")


def test_a_long_otlp_service_name_is_refused_without_normalising_it(normalized):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from agentvm.gate.telemetry import ExportRefused, _looks_like_ours, stamp

    with pytest.raises(ExportRefused, match="characters"):
        _looks_like_ours("\ufdfa" * 100_000)
    # padded with invisible characters past the limit: refused too (never "too long to be a look-alike")
    with pytest.raises(ExportRefused):
        _looks_like_ours("agent-vm" + "\u200b" * names.MAX_NAME)
    req = ExportTraceServiceRequest()
    a = req.resource_spans.add().resource.attributes.add()
    a.key, a.value.string_value = "service.name", "\ufdfa" * 100_000
    with pytest.raises(ExportRefused):
        stamp(req.SerializeToString(), b"application/x-protobuf", b"", "traces", "sb", "ag")
    assert max(normalized, default=0) <= names.MAX_NAME


def _gateway(tmp_path):
    from agentvm.tools import policy as tp
    from agentvm.tools.gateway import ToolGateway

    sp = tp.ServerPolicy(name="notes", kind="local", allow=("*",), deny=("*admin*",))
    pol = tp.ToolPolicy(servers=(sp,), tier_approval=(), tier="L3")
    logs: list = []
    gw = ToolGateway(sandbox_id="sbx1", agent="a", policy=pol, policy_digest="sha256:v1", run_dir=tmp_path,
                     log=lambda **kw: logs.append(kw))

    async def get():
        raise AssertionError("the upstream is never reached for a refused name")

    gw.upstreams["notes"].get = get
    return gw, logs


@pytest.mark.parametrize("name", [BIG, "notes__" + BIG, BIG + "__x", "notes__" + "a" * 300, "x" * 300 + "__y",
                                  "notes__r\u00e9ad", "notes__read\uff0a", "notes__a b", "", None])
def test_the_gateway_refuses_a_bad_tool_name_before_comparing_it(tmp_path, normalized, name):
    from agentvm.tools.gateway import MCPError

    gw, logs = _gateway(tmp_path)
    with pytest.raises(MCPError) as e:
        asyncio.run(gw._call_tool(None, pytypes.SimpleNamespace(name=name, arguments={})))
    assert "tools:invalid-name" in str(e.value)
    assert normalized == [], "an invalid name was normalised"
    assert logs and logs[-1]["rule_id"] == "tools:invalid-name" and len(logs[-1]["tool"]) <= 200


def test_a_long_prompt_name_is_refused_before_comparing_it(tmp_path, normalized):
    from agentvm.tools.gateway import MCPError

    gw, _ = _gateway(tmp_path)
    with pytest.raises(MCPError):
        asyncio.run(gw._get_prompt(None, pytypes.SimpleNamespace(name="x" * 100_000 + "__y", arguments={})))
    assert normalized == []


@pytest.mark.parametrize("name", [
    "agent-vm\u034f",      # COMBINING GRAPHEME JOINER (Mn)
    "agent-vm\ufe0f",      # VARIATION SELECTOR-16
    "agent-vm\U000e0100",  # VARIATION SELECTOR-17
    "agent-vm\u180b",      # MONGOLIAN FREE VARIATION SELECTOR ONE
    "agent-vm\u17b4",      # KHMER VOWEL INHERENT AQ
    "agent-vm\u115f",      # HANGUL CHOSEONG FILLER
    "agent-vm\u2800",      # BRAILLE PATTERN BLANK (not an ignorable, shows nothing)
    "agent\u3164-vm",      # HANGUL FILLER
    "agent-\uffa0vm",      # HALFWIDTH HANGUL FILLER (NFKC: U+1160, another filler)
    "a\U000e0067gent-vm",  # TAG LATIN SMALL LETTER G
    "\u00adagent-vm",      # SOFT HYPHEN
])
def test_invisible_characters_do_not_hide_agent_vm(name):
    from agentvm.gate.telemetry import _looks_like_ours

    assert _looks_like_ours(name)
    assert names.looks_like(name, "agent-vm")


def test_the_ignorable_table_is_default_ignorable_code_point():
    """Spot checks of the generated table against DerivedCoreProperties (and what it is not)."""
    from agentvm._ignorable import RANGES

    def inside(cp):
        return any(lo <= cp <= hi for lo, hi in RANGES)

    for cp in (0x00AD, 0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180F, 0x200B, 0x2065, 0x3164, 0xFE00,
               0xFEFF, 0xFFA0, 0x1D173, 0xE0000, 0xE0100, 0xE0FFF):
        assert inside(cp), hex(cp)
    for cp in (0x0020, 0x0041, 0x2800, 0x00A0, 0xE1000, 0x1161):
        assert not inside(cp), hex(cp)
    assert names.invisible("\u2800") and not names.invisible("a")

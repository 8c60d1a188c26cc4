"""The committed JSON schema is up to date and accepts human units."""

from __future__ import annotations

import json
import re

from agentvm.spec import schema as schema_mod
from agentvm.spec.models import DURATION_PATTERN, SIZE_PATTERN
from agentvm.units import parse_duration, parse_size


def test_committed_schema_file_is_up_to_date():
    committed = schema_mod.SCHEMA_FILE.read_text(encoding="utf-8")
    assert committed == schema_mod.render(), (
        "src/agentvm/schema/agent.schema.json is stale: run `python -m agentvm.spec.schema`"
    )


def test_schema_has_id_title_and_camel_case_names():
    s = schema_mod.json_schema()
    assert s["$id"].endswith("agent.schema.json") and s["title"]
    body = s["$defs"]["AgentSpecBody"]["properties"]
    assert "riskTier" in body and "risk_tier" not in body
    assert "allowPtrace" in s["$defs"]["Security"]["properties"]
    assert s["required"] == ["apiVersion", "kind", "metadata"]
    assert s["additionalProperties"] is False


def _accepts(prop: dict, value) -> bool:
    for alt in prop["anyOf"]:
        if alt["type"] == "integer" and isinstance(value, int):
            return True
        if alt["type"] == "number" and isinstance(value, (int, float)):
            return True
        if alt["type"] == "string" and isinstance(value, str) and re.search(alt["pattern"], value):
            return True
    return False


def test_sizes_and_durations_accept_int_and_string():
    lim = schema_mod.json_schema()["$defs"]["Limits"]["properties"]
    for f in ("memory", "disk", "tmp", "shm"):
        assert _accepts(lim[f], 268435456) and _accepts(lim[f], "256M"), f
        assert not _accepts(lim[f], "lots"), f
    assert _accepts(lim["timeout"], 30) and _accepts(lim["timeout"], "5m") and _accepts(lim["timeout"], "1h30m")
    assert not _accepts(lim["timeout"], "soon")
    assert lim["memory"]["description"]  # field descriptions survive
    rule = schema_mod.json_schema()["$defs"]["EgressRule"]["properties"]["maxBody"]
    assert any(a.get("type") == "string" for a in rule["anyOf"])


def test_schema_patterns_agree_with_the_parsers():
    sizes = ["256M", "1G", "10", "1.5g", "512Ki", "2GiB", " 3 M ", "lots", "1X", "", "M", "-1M"]
    for s in sizes:
        try:
            parse_size(s)
            ok = True
        except ValueError:
            ok = False
        assert bool(re.search(SIZE_PATTERN, s)) == ok, s
    durs = ["30s", "5m", "1h30m", "250ms", "10", "1.5", "soon", "", "5x", "m", "1h 30m"]
    for d in durs:
        try:
            parse_duration(d)
            ok = True
        except ValueError:
            ok = False
        assert bool(re.search(DURATION_PATTERN, d)) == ok, d


def test_schema_is_json_serialisable_and_stable():
    assert json.loads(schema_mod.render()) == schema_mod.json_schema()
    assert schema_mod.render() == schema_mod.render()

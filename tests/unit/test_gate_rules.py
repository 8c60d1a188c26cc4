"""The rule-id registry (``agentvm.gate.rules``) against the code and the docs.

Every id the gate's source can put in a record is registered, and every registered id is in
``docs/egress.md``: a new deny path without a documented id fails here.
"""

from __future__ import annotations

import re
from pathlib import Path


from agentvm.gate import rules

ROOT = Path(__file__).resolve().parents[2]
GATE = ROOT / "src" / "agentvm" / "gate"
DOC = (ROOT / "docs" / "egress.md").read_text()

# the places a rule id is written in the gate's code (a literal after one of these)
_SITES = [
    r'rule_id="([^"]+)"',
    r'rule_id=f"([^"{]+)\{',  # an f-string: its fixed prefix is a family
    r'Deny\(rule_id="([^"]+)"',
    r'\bdeny\(req, "([^"]+)"',
    r'_deny\("([^"]+)"',
    r'Decision\(\s*"deny",\s*"([^"]+)"',
    r'DecodeError\("([^"]+)"',
    r'error_response\(\d+, "([^"]+)"',
    r'deny_response\("([^"]+)"',
    r'error="([^"]+)"',
    r'UpstreamError\("([^"]+)"',
    r'CredentialError\(\s*f"([^"{]+)\{',
    r'"rule": "([^"]+)"',
]


def _ids_in_code() -> dict[str, str]:
    """id (or, for an f-string, its fixed prefix ending in ``:``) -> the file it is in."""
    found: dict[str, str] = {}
    for path in sorted(GATE.glob("*.py")):
        text = path.read_text()
        for pat in _SITES:
            for m in re.finditer(pat, text):
                found.setdefault(m.group(1), path.name)
    return found


def _registered(rule_id: str) -> bool:
    if rule_id in rules.RULES or rules.known(rule_id):
        return True
    # an f-string prefix: the families it can complete to are registered
    return rule_id.endswith(":") and any(fam.startswith(rule_id) for fam in rules.FAMILIES)


def _protocol_codes() -> set[str]:
    text = (GATE / "h1.py").read_text()
    return set(re.findall(r'ProtocolError\("([^"]+)"', text))


def _signing_codes() -> set[str]:
    text = (GATE / "signing.py").read_text()
    return set(re.findall(r'"((?:sigv4|hmac):[a-z0-9-]+)"', text))


def test_the_scan_finds_the_ids_it_should():
    ids = _ids_in_code()
    # the scan itself must work (else the next test passes on nothing)
    for expected in ("default-deny", "limit:connections", "credential:unavailable", "upstream:reset", "not-tls",
                     "credential:leak:", "bad-request:"):
        assert expected in ids, expected
    assert len(ids) > 30 and len(_protocol_codes()) > 10 and len(_signing_codes()) > 8


def test_every_id_the_gate_can_write_is_registered():
    unknown = {i: where for i, where in _ids_in_code().items() if not _registered(i)}
    assert not unknown, f"rule ids used in the gate but missing from agentvm.gate.rules.RULES: {unknown}"
    for code in _protocol_codes():
        assert rules.known(f"bad-request:{code}"), code
    for code in _signing_codes():
        assert rules.known(f"credential:{code}"), code


def test_the_docs_table_is_the_registry():
    start = DOC.index("<!-- rule-ids:begin")
    block = DOC[DOC.index("\n", start) + 1:DOC.index("<!-- rule-ids:end -->")].strip()
    assert block == rules.markdown_table(), "docs/egress.md's rule-id table differs from agentvm.gate.rules: regenerate it"
    for rule_id in rules.RULES:
        assert f"`{rules.shown(rule_id)}`" in block


def test_every_protocol_and_signing_code_is_documented():
    for code in _protocol_codes():
        assert f"`{code}`" in DOC, f"bad-request code {code!r} missing from docs/egress.md"
    for code in _signing_codes():
        assert f"`{code.split(':', 1)[1]}`" in DOC, f"signing code {code!r} missing from docs/egress.md"


def test_describe_resolves_families_and_leaves_operator_ids_alone():
    assert rules.describe("credential:leak:github") == rules.RULES["credential:leak:"]
    assert rules.describe("bad-request:cl-and-te") == rules.RULES["bad-request:"]
    assert rules.describe("api-upload:max-body") == rules.RULES[":max-body"]
    assert rules.describe("my-rule") is None and not rules.known("api-read")

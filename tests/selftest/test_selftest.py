"""`agentvm selftest` proves containment on the host; this proves `agentvm selftest`:
every case is contained in the real configuration, and every case reports *escaped* when
run against the deliberately weakened configuration it names."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agentvm.selftest import runner
from agentvm.selftest.framework import CATEGORIES, POLICY_WEAKENINGS, Env, all_cases, run_cases
from tests.helpers import needs_root

pytestmark = [pytest.mark.attack, needs_root]
ROOT = Path(__file__).resolve().parents[2]
CASES = all_cases()
BY_WEAKENING = {w: [c for c in cs] for w, cs in itertools.groupby(sorted(CASES, key=lambda c: c.weakened_by),
                                                                    key=lambda c: c.weakened_by)}


def test_suite_shape():
    assert len(CASES) >= 80, f"only {len(CASES)} cases"
    assert {c.category for c in CASES} == set(CATEGORIES), "every category has cases"


def test_every_case_is_contained_on_this_host():
    report = runner.run()
    bad = [r for r in report["results"] if r["status"] != "contained"]
    assert not bad, "\n".join(f"{r['id']}: {r['status']}: {r['evidence']}" for r in bad)
    assert report["contained"] == len(CASES)


def _gvisor_unavailable() -> str | None:
    from tests.contract.conftest import skip_reason

    return skip_reason("gvisor")


@pytest.mark.skipif(_gvisor_unavailable() is not None, reason=str(_gvisor_unavailable()))
def test_every_applicable_case_is_contained_on_gvisor():
    """The same attacks against gVisor sandboxes: every case that applies is contained; the
    ones that do not are reported n/a with their reason, never as a pass."""
    report = runner.run(substrate="gvisor")
    bad = [r for r in report["results"] if r["status"] not in ("contained", "n/a")]
    assert not bad, "\n".join(f"{r['id']}: {r['status']}: {r['evidence']}" for r in bad)
    na = [r for r in report["results"] if r["status"] == "n/a"]
    assert {r["id"] for r in na} == {c.id for c in CASES if not c.applies_to("gvisor")}
    assert all("not applicable on gvisor: " in r["evidence"] and len(r["evidence"]) > 40 for r in na)
    assert report["contained"] == report["applicable"] == len(CASES) - len(na)
    assert report["contained"] >= 100, report["contained"]


GVISOR_PROOFS = sorted(w for w in BY_WEAKENING if set(w.split("+")) <= POLICY_WEAKENINGS)


@pytest.mark.skipif(_gvisor_unavailable() is not None, reason=str(_gvisor_unavailable()))
@pytest.mark.parametrize("weakening", GVISOR_PROOFS)
def test_cases_can_fail_on_gvisor_too(weakening):
    """The policy- and gate-level weakenings apply on gVisor as well: its 'contained' verdicts
    can fail there too (the substrate-level ones are proven on bwrap, whose plan they edit)."""
    env = Env(weaken=weakening, substrate="gvisor")
    try:
        results = run_cases([c for c in BY_WEAKENING[weakening] if c.applies_to("gvisor")], env)
    finally:
        env.close()
    not_escaped = [r for r in results if r["status"] != "escaped"]
    assert results and not not_escaped, "\n".join(f"{r['id']}: {r['status']}: {r['evidence']}" for r in not_escaped)


@pytest.mark.parametrize("weakening", sorted(BY_WEAKENING))
def test_cases_report_escaped_when_their_layer_is_removed(weakening):
    env = Env(weaken=weakening)
    try:
        results = run_cases(BY_WEAKENING[weakening], env)
    finally:
        env.close()
    not_escaped = [r for r in results if r["status"] != "escaped"]
    assert not not_escaped, "\n".join(f"{r['id']}: {r['status']}: {r['evidence']}" for r in not_escaped)


def test_security_tests_doc_is_generated_from_the_cases():
    doc = (ROOT / "docs" / "security-tests.md").read_text()
    assert doc.strip() == runner.markdown().strip(), "regenerate: agentvm selftest --list --markdown > docs/security-tests.md"

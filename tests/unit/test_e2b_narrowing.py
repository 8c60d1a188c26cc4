"""Review 8, finding 2: an E2B create's ``network.allowOut`` may only narrow its template.

The gate takes the first matching allow rule, so the rules a create keeps must stay in the
template's order: a tenant listed a wildcard first (``["*.x.test", "a.x.test"]``) and a plain
allow landed in front of the template's ``action: ask`` rule - requests a human had to approve
went out unapproved. Here the sandbox's agent file (``templates.sandbox_spec``) is loaded and
compiled as the daemon does (``load_agent_text`` -> ``policy.compile_policy``) and asked by
the gate's own ``decide_request``: for every request, the sandbox's answer is the template's
answer or a deny - never an allow where the template asks - whatever the allowOut list.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.e2b import templates as tpls
from agentvm.errors import AgentVMError
from agentvm.gate.policy import decide_request
from agentvm.policy import compile_policy
from agentvm.spec.loader import load_agent_text

ASK_TEMPLATE = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {name: tplask}
spec:
  riskTier: L3
  lifecycle: persistent
  command: [/bin/sleep, infinity]
  egress:
    hosts: {a.x.test: 127.0.0.1, b.x.test: 127.0.0.1}
    allow:
      - {host: a.x.test, ports: [18933], action: ask}   # a human approves every request
      - {host: "*.x.test", ports: [18933]}
"""

GITHUB_TEMPLATE = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {name: gh}
spec:
  riskTier: L3
  egress:
    allow:
      - {host: api.github.com, methods: [POST, PUT, DELETE], action: ask}
      - {host: "*.github.com"}
"""

REQUESTS = [(h, port, m, path) for h in ("a.x.test", "b.x.test", "c.a.x.test", "z.x.test", "x.test",
                                         "api.github.com", "gist.github.com", "github.com")
            for port in (443, 18933) for m in ("GET", "POST") for path in ("/", "/admin/x")]


def _policy(text: str):
    return compile_policy(load_agent_text(text, "<test>").spec).egress


def _verdicts(pol) -> dict:
    return {r: _ask(pol, *r) for r in REQUESTS}


def _ask(pol, host, port, method, path) -> str:
    """The gate's verdict on one request (https on 443, with the host as its SNI)."""
    tls = port == 443
    return decide_request(pol, host, port, "https" if tls else "http", method, path, 0, host if tls else None,
                          False).verdict


def _narrowed(text: str, name: str, allow_out: list[str]):
    tpl = tpls.Template(name, text, public=True)
    out = tpls.sandbox_spec(tpl, "e2b-test", tpls.CreateOptions(template=name, allow_out=allow_out))
    return _policy(out)


def _check_monotone(text: str, name: str, allow_out: list[str]) -> None:
    want = _verdicts(_policy(text))
    got = _verdicts(_narrowed(text, name, allow_out))
    for req, v in got.items():
        # the sandbox answers what the template answers, or denies; never allow where it asks
        assert v == "deny" or v == want[req], (allow_out, req, "template:", want[req], "sandbox:", v)


@pytest.mark.parametrize("allow_out", [list(p) for n in (1, 2, 3)
                                       for p in itertools.permutations(["*.x.test", "a.x.test", "b.x.test"], n)]
                         + [["A.X.TEST."], ["*.a.x.test", "*.x.test"], ["c.a.x.test", "*.x.test", "a.x.test"]])
def test_reordering_allow_out_never_skips_the_templates_ask(allow_out):
    _check_monotone(ASK_TEMPLATE, "tplask", allow_out)
    pol = _narrowed(ASK_TEMPLATE, "tplask", allow_out)
    v = decide_request(pol, "a.x.test", 18933, "http", "GET", "/needs-approval", 0, None, False).verdict
    assert v in ("ask", "deny")
    if any(h.lower().rstrip(".") in ("a.x.test", "*.x.test") for h in allow_out):
        assert v == "ask"  # a.x.test is in what the create kept: it is still asked for


def test_the_reviewers_case_and_the_github_example():
    # the review's reproduction: allow[0] was a plain *.x.test, so a.x.test went out unapproved
    pol = _narrowed(ASK_TEMPLATE, "tplask", ["*.x.test", "a.x.test"])
    assert pol.allow[0].ask and pol.allow[0].host == "a.x.test"
    assert decide_request(pol, "a.x.test", 18933, "http", "GET", "/", 0, None, False).verdict == "ask"
    assert decide_request(pol, "b.x.test", 18933, "http", "GET", "/", 0, None, False).verdict == "allow"
    for allow_out in (["*.github.com", "api.github.com"], ["*.github.com"], ["gist.github.com", "*.github.com"]):
        _check_monotone(GITHUB_TEMPLATE, "gh", allow_out)
        pol = _narrowed(GITHUB_TEMPLATE, "gh", allow_out)
        assert _ask(pol, "api.github.com", 443, "POST", "/repos/x") == "ask"
        assert _ask(pol, "api.github.com", 443, "GET", "/repos/x") == "allow"


def test_allow_out_still_cannot_widen():
    for bad in (["*.test"], ["x.test"], ["evil.test"], ["*"], ["10.0.0.0/8"]):
        with pytest.raises(AgentVMError):
            _narrowed(ASK_TEMPLATE, "tplask", bad)


# a small generated space: templates of rules over nested and disjoint host patterns, with and
# without ask, methods and paths; allowOut lists of names and wildcards in any order
HOSTS = ["a.x.test", "*.x.test", "*.a.x.test", "b.x.test", "c.a.x.test", "api.github.com", "*.github.com"]
rule = st.fixed_dictionaries({
    "host": st.sampled_from(HOSTS),
    "ports": st.sampled_from([[443], [18933], [443, 18933]]),
    "methods": st.sampled_from([[], ["POST"]]),
    "paths": st.sampled_from([[], ["/admin/**"]]),
    "action": st.sampled_from(["allow", "ask"]),
})


def _template(rules: list[dict]) -> str:
    import yaml

    return yaml.safe_dump({"apiVersion": "agentvm/v1", "kind": "Agent", "metadata": {"name": "gen"},
                           "spec": {"riskTier": "L3", "egress": {"allow": rules}}}, sort_keys=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=st.lists(rule, min_size=1, max_size=4),
       allow_out=st.lists(st.sampled_from(HOSTS + ["A.X.TEST.", "z.x.test"]), min_size=1, max_size=4))
def test_narrowing_is_monotone_for_generated_templates(rules, allow_out):
    text = _template(rules)
    try:
        pol = _narrowed(text, "gen", allow_out)
    except AgentVMError:
        return  # an allowOut host the template does not allow: refused, nothing made
    want, got = _verdicts(_policy(text)), _verdicts(pol)
    kept = [tpls._pattern(h) for h in allow_out]
    from agentvm.gate.policy import host_matches

    for req, v in got.items():
        assert v == "deny" or v == want[req], (rules, allow_out, req, want[req], v)
        # and exact: a request to a host the create kept gets the template's own answer
        if any(host_matches(k, req[0]) for k in kept):
            assert v == want[req], (rules, allow_out, req, want[req], v)

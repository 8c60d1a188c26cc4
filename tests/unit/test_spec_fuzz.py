"""Hypothesis: whatever text arrives, the loader answers with a result or a SpecError."""

from __future__ import annotations


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentvm.errors import SpecError, SpecProblem
from agentvm.spec.loader import LoadedAgent, load_agent_text

from _spec_helpers import HEADER


YAMLISH = st.text(
    alphabet=st.sampled_from(list("abcdefkmnpsty019 :-[]{},&*!|>'\"#\n\t.%@?<=/") + ["\x00", "\u00e9", "\ufeff"]),
    max_size=200,
)

FIELDS = ["apiVersion", "kind", "metadata", "name", "spec", "limits", "memory", "mounts", "host", "path",
          "mode", "presets", "riskTier", "env", "command", "timeout", "<<", "rw", "L0", "/x", "&a", "*a", "!!str"]
TOKENS = st.lists(
    st.one_of(st.sampled_from(FIELDS), st.sampled_from([": ", "\n", "  ", "- ", "[", "]", "{", "}", ", "]),
              st.integers(-5, 10**6).map(str)),
    max_size=60,
).map("".join)


def _check(text: str) -> None:
    try:
        result = load_agent_text(text, "fuzz.yaml", preset_dirs=[])
    except SpecError as exc:
        assert exc.problems, "every SpecError names at least one problem"
        for p in exc.problems:
            assert isinstance(p, SpecProblem)
            assert p.render().startswith(p.file or "<input>")
            assert p.line is None or p.line >= 1
    else:
        assert isinstance(result, LoadedAgent)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(YAMLISH)
def test_arbitrary_text_only_raises_spec_error(text):
    _check(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TOKENS)
def test_agent_shaped_text_only_raises_spec_error(body):
    _check(HEADER + body)
    _check(HEADER + "spec:\n  " + body.replace("\n", "\n  "))

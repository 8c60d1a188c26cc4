"""One vocabulary of errors: every code the source raises is in agentvm.errorcodes (with its
HTTP status and exit code), docs/cli.md carries the registry's table as it is, and an error's
exit code and status come from the registry - embedded, through the daemon and on the CLI."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from agentvm import errorcodes
from agentvm.errors import AgentVMError, ConfigError, PolicyDenied

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "agentvm"


def _raised_codes() -> dict[str, set[str]]:
    """code -> where: every `code = "..."` of a class and `code="..."` / `_refuse("...")` of a call."""
    found: dict[str, set[str]] = {}
    for p in SRC.rglob("*.py"):
        if p.name == "errorcodes.py":
            continue
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                for b in n.body:
                    if (isinstance(b, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in b.targets)
                            and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                        found.setdefault(b.value.value, set()).add(f"{p.relative_to(SRC)}:{n.name}")
            if isinstance(n, ast.Call):
                for k in n.keywords:
                    if k.arg == "code" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str):
                        found.setdefault(k.value.value, set()).add(f"{p.name}:{n.lineno}")
                if isinstance(n.func, ast.Name) and n.func.id == "_refuse" and n.args and isinstance(n.args[0], ast.Constant):
                    found.setdefault(n.args[0].value, set()).add(f"{p.name}:{n.lineno}")
    return found


def test_every_code_the_source_raises_is_registered():
    missing = {c: sorted(w) for c, w in _raised_codes().items() if errorcodes.lookup(c) is None}
    assert not missing, f"register these in agentvm/errorcodes.py: {missing}"


def test_docs_cli_carries_the_registry_table():
    text = (ROOT / "docs" / "cli.md").read_text()
    start, end = "<!-- error-codes:begin (python -m agentvm.errorcodes) -->", "<!-- error-codes:end -->"
    assert start in text and end in text
    table = text[text.index(start) + len(start):text.index(end)].strip()
    assert table == errorcodes.markdown(), "docs/cli.md's error table is stale: python -m agentvm.errorcodes"


def test_a_class_with_a_code_of_its_own_answers_as_the_registry_says():
    for code, where in _raised_codes().items():
        for w in where:
            mod, _, name = w.partition(":")
            if name.isdigit():
                continue
            path = SRC / mod
            module = ".".join(("agentvm", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
            cls = getattr(importlib.import_module(module), name)
            if not (isinstance(cls, type) and issubclass(cls, AgentVMError)):
                continue
            want = errorcodes.lookup(code)
            assert cls.exit_code == want.exit, f"{module}.{name}: class exit {cls.exit_code}, registry {want.exit}"


def test_an_error_takes_its_status_and_exit_from_its_code():
    e = ConfigError("x", code="sandbox.not-running")
    assert (e.status, e.exit_code) == (409, 78)
    e = AgentVMError("x", code="fleet.busy")
    assert (e.status, e.exit_code) == (409, 1)
    e = PolicyDenied("x")
    assert (e.status, e.exit_code) == (403, 77)
    e = AgentVMError("x", code="no.such-code")  # unregistered: the family's own (the test above forbids it)
    assert (e.status, e.exit_code) == (500, 125)


def test_codes_are_dotted_and_statuses_and_exits_are_from_the_documented_sets():
    for c in errorcodes.CODES.values():
        assert ("." in c.code or c.code == "signing:error") and c.code == c.code.lower(), c.code
        assert 400 <= c.status <= 599 and c.exit in (1, 2, 75, 77, 78, 125), c

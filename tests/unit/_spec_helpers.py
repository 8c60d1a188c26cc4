"""Builders for agent and preset files, shared by the spec tests (line numbers matter:
the header is exactly 4 lines, so a body's first line is line 5)."""

from __future__ import annotations

import textwrap
from pathlib import Path

HEADER = "apiVersion: agentvm/v1\nkind: Agent\nmetadata:\n  name: t\n"


def agent(body: str = "") -> str:
    """An agent file: the fixed 4-line header, then ``body`` (dedented) - line 5 onwards."""
    return HEADER + textwrap.dedent(body)


def write_preset(d: Path, name: str, spec: str = "", *, description: str = "", extra: str = "") -> Path:
    """Write ``d/name.yaml``; ``spec`` is dedented and indented under ``spec:``: its first line is line 7."""
    d.mkdir(parents=True, exist_ok=True)
    body = textwrap.indent(textwrap.dedent(spec), "  ") if spec else ""
    text = (
        f"apiVersion: agentvm/v1\nkind: Preset\nmetadata:\n  name: {name}\n"
        f"description: {description or name + ' preset'}\n"
        + (f"spec:\n{body}" if spec else "")
        + extra
    )
    p = d / f"{name}.yaml"
    p.write_text(text)
    return p

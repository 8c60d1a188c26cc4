"""JSON Schema of the agent file, for editors (yaml-language-server) and other tools.

The committed copy lives in ``src/agentvm/schema/agent.schema.json``; regenerate it with
``python -m agentvm.spec.schema`` (a unit test fails when it is out of date).
"""

from __future__ import annotations

import json
from pathlib import Path

from agentvm.spec.models import AgentSpec

SCHEMA_ID = "https://agentvm.dev/schema/agent.schema.json"
SCHEMA_FILE = Path(__file__).resolve().parent.parent / "schema" / "agent.schema.json"


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of an agent file, field names in YAML spelling."""
    body = AgentSpec.model_json_schema(by_alias=True, mode="validation")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "agent-vm agent file (apiVersion agentvm/v1, kind Agent)",
    }
    body.pop("title", None)
    schema.update(body)
    return schema


def render() -> str:
    """The schema as the exact text of the committed file."""
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


def write(path: Path = SCHEMA_FILE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(), encoding="utf-8")
    return path


if __name__ == "__main__":  # pragma: no cover
    print(write())

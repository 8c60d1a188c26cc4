"""The daemon's state: SQLite (WAL) is the truth about every sandbox it manages.

A row holds what the operator asked for (the agent file's text and CLI overrides, the
desired state) and what is (the sandbox id, the supervisor pid, the last exit). After a
crash the daemon rebuilds everything from here.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    name TEXT PRIMARY KEY,
    spec_text TEXT NOT NULL,
    spec_file TEXT NOT NULL,
    lifecycle TEXT NOT NULL,
    desired TEXT NOT NULL,          -- running | stopped
    state TEXT NOT NULL,            -- created | starting | running | backoff | exited | stopped | failed
    sandbox_id TEXT,
    restarts INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    created REAL NOT NULL,
    started REAL,
    ttl REAL,                       -- ephemeral: seconds after start before it is stopped
    idle_timeout REAL,              -- ephemeral: seconds without exec/egress before it is stopped
    last_activity REAL,
    policy_patch TEXT NOT NULL DEFAULT '{}'   -- live changes applied on top (egress rules, pause)
);
"""


# The daemon's sandbox states and the only transitions between them. The supervisor changes a
# state only through ``State.update(state=...)``, which refuses anything not in this table;
# the tests read the same table.
TRANSITIONS: dict[str, frozenset[str]] = {
    "created": frozenset({"starting", "stopped"}),  # start / stop of a never-started sandbox
    "starting": frozenset({"running", "failed", "stopped"}),  # launched / refused or broken / stopped early
    "running": frozenset({"backoff", "exited", "failed", "stopped"}),  # restart due / done / broken / stopped
    "backoff": frozenset({"starting", "stopped"}),  # the restart begins / stopped while waiting
    "exited": frozenset({"starting", "stopped"}),
    "stopped": frozenset({"starting", "stopped"}),
    "failed": frozenset({"starting", "stopped"}),
}
STATES = tuple(TRANSITIONS)


class IllegalTransition(RuntimeError):
    pass


@dataclass
class SandboxRow:
    name: str
    spec_text: str
    spec_file: str
    lifecycle: str
    desired: str
    state: str
    sandbox_id: str | None
    restarts: int
    exit_code: int | None
    created: float
    started: float | None
    ttl: float | None
    idle_timeout: float | None
    last_activity: float | None
    policy_patch: str

    def public(self) -> dict:
        d = asdict(self)
        d.pop("spec_text")
        d["policy_patch"] = json.loads(self.policy_patch or "{}")
        return d


class State:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        from agentvm import statedb

        self._c = statedb.connect(self.path, "sandboxes", _SCHEMA)

    def close(self) -> None:
        self._c.close()

    def _row(self, r) -> SandboxRow:
        return SandboxRow(*r)

    def get(self, name: str) -> SandboxRow | None:
        with self._lock:
            r = self._c.execute("SELECT * FROM sandboxes WHERE name=?", (name,)).fetchone()
        return self._row(r) if r else None

    def all(self) -> list[SandboxRow]:
        with self._lock:
            return [self._row(r) for r in self._c.execute("SELECT * FROM sandboxes ORDER BY name")]

    def create(self, name: str, spec_text: str, spec_file: str, lifecycle: str, ttl: float | None,
               idle_timeout: float | None) -> SandboxRow:
        with self._lock:
            self._c.execute(
                "INSERT INTO sandboxes(name, spec_text, spec_file, lifecycle, desired, state, created, ttl, idle_timeout)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (name, spec_text, spec_file, lifecycle, "stopped", "created", time.time(), ttl, idle_timeout),
            )
        return self.get(name)

    def update(self, name: str, **fields) -> None:
        """Change a row; a change of ``state`` must be a transition of ``TRANSITIONS``."""
        if not fields:
            return
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._lock:
            new = fields.get("state")
            if new is not None:
                r = self._c.execute("SELECT state FROM sandboxes WHERE name=?", (name,)).fetchone()
                cur = r[0] if r else None
                if cur is not None and new != cur and new not in TRANSITIONS.get(cur, ()):
                    raise IllegalTransition(f"{name}: {cur} -> {new} is not a transition of the daemon's state table")
            self._c.execute(f"UPDATE sandboxes SET {cols} WHERE name=?", (*fields.values(), name))

    def delete(self, name: str) -> None:
        with self._lock:
            self._c.execute("DELETE FROM sandboxes WHERE name=?", (name,))

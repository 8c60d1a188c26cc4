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


# what was applied from a fleet repository (agentvm.fleet): per agent, and every promotion
_FLEET_SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_agents (
    name TEXT PRIMARY KEY,
    repo TEXT NOT NULL,
    commit_id TEXT NOT NULL,
    path TEXT NOT NULL,
    digest TEXT NOT NULL,           -- the policy digest of the agent at that commit
    applied REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS promotions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    repo TEXT NOT NULL,
    commit_id TEXT NOT NULL,
    previous TEXT,                  -- the commit applied before: the rollback target
    plan TEXT NOT NULL,             -- the plan's digest
    actor TEXT NOT NULL,
    result TEXT NOT NULL,           -- applying | applied | failed | rolled-back
    detail TEXT
);
"""


# The daemon's sandbox states and the only transitions between them. The supervisor changes a
# state only through ``State.update(state=...)``, which refuses anything not in this table;
# the tests read the same table.
TRANSITIONS: dict[str, frozenset[str]] = {
    "created": frozenset({"starting", "stopped"}),  # start / stop of a never-started sandbox
    "starting": frozenset({"running", "failed", "stopped"}),  # launched / refused or broken / stopped early
    "running": frozenset({"backoff", "exited", "failed", "stopped", "paused", "suspended"}),  # restart due / done / broken / stopped / frozen / checkpointed
    "paused": frozenset({"running", "stopped", "exited", "failed", "backoff", "suspended"}),  # unpaused / stopped (thawed first) / ...
    "suspended": frozenset({"starting", "stopped"}),  # resumed (restored) / stopped (its checkpoint dropped)
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
        self._c.executescript(_FLEET_SCHEMA)  # added later: created in older state files too

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

    def touch(self, name: str, t: float) -> None:
        """``last_activity`` moves to ``t`` unless the row already has a later time."""
        with self._lock:
            self._c.execute("UPDATE sandboxes SET last_activity = MAX(COALESCE(last_activity, 0), ?) WHERE name=?",
                            (t, name))

    def delete(self, name: str) -> None:
        with self._lock:
            self._c.execute("DELETE FROM sandboxes WHERE name=?", (name,))

    # ---------------------------------------------------------------- fleet (agentvm.fleet)
    def fleet_agents(self) -> dict[str, dict]:
        with self._lock:
            rows = self._c.execute("SELECT name, repo, commit_id, path, digest, applied FROM fleet_agents").fetchall()
        return {r[0]: {"repo": r[1], "commit": r[2], "path": r[3], "digest": r[4], "applied": r[5]} for r in rows}

    def fleet_touch(self, name: str, meta: dict) -> None:
        """An unchanged agent's fleet record moves to the new commit (its sandbox row stays;
        one made by hand with exactly this content becomes the fleet's)."""
        with self._lock:
            self._c.execute("INSERT INTO fleet_agents(name, repo, commit_id, path, digest, applied) VALUES (?,?,?,?,?,?) "
                            "ON CONFLICT(name) DO UPDATE SET repo=excluded.repo, commit_id=excluded.commit_id, "
                            "path=excluded.path, digest=excluded.digest, applied=excluded.applied",
                            (name, meta["repo"], meta["commit"], meta["path"], meta["digest"], time.time()))

    def fleet_put(self, name: str, spec: dict | None, meta: dict | None) -> None:
        """One agent's version, in one transaction: its sandbox row (``spec``: spec_text,
        spec_file, lifecycle, policy_patch; None: the row is deleted) and its fleet record
        (``meta``: repo, commit, path, digest; None: not from a fleet). A daemon killed at
        any point leaves the agent wholly on one version."""
        with self._lock:
            c = self._c
            c.execute("BEGIN IMMEDIATE")
            try:
                if spec is None:
                    c.execute("DELETE FROM sandboxes WHERE name=?", (name,))
                elif c.execute("SELECT 1 FROM sandboxes WHERE name=?", (name,)).fetchone():
                    c.execute("UPDATE sandboxes SET spec_text=?, spec_file=?, lifecycle=?, policy_patch=? WHERE name=?",
                              (spec["spec_text"], spec["spec_file"], spec["lifecycle"], spec.get("policy_patch", "{}"),
                               name))
                else:
                    c.execute("INSERT INTO sandboxes(name, spec_text, spec_file, lifecycle, desired, state, created) "
                              "VALUES (?,?,?,?,?,?,?)", (name, spec["spec_text"], spec["spec_file"], spec["lifecycle"],
                                                         "stopped", "created", time.time()))
                if meta is None:
                    c.execute("DELETE FROM fleet_agents WHERE name=?", (name,))
                else:
                    c.execute("INSERT INTO fleet_agents(name, repo, commit_id, path, digest, applied) VALUES (?,?,?,?,?,?) "
                              "ON CONFLICT(name) DO UPDATE SET repo=excluded.repo, commit_id=excluded.commit_id, "
                              "path=excluded.path, digest=excluded.digest, applied=excluded.applied",
                              (name, meta["repo"], meta["commit"], meta["path"], meta["digest"], time.time()))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    def promotion_start(self, repo: str, commit: str, previous: str | None, plan: str, actor: str) -> int:
        with self._lock:
            cur = self._c.execute("INSERT INTO promotions(time, repo, commit_id, previous, plan, actor, result) "
                                  "VALUES (?,?,?,?,?,?,?)", (time.time(), repo, commit, previous, plan, actor, "applying"))
            return int(cur.lastrowid)

    def promotion_end(self, pid: int, result: str, detail: str | None = None) -> None:
        with self._lock:
            self._c.execute("UPDATE promotions SET result=?, detail=? WHERE id=?", (result, detail, pid))

    def promotions(self, limit: int = 50) -> list[dict]:
        with self._lock:
            rows = self._c.execute("SELECT id, time, repo, commit_id, previous, plan, actor, result, detail FROM promotions "
                                   "ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [{"id": r[0], "time": r[1], "repo": r[2], "commit": r[3], "previous": r[4], "plan": r[5], "actor": r[6],
                 "result": r[7], "detail": r[8]} for r in rows]

    def promotions_interrupted(self) -> list[int]:
        """Promotions a dead daemon left half-applied: marked ``interrupted`` (each agent is on
        one version or the other; ``agentvm status`` says which, ``apply`` can be run again)."""
        with self._lock:
            ids = [r[0] for r in self._c.execute("SELECT id FROM promotions WHERE result='applying'")]
            self._c.execute("UPDATE promotions SET result='interrupted' WHERE result='applying'")
        return ids

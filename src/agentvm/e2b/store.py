"""The E2B adapter's state on disk: one SQLite file, ``<home>/e2b/sandboxes.db`` (0600), so a
daemon restart keeps its E2B sandboxes, their tenants and deadlines.

Its own file, not a table in the daemon's ``daemon.db``: the adapter is a separate package
over the control plane (the daemon's state module knows nothing of tenants or tokens, and its
start-up checks stay the daemon's), and the file can be dropped to forget every E2B sandbox
without touching the daemon's rows. Access tokens are kept as sha256 digests only: the file
lets no one use a sandbox.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

from agentvm.e2b.model import Box

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,      -- the daemon's sandbox (e2b-<id>)
    tenant TEXT NOT NULL,
    template TEXT NOT NULL,
    metadata TEXT NOT NULL,         -- JSON
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,           -- the deadline (timeout, set_timeout, refresh)
    auto_pause INTEGER NOT NULL,
    state TEXT NOT NULL,            -- running | paused
    ports TEXT NOT NULL,            -- JSON list
    token_digests TEXT NOT NULL,    -- JSON list of sha256 hex
    traffic_digests TEXT NOT NULL   -- JSON list of sha256 hex
);
"""


class E2BStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        from agentvm.statedb import init_schema

        init_schema(self.db, self.path, SCHEMA)
        self.db.execute("PRAGMA synchronous=FULL")

    def save(self, b: Box) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (b.id, b.name, b.tenant, b.template, json.dumps(b.metadata), b.started_at, b.end_at, int(b.auto_pause),
             b.state, json.dumps(list(b.ports)), json.dumps(b.token_digests), json.dumps(b.traffic_digests)))

    def delete(self, sid: str) -> None:
        self.db.execute("DELETE FROM sandboxes WHERE id = ?", (sid,))

    def load(self) -> list[Box]:
        import secrets

        out = []
        for (sid, name, tenant, template, md, started, end, ap, state, ports, tds,
             trds) in self.db.execute("SELECT * FROM sandboxes ORDER BY started_at"):
            # the tokens' text was not kept: an unguessable placeholder until connect mints new ones
            b = Box(sid, tenant, template, name, json.loads(md), {}, started, end, secrets.token_urlsafe(32),
                    auto_pause=bool(ap), state=state, ports=tuple(json.loads(ports)), traffic_token="",
                    running_since=started, token_digests=json.loads(tds), traffic_digests=json.loads(trds),
                    known_tokens=False)
            out.append(b)
        return out

    def close(self) -> None:
        self.db.close()

"""The audit sink of the gateway: one hash chain per (sandbox, replica), merged per sandbox.

Replicas share nothing but the configuration source and this sink, and any replica may
serve any request of a sandbox (a Service balances connections), so no replica can append to
a single per-sandbox chain without a lock across replicas - a shared lock would be the one
thing that does not scale. Instead every replica keeps, for each sandbox it served, its own
append-only chain (``SINK/NAMESPACE.SANDBOX/REPLICA.jsonl``)::

    {"seq": n, "prev": H(n-1), "hash": H(n), "rec": {...the decision record...}}
    H(n) = sha256(H(n-1) || n || canonical_json(rec)),  H(0) = "0" * 64

and :func:`verify` is the merge: it checks every replica's chain of the sandbox whole (an
edited, removed, inserted or reordered record breaks it where it happened; a truncated tail
is caught against the replica's ``.head`` file), then orders the records of all replicas by
(time, replica, seq) and hashes that order into one head - the sandbox's chain. The merge is
deterministic, so two verifiers of the same sink get the same head.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

GENESIS = "0" * 64
HEAD_INTERVAL = 1.0  # seconds between writes of a chain's head file
CHAIN_IDLE_CLOSE = 300.0  # a chain without a record this long has its file closed


def _digest(prev: str, seq: int, rec: dict) -> str:
    body = json.dumps(rec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(f"{prev}|{seq}|{body}".encode()).hexdigest()


class _Chain:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.seq, self.head = 0, GENESIS
        try:  # continue a replica's chain after a restart under the same name
            with open(path, "rb") as f:
                last = None
                for last in f:
                    pass
            if last:
                d = json.loads(last)
                self.seq, self.head = int(d["seq"]), str(d["hash"])
        except FileNotFoundError:
            pass
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.pending: list[bytes] = []
        self.head_written = -1
        self.used = time.monotonic()

    def add(self, rec: dict) -> None:
        self.used = time.monotonic()
        self.seq += 1
        h = _digest(self.head, self.seq, rec)
        self.pending.append((json.dumps({"seq": self.seq, "prev": self.head, "hash": h, "rec": rec},
                                        sort_keys=True, ensure_ascii=True) + "\n").encode())
        self.head = h

    def flush(self) -> None:
        if not self.pending:
            return
        data, self.pending = b"".join(self.pending), []
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def write_head(self) -> None:
        """The chain's last (seq, hash) beside it: a removed tail no longer matches. Written at
        most every HEAD_INTERVAL and on close (a file replaced per request costs more than the
        request), so a tail cut within the last interval before a crash is not detected."""
        if self.head_written == self.seq:
            return
        tmp = self.path.with_suffix(".head.tmp")
        tmp.write_text(f"{self.seq} {self.head}\n")
        os.replace(tmp, self.path.with_suffix(".head"))
        self.head_written = self.seq

    def close(self) -> None:
        self.flush()
        self.write_head()
        os.close(self.fd)


class AuditSink:
    """Subscribed to the gate's records (``Gate.subscribers``): each record goes to the chain of
    its sandbox for this replica; chains are written once per loop turn."""

    def __init__(self, directory: Path, replica: str) -> None:
        if not replica or "/" in replica or replica.startswith("."):
            raise ValueError(f"not a replica name: {replica!r}")
        self.directory = Path(directory)
        self.replica = replica
        self.chains: dict[str, _Chain] = {}
        self._armed = False
        self._heads: asyncio.TimerHandle | None = None

    def __call__(self, rec: dict) -> None:
        sid = rec.get("sandbox")
        if not isinstance(sid, str) or not sid or "/" in sid or sid.startswith("."):
            return
        ch = self.chains.get(sid)
        if ch is None:
            ch = self.chains[sid] = _Chain(self.directory / sid / f"{self.replica}.jsonl")
        ch.add(dict(rec, replica=self.replica))
        if not self._armed:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._armed = True
            except RuntimeError:
                self.flush()

    def flush(self) -> None:
        self._armed = False
        for ch in self.chains.values():
            ch.flush()
        if self._heads is None:
            try:
                self._heads = asyncio.get_running_loop().call_later(HEAD_INTERVAL, self.write_heads)
            except RuntimeError:
                self.write_heads()

    def write_heads(self) -> None:
        self._heads = None
        idle = time.monotonic() - CHAIN_IDLE_CLOSE
        for sid, ch in list(self.chains.items()):
            ch.write_head()
            if ch.used < idle:  # not one descriptor per sandbox ever served: reopened (and continued) on use
                ch.close()
                del self.chains[sid]

    def close(self) -> None:
        if self._heads is not None:
            self._heads.cancel()
            self._heads = None
        for ch in self.chains.values():
            ch.close()
        self.chains.clear()


@dataclass
class Verification:
    sandbox: str
    ok: bool
    records: int
    replicas: list[str]
    head: str
    problems: list[str] = field(default_factory=list)


def verify(directory: Path, sandbox: str, *, merged: list | None = None) -> Verification:
    """Verify every replica's chain of ``sandbox`` and merge them (see the module's doc)."""
    base = Path(directory) / sandbox
    problems: list[str] = []
    rows: list[tuple] = []
    replicas = sorted(p.stem for p in base.glob("*.jsonl"))
    for rep in replicas:
        prev, seq = GENESIS, 0
        with open(base / f"{rep}.jsonl", "rb") as f:
            for n, line in enumerate(f, 1):
                try:
                    d = json.loads(line)
                    rec = d["rec"]
                except (ValueError, KeyError, TypeError):
                    problems.append(f"{rep}: line {n} is not a chain record")
                    break
                if d.get("seq") != seq + 1 or d.get("prev") != prev or _digest(prev, seq + 1, rec) != d.get("hash"):
                    problems.append(f"{rep}: the chain breaks at line {n}")
                    break
                if rec.get("sandbox") != sandbox or rec.get("replica") != rep:
                    problems.append(f"{rep}: line {n} is another sandbox's or replica's record")
                    break
                seq, prev = seq + 1, d["hash"]
                rows.append((float(rec.get("time", 0)), rep, seq, prev, rec))
        try:
            hseq, hhash = (base / f"{rep}.head").read_text().split()
            if int(hseq) != seq or hhash != prev:
                problems.append(f"{rep}: the chain ends at {seq}, its head says {hseq} (records were removed)")
        except (FileNotFoundError, ValueError):
            problems.append(f"{rep}: no head file")
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    head = GENESIS
    for t, rep, seq, h, _rec in rows:
        head = hashlib.sha256(f"{head}|{rep}|{seq}|{h}".encode()).hexdigest()
    if merged is not None:
        merged.extend(r[4] for r in rows)
    return Verification(sandbox, not problems, len(rows), replicas, head, problems)

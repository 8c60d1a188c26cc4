"""LLM usage and spend budgets, enforced at the gate.

For requests to the budget's hosts (known LLM APIs by default; the gate terminates TLS to
them and speaks HTTP/1.1 there), the gate reads the model and the token usage from each
response - OpenAI- and Anthropic-compatible JSON bodies and server-sent-event streams - and
adds them to the agent's counters. Before each request it checks the budget
(``limits.budget``: tokens, requests, or money from the agent file's price table): once a
limit is reached, requests to those hosts get ``429 budget:exceeded`` (alerted, on the
audit chain) until the operator raises the budget (``agentvm policy NAME budget``).

Counting is fail-closed: a successful response whose usage the gate cannot read (a stream
without a usage event, a body too large to keep) is *estimated* (request and response bytes
/ 4) and marked as such, never counted as free.

The counters are per agent name, kept in ``<home>/budgets.db``: a daemon restart, a worker
restart or a new run of the same agent continues from them (``--reset`` starts over). Every
sandbox of one agent shares them: in one gate process through one :class:`Ledger`; across
processes (an embedded ``agentvm run`` beside the daemon) because each admission re-reads
the database and each count is an atomic ``SET x = x + ?``.

Concurrency: a request is *reserved* when it is admitted and settled when its response is
counted, so the request limit is exact however many are in flight (in one gate process).
Token and cost limits cannot know a response's size in advance: each request in flight is
reserved at the largest response seen so far (one at a time until one is seen), and a
request is admitted only while what is spent plus those reservations stays under the limit
(``429 budget:reserved``, retryable, when it would not).

A count the database does not take (disk full, locked) is kept in memory, added to every
read and written with the next count: it is never forgotten while the gate runs.
"""

from __future__ import annotations

import fnmatch
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentvm import defaults as D

DEFAULT_LLM_HOSTS = D.LLM_HOSTS  # OpenAI- and Anthropic-compatible APIs (the default ``limits.budget.hosts``)
MAX_JSON = 4 * 1024 * 1024  # a JSON response kept whole to read its usage (bigger: estimated)
MAX_LINE = 1024 * 1024  # one SSE line


@dataclass(frozen=True)
class BudgetSpec:
    tokens: int | None = None
    requests: int | None = None
    cost: float | None = None
    hosts: tuple[str, ...] = DEFAULT_LLM_HOSTS
    prices: tuple[tuple[str, float, float], ...] = ()  # (model glob, per 1M input, per 1M output)

    def price(self, model: str) -> tuple[float, float] | None:
        for glob, pin, pout in self.prices:
            if fnmatch.fnmatchcase(model, glob):
                return pin, pout
        return None

    def covers(self, host: str) -> bool:
        h = (host or "").lower().rstrip(".")
        for pat in self.hosts:
            if pat.startswith("*.") and h.endswith(pat[1:]) and h != pat[2:]:
                return True
            if h == pat:
                return True
        return False

    def with_limits(self, *, tokens=..., requests=..., cost=...) -> "BudgetSpec":
        from dataclasses import replace

        kw = {k: v for k, v in (("tokens", tokens), ("requests", requests), ("cost", cost)) if v is not ...}
        return replace(self, **kw)


@dataclass
class Usage:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    estimated: int = 0  # responses whose usage was estimated
    by_model: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def count(self, model: str, requests: int, input_tokens: int, output_tokens: int, cost: float,
              estimated: int) -> None:
        """Add counts to the totals and to the model's (at most 64 models are kept apart)."""
        self.requests += requests
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost += cost
        self.estimated += estimated
        count_model(self.by_model, model, requests, input_tokens, output_tokens)

    def to_dict(self) -> dict:
        return {"requests": self.requests, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "tokens": self.tokens, "cost": round(self.cost, 6), "estimated": self.estimated}


def count_model(by_model: dict, model: str, requests: int, input_tokens: int, output_tokens: int) -> None:
    """A model's (requests, input, output) counts; at most 64 models are kept apart."""
    if model in by_model or len(by_model) < 64:
        m = by_model.setdefault(model, [0, 0, 0])
        m[0] += requests
        m[1] += input_tokens
        m[2] += output_tokens


class BudgetStore:
    """Per-agent counters in ``<home>/budgets.db`` (owner-only)."""

    def __init__(self, path: Path) -> None:
        from agentvm import statedb

        self.path = Path(path)
        self._c = statedb.connect(self.path, "budgets", _SCHEMA,
                                  consequence="every agent's LLM budget would start over at zero")
        self._lock = threading.Lock()

    def load(self, agent: str) -> Usage:
        with self._lock:
            row = self._c.execute("SELECT requests, input_tokens, output_tokens, cost, estimated, by_model FROM budgets "
                                  "WHERE agent=?", (agent,)).fetchone()
        if row is None:
            return Usage()
        try:
            by_model = json.loads(row[5] or "{}")
        except ValueError:
            by_model = {}
        return Usage(int(row[0]), int(row[1]), int(row[2]), float(row[3]), int(row[4]), by_model)

    def save(self, agent: str, u: Usage) -> None:
        with self._lock:
            self._c.execute("INSERT INTO budgets (agent, requests, input_tokens, output_tokens, cost, estimated, by_model, "
                            "updated) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(agent) DO UPDATE SET requests=excluded.requests, "
                            "input_tokens=excluded.input_tokens, output_tokens=excluded.output_tokens, cost=excluded.cost, "
                            "estimated=excluded.estimated, by_model=excluded.by_model, updated=excluded.updated",
                            (agent, u.requests, u.input_tokens, u.output_tokens, u.cost, u.estimated,
                             json.dumps(u.by_model, sort_keys=True)[:65536], time.time()))

    def add(self, agent: str, model: str, requests: int, input_tokens: int, output_tokens: int, cost: float,
            estimated: int) -> None:
        """Add counts atomically (other processes count the same agent)."""
        with self._lock, self._c:
            self._c.execute("INSERT INTO budgets (agent, requests, input_tokens, output_tokens, cost, estimated, by_model, "
                            "updated) VALUES (?,0,0,0,0,0,'{}',?) ON CONFLICT(agent) DO NOTHING", (agent, time.time()))
            row = self._c.execute("SELECT by_model FROM budgets WHERE agent=?", (agent,)).fetchone()
            try:
                by_model = json.loads(row[0] or "{}") if row else {}
            except ValueError:
                by_model = {}
            count_model(by_model, model, requests, input_tokens, output_tokens)
            self._c.execute("UPDATE budgets SET requests = requests + ?, input_tokens = input_tokens + ?, "
                            "output_tokens = output_tokens + ?, cost = cost + ?, estimated = estimated + ?, "
                            "by_model = ?, updated = ? WHERE agent = ?",
                            (requests, input_tokens, output_tokens, cost, estimated,
                             json.dumps(by_model, sort_keys=True)[:65536], time.time(), agent))

    def reset(self, agent: str) -> None:
        with self._lock:
            self._c.execute("DELETE FROM budgets WHERE agent=?", (agent,))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (
    agent TEXT PRIMARY KEY,
    requests INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost REAL NOT NULL,
    estimated INTEGER NOT NULL,
    by_model TEXT,
    updated REAL NOT NULL
);
"""


class Ledger:
    """One agent's counters in one gate process, shared by all of its sandboxes' endpoints
    (a persistent worker and its runs, two runs at once): the reservations of requests in
    flight and the totals, refreshed from the store at each admission."""

    def __init__(self, agent: str, store: BudgetStore | None) -> None:
        self.agent, self.store = agent, store
        self.lock = threading.Lock()
        self.pending = Usage()  # counts the store did not take yet (a write failed): added to every read
        self.usage = self._load()
        self.inflight = 0
        # the largest response seen (tokens, cost): what each request in flight is reserved at
        self.max_tokens = 0
        self.max_cost = 0.0

    def _load(self) -> Usage:
        if self.store is None:
            return getattr(self, "usage", None) or Usage()
        try:
            u = self.store.load(self.agent)
        except sqlite3.Error:
            return getattr(self, "usage", Usage())  # the last totals seen: never zero on a read error
        p = self.pending
        return Usage(u.requests + p.requests, u.input_tokens + p.input_tokens, u.output_tokens + p.output_tokens,
                     u.cost + p.cost, u.estimated + p.estimated, u.by_model)

    def admit(self, spec: BudgetSpec) -> tuple[str, str] | None:
        """Reserve one request, or say why not: (rule id, reason)."""
        with self.lock:
            self.usage = self._load()  # what other processes counted meanwhile
            why = refusal(spec, self.usage, self.inflight, self.max_tokens, self.max_cost)
            if why is None:
                self.inflight += 1
            return why

    def release(self) -> None:
        with self.lock:
            self.inflight = max(0, self.inflight - 1)

    def settle(self, spec: BudgetSpec, model: str | None, input_tokens: int, output_tokens: int,
               estimated: bool) -> dict:
        """Count one response (its reservation ends); -> the fields its decision record carries."""
        model = (model or "unknown")[:128]
        price = spec.price(model)
        cost = (input_tokens * price[0] + output_tokens * price[1]) / 1e6 if price else 0.0
        with self.lock:
            self.inflight = max(0, self.inflight - 1)
            self.max_tokens = max(self.max_tokens, input_tokens + output_tokens)
            self.max_cost = max(self.max_cost, cost)
            self.usage.count(model, 1, input_tokens, output_tokens, cost, int(estimated))
            if self.store is not None:
                p = self.pending
                p.count(model, 1, input_tokens, output_tokens, cost, int(estimated))
                try:  # this count and any the store missed before, at once
                    self.store.add(self.agent, model, p.requests, p.input_tokens, p.output_tokens, p.cost, p.estimated)
                    self.pending = Usage()
                    self.usage = self._load()
                except sqlite3.Error:
                    pass  # kept in pending: every later read adds it, the next count writes it
        out = {"model": model, "input_tokens": input_tokens, "output_tokens": output_tokens}
        if price is not None:
            out["cost"] = round(cost, 8)
        if estimated:
            out["estimated"] = True
        return out

    def reset(self) -> None:
        with self.lock:
            self.usage = Usage()
            if self.store is not None:
                self.store.reset(self.agent)


def refusal(spec: BudgetSpec, u: Usage, inflight: int = 0, per_tokens: int = 0,
            per_cost: float = 0.0) -> tuple[str, str] | None:
    """Why one more request must not start: (rule id, reason), or None."""
    if spec.requests is not None and u.requests >= spec.requests:
        return "budget:exceeded", f"the LLM budget of {spec.requests} requests is spent ({u.requests} made)"
    if spec.tokens is not None and u.tokens >= spec.tokens:
        return "budget:exceeded", f"the LLM budget of {spec.tokens} tokens is spent ({u.tokens} used)"
    if spec.cost is not None and u.cost >= spec.cost:
        return "budget:exceeded", f"the LLM budget of {spec.cost:g} is spent ({u.cost:.4f} used)"
    if not inflight:
        return None
    if spec.requests is not None and u.requests + inflight >= spec.requests:
        return "budget:reserved", (f"the rest of the LLM budget of {spec.requests} requests is taken by {inflight} "
                                   "in flight; retry when they finish")
    # each request in flight is reserved at the largest response seen; until one is seen, one
    # request at a time (an agent cannot make the reservation small with cheap or failed calls)
    if spec.tokens is not None and (not per_tokens or u.tokens + inflight * per_tokens >= spec.tokens):
        return "budget:reserved", (f"{inflight} LLM request(s) in flight may use the rest of the {spec.tokens}-token "
                                   f"budget ({u.tokens} used); retry when they finish")
    if spec.cost is not None and (not per_cost or u.cost + inflight * per_cost >= spec.cost):
        return "budget:reserved", (f"{inflight} LLM request(s) in flight may use the rest of the budget of "
                                   f"{spec.cost:g} ({u.cost:.4f} used); retry when they finish")
    return None


_LEDGERS: dict[tuple[str, str], Ledger] = {}
_LEDGERS_LOCK = threading.Lock()


def ledger(agent: str, store: BudgetStore | None) -> Ledger:
    """The process's one ledger for ``agent`` in ``store``'s database."""
    if store is None:  # nothing kept: nothing to share either
        return Ledger(agent, None)
    key = (str(store.path.resolve()), agent)
    with _LEDGERS_LOCK:
        led = _LEDGERS.get(key)
        if led is None:
            led = _LEDGERS[key] = Ledger(agent, store)
        return led


class Budget:
    """One endpoint's view of its agent's budget: the spec in force for this sandbox, the
    agent's shared :class:`Ledger`."""

    def __init__(self, agent: str, spec: BudgetSpec, store: BudgetStore | None) -> None:
        self.agent, self.spec, self.store = agent, spec, store
        self.ledger = ledger(agent, store)

    @property
    def usage(self) -> Usage:
        return self.ledger.usage

    def covers(self, host: str) -> bool:
        return self.spec.covers(host)

    def admit(self) -> tuple[str, str] | None:
        """Reserve one request (it must be settled or released), or (rule id, reason)."""
        return self.ledger.admit(self.spec)

    def refusal_now(self) -> tuple[str, str] | None:
        """Why the next request would be refused now (reserves nothing): (rule id, reason)."""
        led = self.ledger
        return refusal(self.spec, led.usage, led.inflight, led.max_tokens, led.max_cost)

    def refusal(self) -> str | None:
        why = self.refusal_now()
        return why[1] if why else None

    def release(self) -> None:
        self.ledger.release()

    def meter(self) -> "Meter":
        return Meter()

    def add(self, model: str | None, input_tokens: int, output_tokens: int, estimated: bool) -> dict:
        """Count one admitted request's response (settles its reservation)."""
        return self.ledger.settle(self.spec, model, input_tokens, output_tokens, estimated)

    def set_spec(self, spec: BudgetSpec) -> None:
        self.spec = spec

    def reset(self) -> None:
        self.ledger.reset()


class Meter:
    """Reads one response's model and usage as it streams past (never changes a byte)."""

    def __init__(self) -> None:
        self.ok = False
        self.answered = False  # the upstream's response head arrived (the request was served)
        self.kind = ""  # "sse" | "json" | ""
        self.buf = bytearray()
        self.line = bytearray()
        self.overflow = False
        self.body_bytes = 0
        self.model: str | None = None
        self.input: int | None = None
        self.output: int | None = None

    def head(self, status: int, headers) -> None:
        self.answered = True
        self.ok = 200 <= status < 300
        ctype = b""
        for k, v in headers:
            if k.lower() == b"content-type":
                ctype = v.lower()
        self.kind = "sse" if b"text/event-stream" in ctype else "json" if b"json" in ctype else ""

    def feed(self, data: bytes) -> None:
        self.body_bytes += len(data)
        if self.kind == "json":
            if len(self.buf) + len(data) > MAX_JSON:
                self.overflow = True
                self.buf.clear()
                self.kind = ""
            else:
                self.buf += data
        elif self.kind == "sse":
            if b"\n" not in data:
                self.line += data
                if len(self.line) > MAX_LINE:
                    self.line.clear()
                    self.overflow = True
                return
            # whole lines: the held partial one plus this chunk, split once (linear in the chunk)
            *lines, rest = (bytes(self.line) + data).split(b"\n")
            self.line = bytearray(rest if len(rest) <= MAX_LINE else b"")
            if len(rest) > MAX_LINE:
                self.overflow = True
            for raw in lines:
                if raw.startswith(b"data:"):
                    payload = raw[5:].strip()
                    # only events that can carry what is counted are parsed (most chunks of a
                    # stream are text deltas: a substring test, not a JSON parse)
                    if b'"usage"' in payload or (self.model is None and b'"model"' in payload):
                        self._take_bytes(payload)

    def _take_bytes(self, payload: bytes) -> None:
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return
        if isinstance(obj, dict):
            self._take(obj)

    def _take(self, obj: dict) -> None:
        msg = obj.get("message") if isinstance(obj.get("message"), dict) else None  # Anthropic message_start
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else None  # OpenAI Responses events
        for src in (obj, msg, resp):
            if not src:
                continue
            m = src.get("model")
            if isinstance(m, str) and m:
                self.model = m
            u = src.get("usage")
            if isinstance(u, dict):
                self._usage(u)

    def _usage(self, u: dict) -> None:
        def num(*keys) -> int | None:
            total, seen = 0, False
            for k in keys:
                v = u.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    total += v
                    seen = True
            return total if seen else None

        # OpenAI chat/completions: prompt/completion; Responses API and Anthropic: input/output
        # (Anthropic's cache reads and writes are input tokens too)
        inp = num("prompt_tokens") if "prompt_tokens" in u else num(
            "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        out = num("completion_tokens") if "completion_tokens" in u else num("output_tokens")
        # streams repeat usage (Anthropic: input at message_start, the running output total at
        # each message_delta): the largest value seen is the total
        if inp is not None:
            self.input = max(self.input or 0, inp)
        if out is not None:
            self.output = max(self.output or 0, out)

    def finish(self, request_bytes: int) -> tuple[str | None, int, int, bool]:
        """-> (model, input tokens, output tokens, estimated)."""
        if self.kind == "json" and self.buf:
            self._take_bytes(bytes(self.buf))
        if self.kind == "sse" and self.line:
            raw = bytes(self.line).strip()
            if raw.startswith(b"data:"):
                self._take_bytes(raw[5:].strip())
        if self.input is not None or self.output is not None:
            return self.model, self.input or 0, self.output or 0, False
        if not self.ok:
            return self.model, 0, 0, False  # an error answer: no tokens were generated
        # a success whose usage is not readable: estimated, never free
        return self.model, (request_bytes + 3) // 4, (self.body_bytes + 3) // 4, True


def compile_budget(spec_budget) -> BudgetSpec | None:
    """From the agent file's ``limits.budget`` (``spec.models.Budget``)."""
    if spec_budget is None:
        return None
    prices = tuple((g, float(p.input), float(p.output)) for g, p in spec_budget.prices.items() if g != "*")
    if "*" in spec_budget.prices:  # the catch-all is tried last
        p = spec_budget.prices["*"]
        prices += (("*", float(p.input), float(p.output)),)
    return BudgetSpec(tokens=spec_budget.tokens, requests=spec_budget.requests, cost=spec_budget.cost,
                      hosts=tuple(h.lower().rstrip(".") for h in spec_budget.hosts), prices=prices)

"""What the daemon has seen: Prometheus metrics and the console's recent-activity view.

Everything the daemon learns arrives as an event (``Daemon.emit``: gate decisions as
``egress``, lifecycle and approval records by their audit kind). :class:`Observer` takes each
event once and keeps

* counters and a latency histogram in its own ``prometheus_client`` registry (never the
  process-global one: two daemons in one test process must not share counts);
* gauges read at scrape time from the daemon's state (sandboxes by state, approvals pending,
  the audit chain's length and whether it verifies - the walk is cached, at most one per
  ``VERIFY_EVERY`` seconds; the workspaces' disk, committed and used, and the free space of
  their filesystem - one scandir, cached ``WORKSPACE_EVERY`` seconds);
* the last ``RECENT`` decisions and a per-sandbox, per-host egress summary for the console
  (in memory, since the daemon started; the gate's NDJSON logs stay the record).

Label values are bounded: agent names and rule ids come from agent files and the gate's rule
registry; hosts never become labels (a sandbox could mint unbounded series with them).
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from pathlib import Path
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# no "<name>_created" series beside every counter: they double the output and nothing here uses them
prometheus_client.disable_created_metrics()

RECENT = 2000  # decisions kept for the console's stream page
MAX_HOSTS = 500  # hosts summarised per sandbox (the rest are counted under "(other hosts)")
MAX_AGENTS = 1000  # distinct agent label values; later ones are counted as "(other)"
VERIFY_EVERY = 30.0
WORKSPACE_EVERY = 5.0  # the workspaces' disk usage is summed at most this often (one scandir of <home>/workspaces)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# upstream latency buckets, seconds: a loopback hop is ~1 ms, an LLM call tens of seconds
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Observer:
    def __init__(self, *, sandboxes_by_state: Callable[[], dict[str, int]],
                 approvals_pending: Callable[[], int | None],
                 audit_status: Callable[[], tuple[int, bool]],
                 workspace_dir: "Path | Callable[[], Path] | None" = None) -> None:
        """``workspace_dir``: ``<home>/workspaces`` (default: the installation's, as
        ``agentvm.paths.default_paths`` finds it, resolved at the first scrape)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # the counts every decision moves are plain numbers here, turned into metric families
        # when Prometheus scrapes (_Counts): the library's counter takes a lock and checks per
        # increment, and the daemon pays it for each request of every sandbox
        self.counts = _Counts()
        r.register(self.counts)
        self.swaps = Counter("agentvm_credential_swaps", "Requests into which the gate swapped a real credential",
                             ["agent", "credential"], registry=r)
        self.leaks = Counter("agentvm_credential_leaks_blocked", "Credential leaks stopped: a placeholder sent where it "
                             "is not bound (request) or a real secret scrubbed from a response (response)",
                             ["agent", "where"], registry=r)
        self.lifecycle = Counter("agentvm_sandbox_events", "Sandbox lifecycle events: start (running), restart "
                                 "(scheduled), failure, exit, stop, run (a run of the agent began), refused (a run was refused)",
                                 ["agent", "event"], registry=r)
        self.approvals = Counter("agentvm_approvals", "Approval requests made and answered",
                                 ["state"], registry=r)
        self.llm_tokens = Counter("agentvm_llm_tokens", "LLM tokens counted by the gate from the responses of "
                                  "budget-metered hosts (estimated ones included)", ["agent", "model", "direction"],
                                  registry=r)
        self.llm_requests = Counter("agentvm_llm_requests", "LLM API responses counted by the gate",
                                    ["agent", "model"], registry=r)
        self.llm_cost = Counter("agentvm_llm_cost", "LLM spend counted by the gate (the price table's currency)",
                                ["agent"], registry=r)
        self._models: set[str] = set()
        self._dyn = _Dynamic(sandboxes_by_state, approvals_pending, audit_status)
        r.register(self._dyn)
        r.register(_Workspaces(workspace_dir))
        from agentvm import sysaudit  # escape probes: agentvm_syscalls_denied_total{syscall} (docs/syscall-audit.md)

        r.register(sysaudit.Collector())
        self.recent: collections.deque = collections.deque(maxlen=RECENT)
        self._children: dict = {}
        self.summary: dict[str, dict[str, list]] = {}  # agent -> host -> [allow, deny, bytes_out, bytes_in, last]
        self._agents: set[str] = set()

    # ------------------------------------------------------------------ intake
    def _agent(self, name) -> str:
        name = str(name or "(none)")[:128]
        if name not in self._agents:
            if len(self._agents) >= MAX_AGENTS:
                return "(other)"
            self._agents.add(name)
        return name

    def observe(self, rec: dict) -> None:
        """One event from ``Daemon.emit`` (never raises: metrics must not break the daemon)."""
        try:
            kind = rec.get("kind")
            if kind == "egress":
                self._decision(rec)
            elif kind in _LIFECYCLE:
                # a run's records name its session (sandbox) and its agent: the label is the agent
                self.lifecycle.labels(self._agent(rec.get("agent") or rec.get("sandbox")), _LIFECYCLE[kind]).inc()
            elif kind == "run.refused":
                self.lifecycle.labels(self._agent(rec.get("agent")), "refused").inc()
            elif kind == "approval.requested":
                self.approvals.labels("requested").inc()
            elif kind == "approval.answered":
                self.approvals.labels(str(rec.get("state") or "?")[:16]).inc()
        except Exception:  # noqa: BLE001
            pass

    def count_bytes(self, agent: str | None, out: int, inn: int) -> None:
        """Bytes the gate moved for a sandbox of ``agent`` since the last count: the same
        counters as the run report's egress summary and ``limits.bytesOut`` (out: request heads,
        bodies and tunnelled bytes toward upstreams; in: what came back toward the sandbox)."""
        counts, agent = self.counts, self._agent(agent)
        if out > 0:
            counts.bytes[(agent, "out")] = counts.bytes.get((agent, "out"), 0) + out
        if inn > 0:
            counts.bytes[(agent, "in")] = counts.bytes.get((agent, "in"), 0) + inn

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, cached: the library's lookup costs more than the count."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def _decision(self, rec: dict) -> None:
        agent = self._agent(rec.get("agent"))
        verdict = str(rec.get("verdict") or "?")[:8]
        rule = str(rec.get("rule") or "?")[:160]
        # a "log:suppressed" record stands for n denials that the deny-log rate limit folded
        n = int(rec.get("suppressed") or 1) if rule == "log:suppressed" else 1
        counts = self.counts
        key = (agent, verdict, rule)
        counts.decisions[key] = counts.decisions.get(key, 0) + n
        # (bytes are not read from the records, whose bytes_out/bytes_in are one request's body:
        # the daemon counts the gate's own counters, see count_bytes)
        for cred in rec.get("credentials") or ():
            self._child(self.swaps, agent, str(cred)[:128]).inc()
        if rule.startswith("credential:leak:"):
            self.leaks.labels(agent, "request").inc()
        if rec.get("scrubbed"):
            self.leaks.labels(agent, "response").inc()
        llm = rec.get("llm")
        if isinstance(llm, dict):
            model = str(llm.get("model") or "unknown")[:128]
            if model not in self._models:
                if len(self._models) < 256:
                    self._models.add(model)
                else:
                    model = "(other)"
            self.llm_requests.labels(agent, model).inc()
            self.llm_tokens.labels(agent, model, "input").inc(int(llm.get("input_tokens") or 0))
            self.llm_tokens.labels(agent, model, "output").inc(int(llm.get("output_tokens") or 0))
            if llm.get("cost"):
                self.llm_cost.labels(agent).inc(float(llm["cost"]))
        ms = rec.get("upstream_ms")
        if isinstance(ms, (int, float)) and ms >= 0:
            counts.observe(ms / 1000.0)
        self.recent.append(rec)  # the event itself (nobody changes it after emit)
        host = str(rec.get("host") or "")
        if host:
            hosts = self.summary.setdefault(agent, {})
            if host not in hosts and len(hosts) >= MAX_HOSTS:
                host = "(other hosts)"
            row = hosts.setdefault(host, [0, 0, 0, 0, 0.0])
            row[0 if verdict == "allow" else 1] += 1
            row[2] += out
            row[3] += inn
            row[4] = float(rec.get("time") or time.time())

    # ------------------------------------------------------------------ output
    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def egress_summary(self, agent: str) -> list[dict]:
        hosts = self.summary.get(agent, {})
        return [{"host": h, "allowed": r[0], "denied": r[1], "bytes_out": r[2], "bytes_in": r[3], "last": r[4]}
                for h, r in sorted(hosts.items(), key=lambda kv: -kv[1][4])]


_LIFECYCLE = {"lifecycle.running": "start", "lifecycle.restart-scheduled": "restart", "lifecycle.failed": "failure",
              "lifecycle.exited": "exit", "lifecycle.stopped": "stop", "run.started": "run"}


class _Counts:
    """The per-decision counters and the upstream latency histogram: numbers the loop adds to,
    exposed as metric families at scrape time (the scrape may run in another thread: it
    copies each dict in one C call, under the GIL, before iterating)."""

    def __init__(self) -> None:
        self.decisions: dict[tuple[str, str, str], int] = {}  # (agent, verdict, rule) -> count
        self.bytes: dict[tuple[str, str], int] = {}  # (agent, direction) -> bytes
        self.buckets = [0] * (len(_BUCKETS) + 1)  # per bucket (not cumulative); the last is +Inf
        self.lat_sum = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(_BUCKETS, seconds)] += 1  # the first bound >= seconds
        self.lat_sum += seconds

    def describe(self):
        return []

    def collect(self):
        c = CounterMetricFamily("agentvm_egress_decisions", "Gate decisions, by agent, verdict (allow, deny, ask) "
                                "and rule id", labels=["agent", "verdict", "rule"])
        for labels, n in sorted(dict(self.decisions).items()):
            c.add_metric(list(labels), n)
        yield c
        c = CounterMetricFamily("agentvm_egress_bytes", "Bytes the gate moved for the agent's sandboxes, as the run "
                                "report counts them (out: request heads, bodies and tunnelled bytes toward "
                                "upstreams; in: toward the sandbox)", labels=["agent", "direction"])
        for labels, n in sorted(dict(self.bytes).items()):
            c.add_metric(list(labels), n)
        yield c
        per, total, cumulative = list(self.buckets), self.lat_sum, []
        acc = 0
        for bound, n in zip((*(floatToGoString(b) for b in _BUCKETS), "+Inf"), per):
            acc += n
            cumulative.append((bound, acc))
        yield HistogramMetricFamily("agentvm_gate_upstream_seconds", "Time from forwarding a request to the end "
                                    "of its response, for requests the gate relayed", buckets=cumulative,
                                    sum_value=total)


class _Dynamic:
    """Gauges read when Prometheus scrapes."""

    def __init__(self, by_state, pending, audit) -> None:
        self.by_state, self.pending, self.audit = by_state, pending, audit
        self._lock = threading.Lock()

    def describe(self):
        return []

    def collect(self):
        g = GaugeMetricFamily("agentvm_sandboxes", "Sandboxes the daemon manages, by state", labels=["state"])
        for state, n in sorted(self.by_state().items()):
            g.add_metric([state], n)
        yield g
        pending = self.pending()
        if pending is not None:
            yield GaugeMetricFamily("agentvm_approvals_pending", "Approval requests waiting for a human", value=pending)
        length, ok = self.audit()
        yield GaugeMetricFamily("agentvm_audit_records", "Records on the audit chain", value=length)
        yield GaugeMetricFamily("agentvm_audit_chain_valid", "1 when the audit chain verifies (hashes and head), "
                                "else 0; re-walked at most every %gs" % VERIFY_EVERY, value=1 if ok else 0)


class _Workspaces:
    """agentvm_workspace_bytes{kind="committed"|"used"}, agentvm_workspace_disk_free_bytes and
    agentvm_workspace_pool_bytes{kind="size"|"free"|"reserved"|"committed"} (when there is a pool), from ``agentvm.workspace.cached_usage`` (a failure drops the gauges, never the scrape)."""

    def __init__(self, where) -> None:
        self.where = where

    def _dir(self) -> Path:
        w = self.where
        if w is None:
            from agentvm.paths import default_paths

            w = self.where = default_paths().workspaces
        return Path(w() if callable(w) else w)

    def describe(self):
        return []

    def collect(self):
        try:
            from agentvm.workspace import cached_usage

            u = cached_usage(self._dir(), WORKSPACE_EVERY)
        except Exception:  # noqa: BLE001 - metrics must not break the scrape
            return
        g = GaugeMetricFamily("agentvm_workspace_bytes", "Disk of the agents' workspaces: committed (the sum of "
                              "their limits: an image's size, reserved in full; a pool workspace's quota) and "
                              "used (an image's blocks; a pool workspace's quota group)", labels=["kind"])
        g.add_metric(["committed"], u.committed)
        g.add_metric(["used"], u.used)
        yield g
        yield GaugeMetricFamily("agentvm_workspace_disk_free_bytes", "Free space of the filesystem holding the "
                                "workspaces", value=u.fs_free)
        yield GaugeMetricFamily("agentvm_workspaces", "Workspaces (images, directories and pool workspaces)",
                                value=u.count)
        pool = u.pool
        if pool:  # (no pool: no gauge - a host without pool workspaces reserves nothing for them)
            p = GaugeMetricFamily("agentvm_workspace_pool_bytes", "The workspace pool (one btrfs filesystem for "
                                  "every pool workspace): size (its filesystem), free (in it), reserved (on the "
                                  "host, fallocated in full) and committed (the sum of its workspaces' quotas)",
                                  labels=["kind"])
            for kind in ("size", "free", "reserved", "committed"):
                if pool.get(kind) is not None:
                    p.add_metric([kind], pool[kind])
            yield p


class CachedVerify:
    """The chain's verification, walked at most once per ``every`` seconds (a scrape every 15 s
    must not re-hash a long chain each time)."""

    def __init__(self, verify: Callable[[], object], length: Callable[[], int], every: float = VERIFY_EVERY) -> None:
        self._verify, self._length, self.every = verify, length, every
        self._at, self._ok = 0.0, True
        self._lock = threading.Lock()

    def __call__(self) -> tuple[int, bool]:
        with self._lock:
            if time.monotonic() - self._at >= self.every or not self._at:
                try:
                    self._ok = bool(getattr(self._verify(), "ok", False))
                except Exception:  # noqa: BLE001 - a chain that cannot be read does not verify
                    self._ok = False
                self._at = time.monotonic()
            try:
                return self._length(), self._ok
            except Exception:  # noqa: BLE001
                return 0, False

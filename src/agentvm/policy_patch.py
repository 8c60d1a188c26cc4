"""Live policy as data: the changes an operator makes to a running sandbox's policy.

Two kinds of value, both plain and frozen:

- a :class:`PolicyPatch` is one change as asked for (``agentvm policy NAME allow HOST``, the
  console's pause button, ``POST /v1/sandboxes/NAME/policy``): :func:`parse_patch` makes one
  from the API's fields;
- a :class:`LivePolicy` is every change kept for a sandbox (its row's ``policy_patch``: they
  hold for its later starts too).

Three pure functions join them (no I/O, no daemon, no gate: what they refuse is an
:class:`~agentvm.errors.AgentVMError` with its registered code, and nothing has changed):

- :func:`fold` - a LivePolicy with one more PolicyPatch in it, or a refusal;
- :func:`apply` - an agent file's Policy with a LivePolicy's changes, or a refusal (a live
  change never widens past the agent's risk tier);
- :func:`parse_patch` - a PolicyPatch from a request's fields.

What a change does outside the policy (a budget's counters reset, a credential revoked in
the vault, a cgroup's limits lowered) is the daemon's (``agentvm.daemon.control``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Union

from agentvm.errors import AgentVMError

LIMIT_MINIMUMS = "16M memory, 8 pids, >0 cpus"


def _refuse(code: str, message: str, hint: str = "") -> AgentVMError:
    return AgentVMError(message, hint=hint, code=code)


# -- one change ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRules:
    """``allow`` or ``deny`` HOST[:PORT] rules (a deny without a port: every port)."""

    kind: str  # "allow" | "deny"
    rules: tuple[str, ...]


@dataclass(frozen=True)
class RemoveRule:
    rule_id: str


@dataclass(frozen=True)
class SetPaused:
    paused: bool


@dataclass(frozen=True)
class SetCredential:
    """``revoke`` (``revoked=True``) or ``restore`` a credential by its name."""

    name: str
    revoked: bool


@dataclass(frozen=True)
class ToolChange:
    action: str  # allow | deny | approve
    tool: str  # SERVER__TOOL (a glob may follow the server)


@dataclass(frozen=True)
class BudgetChange:
    tokens: Any = None
    requests: Any = None
    cost: Any = None
    reset: bool = False


@dataclass(frozen=True)
class LimitsChange:
    """Lower memory/pids/cpus of a running sandbox (``memory`` as given: bytes or ``512M``)."""

    memory: Any = None
    pids: Any = None
    cpus: Any = None


@dataclass(frozen=True)
class LimitsApplied:
    """The limits a backend applied (after a :class:`LimitsChange`): kept for later starts."""

    limits: tuple[tuple[str, Any], ...]


PolicyPatch = Union[AddRules, RemoveRule, SetPaused, SetCredential, ToolChange, BudgetChange, LimitsChange,
                    LimitsApplied]

OPS = ("show", "allow", "deny", "remove", "pause", "resume", "revoke", "restore", "limits", "tools", "budget")


def parse_patch(doc: dict) -> PolicyPatch:
    """A change from the API's fields (``{"op": ..., ...}``, already typed by
    ``agentvm.daemon.api``) or the console's form. ``show`` is not a change (refused here)."""
    op = doc.get("op")
    if op in ("allow", "deny"):
        rules = doc.get("rules") or ([doc["rule"]] if doc.get("rule") is not None else [])
        if not rules or not all(isinstance(r, str) for r in rules):
            raise _refuse("api.bad-request", f"{op} needs a rule (HOST or HOST:PORT)")
        return AddRules(op, tuple(rules))
    if op == "remove":
        if not isinstance(doc.get("rule_id"), str):
            raise _refuse("api.bad-request", "remove needs a rule_id")
        return RemoveRule(doc["rule_id"])
    if op in ("pause", "resume"):
        return SetPaused(op == "pause")
    if op in ("revoke", "restore"):
        return SetCredential(str(doc.get("credential") or ""), op == "revoke")
    if op == "tools":
        return ToolChange(doc.get("action"), doc.get("tool"))
    if op == "budget":
        return BudgetChange(doc.get("tokens"), doc.get("requests"), doc.get("cost"), bool(doc.get("reset")))
    if op == "limits":
        return LimitsChange(doc.get("memory"), doc.get("pids"), doc.get("cpus"))
    raise _refuse("api.bad-request", "op is one of " + ", ".join(OPS))


def op_of(patch: PolicyPatch) -> str:
    """The operation's name as the API and the audit chain call it."""
    if isinstance(patch, AddRules):
        return patch.kind
    if isinstance(patch, SetPaused):
        return "pause" if patch.paused else "resume"
    if isinstance(patch, SetCredential):
        return "revoke" if patch.revoked else "restore"
    return {RemoveRule: "remove", ToolChange: "tools", BudgetChange: "budget", LimitsChange: "limits",
            LimitsApplied: "limits"}[type(patch)]


def detail_of(patch: PolicyPatch) -> dict:
    """The change's fields as the audit record shows them (as they were asked for)."""
    if isinstance(patch, AddRules):
        return {"rules": list(patch.rules)} if len(patch.rules) != 1 else {"rule": patch.rules[0]}
    if isinstance(patch, RemoveRule):
        return {"rule_id": patch.rule_id}
    if isinstance(patch, SetPaused):
        return {}
    if isinstance(patch, SetCredential):
        return {"credential": patch.name}
    if isinstance(patch, ToolChange):
        return {"action": patch.action, "tool": patch.tool}
    if isinstance(patch, BudgetChange):
        return {k: v for k, v in (("tokens", patch.tokens), ("requests", patch.requests), ("cost", patch.cost))
                if v is not None} | ({"reset": True} if patch.reset else {})
    if isinstance(patch, LimitsApplied):
        return dict(patch.limits)
    return {k: v for k, v in dataclasses.asdict(patch).items() if v is not None}


# -- every change kept --------------------------------------------------------------------


@dataclass(frozen=True)
class LivePolicy:
    """A sandbox's live changes, in the order they were made (``None``: never changed; the
    stored JSON keeps only what was changed)."""

    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] | None = None
    removed: tuple[str, ...] | None = None
    tools: tuple[tuple[tuple[str, str], ...], ...] | None = None  # each change as sorted items
    budget: tuple[tuple[str, Any], ...] | None = None
    limits: tuple[tuple[str, Any], ...] | None = None
    paused: bool | None = None
    revoked: tuple[str, ...] | None = None

    @classmethod
    def from_dict(cls, doc: dict | None) -> "LivePolicy":
        doc = doc or {}

        def strs(k):
            return tuple(doc[k]) if k in doc else None

        return cls(allow=strs("allow"), deny=strs("deny"), removed=strs("removed"),
                   tools=tuple(tuple(sorted(c.items())) for c in doc["tools"]) if "tools" in doc else None,
                   budget=tuple(doc["budget"].items()) if "budget" in doc else None,
                   limits=tuple(doc["limits"].items()) if "limits" in doc else None,
                   paused=doc.get("paused"), revoked=strs("revoked"))

    @classmethod
    def from_json(cls, text: str | None) -> "LivePolicy":
        return cls.from_dict(json.loads(text or "{}"))

    def to_dict(self) -> dict:
        out: dict = {}
        for k in ("allow", "deny", "removed"):
            if getattr(self, k) is not None:
                out[k] = list(getattr(self, k))
        if self.tools is not None:
            out["tools"] = [dict(c) for c in self.tools]
        if self.budget is not None:
            out["budget"] = dict(self.budget)
        if self.limits is not None:
            out["limits"] = dict(self.limits)
        if self.paused is not None:
            out["paused"] = self.paused
        if self.revoked is not None:
            out["revoked"] = list(self.revoked)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @property
    def is_paused(self) -> bool:
        return bool(self.paused)

    @property
    def revoked_names(self) -> tuple[str, ...]:
        return self.revoked or ()


def _deny_rules(specs) -> list:
    """``policy NAME deny HOST[:PORT]``: without a port, the host on every port."""
    from agentvm.gate.policy import cli_rule

    return [cli_rule(f"live-deny[{i}]", s, default_ports=()) for i, s in enumerate(specs)]


def fold(live: LivePolicy, patch: PolicyPatch, current) -> LivePolicy:
    """``live`` with ``patch`` kept in it, checked against ``current`` (the policy the sandbox
    has now: its file's with ``live`` applied). Refuses what could not apply; the caller then
    checks the result with :func:`apply` before storing it."""
    if isinstance(patch, AddRules):
        from agentvm.gate.policy import compile_egress

        try:
            compile_egress(None, extra_allow=list(patch.rules))  # validates
        except ValueError as exc:
            raise _refuse("policy.invalid-rule", str(exc)) from None
        have = getattr(live, patch.kind) or ()
        return dataclasses.replace(live, **{patch.kind: have + tuple(patch.rules)})
    if isinstance(patch, RemoveRule):
        eg = current.egress
        ids = [r.id for r in (eg.allow + eg.deny)] if eg is not None else []
        if patch.rule_id not in ids:
            raise _refuse("policy.no-such-rule", f"{current.name} has no rule {patch.rule_id!r}"
                          + (f" (its rules: {', '.join(ids)})" if ids else ""),
                          hint=f"`agentvm policy {current.name} show` lists the rules and their ids")
        from agentvm.egress_defaults import default_deny_rules

        if patch.rule_id in {r.id for r in default_deny_rules()}:
            raise _refuse("policy.rule-not-removable", f"{patch.rule_id!r} is a deny rule every sandbox gets "
                          "(DNS-over-HTTPS endpoints): it cannot be removed")
        return dataclasses.replace(live, removed=(live.removed or ()) + (patch.rule_id,))
    if isinstance(patch, ToolChange):
        from agentvm.tools.policy import LIVE_ACTIONS, apply_live, split_name

        split = split_name(patch.tool) if isinstance(patch.tool, str) else None
        if patch.action not in LIVE_ACTIONS or split is None:
            raise _refuse("api.bad-request", "tools needs an action (allow, deny, approve) and a tool as "
                          "SERVER__TOOL (a glob may follow the server: SERVER__read_*)")
        if current.tools is None:
            raise _refuse("tools.none-declared", f"{current.name} declares no tools (spec.tools)")
        change = {"action": patch.action, "server": split[0], "tool": split[1]}
        try:
            apply_live(current.tools, [change])
        except ValueError as exc:
            raise _refuse("tools.invalid-change", str(exc)) from None
        return dataclasses.replace(live, tools=(live.tools or ()) + (tuple(sorted(change.items())),))
    if isinstance(patch, BudgetChange):
        change = {}
        for k, kind in (("tokens", int), ("requests", int), ("cost", float)):
            given = getattr(patch, k)
            if given is None:
                continue
            try:
                if isinstance(given, bool):
                    raise ValueError
                v = kind(given)
                if not math.isfinite(v) or v <= 0 or (kind is int and v != given):
                    raise ValueError
            except (TypeError, ValueError):
                raise _refuse("budget.invalid", f"budget {k} is a positive {'whole ' if kind is int else ''}"
                              f"number, not {given!r}") from None
            change[k] = v
        if not change and not patch.reset:
            raise _refuse("api.bad-request", "budget: give --tokens, --requests, --cost and/or --reset")
        return dataclasses.replace(live, budget=tuple({**dict(live.budget or ()), **change}.items()))
    if isinstance(patch, SetPaused):
        return dataclasses.replace(live, paused=patch.paused)
    if isinstance(patch, SetCredential):
        if not any(b.name == patch.name for b in current.credentials):
            raise _refuse("policy.no-such-credential", f"{current.name} has no credential {patch.name!r}")
        revoked = set(live.revoked or ())
        (revoked.add if patch.revoked else revoked.discard)(patch.name)
        return dataclasses.replace(live, revoked=tuple(sorted(revoked)))
    if isinstance(patch, LimitsApplied):
        return dataclasses.replace(live, limits=tuple({**dict(live.limits or ()), **dict(patch.limits)}.items()))
    if isinstance(patch, LimitsChange):
        raise _refuse("api.bad-request", "live limits are applied by the sandbox's backend first (LimitsApplied)")
    raise _refuse("api.bad-request", f"not a policy change: {type(patch).__name__}")


def check_limits(patch: LimitsChange) -> tuple[int | None, int | None, float | None]:
    """A :class:`LimitsChange`'s values (memory in bytes), or ``limits.invalid``."""
    from agentvm.units import parse_size

    try:
        mem = parse_size(patch.memory) if patch.memory is not None else None
        pids = int(patch.pids) if patch.pids is not None else None
        cpus = float(patch.cpus) if patch.cpus is not None else None
        if (mem is not None and mem < 16 * 1024**2) or (pids is not None and pids < 8) or (cpus is not None and cpus <= 0):
            raise ValueError(f"below the minimum ({LIMIT_MINIMUMS})")
    except AgentVMError as exc:
        raise _refuse("limits.invalid", exc.message) from None
    except (ValueError, TypeError) as exc:
        raise _refuse("limits.invalid", str(exc)) from None
    return mem, pids, cpus


def apply(policy, live: LivePolicy):
    """An agent file's Policy with the live changes: the policy its gate enforces. Raises
    what is not allowed (a live change may not widen past the agent's risk tier)."""
    from agentvm.policy import check_tier

    if live.allow or live.deny or live.removed:
        from agentvm.egress_defaults import with_default_denies
        from agentvm.gate.policy import compile_egress

        eg = policy.egress or compile_egress(None)
        extra = compile_egress(None, extra_allow=list(live.allow or ()))
        removed = set(live.removed or ())
        allow = tuple(r for r in eg.allow + extra.allow if r.id not in removed)
        deny = tuple(r for r in eg.deny + tuple(_deny_rules(live.deny or ())) if r.id not in removed)
        policy = dataclasses.replace(policy, egress=with_default_denies(dataclasses.replace(eg, allow=allow, deny=deny)))
    if live.tools and policy.tools is not None:
        from agentvm.tools.policy import apply_live

        policy = dataclasses.replace(policy, tools=apply_live(policy.tools, [dict(c) for c in live.tools]))
    check_tier(policy)
    if live.budget:  # a budget changed live (raised, lowered, added) holds for later starts too
        from agentvm.gate.budget import BudgetSpec

        b = dict(live.budget)
        cur = policy.limits.budget or BudgetSpec()
        spec = cur.with_limits(**{k: b[k] for k in ("tokens", "requests", "cost") if k in b})
        policy = dataclasses.replace(policy, limits=dataclasses.replace(policy.limits, budget=spec))
    lim = dict(live.limits or ())
    if lim:  # live-tightened limits hold for every later start too (only ever lower)
        cur = policy.limits
        policy = dataclasses.replace(policy, limits=dataclasses.replace(
            cur,
            memory=min(cur.memory, int(lim.get("memory", cur.memory))),
            pids=min(cur.pids, int(lim.get("pids", cur.pids))),
            cpus=min(cur.cpus, float(lim.get("cpus", cur.cpus))),
        ))
    return policy

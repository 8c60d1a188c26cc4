"""Fleet promotion, the daemon's side: plan, apply (with canaries) and roll back a fleet
repository's commit (``agentvm.fleet`` makes the plans; this applies them to the daemon's
sandboxes, one apply or rollback at a time), and the fleet's status and drift.

:class:`FleetOps` is a part of :class:`agentvm.daemon.control.ControlPlane`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass

from agentvm.daemon.events import refuse
from agentvm.errors import AgentVMError


@dataclass(frozen=True)
class Replay:
    """A plan's replay of recorded traffic under the new policies (``since``: a Unix time;
    ``last``: at most this many records per agent; ``all``: unchanged agents too)."""

    since: float | None = None
    last: int | None = None
    all: bool = False


class FleetOps:
    """Fleet promotion (a part of the ControlPlane)."""

    def _fleet_current(self) -> tuple[dict, str | None]:
        """name -> what runs now (its policy from the stored spec, without live changes), and
        the commit of the last applied promotion."""
        from agentvm.policy import compile_policy
        from agentvm.spec.loader import load_agent_text

        meta = self.state.fleet_agents()
        cur = {}
        for row in self.state.all():
            try:
                policy = compile_policy(load_agent_text(row.spec_text, row.spec_file).spec)
            except AgentVMError:
                continue
            cur[row.name] = {"policy": policy, "digest": policy.digest(), "fleet": row.name in meta,
                             "running": row.state in ("running", "starting", "backoff"), "desired": row.desired,
                             "state": row.state, "row": row}
            if row.policy_patch not in ("", "{}"):
                cur[row.name]["live"] = row.policy_patch
                try:
                    cur[row.name]["effective"] = self.effective_policy(row)
                except AgentVMError:
                    pass
        done = [x for x in self.state.promotions() if x["result"] in ("applied", "rolled-back")]
        return cur, (done[0]["commit"] if done else None)

    async def _fleet_plan(self, repo: str, commit: str | None, replay: "Replay | None"):
        from agentvm import fleet as fl

        ref = commit or "HEAD"
        sha = await asyncio.to_thread(fl.resolve, repo, ref)
        trust = fl.load_trust(self.paths.home)
        fleet = await asyncio.to_thread(fl.load, repo, sha, trust=trust)
        cur, previous = self._fleet_current()
        meta = self.state.fleet_agents()
        for name, c in cur.items():  # another repository's agents are not this plan's to remove
            if c["fleet"] and meta.get(name, {}).get("repo") != fleet.repo:
                c["fleet"] = False
        plan = fl.make_plan(fleet, {k: {kk: v[kk] for kk in ("policy", "digest", "fleet", "running", "live", "effective")
                                        if kk in v} for k, v in cur.items()}, previous)
        if replay is not None:
            since, last = replay.since, replay.last or 1000
            for a in plan.actions:
                if a.kind in ("update", "create") or (a.kind == "unchanged" and replay.all):
                    old = cur.get(a.name, {}).get("policy")
                    recs = await asyncio.to_thread(fl.recorded, self.paths.home / "logs", a.name, since=since, last=last)
                    a.replay = fl.replay(recs, old, fleet.agents[a.name].policy)
        return fleet, plan, ref

    async def fleet_plan(self, repo: str, commit: str | None = None, replay: Replay | None = None, *,
                         actor: str = "operator") -> dict:
        """What applying ``commit`` (a ref: resolved here) of ``repo`` would change, recorded."""
        fleet, plan, ref = await self._fleet_plan(repo, commit, replay)
        out = plan.to_dict()
        out["ref"] = ref
        self.record("fleet.planned", actor=actor, repo=plan.repo, commit=plan.commit, ref=ref, digest=out["digest"],
                    changes=out["changes"], widening=out["widening"],
                    breakage=sum(len((a.replay or {}).get("breakage", [])) for a in plan.actions))
        return out

    async def fleet_apply(self, repo: str, commit: str, *, digest: str | None = None, canary: bool = False,
                          actor: str = "operator") -> dict:
        """Apply exactly ``commit`` (a full commit id) of ``repo``; with ``digest``, only if the
        plan is still the one shown."""
        from agentvm import fleet as fl

        async def planned():
            if not fl.is_full_id(str(commit or "")):
                raise refuse("fleet.not-a-commit-id", "apply takes a full commit id (40 hex digits), not a "
                             "branch, a tag or a short id",
                             hint="`agentvm apply` resolves a ref and shows it first (with --yes)")
            fleet, plan, _ = await self._fleet_plan(repo, commit, None)
            if plan.commit != commit:
                raise refuse("fleet.not-a-commit-id", f"{commit} resolves to {plan.commit}")
            if digest is not None and digest != plan.digest():
                raise refuse("fleet.plan-changed", "the plan changed since it was shown (the daemon's state or "
                             "the repository moved)", hint="run `agentvm plan` again and review it")
            return fleet, plan

        return await self._fleet_exclusive(planned, canary, actor, repo, commit)

    async def fleet_rollback(self, to: str | None = None, *, canary: bool = False, actor: str = "operator") -> dict:
        """Go back to the previous promotion (or the one of commit ``to``, 7 hex digits at least)."""
        hist = self.state.promotions(200)
        if to is None:
            last = next((x for x in hist if x["result"] in ("applied", "rolled-back")), None)
            if last is None or not last["previous"]:
                raise refuse("fleet.no-rollback-target", "no earlier promotion is recorded to go back to")
            repo, to = last["repo"], last["previous"]
        else:
            match = next((x for x in hist if x["commit"].startswith(str(to)) and len(str(to)) >= 7
                          and x["result"] in ("applied", "rolled-back")), None)
            if match is None:
                raise refuse("fleet.no-such-promotion", f"no promotion of a commit {to!r} is recorded",
                             hint="`agentvm status --json` lists the promotions")
            repo, to = match["repo"], match["commit"]

        async def planned():
            fleet, plan, _ = await self._fleet_plan(repo, to, None)
            return fleet, plan

        return await self._fleet_exclusive(planned, canary, actor, repo, to, rollback=True)

    async def _fleet_exclusive(self, planned, canary: bool, actor: str, repo, commit, rollback: bool = False) -> dict:
        """An apply or a rollback: one at a time, holding the fleet lock from its plan to its
        end; a refusal before anything is applied (not a commit id, unsigned, plan changed)
        is on the audit chain too."""
        if self._fleet_lock.locked():
            raise refuse("fleet.busy", "another apply or rollback is in progress",
                           hint="wait for it (`agentvm status`), then plan again")
        async with self._fleet_lock:
            try:
                fleet, plan = await planned()
            except AgentVMError as exc:
                self.record("fleet.refused", actor=actor, repo=str(repo)[:500], commit=str(commit)[:100],
                            error=exc.code, message=exc.message[:500], **({"rollback": True} if rollback else {}))
                raise
            return await self._fleet_apply(fleet, plan, canary, actor, rollback=rollback)

    async def _fleet_apply(self, fleet, plan, canary_all: bool, actor: str, rollback: bool = False) -> dict:
        """Apply exactly ``plan`` (creates, then updates, then removes), each agent atomically:
        its new spec and fleet record in one transaction; an update that does not come up
        (or fails its canary) is put back on its old version and the apply stops there."""
        from agentvm import fleet as fl

        canary = fleet.config.get("canary") or {}
        pid = self.state.promotion_start(plan.repo, plan.commit, plan.previous, plan.digest(), actor)
        self.record("fleet.rollback-started" if rollback else "fleet.apply-started", actor=actor, repo=plan.repo,
                    commit=plan.commit, previous=plan.previous, digest=plan.digest(), signed=plan.signed)
        done, failed = [], None
        try:
            failed = await self._fleet_actions(fleet, plan, canary, canary_all, actor, done)
        except BaseException as exc:  # noqa: BLE001 - the promotion is always closed and recorded
            failed = {"agent": None, "error": "internal", "message": f"{type(exc).__name__}: {exc}"[:500]}
            if not isinstance(exc, Exception):
                self.state.promotion_end(pid, "failed", json.dumps(failed))
                raise
        result = "failed" if failed else ("rolled-back" if rollback else "applied")
        self.state.promotion_end(pid, result, json.dumps(failed) if failed else None)
        self.record("fleet." + result, actor=actor, repo=plan.repo, commit=plan.commit, previous=plan.previous,
                    digest=plan.digest(), agents=done, failure=failed)
        return {"result": result, "commit": plan.commit, "previous": plan.previous, "done": done, "failure": failed,
                "digest": plan.digest()}

    async def _fleet_actions(self, fleet, plan, canary: dict, canary_all: bool, actor: str, done: list) -> dict | None:
        from agentvm import fleet as fl

        failed = None
        for a in plan.actions:
            if a.kind == "unchanged":
                # the same content: only the record of which commit it comes from moves on
                fa = fleet.agents.get(a.name)
                self.state.fleet_touch(a.name, {"repo": fleet.repo, "commit": fleet.commit, "path": fa.path,
                                                "digest": fa.digest})
                continue
            fa = fleet.agents.get(a.name)
            try:
                if a.kind == "remove":
                    if self.state.get(a.name) is not None:
                        await self.stop(a.name, actor=actor)
                    self.state.fleet_put(a.name, None, None)
                    self.managed.pop(a.name, None)
                    self.record("lifecycle.removed", actor=actor, sandbox=a.name, commit=plan.commit)
                else:
                    check = a.kind == "update" and (canary_all or fl.matches(a.name, list(canary.get("agents") or [])))
                    await self._fleet_put_agent(fleet, fa, a, actor, canary=(canary if check else None))
                done.append(a.name)
            except AgentVMError as exc:
                failed = {"agent": a.name, "error": exc.code, "message": exc.message}
            if failed:
                break
        return failed

    async def _fleet_put_agent(self, fleet, fa, action, actor: str, canary: dict | None) -> None:
        old = self.state.get(fa.name)
        old_meta = self.state.fleet_agents().get(fa.name)
        spec = {"spec_text": fa.spec_text, "spec_file": f"{fleet.repo}@{fleet.commit[:12]}:{fa.path}",
                "lifecycle": fa.policy.lifecycle, "policy_patch": "{}"}
        meta = {"repo": fleet.repo, "commit": fleet.commit, "path": fa.path, "digest": fa.digest}
        was_running = old is not None and old.desired == "running"
        if canary is not None and was_running:
            # beside the old version, which keeps running: the new one under a name of its own
            # (its own uid, a fresh workspace: the durable one has one writer), checked, removed
            await self._fleet_canary_beside(fleet, fa, actor, canary)
            # the replacement still has to come up (checked below): no second stay-up window, but
            # its health check has as long to pass as the canary had - it has only just started
            canary = {**canary, "seconds": 0, "settle": float(canary.get("seconds", 3))}
        if old is not None and old.policy_patch not in ("", "{}"):
            self.record("fleet.live-changes-dropped", actor=actor, sandbox=fa.name, patch=json.loads(old.policy_patch))
        # the new version is the state first (one transaction): a daemon killed from here on
        # restarts the agent on it; before here, on the old one
        self.state.fleet_put(fa.name, spec, meta)
        self.record("fleet.agent-" + ("created" if old is None else "updated"), actor=actor, sandbox=fa.name,
                    commit=fleet.commit, path=fa.path, policy=fa.digest, previous=action.old_digest)
        if was_running:
            await self.stop(fa.name, actor=actor)
            self.state.update(fa.name, desired="running")  # (no await since the stop: nothing can come between)
        if not (was_running or (old is None and fa.policy.lifecycle == "persistent")):
            return
        try:
            problem = await self._fleet_start_checked(fa.name, actor, canary)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the old version comes back
            problem = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:500]
        if problem is None:
            return
        # the new version did not come up: back to the old one, which is started again
        self.record("fleet.agent-failed", actor=actor, sandbox=fa.name, commit=fleet.commit, problem=problem)
        await self.stop(fa.name, actor=actor)
        if old is None:
            self.state.fleet_put(fa.name, None, None)
            self.managed.pop(fa.name, None)
        else:
            self.state.fleet_put(fa.name, {"spec_text": old.spec_text, "spec_file": old.spec_file,
                                           "lifecycle": old.lifecycle, "policy_patch": old.policy_patch}, old_meta)
            if was_running:
                m = self.managed.get(fa.name)
                if m is not None:
                    m.last_error = None
                await self.start(fa.name, actor=actor)
        self.record("fleet.agent-rolled-back", actor=actor, sandbox=fa.name, to=(old_meta or {}).get("commit"))
        raise refuse("fleet.agent-failed", f"{fa.name} at {fleet.commit[:12]} did not pass: {problem}; it runs "
                       "its previous version again and the apply stopped here")

    async def _fleet_canary_beside(self, fleet, fa, actor: str, canary: dict) -> None:
        import yaml

        cname = (fa.name[:56] + "-canary").strip("-")
        left = self.state.get(cname)
        if left is not None and str(left.spec_file).endswith("(canary)"):
            # a canary an interrupted apply left behind (the daemon was killed): removed first
            if left.state in ("running", "starting", "backoff"):
                await self.stop(cname, actor=actor)
            self.state.fleet_put(cname, None, None)
            self.managed.pop(cname, None)
            self.record("fleet.canary-removed", actor=actor, sandbox=cname, reason="left by an interrupted apply")
        elif left is not None:
            raise refuse("fleet.canary-name-taken", f"cannot run the canary of {fa.name} beside it: a sandbox "
                           f"named {cname} exists")
        doc = yaml.safe_load(fa.spec_text)
        doc["metadata"]["name"] = cname
        doc["spec"]["workspace"] = {"enabled": False}
        doc["spec"]["lifecycle"] = "persistent"
        spec = {"spec_text": yaml.safe_dump(doc, sort_keys=False),
                "spec_file": f"{fleet.repo}@{fleet.commit[:12]}:{fa.path} (canary)", "lifecycle": "persistent",
                "policy_patch": "{}"}
        hc = (canary.get("healthchecks") or {}).get(fa.name)
        check = {**canary, "healthchecks": {cname: hc} if hc else {}}
        self.record("fleet.canary-started", actor=actor, sandbox=fa.name, canary=cname, commit=fleet.commit)
        self.state.fleet_put(cname, spec, None)
        try:
            try:
                problem = await self._fleet_start_checked(cname, actor, check)
            except Exception as exc:  # noqa: BLE001
                problem = f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"[:500]
        finally:
            try:
                if self.state.get(cname) is not None:
                    await self.stop(cname, actor=actor)
            finally:
                self.state.fleet_put(cname, None, None)
                self.managed.pop(cname, None)
        if problem is not None:
            self.record("fleet.canary-failed", actor=actor, sandbox=fa.name, commit=fleet.commit, problem=problem)
            raise refuse("fleet.agent-failed", f"the canary of {fa.name} at {fleet.commit[:12]} did not pass: "
                           f"{problem}; the old version ran on untouched and the apply stopped here")

    async def _fleet_start_checked(self, name: str, actor: str, canary: dict | None) -> str | None:
        m = self.managed.get(name)
        if m is not None:
            m.last_error = None
        await self.start(name, actor=actor)
        await self.wait_state(name, ("running", "exited", "failed", "stopped", "backoff"), 30)
        row = self.state.get(name)
        if row is None or row.state != "running":
            err = (self.managed.get(name).last_error if self.managed.get(name) else None) or {}
            return f"it did not start ({row.state if row else 'gone'}{': ' + err.get('message', '') if err else ''})"
        if canary is None:
            return None
        seconds = float(canary.get("seconds", 3))
        deadline = time.monotonic() + seconds
        start_restarts = row.restarts
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            row = self.state.get(name)
            if row is None or row.state != "running" or row.restarts != start_restarts:
                return f"it did not stay up for {seconds:g}s (state {row.state if row else 'gone'})"
        hc = (canary.get("healthchecks") or {}).get(name)
        if hc:
            settle = float(canary.get("settle", 0))  # a just-started replacement: retried this long
            until = time.monotonic() + settle
            while True:
                m = self.managed.get(name)
                if m is None or m.handle is None:
                    return "it is not running for its health check"

                def run_check(m=m):
                    null = os.open(os.devnull, os.O_RDWR)
                    try:
                        return m.backend.exec(m.handle, [str(x) for x in hc], stdio=(null, null, null), timeout=30)
                    finally:
                        os.close(null)

                status = await asyncio.to_thread(run_check)
                if status.exit_code == 0:
                    break
                if time.monotonic() >= until:
                    within = f" (retried for {settle:g}s after its start)" if settle else ""
                    return f"its health check {hc} exited {status.exit_code}{within}"
                await asyncio.sleep(0.2)
                row = self.state.get(name)
                if row is None or row.state != "running" or row.restarts != start_restarts:
                    return f"it did not stay up for its health check (state {row.state if row else 'gone'})"
        self.record("fleet.canary-passed", actor=actor, sandbox=name, seconds=seconds, healthcheck=hc or None)
        return None

    def fleet_status(self) -> dict:
        """Each agent's state, commit and drift against the last promotion (a drift is recorded)."""
        meta = self.state.fleet_agents()
        cur, desired = self._fleet_current()
        agents, drifted = [], False
        for name, c in sorted(cur.items()):
            fm = meta.get(name)
            row = c["row"]
            d = {"name": name, "state": row.state, "commit": fm["commit"] if fm else None, "desired": desired,
                 "path": fm["path"] if fm else None, "drift": []}
            if fm is None:
                # not from a fleet: plan leaves it alone, and so does status (listed, never drift)
                d["unmanaged"] = True
            else:
                if desired and fm["commit"] != desired:
                    d["drift"].append(f"runs {fm['commit'][:12]}, the last promotion is {desired[:12]}")
                if c["digest"] != fm["digest"]:
                    d["drift"].append("its stored config differs from its commit's")
                patch = json.loads(row.policy_patch or "{}")
                if patch:
                    d["drift"].append("live policy changes: " + ", ".join(sorted(patch)))
                    try:
                        d["running_digest"] = self.effective_policy(row).digest()
                    except AgentVMError:
                        pass
                if c["policy"].lifecycle == "persistent" and row.desired != "running":
                    d["drift"].append("declared, not running")
            d["config_digest"] = c["digest"]
            drifted = drifted or bool(d["drift"])
            agents.append(d)
        for name, fm in sorted(meta.items()):
            if name not in cur:
                agents.append({"name": name, "state": "missing", "commit": fm["commit"], "desired": desired,
                               "path": fm["path"], "drift": ["declared, but its sandbox is gone"]})
                drifted = True
        out = {"desired": desired, "drift": drifted, "agents": agents, "promotions": self.state.promotions(20),
               "unmanaged": [a["name"] for a in agents if a.get("unmanaged")]}
        if drifted:  # a drift finding is on the audit chain (what was found, when, by whom)
            self.record("fleet.drift", desired=desired,
                        agents={a["name"]: a["drift"] for a in agents if a["drift"]})
        return out

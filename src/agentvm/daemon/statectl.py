"""State you control (issue 37): pause/unpause (the cgroup freezer), suspend/resume (a
checkpoint, gVisor), wake (an exec, a cp, an answered approval or an operator command on a
paused or suspended agent), snapshots of a workspace, fork and restore.

:class:`StateControl` is a part of :class:`agentvm.daemon.control.ControlPlane`, beside the
:class:`~agentvm.daemon.supervisor.Supervisor` whose runs it ends in a checkpoint (``Managed.
suspending``) or starts from one (``Managed.restore``) or from a snapshot (``Managed.seed``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentvm.daemon.events import refuse
from agentvm.daemon.supervisor import Managed
from agentvm.errors import AgentVMError


class StateControl:
    """pause, unpause, suspend, resume_sandbox, wake, snapshot, fork, restore_snapshot."""

    # ------------------------------------------------------------------ pause, suspend, resume
    @property
    def checkpoints(self):
        cs = getattr(self, "_checkpoint_store", None)
        if cs is None:
            from agentvm.checkpoint import CheckpointStore

            cs = self._checkpoint_store = CheckpointStore(self.paths.home / "daemon.db")
        return cs

    def _live(self, name: str) -> Managed:
        row = self.state.get(name)
        if row is None:
            raise refuse("sandbox.not-found", f"no sandbox named {name!r}")
        if row.state == "suspended":
            raise refuse("sandbox.suspended", f"{name} is suspended", hint=f"agentvm resume {name}")
        m = self.managed.get(name)
        if m is None or m.handle is None or row.state not in ("running", "paused"):
            raise refuse("sandbox.not-running", f"{name} is not running ({row.state})", hint=f"agentvm start {name}")
        return m

    async def pause(self, name: str, *, actor: str = "operator") -> dict:
        """The cgroup freezer: every process stopped where it is; memory, the gate endpoint, the
        workspace and the uid kept; CPU zero. Any substrate with a freezer (bubblewrap too)."""
        m = self._live(name)
        if self.state.get(name).state == "paused":
            return {"name": name, "state": "paused"}
        await asyncio.to_thread(m.backend.pause, m.handle)
        self.state.update(name, state="paused")
        self.record("lifecycle.paused", actor=actor, sandbox=name, sandbox_id=m.session.sandbox_id)
        return {"name": name, "state": "paused"}

    async def unpause(self, name: str, *, actor: str = "operator", why: str | None = None) -> dict:
        m = self._live(name)
        if self.state.get(name).state != "paused":
            return {"name": name, "state": "running"}
        await asyncio.to_thread(m.backend.unpause, m.handle)
        self.state.update(name, state="running")
        m.active(time.time())
        self.record("lifecycle.unpaused", actor=actor, sandbox=name, sandbox_id=m.session.sandbox_id,
                    **({"woken_by": why} if why else {}))
        return {"name": name, "state": "running"}

    async def suspend(self, name: str, *, actor: str = "operator") -> dict:
        """Write the sandbox's whole state to a root-only checkpoint and free every host
        resource it held (its processes, memory, cgroup, gate endpoint): the run ends in the
        checkpoint, and ``resume`` restores it. A substrate that cannot do so faithfully
        (bubblewrap: CRIU cannot restore Landlock) refuses (``backend.suspend-unsupported``)."""
        from agentvm import checkpoint

        m = self._live(name)
        backend, s = m.backend, m.session
        if not getattr(backend, "can_suspend", False):
            backend.suspend(m.handle, "")  # the substrate's refusal, by its code
        busy = getattr(m.endpoint, "active", 0) if m.endpoint is not None else 0
        if busy:  # runsc cannot save a host socket (the gate's): checkpointing now would crash it
            raise refuse("sandbox.suspend-busy", f"{name} has {busy} egress connection(s) open through the gate; "
                         "a sandbox holding a host socket cannot be checkpointed",
                         hint=f"try again when it is idle (`agentvm suspend {name}`), or pause it: "
                              f"`agentvm pause {name}`")
        if self.state.get(name).state == "paused":
            await self.unpause(name, actor=actor, why="suspend")
        # the policy it resumes on: its agent file's with the live changes made so far (what a
        # start now would run; a change made while it is suspended wakes it first)
        digest = await asyncio.to_thread(lambda: self.effective_policy(self.state.get(name)).digest())
        sid, substrate = s.sandbox_id, s.plan.substrate
        image = await asyncio.to_thread(checkpoint.new_dir, self.paths.home, name, sid)
        t0 = time.monotonic()
        m.suspending = True
        try:
            await asyncio.to_thread(backend.suspend, m.handle, str(image))
        except BaseException:
            m.suspending = False
            raise
        if m.task is not None:
            await asyncio.gather(m.task, return_exceptions=True)  # the teardown frees the rest
        cp = await asyncio.to_thread(checkpoint.seal, name, sid, substrate, digest, image)
        self.checkpoints.put(cp)
        took = time.monotonic() - t0
        self.record("lifecycle.suspended", actor=actor, sandbox=name, sandbox_id=sid, binding=cp.binding,
                    image_digest=cp.image_digest, policy=digest, bytes=cp.bytes, seconds=round(took, 3))
        return {"name": name, "state": self.state.get(name).state, "checkpoint": {
            "binding": cp.binding, "bytes": cp.bytes, "seconds": round(took, 3)}}

    async def resume_sandbox(self, name: str, *, actor: str = "operator", why: str | None = None) -> dict:
        """(``resume``: the ControlPlane's ``resume`` is the flag of ``agentvm up --no-resume``.)
        Restore a suspended sandbox on the same policy and workspace, its processes continuing;
        its checkpoint is checked against the binding recorded when it was taken first."""
        from agentvm import checkpoint

        row = self.state.get(name)
        if row is None:
            raise refuse("sandbox.not-found", f"no sandbox named {name!r}")
        if row.state != "suspended":
            raise refuse("sandbox.not-suspended", f"{name} is not suspended ({row.state})")
        digest = await asyncio.to_thread(lambda: self.effective_policy(row).digest())
        try:
            cp = await asyncio.to_thread(checkpoint.verify, self.checkpoints.get(name), name, digest)
        except AgentVMError as exc:
            self.record("lifecycle.resume-refused", actor=actor, sandbox=name, error=exc.code, message=exc.message)
            raise
        m = self.managed.setdefault(name, Managed(name))
        m.restore = cp
        t0 = time.monotonic()
        self.record("lifecycle.resume-requested", actor=actor, sandbox=name, binding=cp.binding,
                    **({"woken_by": why} if why else {}))
        try:
            out = await self.start_and_wait(name, actor=actor)
        finally:
            m.restore = None
        if out.get("state") == "running":
            self.checkpoints.drop(name)  # restored: the image is spent (a later suspend writes a new one)
        out["resume_seconds"] = round(time.monotonic() - t0, 3)
        return out

    async def wake(self, name: str, *, actor: str, why: str) -> bool:
        """Before an exec, a cp, an answered approval or an operator command: a paused agent is
        unpaused, a suspended one resumed (the caller waits; the audit says why). True if woken."""
        row = self.state.get(name)
        if row is None:
            return False
        if row.state == "paused":
            await self.unpause(name, actor=actor, why=why)
            return True
        if row.state == "suspended":
            await self.resume_sandbox(name, actor=actor, why=why)
            return True
        return False

    # ------------------------------------------------------------------ snapshots, fork, restore (issue 37)
    @property
    def snapshots(self):
        ss = getattr(self, "_snapshot_store", None)
        if ss is None:
            from agentvm.snapshot import SnapshotStore

            ss = self._snapshot_store = SnapshotStore(self.paths.home, self.paths.home / "daemon.db")
        return ss

    async def snapshot(self, name: str, *, tag: str | None = None, actor: str = "operator") -> dict:
        """The agent's workspace, content-addressed, with the policy and image it runs on; taken
        while its sandbox is paused where it can be (a consistent point; nothing moves while the
        files are read). A suspended agent is resumed first."""
        from agentvm import snapshot

        await self.wake(name, actor=actor, why="snapshot")
        m = self._live(name)
        ws = m.session.res.workspace
        if ws is None:
            raise refuse("config.invalid", f"{name} has no workspace to snapshot")
        row = self.state.get(name)
        policy = await asyncio.to_thread(self.effective_policy, row)
        digest = policy.digest()
        image = getattr(m.session.policy, "image", None) or "host-view"
        # a snapshot holds at most the agent's disk limit of file content (restored into that limit)
        limit = policy.limits.disk or snapshot.MAX_BYTES
        doc = {"spec_text": row.spec_text, "spec_file": row.spec_file, "policy_patch": row.policy_patch or "{}"}
        froze = False
        if row.state == "running":
            try:
                await asyncio.to_thread(m.backend.pause, m.handle)
                froze = True
            except AgentVMError:
                pass  # no freezer: read while it runs
        try:
            snap = await asyncio.to_thread(self.snapshots.take, name, tag, Path(ws.host_dir), policy_digest=digest,
                                           image=image, limit=limit, policy_doc=doc)
        except AgentVMError as exc:
            self.record("snapshot.refused", actor=actor, sandbox=name, error=exc.code, message=exc.message)
            raise
        finally:
            if froze:
                await asyncio.to_thread(m.backend.unpause, m.handle)
        self.record("snapshot.created", actor=actor, sandbox=name, snapshot=snap.id, tag=tag,
                    workspace_digest=snap.workspace_digest, policy=digest, image=image, bytes=snap.bytes,
                    files=snap.files, skipped=snap.skipped)
        return snap.to_dict()

    def _has_snapshots(self) -> bool:
        return getattr(self, "_snapshot_store", None) is not None or (self.paths.home / "snapshots").exists()

    def _placeholders_of(self, name: str) -> list[tuple[str, str]]:
        """``name``'s live placeholders and its own ancestors', as its fork's gate must know them."""
        out = []
        m = self.managed.get(name)
        creds = m.session.res.creds if m is not None and m.session is not None else None
        if creds is not None:
            out += [(f"{n.split('.', 1)[0]}.parent", p) for n, p in creds.placeholders.items()]
        out += self.snapshots.lineage(name)
        return out

    def snapshot_list(self, agent: str | None = None) -> list[dict]:
        return [s.to_dict() for s in self.snapshots.all(agent)]

    def _snapshot_of(self, ref: str):
        snap = self.snapshots.find(ref)
        if snap is None:
            raise refuse("snapshot.not-found", f"no snapshot {ref!r}", hint="`agentvm snapshot ls` lists them")
        return snap

    def snapshot_remove(self, ref: str, *, actor: str = "operator") -> dict:
        snap = self._snapshot_of(ref)
        self.snapshots.remove(snap.id)
        self.record("snapshot.removed", actor=actor, sandbox=snap.agent, snapshot=snap.id)
        return {"removed": snap.id}

    def _snapshot_policy(self, snap):
        """The policy the snapshot's digest binds (its agent file and live changes, kept beside
        it, recompiled and checked against the digest; for a snapshot taken before they were
        kept, its agent's policy now if that is the same digest), or None."""
        from types import SimpleNamespace

        candidates = []
        doc = self.snapshots.policy_doc(snap)
        if doc is not None:
            candidates.append(SimpleNamespace(spec_text=doc["spec_text"], spec_file=doc.get("spec_file") or "<snapshot>",
                                              policy_patch=doc.get("policy_patch") or "{}"))
        parent = self.state.get(snap.agent)
        if parent is not None:
            candidates.append(parent)
        for c in candidates:
            try:
                p = self.effective_policy(c)
            except Exception:  # noqa: BLE001 - a file that no longer compiles binds nothing
                continue
            if p.digest() == snap.policy_digest:
                return p
        return None

    def _workspace_exists(self, name: str) -> bool:
        """A workspace named ``name`` is there (kept from an agent removed before); True when it
        cannot be told (a fork that fails then keeps it)."""
        from agentvm import workspace

        try:
            return any(w.name == name for w in workspace.list_workspaces(self.paths.workspaces,
                                                                          runtime=self.paths.runtime))
        except Exception:  # noqa: BLE001
            return True

    async def fork(self, source: str, new: str, *, actor: str = "operator") -> dict:
        """A new agent from ``source`` (an agent: snapshotted now; or a snapshot by id or tag):
        its agent file under the new name with the parent's live changes (a live deny, lowered
        limits, a revoked credential, a lowered budget hold for the child too), the snapshot's
        workspace, a new sandbox - so a new uid and fresh credential placeholders, minted for it
        alone (no placeholder is valid in two sandboxes; its credentials are revoked on their
        own). A child whose policy would be wider than the one the snapshot was taken under is
        refused (``snapshot.policy-wider``); a child that fails to start is removed. LLM budget
        counters are per agent: the child's start at zero, under the limits it inherits
        (docs/concepts.md "Snapshots"). Parent and child on the chain."""
        import yaml

        from agentvm.fleet import widening
        from agentvm.policy_patch import LivePolicy

        if self.state.get(source) is not None:
            snap_d = await self.snapshot(source, tag=f"fork:{new}", actor=actor)
            snap = self._snapshot_of(snap_d["id"])
        else:
            snap = self._snapshot_of(source)
        tar = await asyncio.to_thread(self.snapshots.load, snap)  # checked: tampered is refused
        parent = self.state.get(snap.agent)
        if parent is None:
            raise refuse("sandbox.not-found", f"the snapshot's agent {snap.agent!r} is gone: its agent file with it",
                         hint="fork from an agent that exists")
        if self.state.get(new) is not None:
            raise refuse("sandbox.exists", f"a sandbox named {new!r} exists", hint=f"agentvm rm {new}")
        bound = await asyncio.to_thread(self._snapshot_policy, snap)
        if bound is None:
            raise refuse("snapshot.policy-wider", f"the policy snapshot {snap.id[:16]} was taken under cannot be "
                         f"recovered (its agent file or live changes changed since): a fork of it cannot be "
                         "checked to be no wider", hint=f"fork the agent itself: `agentvm fork {snap.agent} {new}`")
        doc = yaml.safe_load(parent.spec_text)
        doc.setdefault("metadata", {})["name"] = new
        patch = parent.policy_patch or "{}"  # the parent's live changes, now: the child is at least as narrow
        kept = await asyncio.to_thread(self._workspace_exists, new)  # (a kept one of that name: never removed here)
        await self.create(yaml.safe_dump(doc, sort_keys=False), f"{parent.spec_file} (fork of {snap.agent})",
                          actor=actor)
        try:
            self.state.update(new, policy_patch=patch)
            child = await asyncio.to_thread(self.effective_policy, self.state.get(new))
            wider = widening(bound, child)
            if wider:
                raise refuse("snapshot.policy-wider", f"{new} would run under a wider policy than snapshot "
                             f"{snap.id[:16]} was taken under: " + "; ".join(wider),
                             hint=f"narrow {snap.agent} again (`agentvm policy {snap.agent} ...`), or fork the agent "
                                  f"itself: `agentvm fork {snap.agent} {new}`")
            self.record("lifecycle.forked", actor=actor, sandbox=new, parent=snap.agent, child=new, snapshot=snap.id,
                        policy=snap.policy_digest, child_policy=child.digest(),
                        policy_patch=LivePolicy.from_json(patch).to_dict(), budget="per-agent counters (fresh)")
            self.snapshots.add_lineage(new, self._placeholders_of(snap.agent))
            m = self.managed.setdefault(new, Managed(new))
            m.seed = (tar, snap.workspace_digest, False)
            try:
                return await self.start_and_wait(new, actor=actor)
            finally:
                m.seed = None
        except BaseException as exc:
            # a fork that did not start leaves no agent behind (its row, the workspace made for
            # it, its lineage); a workspace of that name kept from before stays as it was
            err = getattr(exc, "code", type(exc).__name__)
            try:
                await self.remove(new, keep_workspace=kept, actor=actor)
                if not kept:  # (also where the agent file says workspace.keep: it was made for this fork)
                    from agentvm import workspace

                    await asyncio.to_thread(workspace.on_agent_removed, self.paths.workspaces, new,
                                            runtime=self.paths.runtime)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                import logging

                logging.getLogger("agentvm.daemon").exception("cannot remove the failed fork %s", new)
            self.record("lifecycle.fork-failed", actor=actor, sandbox=new, parent=snap.agent, snapshot=snap.id,
                        error=err)
            raise

    async def restore_snapshot(self, name: str, ref: str, *, actor: str = "operator") -> dict:
        """Roll ``name`` back to one of its snapshots: stopped, its workspace replaced by the
        snapshot's (checked first; extracted beside the current content and swapped in only when
        whole: a restore that fails leaves the workspace as it was, the agent stopped), started
        again."""
        snap = self._snapshot_of(ref)
        if snap.agent != name:
            raise refuse("config.invalid", f"snapshot {snap.id[:16]} is of {snap.agent}, not {name}",
                         hint=f"to start a new agent from it: agentvm fork {snap.id[:16]} NEW")
        tar = await asyncio.to_thread(self.snapshots.load, snap)
        self.row(name)
        await self.stop(name, actor=actor)
        self.record("lifecycle.restored", actor=actor, sandbox=name, snapshot=snap.id)
        m = self.managed.setdefault(name, Managed(name))
        m.seed = (tar, snap.workspace_digest, True)
        try:
            return await self.start_and_wait(name, actor=actor)
        finally:
            m.seed = None

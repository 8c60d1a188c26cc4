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

# how long a suspend lets requests under way through the gate finish (the daemon's environment
# may set it: AGENTVM_SUSPEND_DRAIN)
DRAIN_SECONDS = 10.0


def _drain() -> float:
    import os

    try:
        return max(0.0, float(os.environ.get("AGENTVM_SUSPEND_DRAIN", DRAIN_SECONDS)))
    except ValueError:
        return DRAIN_SECONDS


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

    async def suspend(self, name: str, *, actor: str = "operator", drain: float | None = None) -> dict:
        """Write the sandbox's whole state to a root-only checkpoint and free every host
        resource it held (its processes, memory, cgroup, gate endpoint): the run ends in the
        checkpoint, and ``resume`` restores it. A substrate that cannot do so faithfully
        (bubblewrap: CRIU cannot restore Landlock) refuses (``backend.suspend-unsupported``).

        Its gate connections first (runsc cannot save a host socket: a checkpoint holding one
        takes the sandbox down): the endpoint is quiesced - no new connection served, idle
        keep-alive ones closed, requests under way given ``drain`` seconds (DRAIN_SECONDS) to
        finish - and the backend checkpoints only a sandbox it has paused and found holding no
        connection to the gate. Otherwise ``sandbox.suspend-busy`` says what is open, the
        endpoint serves again and the sandbox keeps running: a suspend never loses it."""
        m = self._live(name)
        cp = await self._checkpoint(name, m, actor=actor, drain=_drain() if drain is None else drain)
        return {"name": name, "state": self.state.get(name).state, "checkpoint": {
            "binding": cp.binding, "bytes": cp.bytes, "seconds": cp.seconds}}

    async def _checkpoint(self, name: str, m: Managed, *, actor: str, drain: float, why: str = "suspend",
                          paused=None):
        """The checkpoint of ``m``'s sandbox (its run ends in it; the agent is then suspended),
        sealed and recorded: the Checkpoint, with ``seconds`` it took."""
        from agentvm import checkpoint

        backend, s = m.backend, m.session
        if not getattr(backend, "can_suspend", False):
            backend.suspend(m.handle, "")  # the substrate's refusal, by its code
        if self.state.get(name).state == "paused":
            await self.unpause(name, actor=actor, why=why)
        # the policy it resumes on: its agent file's with the live changes made so far (what a
        # start now would run; a change made while it is suspended wakes it first)
        digest = await asyncio.to_thread(lambda: self.effective_policy(self.state.get(name)).digest())
        sid, substrate = s.sandbox_id, s.plan.substrate
        ep = m.endpoint
        creds = s.res.creds  # (its processes hold these placeholders: kept with the checkpoint)
        held_placeholders = {b.name: creds.placeholders[b.name] for b in getattr(s.policy, "credentials", ())
                             if creds is not None and b.name in creds.placeholders}
        quiesced = ep is not None and hasattr(ep, "quiesce")
        t0 = time.monotonic()
        if quiesced:
            busy = await ep.quiesce(drain)
            if busy:
                ep.unquiesce()
                self.record("lifecycle.suspend-refused", actor=actor, sandbox=name, sandbox_id=sid,
                            error="sandbox.suspend-busy", message=f"{busy} request(s) under way after {drain:g} s")
                raise refuse("sandbox.suspend-busy", f"{name} still has {busy} request(s) under way through its gate "
                             f"after {drain:g} s: a sandbox holding a connection to its gate cannot be checkpointed. "
                             "Nothing was changed: it keeps running",
                             hint=f"try again when they are done (`agentvm suspend {name}`), or pause it: "
                                  f"`agentvm pause {name}`")
        wait_quiet = getattr(backend, "wait_quiet", None)
        if wait_quiet is not None:  # (what the endpoint closed, or requests under way a worker's gate serves)
            left = max(0.0, drain - (time.monotonic() - t0))
            await asyncio.to_thread(wait_quiet, m.handle, left)
        image = await asyncio.to_thread(checkpoint.new_dir, self.paths.home, name, sid)
        m.suspending = True
        try:
            if paused is not None:
                await asyncio.to_thread(lambda: backend.suspend(m.handle, str(image), paused=paused))
            else:
                await asyncio.to_thread(backend.suspend, m.handle, str(image))
        except BaseException as exc:
            m.suspending = False
            if quiesced and m.task is not None and not m.task.done():
                ep.unquiesce()  # (refused or failed, the sandbox still runs: it is served again)
            import shutil

            await asyncio.to_thread(shutil.rmtree, image.parent, True)
            if isinstance(exc, AgentVMError):
                self.record("lifecycle.suspend-refused", actor=actor, sandbox=name, sandbox_id=sid, error=exc.code,
                            message=exc.message[:500])
            raise
        if m.task is not None:
            await asyncio.gather(m.task, return_exceptions=True)  # the teardown frees the rest
        cp = await asyncio.to_thread(checkpoint.seal, name, sid, substrate, digest, image)
        if held_placeholders:
            import json

            cp.placeholders = json.dumps(held_placeholders)
        self.checkpoints.put(cp)
        cp.seconds = round(time.monotonic() - t0, 3)
        self.record("lifecycle.suspended", actor=actor, sandbox=name, sandbox_id=sid, binding=cp.binding,
                    image_digest=cp.image_digest, policy=digest, bytes=cp.bytes, seconds=cp.seconds,
                    **({"for": why} if why != "suspend" else {}))
        return cp

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

    async def snapshot(self, name: str, *, tag: str | None = None, actor: str = "operator",
                       memory: bool = False) -> dict:
        """The agent's workspace, content-addressed, with the policy and image it runs on; taken
        while its sandbox is paused where it can be (a consistent point; nothing moves while the
        files are read). A suspended agent is resumed first. ``memory``: its processes too
        (:meth:`_memory_snapshot`, gVisor)."""
        if memory:
            return await self._memory_snapshot(name, tag=tag, actor=actor)
        await self.wake(name, actor=actor, why="snapshot")
        m = self._live(name)
        ws, row, policy, digest, image, limit, doc = await self._snapshot_basis(name, m)
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

    async def _snapshot_basis(self, name: str, m):
        """What any snapshot of ``name`` records: its workspace, row, effective policy and its
        digest, the image it runs on, the content limit (at most the agent's disk limit of file
        content: restored into that limit) and the policy document."""
        from agentvm import snapshot

        ws = m.session.res.workspace
        if ws is None:
            raise refuse("config.invalid", f"{name} has no workspace to snapshot")
        row = self.state.get(name)
        policy = await asyncio.to_thread(self.effective_policy, row)
        image = getattr(m.session.policy, "image", None) or "host-view"
        doc = {"spec_text": row.spec_text, "spec_file": row.spec_file, "policy_patch": row.policy_patch or "{}"}
        return ws, row, policy, policy.digest(), image, policy.limits.disk or snapshot.MAX_BYTES, doc

    async def _memory_snapshot(self, name: str, *, tag: str | None, actor: str) -> dict:
        """A snapshot with memory (gVisor): the sandbox is checkpointed as by ``suspend`` (its
        gate connections drained first, or refused), its workspace read while it is paused just
        before (nothing runs: files and memory are of one instant), the checkpoint image linked
        into the snapshot (root-only, its digest part of the snapshot's id), and the agent
        resumed from its checkpoint - it runs on, its processes continuing. The placeholders its
        memory holds are kept with the snapshot: a fork's gate refuses them as leaks. A
        substrate that cannot checkpoint faithfully refuses (``snapshot.memory-unsupported``)."""
        await self.wake(name, actor=actor, why="snapshot")
        m = self._live(name)
        if not getattr(m.backend, "can_suspend", False):
            raise refuse("snapshot.memory-unsupported",
                         f"{name} runs on {m.session.plan.substrate}, which cannot checkpoint its processes faithfully: "
                         "the only checkpointer for host processes (CRIU) can neither save nor restore a Landlock "
                         "domain, so a memory fork would run weaker than its parent - never attempted",
                         hint=f"snapshot the workspace only (`agentvm snapshot {name}`), or run the agent on gVisor "
                              "(`substrate: gvisor`) to snapshot its memory")
        ws, row, policy, digest, image, limit, doc = await self._snapshot_basis(name, m)
        creds = m.session.res.creds
        held = [[f"{n.split('.', 1)[0]}.parent", p] for n, p in (creds.placeholders.items() if creds else ())]
        staged: dict = {}
        store = self.snapshots
        host_dir = Path(ws.host_dir)

        def while_paused():  # (the backend's thread, the sandbox paused)
            staged["tar"] = store.stage(host_dir, limit=limit)

        try:
            cp = await self._checkpoint(name, m, actor=actor, drain=_drain(), why="snapshot", paused=while_paused)
        except AgentVMError as exc:
            if "tar" in staged:
                store.unstage(staged["tar"])
            self.record("snapshot.refused", actor=actor, sandbox=name, error=exc.code, message=exc.message[:500],
                        memory=True)
            raise
        except BaseException:
            if "tar" in staged:
                store.unstage(staged["tar"])
            raise
        # checkpointed: from here on the agent is resumed, whatever happens to the snapshot
        snap, err = None, None
        try:
            snap = await asyncio.to_thread(store.commit, name, tag, staged["tar"], policy_digest=digest, image=image,
                                           policy_doc=doc, memory=Path(cp.dir), memory_digest=cp.image_digest,
                                           extra={"placeholders": held, "substrate": cp.substrate,
                                                  "sandbox_id": cp.sandbox_id})
        except AgentVMError as exc:
            err = exc
            self.record("snapshot.refused", actor=actor, sandbox=name, error=exc.code, message=exc.message[:500],
                        memory=True)
        finally:
            try:
                await self.resume_sandbox(name, actor=actor, why="snapshot")
            except Exception as exc:  # noqa: BLE001 - it stays suspended, its checkpoint kept: never lost
                import logging

                logging.getLogger("agentvm.daemon").warning("%s: not resumed after its memory snapshot: %s", name, exc)
                if err is None and snap is not None:
                    self.record("snapshot.created", actor=actor, sandbox=name, snapshot=snap.id, tag=tag, memory=True,
                                memory_digest=snap.memory_digest, workspace_digest=snap.workspace_digest,
                                policy=digest, image=image, bytes=snap.bytes, files=snap.files, skipped=snap.skipped)
                raise
        if err is not None:
            raise err
        self.record("snapshot.created", actor=actor, sandbox=name, snapshot=snap.id, tag=tag, memory=True,
                    memory_digest=snap.memory_digest, memory_bytes=cp.bytes, workspace_digest=snap.workspace_digest,
                    policy=digest, image=image, bytes=snap.bytes, files=snap.files, skipped=snap.skipped)
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

    async def fork(self, source: str, new: str, *, actor: str = "operator", memory: bool = False) -> dict:
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
            snap_d = await self.snapshot(source, tag=f"fork:{new}", actor=actor, memory=memory)
            snap = self._snapshot_of(snap_d["id"])
        else:
            snap = self._snapshot_of(source)
            if memory and not snap.memory_digest:
                raise refuse("snapshot.not-found", f"snapshot {snap.id[:16]} holds no memory",
                             hint=f"fork the agent itself with its memory: `agentvm fork {snap.agent} {new} --memory`")
        tar = await asyncio.to_thread(self.snapshots.load, snap)  # checked: tampered is refused
        # a memory snapshot: its checkpoint image, checked (the child restores it)
        mem = await asyncio.to_thread(self.snapshots.load_memory, snap) if snap.memory_digest else None
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
                        memory=bool(snap.memory_digest),
                        policy=snap.policy_digest, child_policy=child.digest(),
                        policy_patch=LivePolicy.from_json(patch).to_dict(), budget="per-agent counters (fresh)")
            # the placeholders the snapshot's memory holds (its agent's session then) are leaks
            # in the child too, beside its parent's now and their ancestors'
            held = [tuple(x) for x in self.snapshots.extra(snap).get("placeholders", []) if len(x) == 2]
            self.snapshots.add_lineage(new, self._placeholders_of(snap.agent) + held)
            m = self.managed.setdefault(new, Managed(new))
            m.seed = (tar, snap.workspace_digest, False)
            if mem is not None:  # restored (runsc restore) into the child's new sandbox: bound to the snapshot
                from agentvm import checkpoint

                cd = child.digest()
                m.restore = checkpoint.Checkpoint(new, snap.id, self.snapshots.extra(snap).get("substrate", "gvisor"),
                                                  cd, snap.memory_digest, checkpoint.binding(snap.memory_digest, cd,
                                                                                             snap.id),
                                                  str(mem[0]), mem[1], time.time())
            try:
                out = await self.start_and_wait(new, actor=actor)
            finally:
                m.seed = None
                m.restore = None
            if mem is not None and out.get("state") != "running":
                raise refuse("sandbox.start-failed", f"{new} did not start from snapshot {snap.id[:16]}'s memory "
                             f"({out.get('state')}): {((out.get('error') or {}).get('message') or '')[:300]}",
                             hint=f"fork its workspace only: `agentvm fork {snap.agent} {new}`")
            return out
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

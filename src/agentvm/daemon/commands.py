"""Commands in sandboxes: ``exec`` in a running one, ``run`` (one command in a fresh sandbox,
the lifecycle sequence on the daemon's gate) and ``cp`` in and out of a running one's
workspace. Output is streamed to an :class:`~agentvm.daemon.pump.Output` (the transport's).

:class:`Commands` is a part of :class:`agentvm.daemon.control.ControlPlane`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentvm.daemon.events import refuse
from agentvm.daemon.pump import ClientGone, Output, pump
from agentvm.errors import PolicyDenied

log = logging.getLogger("agentvm.daemon")


@dataclass(frozen=True)
class RunRequest:
    """``agentvm run`` through the daemon: one command in a fresh sandbox. The options come
    either as the CLI took them (``cli``: its option names and strings, parsed by the embedded
    run's own code) or as values."""

    command: tuple[str, ...] | None = None
    cli: dict[str, Any] | None = None
    spec: str | None = None
    file: str = "<api>"
    preset_dirs: tuple[str, ...] | None = None
    stdin: bytes = b""
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (host, path, writable)
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    memory: int | None = None
    allow: tuple[str, ...] = ()
    hosts: dict[str, str] = field(default_factory=dict)
    network: str | None = None
    substrate: str | None = None


class Commands:
    """exec, run and cp (a part of the ControlPlane)."""

    async def exec(self, name: str, argv: list[str], out: Output, *, timeout: float | None = None,
                   actor: str = "operator"):
        """Run ``argv`` in the running sandbox ``name``, its output streamed to ``out``;
        returns its ExitStatus."""
        m = self.managed.get(name)
        if m is None or m.handle is None:
            raise refuse("sandbox.not-running", f"{name} is not running", hint=f"agentvm start {name}")
        m.touch(self.state, time.time())
        self.record("operator.exec", actor=actor, sandbox=name, argv=argv)
        backend = m.backend
        o_r, o_w = os.pipe2(os.O_CLOEXEC)
        e_r, e_w = os.pipe2(os.O_CLOEXEC)
        stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        fut = asyncio.ensure_future(asyncio.to_thread(backend.exec, m.handle, argv, stdio=(stdin, o_w, e_w),
                                                      timeout=timeout))
        began = time.time()
        await out.start()
        status = await pump({o_r: "stdout", e_r: "stderr"}, fut, (o_w, e_w, stdin), out)
        trace = m.session.trace if m.session is not None else None
        if trace is not None:
            trace.span("exec", began, attributes={"agentvm.exec.command": os.path.basename(argv[0])[:128],
                                                  "agentvm.exec.exit_code": status.exit_code,
                                                  "agentvm.exec.timed_out": bool(status.timed_out)})
        return status

    def run_policy(self, req: RunRequest):
        """The policy of a run request (the same code as the embedded run builds it with)."""
        from agentvm.policy import MountGrant, Policy, compile_policy, with_overrides
        from agentvm.spec.loader import load_agent_text

        if req.spec:
            dirs = [Path(d) for d in req.preset_dirs] if req.preset_dirs is not None else None
            policy = compile_policy(load_agent_text(req.spec, req.file, preset_dirs=dirs).spec)
        else:
            net = (req.cli or {}).get("network") if req.cli is not None else req.network
            policy = Policy(name="run", network=net if net in ("gate", "none") else "gate")
        if req.cli is not None:
            # the thin client's options as typed: parsed here by the same code as embedded runs
            from agentvm.overrides import from_cli

            return with_overrides(policy, **from_cli(dict(req.cli), list(req.command) if req.command else None))
        return with_overrides(
            policy,
            command=tuple(req.command or ()) or None,
            mounts=tuple(MountGrant(h, p, bool(w)) for h, p, w in req.mounts),
            env=dict(req.env),
            timeout=req.timeout,
            memory=req.memory,
            allow=tuple(req.allow),
            hosts=dict(req.hosts),
            network=req.network,
            substrate=req.substrate,
        )

    async def run(self, req: RunRequest, out: Output, *, actor: str = "operator"):
        """``agentvm run`` through the daemon: one sandbox for one command (the lifecycle
        sequence on the daemon's gate, the same policy semantics as the embedded run), its
        output streamed to ``out``; returns its RunResult. A client that goes away is like
        Ctrl-C on an embedded run: the run is stopped (ClientGone)."""
        from agentvm.errors import HostEnvironmentError

        try:
            policy = self.run_policy(req)
        except (PolicyDenied, HostEnvironmentError) as exc:
            # refused before the lifecycle's own preflight (a tier ceiling, an option): on the
            # chain all the same, as every refused run is
            self.record("run.refused", actor=actor, agent=_spec_name(req.spec), code=exc.code,
                        message=exc.message[:500])
            raise
        if not policy.command:
            raise refuse("api.bad-request", "nothing to run")
        o_r, o_w = os.pipe2(os.O_CLOEXEC)
        e_r, e_w = os.pipe2(os.O_CLOEXEC)
        i_r, i_w = os.pipe2(os.O_CLOEXEC)
        stdin_data = req.stdin

        def feed_stdin():
            try:
                if stdin_data:
                    os.write(i_w, stdin_data)
            except OSError:
                pass
            finally:
                os.close(i_w)

        self.record("operator.run", actor=actor, sandbox=policy.name, command=list(policy.command))
        stop = asyncio.Event()
        fut = asyncio.ensure_future(self._lifecycle().run_to_end(policy, stdio=(i_r, o_w, e_w), timed=True,
                                                                 stop=stop, grace=1.0))

        def client_gone():
            # like Ctrl-C on an embedded run: the caller is gone, so is the run
            self.record("operator.run-abandoned", sandbox=policy.name, reason="the client went away")
            stop.set()

        feeder = asyncio.ensure_future(asyncio.to_thread(feed_stdin))
        await out.start()
        try:
            return await pump({o_r: "stdout", e_r: "stderr"}, fut, (o_w, e_w, i_r), out, client_gone)
        except ConnectionError as exc:
            if isinstance(exc, ClientGone):
                raise
            # the run's own failure (not the client's leaving): an answer, in the stream
            log.exception("a run failed")
            raise refuse("internal.bug", f"the run failed: {type(exc).__name__}: {exc}",
                         "a bug in agent-vm: the daemon's log has the traceback") from exc
        finally:
            await feeder

    def _workspace_dir(self, name: str) -> tuple[Path, int | None]:
        m = self.managed.get(name)
        s = m.session if m is not None else None
        if s is None or s.res.workspace is None or s.handle is None:
            raise refuse("sandbox.not-running", f"{name} is not running (its workspace is mounted only while it runs)")
        return Path(s.res.workspace.host_dir), s.res.host_uid

    async def copy_in(self, name: str, path: str, data: bytes, *, tar: bool = False, actor: str = "operator") -> dict:
        """cp into a running sandbox's workspace: one file, or with ``tar`` a folder as a tar
        stream (daemon.files: the same path checks for every member)."""
        from agentvm.daemon import files

        self.row(name)  # not-found for a sandbox that does not exist, before "not running"
        root, uid = self._workspace_dir(name)
        if tar:
            got = await asyncio.to_thread(files.write_tree_beneath, root, path, data, uid)
            self.record("operator.cp-in", actor=actor, sandbox=name, path=path, folder=True, **got)
            return {"written": got["bytes"], "path": path, **got}
        n = await asyncio.to_thread(files.write_beneath, root, path, data, uid)
        self.record("operator.cp-in", actor=actor, sandbox=name, path=path, bytes=n)
        return {"written": n, "path": path}

    async def copy_out(self, name: str, path: str, *, tar: bool = False, actor: str = "operator") -> dict:
        """cp out of a running sandbox's workspace: ``{"path", "kind": "file"|"tar", "data":
        bytes, ...}`` (with ``tar``, a folder comes as a tar stream)."""
        from agentvm.daemon import files

        self.row(name)
        root, _uid = self._workspace_dir(name)
        if tar and await asyncio.to_thread(files.is_dir_beneath, root, path):
            data, got = await asyncio.to_thread(files.read_tree_beneath, root, path)
            self.record("operator.cp-out", actor=actor, sandbox=name, path=path, folder=True, **got)
            return {"path": path, "kind": "tar", **got, "data": data}
        data = await asyncio.to_thread(files.read_beneath, root, path)
        self.record("operator.cp-out", actor=actor, sandbox=name, path=path, bytes=len(data))
        return {"path": path, "kind": "file", "data": data}


def _spec_name(text) -> str:
    """An agent file's metadata.name, for a record about it (``run`` when there is none)."""
    if not isinstance(text, str):
        return "run"
    try:
        import yaml

        name = yaml.safe_load(text)["metadata"]["name"]
    except Exception:  # noqa: BLE001 - a record's label, never a reason to fail
        return "run"
    return str(name)[:200] if isinstance(name, str) else "run"

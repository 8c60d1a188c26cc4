"""The Python SDK: a typed bridge between a host program and a sandbox, over the daemon API.

    import agentvm
    with agentvm.Sandbox("agent.yaml") as sb:          # create + start (removed on exit)
        r = sb.exec(["python3", "-c", "print(1)"])
        print(r.exit_code, r.stdout)
        sb.exec(["sort"], stdin=b"b\na\n").stdout            # stdin, streamed
        with sb.session(["sh"], tty=(24, 80)) as s: ...      # an interactive terminal
        sb.put("in/data.csv", b"...");  sb.get("out/result.json")
        sb.allow("pypi.org:443");  sb.revoke("openai")

    async with agentvm.AsyncSandbox("agent.yaml") as sb:
        r = await sb.exec(["make", "test"])

The CLI uses the same client (``agentvm.daemon.client``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from agentvm.daemon.client import Client, ensure_spec_text


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    setup_error: dict | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Sandbox:
    def __init__(self, spec, *, client: Client | None = None, keep: bool = False, ttl: float | None = None,
                 idle_timeout: float | None = None):
        self.client = client or Client()
        self.spec_text, self.file = ensure_spec_text(spec)
        self.keep = keep
        self.ttl, self.idle_timeout = ttl, idle_timeout
        self.name: str | None = None

    def __enter__(self) -> "Sandbox":
        self.name = self.client.create(self.spec_text, self.file, self.ttl, self.idle_timeout)["name"]
        self.client.action(self.name, "start")
        return self

    def __exit__(self, *exc) -> None:
        if self.name and not self.keep:
            self.client.rm(self.name)

    def exec(self, argv: list[str], timeout: float | None = None, *, stdin: bytes | None = None) -> ExecResult:
        """Run ``argv`` in the sandbox; its output collected. With ``stdin`` (bytes), the command
        reads them, then EOF (an interactive session streams them: no size limit of a request)."""
        if stdin is not None:
            return self._exec_with_stdin(argv, timeout, stdin)
        out, err, final = [], [], {}
        for ev in self.client.exec(self.name, argv, timeout):
            if ev.get("stream") == "stdout":
                out.append(ev["data"])
            elif ev.get("stream") == "stderr":
                err.append(ev["data"])
            else:
                final = ev
        return ExecResult(final.get("exit_code", 125), b"".join(out), b"".join(err), bool(final.get("timed_out")),
                          final.get("setup_error"))

    def _exec_with_stdin(self, argv: list[str], timeout: float | None, stdin: bytes) -> ExecResult:
        import threading

        out, err = [], []
        code, text = 125, ""
        with self.session(argv, timeout=timeout) as sess:
            def feed():
                try:
                    sess.send(stdin)
                    sess.close_stdin()
                except OSError:
                    pass  # the command ended first: the rest is not read

            t = threading.Thread(target=feed, daemon=True)
            t.start()
            for kind, data in sess.events():
                if kind == "stdout":
                    out.append(data)
                elif kind == "stderr":
                    err.append(data)
                else:
                    code, text = data
        t.join(timeout=5)
        return ExecResult(code, b"".join(out), b"".join(err), code == 124,
                          {"message": text} if text else None)

    def session(self, argv: list[str], *, timeout: float | None = None, tty: tuple[int, int] | None = None):
        """An interactive exec (``exec -i``, with ``tty`` (rows, cols) ``exec -it``): an
        ``AttachedSession`` - ``send(bytes)``, ``close_stdin()``, ``resize(rows, cols)``,
        ``signal("INT")``, ``events()`` yielding ("stdout"|"stderr", bytes) then
        ("exit", (code, text)). Use it as a context manager."""
        return self.client.exec_session(self.name, argv, timeout=timeout, tty=tty)

    def put(self, path: str, data: bytes):
        return self.client.put_file(self.name, path, data)

    def get(self, path: str) -> bytes:
        return self.client.get_file(self.name, path)

    def logs(self) -> str:
        return self.client.logs(self.name)

    def status(self) -> dict:
        return self.client.get(self.name)

    def allow(self, rule: str):
        return self.client.policy(self.name, "allow", rule=rule)

    def deny(self, rule: str):
        return self.client.policy(self.name, "deny", rule=rule)

    def pause_egress(self):
        return self.client.policy(self.name, "pause")

    def resume_egress(self):
        return self.client.policy(self.name, "resume")

    def revoke(self, credential: str):
        return self.client.policy(self.name, "revoke", credential=credential)

    def tighten(self, *, memory: str | int | None = None, pids: int | None = None, cpus: float | None = None):
        return self.client.policy(self.name, "limits", memory=memory, pids=pids, cpus=cpus)

    def tools(self, action: str, tool: str):
        """``allow``, ``deny`` or ``approve`` SERVER__TOOL (or SERVER__glob) live."""
        return self.client.policy(self.name, "tools", action=action, tool=tool)


def pending_approvals(*, all_states: bool = False, client: Client | None = None) -> list[dict]:
    """Held actions waiting for a human (with ``all_states``: answered ones too)."""
    return (client or Client()).approvals(all_states)


def approve(request_id: str, note: str | None = None, *, client: Client | None = None) -> dict:
    return (client or Client()).answer(request_id, True, note)


def deny(request_id: str, note: str | None = None, *, client: Client | None = None) -> dict:
    return (client or Client()).answer(request_id, False, note)


class AsyncSandbox:
    """The same API for asyncio programs (the blocking calls run in a worker thread)."""

    def __init__(self, spec, **kw):
        self._sync = Sandbox(spec, **kw)

    async def __aenter__(self) -> "AsyncSandbox":
        await asyncio.to_thread(self._sync.__enter__)
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self._sync.__exit__, *exc)

    @property
    def name(self) -> str | None:
        return self._sync.name

    def __getattr__(self, attr):
        fn = getattr(self._sync, attr)
        if not callable(fn):
            return fn

        async def call(*a, **kw):
            return await asyncio.to_thread(fn, *a, **kw)

        return call

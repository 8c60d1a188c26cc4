"""Daemon and lifecycle commands: up, down, create, start, stop, restart, rm, ps, exec, cp,
logs, policy, audit, events. Thin wrappers over ``agentvm.daemon.client``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from agentvm.cli.common import Parsed as _Parsed  # (shared with workspace_cmds: below both)
from agentvm.cli.common import duration as _duration
from agentvm.errors import EXIT_POLICY, ConfigError


def _since() -> _Parsed:  # a Unix time, a duration ago, an ISO date
    from agentvm.units import parse_since

    return _Parsed("time", parse_since)


def _client():
    from agentvm.daemon.client import Client

    return Client()


def _gate_workers(text: str) -> int | str:
    """``agent`` (the default: a confined worker per running agent), ``auto`` (one shared
    worker per CPU), N shared workers, or 0 (the daemon's own process: the audited opt-in)."""
    from agentvm.gate.workers import MAX_WORKERS

    t = (text or "agent").strip().lower()
    if t in ("agent", "per-agent"):
        return "agent"
    if t == "auto":
        return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
    try:
        n = int(t)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_WORKERS:
        raise click.BadParameter(f"{text!r}: give agent (the default: one confined worker per running agent), "
                                 f"a number from 0 to {MAX_WORKERS}, or auto (one per CPU)",
                                 param_hint="--gate-workers")
    return n


@click.command()
@click.option("--foreground", is_flag=True, help="Stay in the foreground (logs to stderr).")
@click.option("--listen", metavar="HOST:PORT", help="Also serve the API on TCP, with a bearer token (<home>/daemon.token).")
@click.option("--accept-broken-chain", is_flag=True,
              help="Start although the audit chain does not verify (the break is recorded first).")
@click.option("--otlp-endpoint", metavar="URL", envvar="AGENTVM_OTLP_ENDPOINT",
              help="Export traces to this OpenTelemetry collector (OTLP/HTTP base URL, e.g. http://127.0.0.1:4318) "
              "and relay the agents' own OTLP export to it (env: AGENTVM_OTLP_ENDPOINT).")
@click.option("--otlp-sample-allowed", type=float, metavar="RATIO", envvar="AGENTVM_OTLP_SAMPLE_ALLOWED",
              help="The share (0-1, default 1) of plain allowed egress decisions that become spans; denials, "
              "credential uses, LLM calls, tools, approvals and lifecycle always do.")
@click.option("--gate-workers", metavar="agent|N|auto", envvar="AGENTVM_GATE_WORKERS", default="agent", show_default=True,
              help="Who parses the sandboxes' egress: agent - a confined gate worker per running agent, started with "
              "its first sandbox and retired after its last (the default); N (or auto: one per CPU) - N confined "
              "workers shared by all agents; 0 - the daemon's own root process, not contained (recorded on the "
              "audit chain as a security alert, warned by doctor and status). Sandboxes with tools stay on the "
              "daemon's gate (recorded). Env: AGENTVM_GATE_WORKERS.")
@click.option("--unconfined-gate", is_flag=True,
              help="The same as --gate-workers 0: the gate in the daemon's own process (audited; docs/threat-model.md).")
@click.option("--no-resume", is_flag=True,
              help="Leave stopped the persistent workers the last daemon left running (by default they start again).")
@click.option("--e2b-listen", metavar="HOST:PORT",
              help="Also serve the E2B-compatible API on this loopback port (docs/e2b.md; `agentvm e2b env`).")
@click.option("--e2b-max-per-tenant", type=click.IntRange(1, 10000), default=20, show_default=True,
              help="E2B API: sandboxes one API key may hold.")
@click.option("--e2b-max-creating", type=click.IntRange(1, 1000), default=4, show_default=True,
              help="E2B API: creates in progress at once (more: 429).")
def up(foreground, listen, accept_broken_chain, otlp_endpoint, otlp_sample_allowed, gate_workers, unconfined_gate,
       no_resume, e2b_listen, e2b_max_per_tenant, e2b_max_creating):
    """Start the control-plane daemon (and the persistent workers that were running)."""
    from agentvm.daemon.server import check_chain, check_state
    from agentvm.paths import default_paths

    workers = 0 if unconfined_gate else _gate_workers(gate_workers)
    if workers == 0:
        click.echo(click.style("agentvm: warning: ", fg="yellow") + "the gate runs in the daemon's own process "
                   "(--gate-workers 0): every sandbox's bytes are parsed by it, not contained; this is recorded on "
                   "the audit chain (gate.unconfined)", err=True)
    paths = default_paths().ensure()
    c = _client()
    if c.available():
        click.echo(f"agentvm: the daemon is already running ({c.socket_path})")
        return 0
    check_chain(paths, accept_broken_chain)  # refused here, with the reason, not in a log file
    check_state(paths)  # a lost identity database: refused here too (state.lost)
    _warn_workspace_disk(paths)
    e2b = None
    if e2b_listen:
        from agentvm.daemon.server import parse_e2b_listen

        parse_e2b_listen(e2b_listen)  # refused here, with the reason, not in a log file
        e2b = {"listen": e2b_listen, "max_per_tenant": e2b_max_per_tenant, "max_creating": e2b_max_creating}
    if foreground:
        from agentvm.daemon.server import run_daemon

        run_daemon(paths, listen=listen, accept_broken_chain=accept_broken_chain, otlp_endpoint=otlp_endpoint,
                   otlp_sample_allowed=otlp_sample_allowed, gate_workers=workers, resume=not no_resume, e2b=e2b)
        return 0
    if otlp_endpoint:
        from agentvm.observe.tracing import check_endpoint, check_sample

        check_endpoint(otlp_endpoint)  # refused here, with the reason, not in a log file
        if otlp_sample_allowed is not None:
            check_sample(otlp_sample_allowed)
    log = paths.home / "daemon.log"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    args = [sys.executable, "-m", "agentvm", "up", "--foreground"] + (["--listen", listen] if listen else [])
    args += ["--accept-broken-chain"] if accept_broken_chain else []
    args += ["--otlp-endpoint", otlp_endpoint] if otlp_endpoint else []
    args += ["--otlp-sample-allowed", str(otlp_sample_allowed)] if otlp_sample_allowed is not None else []
    args += ["--gate-workers", str(workers)]
    args += ["--no-resume"] if no_resume else []
    args += ["--e2b-listen", e2b_listen, "--e2b-max-per-tenant", str(e2b_max_per_tenant),
             "--e2b-max-creating", str(e2b_max_creating)] if e2b_listen else []
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True, close_fds=True)
    os.close(fd)
    try:
        (paths.runtime / "daemon.pid").write_text(f"{proc.pid}\n")
    except BaseException:  # (a full disk): a daemon no pid file names would outlive every `down`
        proc.kill()
        proc.wait()
        raise
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            click.echo(f"agentvm: the daemon exited at start (exit {proc.returncode}); see {log}", err=True)
            return 125
        if c.available():
            click.echo(f"agentvm: daemon running (pid {proc.pid}, socket {c.socket_path}, log {log})")
            return 0
        time.sleep(0.05)
    click.echo(f"agentvm: the daemon did not answer within 20 s; see {log}", err=True)
    return 125


def _warn_workspace_disk(paths) -> None:
    """Past 90% use of the filesystem holding the workspaces: say so (never refuse to start)."""
    from agentvm.workspace import usage

    try:
        warnings = usage(paths.workspaces).warnings
    except OSError:
        return
    for w in warnings:
        click.echo(click.style("agentvm: warning: ", fg="yellow") + w, err=True)


@click.command()
def down():
    """Stop the daemon (its sandboxes are stopped, their teardown verified)."""
    from agentvm.paths import default_paths

    c = _client()
    if not c.available():
        click.echo("agentvm: the daemon is not running")
        return 0
    from agentvm.runtime import _alive

    pidf = default_paths().runtime / "daemon.pid"
    try:
        pid = int(pidf.read_text())
    except (OSError, ValueError):
        pid = None
    c.shutdown()
    deadline = time.monotonic() + 60
    # stopped means the process is gone, not merely the socket: its exit path still tears down
    while (c.available() or (pid is not None and _alive(pid))) and time.monotonic() < deadline:
        time.sleep(0.05)
    pidf.unlink(missing_ok=True)
    click.echo("agentvm: daemon stopped")
    return 0


@click.command()
@click.option("-f", "--file", "agent_file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--ttl", type=_duration(), help="Ephemeral: stop after this long (e.g. 5m, 2h, 90).")
@click.option("--idle-timeout", type=_duration(), help="Ephemeral: stop after this long without activity (e.g. 10m).")
@click.option("--start", "start_now", is_flag=True, help="Start it right away.")
def create(agent_file, ttl, idle_timeout, start_now):
    """Register an agent with the daemon."""
    c = _client()
    row = c.create(Path(agent_file).read_text(), str(agent_file), ttl, idle_timeout)
    if start_now:
        row = c.action(row["name"], "start")
    click.echo(f"{row['name']}: {row['state']}")
    return 0


def _lifecycle(action):
    @click.command(name=action, help=f"{action.capitalize()} a sandbox.")
    @click.argument("name")
    def cmd(name):
        row = _client().action(name, action)
        click.echo(f"{name}: {row['state']}")
        return 0

    return cmd


start = _lifecycle("start")
stop = _lifecycle("stop")
restart = _lifecycle("restart")


@click.command()
@click.argument("name")
@click.option("--keep-workspace", is_flag=True,
              help="Keep its workspace (`agentvm workspace ls` lists it, `workspace rm` removes it).")
def rm(name, keep_workspace):
    """Stop and remove a sandbox and its workspace (unless kept: --keep-workspace, or the agent
    file's `workspace: {keep: true}`). Without a daemon: remove the workspace an agent run with
    `run -f` left."""
    from agentvm.daemon.client import DaemonUnavailable
    from agentvm.workspace import human

    c = _client()
    try:
        ans = c.rm(name, keep_workspace=keep_workspace)
    except DaemonUnavailable as exc:
        if c.url or not isinstance(exc.__cause__, (FileNotFoundError, ConnectionRefusedError)):
            raise
        return _rm_local(name, keep_workspace)
    ws = ans.get("workspace") if isinstance(ans, dict) else None
    if isinstance(ws, dict):
        said = (f"workspace removed ({human(int(ws.get('bytes') or 0))} freed)" if ws.get("removed")
                else "workspace kept" if ws.get("kept") else "no workspace")
        click.echo(f"{name}: removed ({said})")
    else:  # a daemon that does not remove workspaces
        click.echo(f"{name}: removed")
        from agentvm.paths import default_paths

        if (default_paths().workspaces / f"{name}.img").exists() and not keep_workspace:
            click.echo(f"agentvm: its workspace remains (this daemon keeps workspaces): `agentvm workspace rm {name}`",
                       err=True)
    return 0


def _rm_local(name, keep_workspace):
    """No daemon: nothing of ``name`` is registered, or the daemon that owns it is down."""
    from agentvm.cli.common import recorder
    from agentvm.paths import default_paths
    from agentvm.workspace import human, on_agent_removed, registered_agents

    paths = default_paths()
    owners = registered_agents(paths.home)
    if owners is None or name in owners:
        raise ConfigError(f"{name!r} is registered with the daemon, which is not running" if owners is not None
                          else "the daemon is not running and its state cannot be read",
                          hint="start it (`agentvm up`), then `agentvm rm` again", code="daemon.needed")
    ws = on_agent_removed(paths.workspaces, name, keep=keep_workspace, runtime=paths.runtime,
                          record=recorder(paths))
    if not ws["removed"] and not ws["kept"]:
        raise ConfigError(f"there is no sandbox or workspace named {name!r} (no daemon is running)",
                          hint="`agentvm workspace ls` lists the workspaces", code="workspace.not-found")
    click.echo(f"{name}: " + (f"workspace removed ({human(ws['bytes'])} freed)" if ws["removed"] else "workspace kept"))
    return 0


@click.command()
@click.option("--json", "as_json", is_flag=True)
def ps(as_json):
    """List the daemon's sandboxes."""
    rows = _client().ps()
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    click.echo(f"{'NAME':<24} {'STATE':<10} {'LIFECYCLE':<11} {'RESTARTS':>8} {'EXIT':>5}  SANDBOX")
    for r in rows:
        click.echo(f"{r['name']:<24} {r['state']:<10} {r['lifecycle']:<11} {r['restarts']:>8} "
                   f"{'' if r['exit_code'] is None else r['exit_code']:>5}  {r['sandbox_id'] or ''}")
    return 0


@click.command(name="exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("name")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
@click.option("--timeout", type=float)
@click.option("-i", "--interactive", is_flag=True, help="relay this stdin to the command (until its end)")
@click.option("-t", "--tty", is_flag=True, help="give the command a terminal (this terminal's input, size and "
              "Ctrl-C reach it; implies -i)")
@click.option("--raw-output", is_flag=True, help="write the command's output to this terminal byte for byte (default: "
              "escape sequences that make a terminal act - clipboard, answer-back queries, titles - are removed)")
def exec_cmd(name, argv, timeout, interactive, tty, raw_output):
    """Run a command in a running sandbox; streams its output; exits with its code.
    `exec -it NAME -- sh` attaches a terminal; `exec -i` relays a stdin pipe."""
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if interactive or tty:
        from urllib.parse import quote

        from agentvm.cli.fastrun import attach, attach_body

        sock, headers = _client().connect_raw()
        doc = json.dumps({"argv": argv, "timeout": timeout}).encode()
        code = attach(sock, f"/v1/sandboxes/{quote(name, safe='')}/exec/attach", attach_body(doc, tty), tty=tty,
                      headers=headers, raw_output=raw_output)
        if code is None:
            raise click.ClickException("this daemon has no interactive exec: restart it (`agentvm down; agentvm up`)")
        return code
    code = 125
    from agentvm.cli.fastrun import output_filters

    fo, fe = output_filters(raw_output)  # a terminal: agentvm.termfilter (docs/daemon.md)
    for ev in _client().exec(name, argv, timeout):
        if ev.get("stream") == "stdout":
            sys.stdout.buffer.write(fo.feed(ev["data"]) if fo else ev["data"])
            sys.stdout.buffer.flush()
        elif ev.get("stream") == "stderr":
            sys.stderr.buffer.write(fe.feed(ev["data"]) if fe else ev["data"])
            sys.stderr.buffer.flush()
        elif "exit_code" in ev:
            code = ev["exit_code"]
            if ev.get("setup_error"):
                click.echo(f"agentvm: exec failed at step '{ev['setup_error']['step']}': {ev['setup_error']['message']}",
                           err=True)
    return code


@click.command()
@click.argument("src")
@click.argument("dst")
def cp(src, dst):
    """Copy into or out of a workspace: `cp FILE|DIR NAME:PATH` or `cp NAME:PATH FILE|DIR`
    (a folder is copied whole: folders and regular files; links and special files are not).
    Streamed both ways: a file of any size within the workspace's room, never whole in memory."""
    c = _client()
    if ":" in dst and not Path(dst).exists():
        name, _, path = dst.partition(":")
        local = Path(src)
        if local.is_dir():
            import tempfile

            with tempfile.TemporaryFile(prefix="agentvm-cp-") as spool:  # the tar on disk, not in memory
                try:
                    skipped = _tar_of(local, spool)
                except OSError as exc:
                    raise ConfigError(f"cannot read {src}: {exc.strerror}") from None
                size = spool.tell()
                spool.seek(0)
                r = c.put_stream(name, path, spool, size, tar=True)
            click.echo(f"{src} -> {name}:{path} ({r['files']} files, {r['dirs']} folders, {r['bytes']} bytes)"
                       + (f"; left out {len(skipped)} links or special files: {', '.join(skipped[:5])}"
                          if skipped else ""))
            return 0
        try:
            fh = open(local, "rb")
        except OSError as exc:
            raise ConfigError(f"cannot read {src}: {exc.strerror}") from None
        with fh:
            r = c.put_stream(name, path, fh, os.fstat(fh.fileno()).st_size)
        click.echo(f"{r['written']} bytes -> {name}:{path}")
    elif ":" in src:
        name, _, path = src.partition(":")
        with c.open_download(name, path) as dl:
            out = Path(dst)
            if out.is_dir():  # `cp NAME:PATH .`: into the folder, under its own name
                out = out / Path(path).name
            if dl.kind == "tar":
                import tempfile

                with tempfile.TemporaryFile(prefix="agentvm-cp-") as spool:
                    _receive(dl, spool, out)
                    spool.seek(0)
                    try:
                        n = _untar_into(spool, out)
                    except OSError as exc:
                        raise ConfigError(f"cannot write {out}: {exc.strerror}") from None
                click.echo(f"{name}:{path} -> {out} ({n} files)")
                return 0
            n = _receive_file(dl, out)
        click.echo(f"{name}:{path} -> {out} ({n} bytes)")
    else:
        raise click.UsageError("one side must be NAME:PATH")
    return 0


def _receive(dl, fh, out: Path) -> int:
    """The download into the binary file ``fh``, a piece at a time; its byte count."""
    import http.client

    from agentvm.errors import BackendError

    n = 0
    try:
        while True:
            b = dl.read()
            if not b:
                return n
            fh.write(b)
            n += len(b)
    except http.client.IncompleteRead:
        raise BackendError(f"the copy to {out} was cut short after {n} bytes (the file changed or the daemon "
                           "stopped): nothing was written", hint="copy it again") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}") from None


def _receive_file(dl, out: Path) -> int:
    """A file's download, written next to ``out`` and renamed over it once whole (a copy cut
    short leaves the old ``out``, not half a file)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.agentvm-", dir=str(out.parent or "."))
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            n = _receive(dl, fh, out)
        try:
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, out)
        except OSError as exc:
            raise ConfigError(f"cannot write {out}: {exc.strerror}") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return n


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


def _tar_of(folder: Path, out) -> list[str]:
    """A local folder as a tar stream of its folders and regular files, written to the binary
    file ``out`` (links and special files are left out - named - never followed)."""
    import stat
    import tarfile

    skipped = []
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT, copybufsize=1 << 20) as tf:
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
            rel_dir = Path(dirpath).relative_to(folder)
            for d in sorted(dirnames):
                p = Path(dirpath) / d
                if p.is_symlink():
                    skipped.append(str(rel_dir / d))
                    continue
                tf.add(p, arcname=str(rel_dir / d), recursive=False)
            dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) / d).is_symlink())
            for f in sorted(filenames):
                p = Path(dirpath) / f
                if not stat.S_ISREG(p.lstat().st_mode):
                    skipped.append(str(rel_dir / f))
                    continue
                tf.add(p, arcname=str(rel_dir / f), recursive=False)
    return skipped


def _untar_into(src, out: Path) -> int:
    """Unpack a workspace folder's tar stream (a seekable binary file) at ``out`` (created),
    with the stdlib's 'data' filter: nothing outside ``out``, no links out, no device files, no
    setuid bits."""
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=src, mode="r:") as tf:
        members = tf.getmembers()
        tf.extractall(out, members=members, filter="data")
    return sum(1 for m in members if m.isreg())


@click.command()
@click.argument("name")
@click.argument("op", type=click.Choice(["show", "allow", "deny", "remove", "pause", "resume", "revoke", "restore", "limits",
                                        "tools", "budget"]))
@click.argument("args", nargs=-1)
@click.option("--memory", help="limits: lower the memory limit, e.g. 256M")
@click.option("--pids", type=int, help="limits: lower the pids limit")
@click.option("--cpus", type=float, help="limits: lower the CPU quota")
@click.option("--tokens", type=int, help="budget: the LLM token budget (total)")
@click.option("--requests", "budget_requests", type=int, help="budget: the LLM request budget (total)")
@click.option("--cost", type=float, help="budget: the LLM spend budget (total, in the price table's currency)")
@click.option("--reset", is_flag=True, help="budget: start the agent's usage counters over")
@click.option("--json", "as_json", is_flag=True, help="show: one JSON object")
def policy(name, op, args, memory, pids, cpus, tokens, budget_requests, cost, reset, as_json):
    """Show or change a sandbox's policy live: show, allow|deny HOST[:PORT] (deny without a port:
    every port), remove RULE_ID, pause|resume (all egress), revoke|restore CREDENTIAL (this
    session), limits --memory/--pids/--cpus (lower only), tools allow|deny|approve SERVER__TOOL
    (the next tool call is decided under it), budget --tokens/--requests/--cost/--reset (the
    LLM budget; the next request is checked against it). A change that would exceed the
    agent's risk tier is refused."""
    from agentvm.errors import ConfigError

    want = 2 if op == "tools" else (0 if op in ("show", "pause", "resume", "limits", "budget") else 1)
    if len(args) != want:
        raise ConfigError(f"policy {op} takes {want} argument(s), got {len(args)}",
                          hint="e.g. `agentvm policy NAME tools deny github__create_issue`" if op == "tools" else
                          "see `agentvm policy --help`")
    arg = args[0] if args else None
    if op == "show":
        v = _client().policy(name, "show")
        if as_json:
            click.echo(json.dumps(v, sort_keys=True))
            return 0
        click.echo(f"{name}: network {v['network']}{', egress PAUSED' if v['paused'] else ''}"
                   f"{'' if v['live'] else ' (not running: applies at the next start)'}")
        for r in v["rules"]:
            ports = r["ports"] if r["ports"] == "all" else ",".join(map(str, r["ports"]))
            extra = "".join(f" {k}={','.join(r[k])}" for k in ("methods", "paths") if k in r)
            click.echo(f"  {r['kind']:<5} {r['id']:<24} {r['host']}:{ports}{extra}")
        if not v["rules"]:
            click.echo("  (no rules: every request is denied)" if v["network"] == "gate" else "  (no route out at all)")
        if v["revoked"]:
            click.echo(f"  revoked credentials: {', '.join(v['revoked'])}")
        for t in v.get("tools", []):
            click.echo(f"  tools {t['server']}: allow {','.join(t['allow']) or '-'}; approve {','.join(t['approve']) or '-'}; "
                       f"deny {','.join(t['deny']) or '-'}")
        b = v.get("budget")
        if b:
            u = b["used"]
            lims = ", ".join(f"{u[k] if k != 'cost' else round(u[k], 4)}/{b[k]} {k}" for k in ("tokens", "requests", "cost")
                             if b[k] is not None)
            click.echo(f"  LLM budget: {lims}" + (f" ({u['estimated']} responses estimated)" if u["estimated"] else ""))
        return 0
    kw = {}
    if op == "limits":
        kw = {"memory": memory, "pids": pids, "cpus": cpus}
    if op == "budget":
        kw = {k: v for k, v in (("tokens", tokens), ("requests", budget_requests), ("cost", cost)) if v is not None}
        if reset:
            kw["reset"] = True
    if op in ("allow", "deny"):
        kw["rule"] = arg
    elif op == "remove":
        kw["rule_id"] = arg
    elif op in ("revoke", "restore"):
        kw["credential"] = arg
    elif op == "tools":
        kw = {"action": args[0], "tool": args[1]}
    r = _client().policy(name, op, **kw)
    click.echo(f"{name}: {op} applied {'live' if r['live'] else '(takes effect at next start)'} in {r['ms']} ms")
    if r.get("limits"):
        click.echo(f"{name}: limits now {r['limits']}")
    return 0


@click.group()
def audit():
    """The tamper-evident audit trail."""


def _local_audit(db: str | None):
    """The audit chain read-only from its file (no daemon needed), unless the daemon is remote
    (AGENTVM_DAEMON_URL) and no file was named."""
    import os

    from agentvm.audit import AuditLog
    from agentvm.paths import default_paths

    if db is None and os.environ.get("AGENTVM_DAEMON_URL"):
        return None
    path = Path(db) if db else default_paths().audit_dir / "audit.db"
    if not path.exists():
        raise ConfigError(f"no audit chain at {path}", hint="nothing has run yet with this AGENTVM_HOME, or name one with --file")
    return AuditLog.open_readonly(path)


@audit.command("show")
@click.option("--since", type=_since(), help="Records from this time on: a Unix time, a duration ago (10m, 2h) or an ISO date.")
@click.option("--sandbox")
@click.option("--json", "as_json", is_flag=True)
@click.option("--file", "db", type=click.Path(dir_okay=False), help="Read this audit database (default: this installation's).")
def audit_show(since, sandbox, as_json, db):
    """Print audit records (read-only; the daemon need not run)."""
    local = _local_audit(db)
    recs = [r.to_dict() for r in local.records(since=since, sandbox=sandbox)] if local else _client().audit(since, sandbox)
    for r in recs:
        if as_json:
            click.echo(json.dumps(r, sort_keys=True))
        else:
            t = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"]))
            click.echo(f"{r['seq']:>6} {t} {r['kind']:<26} {r['actor']:<10} {r['sandbox'] or '-':<20} "
                       f"{json.dumps(r['data'], sort_keys=True)[:160]}")
    return 0


@audit.command("verify")
@click.option("--file", "db", type=click.Path(dir_okay=False), help="Verify this audit database (default: this installation's).")
def audit_verify(db):
    """Walk the hash chain (read-only; the daemon need not run). Exit 77 when it is broken."""
    local = _local_audit(db)
    # a named copy may come without its head file: the chain is still checked, only a cut tail
    # cannot be seen - said, not reported as broken
    v = local.verify(require_head=not db).to_dict() if local else _client().verify()
    if v["ok"]:
        click.echo(f"audit chain intact: {v['records']} records")
        if v.get("problem"):
            click.echo(f"note: {v['problem']}", err=True)
        return 0
    click.echo(f"audit chain BROKEN at record {v['at_seq']}: {v['problem']}", err=True)
    return EXIT_POLICY


@audit.command("export")
@click.option("--format", "fmt", type=click.Choice(["ocsf", "json"]), default="ocsf", show_default=True,
              help="ocsf: OCSF 1.3 events (HTTP Activity for decisions, API Activity for audit records); json: as stored.")
@click.option("--what", type=click.Choice(["all", "audit", "decisions", "syscalls"]), default="all", show_default=True,
              help="The audit chain's records, the gate's decisions (its logs), or both; syscalls: only the "
                   "escape probes (syscall.* records: the chain's, and those of sandbox logs the chain lacks).")
@click.option("--since", type=_since(), help="From this time on: a Unix time, a duration ago (10m, 2h) or an ISO date.")
@click.option("--sandbox", help="Only this sandbox (its name, or a run's sandbox id for decisions).")
@click.option("--file", "db", type=click.Path(dir_okay=False), help="Read this audit database (default: this installation's).")
def audit_export(fmt, what, since, sandbox, db):
    """Export audit records and egress decisions as JSON lines (read-only; the daemon need not run)."""
    from agentvm.observe import ocsf
    from agentvm.paths import default_paths

    if what in ("all", "audit"):
        local = _local_audit(db)
        recs = [r.to_dict() for r in local.records(since=since, sandbox=sandbox)] if local else _client().audit(since, sandbox)
        for r in recs:
            click.echo(json.dumps(ocsf.audit_record(r) if fmt == "ocsf" else r, sort_keys=True))
    if what == "syscalls":
        _export_syscalls(fmt, since, sandbox, db)
    if what in ("all", "decisions"):
        import os

        if os.environ.get("AGENTVM_DAEMON_URL") and not db:
            raise ConfigError("decisions are exported from the gate's logs on the daemon's host, not over the API",
                              hint="run `agentvm audit export --what decisions` on that host (or --what audit here)")
        logs = default_paths().home / "logs"
        for path in sorted(logs.glob("*.egress.jsonl"), key=lambda p: p.stat().st_mtime) if logs.is_dir() else ():
            with open(path, encoding="utf-8", errors="replace") as f:
                for rec in ocsf.decisions_from_logs(f, since=since, sandbox=sandbox):
                    click.echo(json.dumps(ocsf.decision(rec) if fmt == "ocsf" else rec, sort_keys=True))
    return 0


def _export_syscalls(fmt, since, sandbox, db) -> None:
    """``audit export --what syscalls``: the chain's ``syscall.*`` records (OCSF Process Activity),
    then the lines of each sandbox's ``.syscalls.jsonl`` whose sandbox has none on the chain
    (a run from before its records reached the chain, or another installation's chain)."""
    from agentvm import sysaudit
    from agentvm.observe import ocsf
    from agentvm.paths import default_paths

    local = _local_audit(db)
    recs = [r.to_dict() for r in local.records(since=since, sandbox=sandbox)] if local else _client().audit(since, sandbox)
    seen = set()
    for r in recs:
        if str(r.get("kind") or "").startswith("syscall."):
            seen.add(r.get("sandbox"))
            click.echo(json.dumps(ocsf.syscall(r) if fmt == "ocsf" else r, sort_keys=True))
    logs = default_paths().home / "logs"
    for path in sorted(logs.glob("*.syscalls.jsonl"), key=lambda p: p.stat().st_mtime) if logs.is_dir() else ():
        sid = path.name[:-len(".syscalls.jsonl")]
        if sid in seen or (sandbox and sandbox not in (sid, sid.rsplit("-", 1)[0])):
            continue
        for rec in sysaudit.read_log(path):
            if since is not None and float(rec.get("time") or 0) < since:
                continue
            click.echo(json.dumps(ocsf.syscall(rec) if fmt == "ocsf" else rec, sort_keys=True))


@click.command()
@click.option("--open", "open_browser", is_flag=True, help="Also open the link in this machine's browser.")
def console(open_browser):
    """Print a one-time login link to the daemon's web console (valid 60 s, single use)."""
    r = _client().console_login()
    click.echo(r["url"])
    click.echo(f"agentvm: the link signs one browser in; it expires in {r['expires_in']:g} s and works once",
               err=True)
    if open_browser:
        import webbrowser

        webbrowser.open(r["url"])
    return 0


@click.command()
def events():
    """Stream decisions and lifecycle events (NDJSON) until interrupted.

    Exits 3 if the daemon cut the stream off because this reader fell too far behind (the
    last line is a ``stream.lagged`` record; the audit trail has everything)."""
    for ev in _client().events():
        click.echo(json.dumps(ev, sort_keys=True, default=str))
        if ev.get("kind") == "stream.lagged":
            click.echo("agentvm: " + ev.get("reason", "cut off") + " (agentvm audit show)", err=True)
            return 3
    return 0

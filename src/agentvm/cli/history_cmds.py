"""Run history from the audit chain: ``agentvm runs`` and ``agentvm logs RUN`` for runs that
never went through the daemon. Both read the chain directly (no daemon needed)."""

from __future__ import annotations

import json
import time

import click

from agentvm.audit import RUN_KINDS, fold_runs as collect_runs  # noqa: F401 (RUN_KINDS: runs' kinds)


def _audit():
    from agentvm.audit import AuditLog
    from agentvm.paths import default_paths

    db = default_paths().audit_dir / "audit.db"
    if not db.exists():
        return None
    return AuditLog.open_readonly(db)  # history is read, never written, like `audit show`


@click.command()
@click.option("-n", "--limit", default=20, show_default=True, help="How many runs to show.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
def runs(limit, as_json):
    """Recent runs (embedded, via the daemon, and managed sandboxes' sessions), newest first."""
    log = _audit()
    found = collect_runs(log.records(kinds=RUN_KINDS)) if log else []
    found = found[: max(0, limit)]
    if as_json:
        for r in found:
            click.echo(json.dumps(r, sort_keys=True))
        return 0
    if not found:
        click.echo("no runs recorded yet")
        return 0
    rows = []
    for r in found:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started"]))
        dur = (r["ended"] if r.get("ended") else "running") if r["exit_code"] is None else f"{r['duration']:.1f}s"
        code = "-" if r["exit_code"] is None else str(r["exit_code"])
        denied = str((r.get("egress") or {}).get("denied", "")) if r.get("egress") else ""
        what = f"refused: {r['refused']}" if r.get("refused") else " ".join(r["command"])
        rows.append([_printable(str(r["run"])), _printable(str(r["agent"])), started, dur, code, denied,
                     _printable(what)])
    for line in table(["RUN", "AGENT", "STARTED", "DURATION", "EXIT", "DENIED", "COMMAND"], rows,
                      right=(3, 4, 5)):
        click.echo(line)
    return 0


WIDTH = 160  # a line's length, when its last column (a command line) has to be cut


def table(header: list[str], rows: list[list[str]], *, right=(), width: int = WIDTH) -> list[str]:
    """Aligned columns as wide as their widest cell (nothing cut but the last column, which is
    cut to keep a line within ``width``, with at least 20 characters of it kept)."""
    cols = len(header) - 1
    widths = [max(len(x[i]) for x in [header, *rows]) for i in range(cols)]
    room = max(20, width - sum(widths) - 2 * cols)
    out = []
    for row in [header, *rows]:
        cells = [row[i].rjust(widths[i]) if i in right else row[i].ljust(widths[i]) for i in range(cols)]
        last = row[cols] if len(row[cols]) <= room else row[cols][: room - 3] + "..."
        out.append(("  ".join(cells) + "  " + last).rstrip())
    return out


def _printable(s: str) -> str:
    """One terminal line: control characters (newlines, escapes) shown as ``\\xNN``."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in s)


def print_run_log(run_id: str) -> bool:
    """The history of one run (its audit records and its gate decisions); False when the
    chain has no run of that id."""
    log = _audit()
    recs = log.records(sandbox=run_id) if log else []
    started = next((r for r in recs if r.kind == "run.started"), None)
    if started is None:
        return False
    for r in recs:
        t = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.time))
        click.echo(f"{t} {r.kind:<12} {json.dumps(r.data, sort_keys=True)}")  # JSON escapes control characters
    from agentvm.paths import default_paths

    egress = default_paths().home / "logs" / f"{run_id}.egress.jsonl"
    if egress.exists():
        from agentvm.gate.policy import _safe  # what a sandbox sent: printable ASCII only

        for line in egress.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            t = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
            where = f"{e.get('host')}:{e.get('port')}"
            click.echo(_safe(f"{t} egress {e.get('verdict', '?'):<5} {e.get('method') or e.get('phase') or '':<7} "
                             f"{where} {e.get('path') or ''} rule={e.get('rule')} {e.get('reason') or ''}".rstrip(), 400))
    else:
        click.echo("(no egress decisions logged: none made, or the log is past AGENTVM_LOG_RETENTION)")
    click.echo(f"({_output_note(log, run_id, started)})")
    return True


def _output_note(log, run_id: str, started) -> str:
    """Where a run's output went: a managed sandbox's session to its log, a run through the
    daemon (recorded by the daemon: actor ``agentvm``) and an embedded run to their caller."""
    for r in log.records(kinds=("lifecycle.running",)):
        if r.data.get("sandbox_id") == run_id and r.sandbox:
            return (f"a session of the daemon's sandbox {_printable(r.sandbox)}: its output is in its log, "
                    f"`agentvm logs {_printable(r.sandbox)}`")
    if started.actor == "agentvm":
        return ("a run through the daemon: its stdout and stderr were relayed to its caller; "
                "agent-vm does not keep them")
    return "an embedded run: its stdout and stderr went to its caller; agent-vm does not keep them"


# ------------------------------------------------------------------ syscall records


def syscall_records(name: str) -> list[dict]:
    """The syscall audit's records of run/sandbox ``name`` (``<home>/logs/NAME.syscalls.jsonl``),
    or of every session of a managed sandbox ``NAME`` (``NAME-<8 hex>``), oldest first."""
    import re

    from agentvm import sysaudit
    from agentvm.paths import default_paths

    logs = default_paths().home / "logs"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}", name):
        return []
    paths = [logs / f"{name}.syscalls.jsonl"]
    paths += sorted(p for p in logs.glob(f"{name}-*.syscalls.jsonl")
                    if re.fullmatch(re.escape(name) + r"-[0-9a-f]{8}\.syscalls\.jsonl", p.name))
    out: list[dict] = []
    for p in paths:
        out += sysaudit.read_log(p)
    return sorted(out, key=lambda r: r.get("time") or 0)


def syscall_lines(recs: list[dict]) -> list[str]:
    """One line per record: time, sandbox, pid, syscall, errno (or 'watched'), rule, decoded
    arguments, the process (argv, exe), whether it was verified live; repeats folded into it."""
    from agentvm.gate.policy import _safe  # what a sandbox chose (argv, exe): printable ASCII only

    rows = []
    for r in recs:
        t = time.strftime("%H:%M:%S", time.localtime(r.get("time") or 0))
        kind = r.get("kind", "")
        if kind in ("syscall.denied", "syscall.watched"):
            args = " ".join(f"{k}={v}" for k, v in sorted((r.get("args") or {}).items()))
            argv = " ".join(r.get("argv") or [])[:160]
            what = r.get("errno") or "watched"
            rep = f" (+{r['repeats']} repeats)" if r.get("repeats") else ""
            ver = "" if r.get("verified") else " [process not verified]"
            rows.append(_safe(f"{t} {r.get('sandbox', '')} pid={r.get('pid')} {r.get('syscall')} {what} "
                              f"rule={r.get('rule')} {args} argv=[{argv}] exe={r.get('exe') or '?'}{rep}{ver}"
                              f"{' ALERT' if r.get('alert') else ''}", 600))
        else:
            rows.append(_safe(f"{t} {r.get('sandbox', '')} {kind}: {r.get('reason') or ''}"
                              f"{'' if r.get('ok', True) else ' (FAILED)'}", 600))
    return rows


def print_syscalls(name: str, as_json: bool) -> bool:
    """``agentvm logs NAME --syscalls [--json]``; False when nothing was recorded under NAME."""
    recs = syscall_records(name)
    if as_json:
        click.echo(json.dumps(recs, sort_keys=True))
        return True
    if not recs:
        return False
    for line in syscall_lines(recs):
        click.echo(line)
    denied = sum(1 for r in recs if r.get("kind") == "syscall.denied")
    click.echo(f"({denied} denied record(s); identical calls of one process within "
               f"10 s are folded into one record with a repeat count)")
    return True


@click.command("logs")
@click.argument("name")
@click.option("--syscalls", is_flag=True, help="The syscall audit: escape probes refused by seccomp, and watched calls.")
@click.option("--json", "as_json", is_flag=True, help="With --syscalls: the records as one JSON array.")
def logs(name, syscalls, as_json):
    """Print a managed sandbox's output log, or a past run's history (its audit records and
    gate decisions; see `agentvm runs`). --syscalls: its syscall audit records instead."""
    if as_json and not syscalls:
        raise click.UsageError("--json goes with --syscalls")
    if syscalls:
        if print_syscalls(name, as_json):
            return 0
        click.echo(f"(no syscall records for {name!r}: none made, an unknown name, or the sandbox ran without "
                   "the syscall audit - `agentvm runs` shows a run's degradations)")
        return 0
    if print_run_log(name):
        return 0
    from agentvm.cli.daemon_cmds import _client
    from agentvm.daemon.client import ApiFailure, DaemonUnavailable
    from agentvm.errors import ConfigError

    hint = "`agentvm runs` lists past runs, `agentvm ps` the daemon's sandboxes"
    try:
        text = _client().logs(name)
    except ApiFailure as exc:
        if exc.status != 404:
            raise
        raise ConfigError(f"no run or sandbox named {name!r}", hint=hint, code="logs.not-found") from None
    except DaemonUnavailable as exc:
        if exc.code != "daemon.unavailable" or "not running" not in exc.message:
            raise
        raise ConfigError(f"no run or sandbox named {name!r}",
                          hint=f"{hint} (the daemon is not running: no sandbox was looked up)",
                          code="logs.not-found") from None
    from agentvm.termfilter import for_fd

    f = for_fd(1)  # the sandbox's output: on a terminal, without clipboard writes or answer-back queries
    if f is None:
        click.echo(text, nl=False)
    else:
        data = f.feed(text.encode("utf-8", "surrogateescape")) + f.finish()
        click.echo(data.decode("utf-8", "replace"), nl=False)
    return 0

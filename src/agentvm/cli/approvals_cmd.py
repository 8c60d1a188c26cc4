"""``agentvm approvals``: the human side of held actions (list, show, approve, deny).

The queue is agent-vm's ``approvals.db``, shared by the daemon and embedded runs; answering
needs write access to it (root, or agent-vm's owner) and puts the answer on the audit chain
with the answering user as the actor. Nothing inside a sandbox can reach either file.
"""

from __future__ import annotations

import json
import os
import time

import click


def _store():
    from agentvm.approvals import open_store
    from agentvm.audit import AuditLog
    from agentvm.paths import default_paths

    paths = default_paths()
    audit = AuditLog(paths.audit_dir / "audit.db")

    def record(kind, *, actor, sandbox=None, **data):
        audit.append(kind, actor=actor, sandbox=sandbox, data=data)

    return open_store(paths, record)


def _actor() -> str:
    import pwd

    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    sudo = os.environ.get("SUDO_USER")
    return f"cli:{name}" + (f"(sudo:{sudo})" if sudo and sudo != name else "")


def _safe(v) -> str:
    """Printable ASCII only: what a sandbox wrote (a request_access text, a path) must not
    drive the operator's terminal."""
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, ensure_ascii=True)
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in s)


def _line(r) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(r.created))
    left = max(0, int(r.deadline - time.time()))
    status = f"{r.state} ({left}s left)" if r.state == "pending" else f"{r.state} by {r.by}"
    return f"{_safe(r.id)}  {t}  {r.kind:<6} {_safe(r.agent):<16} {_safe(r.target)[:60]:<60}  {_safe(status)}"


@click.group()
def approvals():
    """Held actions waiting for a human: tool calls in `approve`, egress rules with `action: ask`."""


@approvals.command("list")
@click.option("--all", "show_all", is_flag=True, help="answered ones too (newest first)")
@click.option("--json", "as_json", is_flag=True)
def list_cmd(show_all, as_json):
    """Pending requests (with --all: every request)."""
    from agentvm.approvals import STATES

    rows = _store().list(STATES if show_all else ("pending",))
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], sort_keys=True))
        return 0
    if not rows:
        click.echo("no pending approvals" if not show_all else "no approval requests")
    for r in rows:
        click.echo(_line(r))
    return 0


@approvals.command("show")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def show_cmd(request_id, as_json):
    """One request: what is held, by which sandbox and rule, and its preview."""
    r = _store().get(request_id)
    if as_json:
        click.echo(json.dumps(r.to_dict(), sort_keys=True))
        return 0
    click.echo(_line(r))
    for k in ("sandbox", "agent", "kind", "target", "digest", "policy"):
        click.echo(f"  {k:<8} {_safe(getattr(r, k))}")
    for k, v in sorted(r.summary.items()):
        if k == "arguments" and isinstance(v, str):  # the whole of them, one safe line at a time
            click.echo("  arguments (all of them: what you approve)")
            for ln in v.splitlines():
                click.echo(f"    {_safe(ln)}")
            continue
        click.echo(f"  {_safe(k):<8} {_safe(v)}")
    if r.note:
        click.echo(f"  note     {_safe(r.note)}")
    if r.notified:
        click.echo(f"  webhook  {_safe(r.notified)}")
    return 0


def _answer(request_id: str, approve: bool, note: str | None, as_json: bool) -> int:
    r = _answer_via_daemon(request_id, approve, note)
    if r is None:  # no daemon up: the queue itself (the answer is on the chain either way)
        r = _store().answer(request_id, approve, _actor(), note)
    if as_json:
        click.echo(json.dumps(r.to_dict(), sort_keys=True))
    else:
        click.echo(f"{_safe(r.id)}: {r.state} ({r.kind} {_safe(r.target)[:80]})")
    return 0


def _answer_via_daemon(request_id: str, approve: bool, note: str | None):
    """With a daemon up, the answer goes through it, so that it is counted
    (``agentvm_approvals_total``) and traced (the request's ``approval`` span) like an answer
    from the console or the SDK; the CLI's user is recorded beside it (``api:operator via
    cli:USER via api:operator``). None when no daemon is up."""
    from types import SimpleNamespace

    from agentvm.daemon.client import Client, DaemonUnavailable, default_socket

    if os.environ.get("AGENTVM_NO_DAEMON") == "1" or not (
            os.environ.get("AGENTVM_DAEMON_URL") or default_socket().exists()):
        return None
    try:
        d = Client().answer(request_id, approve, note, via=_actor().replace(" ", "_")[:100])
    except DaemonUnavailable:
        return None
    return SimpleNamespace(**{**d, "to_dict": lambda: d})


@approvals.command("approve")
@click.argument("request_id")
@click.option("--note", help="why (kept on the audit chain)")
@click.option("--json", "as_json", is_flag=True)
def approve_cmd(request_id, note, as_json):
    """Let one held action go ahead (once: the next one asks again)."""
    return _answer(request_id, True, note, as_json)


@approvals.command("deny")
@click.argument("request_id")
@click.option("--note", help="why (kept on the audit chain; the agent sees it)")
@click.option("--json", "as_json", is_flag=True)
def deny_cmd(request_id, note, as_json):
    """Refuse one held action."""
    return _answer(request_id, False, note, as_json)

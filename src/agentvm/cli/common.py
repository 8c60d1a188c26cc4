"""Bits the CLI's command modules share, below all of them (no command module is imported
here): the parameter type for agent-vm's own parsers, and the audit recorder the CLI uses when
no daemon records for it."""

from __future__ import annotations

import errno
import os

import click


class Parsed(click.ParamType):
    """A value parsed by one of agent-vm's own parsers (``agentvm.units``), its ValueError a
    usage error: the CLI takes durations and times the same way everywhere."""

    def __init__(self, name: str, parse) -> None:
        self.name, self._parse = name, parse

    def convert(self, value, param, ctx):
        try:
            return self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def duration() -> Parsed:  # 90, 30s, 5m, 1h30m
    from agentvm.units import parse_duration

    return Parsed("duration", parse_duration)


def _actor() -> str:
    from agentvm.cli.approvals_cmd import _actor as actor

    return actor()


def recorder(paths, actor: str | None = None):
    """``record(kind, data)`` appending to the audit chain (opened on the first record: listing
    writes nothing), the way the CLI records when no daemon does it."""
    state: dict = {}

    def record(kind: str, data: dict) -> None:
        import sqlite3

        try:
            if "log" not in state:
                from agentvm.audit import AuditLog

                state["log"] = AuditLog(paths.audit_dir / "audit.db")
            state["log"].append(kind, actor=actor or _actor(), sandbox=data.get("name"), data=data)
        except sqlite3.Error as exc:
            # SQLite says "disk I/O error" when it cannot even make its WAL files: name a full
            # disk as one (the removal that gives the space back then records afterwards)
            try:
                st = os.statvfs(paths.audit_dir)
                full = st.f_bavail * st.f_frsize < (1 << 20)
            except OSError:
                full = False
            if full:
                state.pop("log", None)
                raise OSError(errno.ENOSPC, f"the disk holding the audit chain is full ({exc})") from exc
            raise

    return record

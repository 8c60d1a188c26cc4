"""Decisions and audit records as OCSF events (Open Cybersecurity Schema Framework 1.3), one
JSON object per line, for SIEMs and the tools that already read OCSF.

* a gate decision -> **HTTP Activity** (class 4002, Network Activity), with the Security
  Control profile's ``action``/``disposition`` (allowed or denied) and ``firewall_rule`` (the
  rule id that decided, and the reason); a CONNECT tunnel or a cut connection has no HTTP
  method and maps to activity "Other".
* an audit record -> **API Activity** (class 6003, Application Activity): the record's kind
  is the operation, its actor the user, the sandbox the resource; the chain's own fields
  (``seq``, ``hash``, ``prev``) travel in ``unmapped`` so an export can still be checked
  against the chain.
* a syscall record (``agentvm.sysaudit``: ``syscall.denied``, ``syscall.watched``, and the
  ``syscall.probe-*``/``audit-detached`` actions), from the chain or a sandbox's
  ``.syscalls.jsonl`` -> **Process Activity** (class 1007, System Activity), activity
  "Other" with the Security Control profile: the actor is the process (pid, command line,
  executable), ``action``/``disposition`` say Denied/Blocked (or Allowed for a watched call),
  ``firewall_rule`` the seccomp rule id; the syscall, its errno and decoded flags are in
  ``unmapped``. An alert (``security.onEscapeProbe`` other than ``log``) is severity High.

Nothing here reads a secret: decisions carry credential *names*, never values (as the gate's
log does).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from agentvm import __version__

OCSF_VERSION = "1.3.0"
_PRODUCT = {"name": "agent-vm", "vendor_name": "agent-vm", "version": __version__}

# HTTP Activity's activity_id by method
_HTTP_ACTIVITY = {"CONNECT": 1, "DELETE": 2, "GET": 3, "HEAD": 4, "OPTIONS": 5, "POST": 6, "PUT": 7, "TRACE": 8,
                  "PATCH": 9}
_API_ACTIVITY = {"created": 1, "create": 1, "requested": 1, "started": 1, "start-requested": 1,
                 "removed": 4, "delete": 4, "change": 3, "answered": 3, "cp-in": 3}


def _ms(t: Any) -> int:
    try:
        return int(float(t) * 1000)
    except (TypeError, ValueError):
        return 0


def decision(rec: dict) -> dict:
    """One line of a gate log (``<home>/logs/<sandbox>.egress.jsonl``) as HTTP Activity."""
    method = str(rec.get("method") or "").upper()
    act = _HTTP_ACTIVITY.get(method, 99)
    verdict = rec.get("verdict")
    allowed = verdict == "allow"
    alert = bool(rec.get("alert"))
    severity = 4 if alert else (1 if allowed else 3)  # High / Informational / Medium
    out: dict[str, Any] = {
        "class_uid": 4002, "class_name": "HTTP Activity", "category_uid": 4, "category_name": "Network Activity",
        "activity_id": act, "type_uid": 4002 * 100 + act, "time": _ms(rec.get("time")),
        "severity_id": severity, "status_id": 1 if allowed and not rec.get("error") else 2,
        "action_id": 1 if allowed else 2, "action": "Allowed" if allowed else "Denied",
        "disposition_id": 1 if allowed else 2, "disposition": "Allowed" if allowed else "Blocked",
        "message": str(rec.get("reason") or ""),
        "metadata": {"version": OCSF_VERSION, "product": _PRODUCT, "log_name": "egress",
                     "profiles": ["security_control"]},
        "firewall_rule": {"uid": str(rec.get("rule") or ""), "desc": str(rec.get("reason") or "")},
        "src_endpoint": {"name": str(rec.get("sandbox") or ""), "svc_name": str(rec.get("agent") or "")},
        "traffic": {"bytes_out": int(rec.get("bytes_out") or 0), "bytes_in": int(rec.get("bytes_in") or 0)},
    }
    if verdict == "ask":
        out["action"], out["disposition"], out["disposition_id"] = "Other", "Other", 99
        out["action_id"] = 99
    host = rec.get("host")
    if host:
        out["dst_endpoint"] = {"hostname": str(host), **({"port": rec["port"]} if rec.get("port") else {})}
    if method:
        url = {"hostname": str(host or ""), "path": str(rec.get("path") or "")}
        if rec.get("port"):
            url["port"] = rec["port"]
        out["http_request"] = {"http_method": method, "url": url}
    if rec.get("upstream_ms") is not None:
        out["duration"] = int(float(rec["upstream_ms"]))
    if alert:
        out["is_alert"] = True
    unmapped = {k: rec[k] for k in ("phase", "credentials", "credential", "scrubbed", "tool", "suppressed", "error",
                                    "how_to_allow", "protocol", "sni") if rec.get(k) is not None}
    if verdict == "ask":
        unmapped["verdict"] = "ask"
    if unmapped:
        out["unmapped"] = unmapped
    return out


def audit_record(rec: dict) -> dict:
    """One audit record (``AuditLog.Record.to_dict()``) as API Activity (a syscall record as
    Process Activity: :func:`syscall`)."""
    kind = str(rec.get("kind") or "")
    if kind.startswith("syscall."):
        return syscall(rec)
    verb = kind.rsplit(".", 1)[-1]
    act = _API_ACTIVITY.get(verb, 99)
    denied = kind.endswith(".deny") or kind.endswith("refused") or kind.endswith("failed")
    out: dict[str, Any] = {
        "class_uid": 6003, "class_name": "API Activity", "category_uid": 6, "category_name": "Application Activity",
        "activity_id": act, "type_uid": 6003 * 100 + act, "time": _ms(rec.get("time")),
        "severity_id": 3 if denied else 1, "status_id": 2 if denied else 1,
        "message": kind,
        "metadata": {"version": OCSF_VERSION, "product": _PRODUCT, "log_name": "audit", "uid": str(rec.get("seq")),
                     "sequence": rec.get("seq")},
        "api": {"operation": kind, "service": {"name": "agent-vm"}},
        "actor": {"user": {"name": str(rec.get("actor") or "")}},
        "unmapped": {"data": rec.get("data") or {}, "seq": rec.get("seq"), "hash": rec.get("hash"),
                     "prev": rec.get("prev")},
    }
    if rec.get("sandbox"):
        out["resources"] = [{"type": "sandbox", "name": str(rec["sandbox"])}]
    return out


def syscall(rec: dict) -> dict:
    """One syscall record (``agentvm.sysaudit``) as Process Activity (1007). From the audit
    chain (``Record.to_dict()``: the fields under ``data``) or from a ``.syscalls.jsonl`` line."""
    d = rec.get("data") if isinstance(rec.get("data"), dict) else rec
    kind = str(rec.get("kind") or "")
    watched = kind == "syscall.watched"
    alert = bool(d.get("alert"))
    argv = [str(a) for a in (d.get("argv") or [])]
    proc: dict[str, Any] = {"pid": int(d.get("pid") or 0)}
    if argv:
        proc["cmd_line"] = " ".join(argv)
    if d.get("exe"):
        proc["file"] = {"path": str(d["exe"]), "name": str(d["exe"]).rsplit("/", 1)[-1]}
    act = 99  # Other: a syscall attempt is neither a launch nor a termination
    out: dict[str, Any] = {
        "class_uid": 1007, "class_name": "Process Activity", "category_uid": 1, "category_name": "System Activity",
        "activity_id": act, "activity_name": kind or "syscall", "type_uid": 1007 * 100 + act,
        "time": _ms(rec.get("time") if rec.get("time") is not None else d.get("time")),
        "severity_id": 4 if alert else (1 if watched else 3),
        "status_id": 1 if watched else 2,
        "action_id": 1 if watched else 2, "action": "Allowed" if watched else "Denied",
        "disposition_id": 1 if watched else 2, "disposition": "Allowed" if watched else "Blocked",
        "message": (f"{d.get('syscall')} {'watched' if watched else 'refused with ' + str(d.get('errno'))}"
                    if d.get("syscall") else str(d.get("reason") or kind)),
        "metadata": {"version": OCSF_VERSION, "product": _PRODUCT, "log_name": "syscalls",
                     "profiles": ["security_control"]},
        "actor": {"process": proc},
        "process": proc,
        "device": {"type_id": 99, "name": str(rec.get("sandbox") or d.get("sandbox") or "")},
    }
    if d.get("rule"):
        out["firewall_rule"] = {"uid": str(d["rule"]), "type": "seccomp"}
    if alert:
        out["is_alert"] = True
    unmapped = {k: d[k] for k in ("syscall", "nr", "errno", "args", "verified", "repeats", "ok", "denied",
                                  "threshold", "reason") if d.get(k) is not None}
    if rec.get("seq") is not None:
        unmapped.update({"seq": rec.get("seq"), "hash": rec.get("hash"), "prev": rec.get("prev")})
    if unmapped:
        out["unmapped"] = unmapped
    return out


def decisions_from_logs(lines: Iterable[str], *, since: float | None = None, sandbox: str | None = None) -> Iterator[dict]:
    """Parsed gate-log lines (a torn last line - a gate killed mid-write - is skipped)."""
    import json

    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if since is not None and float(rec.get("time") or 0) < since:
            continue
        if sandbox is not None and sandbox not in (rec.get("agent"), rec.get("sandbox")):
            continue
        yield rec

"""The syscall audit's pure parts: the rule list both the BPF and the supervisor read, the
classification of a notification, argument decoding, and onEscapeProbe's actions.

The kernel-facing parts (the helper's listener handoff, answers, a dead supervisor) are in
test_sysaudit_kernel.py; the real sandbox in tests/attacks/test_syscall_audit.py."""

from __future__ import annotations

import errno
import struct

import pytest

from agentvm import seccomp as sc
from agentvm import sysaudit

OPTS = sc.SeccompOptions(notify=True, watch=sc.DEFAULT_WATCH, chown_mapped=(1000, 1000))


def _args_for(rule: sc.Rule) -> list[int]:
    """Arguments meeting every condition of ``rule``."""
    a = [0] * 6
    for c in rule.conds:
        if c[1] == "eq":
            a[c[0]] = c[2]
        elif c[1] == "masked_eq":
            a[c[0]] = (a[c[0]] & ~c[2]) | c[3]
        elif c[1] == "ne":
            a[c[0]] = c[2] + 1
    return a


def _insns(bpf: bytes) -> list[tuple]:
    return [struct.unpack("<HBBI", bpf[i:i + 8]) for i in range(0, len(bpf), 8)]


def test_notify_program_differs_from_the_deny_list_only_in_what_it_returns():
    """Allowed syscalls take the same path through the same instructions: the notify filter
    costs nothing on the fast path; only the denials' return value changes (EPERM -> USER_NOTIF)."""
    plain = _insns(sc._build(sc.SeccompOptions(chown_mapped=(1000, 1000))))
    notify = _insns(sc._build(sc.SeccompOptions(chown_mapped=(1000, 1000), notify=True)))
    assert len(plain) == len(notify)
    diff = [(p, n) for p, n in zip(plain, notify) if p != n]
    assert diff, "the notify program must differ (it returns USER_NOTIF)"
    for p, n in diff:
        assert p[0] == n[0] == 0x06, "only return instructions differ"
        assert p[3] == 0x00050000 | errno.EPERM and n[3] == 0x7FC00000


def test_compat_rules_and_chown_are_never_notified():
    bpf = sc._build(OPTS)
    rets = {i[3] for i in _insns(bpf) if i[0] == 0x06}
    assert 0x00050000 | errno.ENOSYS in rets, "clone3/openat2 keep their ENOSYS (libc falls back)"
    assert 0x00050000 | errno.EPERM in rets, "the chown prefix keeps its EPERM"
    assert 0x7FC00000 in rets


def test_watched_rules_only_with_notify_and_only_known_ids():
    assert not [r for r in sc.rules(sc.SeccompOptions(watch=sc.DEFAULT_WATCH)) if r.action == "watch"]
    assert {r.id for r in sc.rules(OPTS) if r.action == "watch"} == set(sc.DEFAULT_WATCH)
    with pytest.raises(ValueError, match="unknown watched"):
        sc.rules(sc.SeccompOptions(notify=True, watch=("watch:everything",)))


def test_every_rule_classifies_to_itself_with_its_errno():
    c = sysaudit.Classifier(OPTS)
    import pyseccomp

    seen = 0
    for r in sc.rules(OPTS):
        if r.action in ("compat", "refuse"):  # errno in the BPF: never notified
            continue
        nr = int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, r.syscall))
        if nr < 0:
            continue  # not on this architecture: the BPF does not name it either
        v = c.classify(nr, _args_for(r))
        # the first matching rule of the syscall wins, as in the BPF: same id and action
        assert v.syscall == r.syscall
        assert v.action == r.action
        if r.action == "deny":
            assert v.errno == errno.EPERM and v.rule.startswith("seccomp:")
        else:
            assert v.errno == 0 and v.rule.startswith("watch:")
        seen += 1
    assert seen > 60


def test_the_three_probes_of_the_issue():
    import pyseccomp

    c = sysaudit.Classifier(OPTS)
    nr = lambda n: int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n))  # noqa: E731
    assert c.classify(nr("unshare"), [0x10000000, 0, 0, 0, 0, 0]) == sysaudit.Verdict(
        "unshare", "seccomp:namespaces", "deny", errno.EPERM)
    assert c.classify(nr("mount"), [1, 2, 3, 0, 0, 0]).rule == "seccomp:mount"
    assert c.classify(nr("socket"), [2, 3 | 0o2000000, 1, 0, 0, 0]).rule == "seccomp:socket-raw"
    assert c.classify(nr("socket"), [10, 3, 58, 0, 0, 0]).rule == "seccomp:socket-raw"
    assert c.classify(nr("socket"), [16, 3, 15, 0, 0, 0]).rule == "seccomp:socket-netlink"


def test_unexplained_notification_is_denied_fail_closed():
    c = sysaudit.Classifier(OPTS)
    v = c.classify(999_999, [0] * 6)
    assert (v.action, v.errno, v.rule) == ("deny", errno.EPERM, "seccomp:unknown")
    import pyseccomp

    # a socket() call the BPF would not have notified (a TCP socket): still denied if it ever came
    v = c.classify(int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "socket")), [2, 1, 0, 0, 0, 0])
    assert v.action == "deny" and v.rule == "seccomp:unknown"


def test_decoding_reads_flags_not_pointers():
    assert sysaudit.decode_args("unshare", [0x10000000 | 0x00020000, 0, 0, 0, 0, 0]) == {
        "flags": "CLONE_NEWNS|CLONE_NEWUSER"}
    d = sysaudit.decode_args("socket", [2, 3 | 0o2000000, 1, 0, 0, 0])
    assert d == {"domain": "AF_INET", "type": "SOCK_RAW|SOCK_CLOEXEC", "protocol": 1}
    assert sysaudit.decode_args("mount", [0x7FFF0000, 0x7FFF1000, 0x7FFF2000, 0x1000 | 0x4000, 0, 0]) == {
        "flags": "MS_BIND|MS_REC"}
    assert sysaudit.decode_args("ioctl", [0, 0x5412, 0x7FFF0000, 0, 0, 0]) == {"fd": 0, "cmd": "TIOCSTI"}
    assert sysaudit.decode_args("setns", [2**64 - 1, 0x40000000, 0, 0, 0, 0]) == {"fd": -1, "nstype": "CLONE_NEWNET"}
    # no pointer value and no pointed-to content appears in any decoding
    for name in ("mount", "keyctl", "bpf", "add_key", "pivot_root", "chroot"):
        d = sysaudit.decode_args(name, [0x7FFF0000AAAA] * 6)
        assert "0x7fff0000aaaa" not in str(d).lower() and str(0x7FFF0000AAAA) not in str(d)


def _audit(on_probe: str, calls: list):
    recs: list[dict] = []
    a = sysaudit.SandboxAudit("run-x", on_probe=on_probe, sinks=[recs.append],
                              freeze=lambda: calls.append("freeze"), kill=lambda: calls.append("kill"))
    return a, recs


def _denied(a):
    a.denied += 1
    return {"kind": "syscall.denied", "sandbox": a.sandbox_id, "syscall": "unshare", "rule": "seccomp:namespaces"}


@pytest.mark.parametrize("on_probe,expect", [("log", []), ("alert", []), ("pause", ["freeze"]), ("stop", ["kill"])])
def test_on_escape_probe_actions(on_probe, expect):
    calls: list = []
    a, recs = _audit(on_probe, calls)
    def one():
        sysaudit.deliver(a, _denied(a))
        if sysaudit.act_due(a):
            sysaudit.act(a, "seccomp:namespaces")

    for _ in range(sysaudit.PROBE_THRESHOLD - 1):
        one()
    assert calls == [], "nothing happens below the threshold"
    for _ in range(3):
        one()
    assert calls == expect, "the action happens once, at the threshold"
    alerts = [r for r in recs if r.get("alert")]
    if on_probe == "log":
        assert not alerts
    else:
        assert len([r for r in alerts if r["kind"] == "syscall.denied"]) == sysaudit.PROBE_THRESHOLD + 2
    acted = [r for r in recs if r["kind"].startswith("syscall.probe-")]
    assert len(acted) == (1 if expect else 0)
    if expect:
        assert acted[0]["ok"] and acted[0]["alert"] and a.acted in ("paused", "stopped")


def test_watched_calls_never_trigger_the_action():
    calls: list = []
    a, recs = _audit("stop", calls)
    for _ in range(10):
        a.watched += 1
        sysaudit.deliver(a, {"kind": "syscall.watched", "sandbox": "run-x", "syscall": "memfd_create"})
        assert not sysaudit.act_due(a)
    assert calls == [] and not any(r.get("alert") for r in recs)


def test_a_failing_sink_does_not_stop_the_others():
    got: list = []

    def bad(rec):
        raise RuntimeError("sink down")

    a = sysaudit.SandboxAudit("run-x", sinks=[bad, got.append])
    sysaudit.deliver(a, {"kind": "syscall.denied", "sandbox": "run-x"})
    assert len(got) == 1


def test_collector_exports_the_issue_metric():
    from prometheus_client import CollectorRegistry, generate_latest

    with sysaudit._metric_lock:
        sysaudit._denied_by_syscall["unshare"] += 2
    r = CollectorRegistry()
    r.register(sysaudit.Collector())
    text = generate_latest(r).decode()
    assert 'agentvm_syscalls_denied_total{syscall="unshare"}' in text
    assert "agentvm_syscall_audit_dropped_total" in text


def test_audit_and_trace_sinks_shape():
    appended = []

    class Log:
        def append(self, kind, *, actor, sandbox, data):
            appended.append((kind, actor, sandbox, data))

    sysaudit.audit_sink(Log())({"kind": "syscall.denied", "sandbox": "run-x", "time": 1.0, "syscall": "mount"})
    assert appended == [("syscall.denied", "agentvm", "run-x", {"syscall": "mount"})]
    spans = []

    class Trace:
        def span(self, name, start, end=None, attributes=None):
            spans.append((name, attributes))

    sysaudit.trace_sink(Trace())({"kind": "syscall.denied", "time": 1.0, "syscall": "mount", "rule": "seccomp:mount",
                                  "errno": "EPERM", "pid": 7, "argv": ["a"], "args": {"flags": "0"}})
    assert spans[0][0] == "syscall.denied" and spans[0][1]["agentvm.syscall"] == "mount"


def test_ocsf_process_activity_from_a_record_and_from_the_chain():
    from agentvm.observe import ocsf

    rec = {"kind": "syscall.denied", "time": 10.5, "sandbox": "run-x", "pid": 42, "argv": ["unshare", "-U", "true"],
           "exe": "/usr/bin/unshare", "syscall": "unshare", "errno": "EPERM", "rule": "seccomp:namespaces",
           "args": {"flags": "CLONE_NEWUSER"}, "verified": True, "alert": True}
    e = ocsf.syscall(rec)
    assert (e["class_uid"], e["category_uid"], e["action"], e["disposition"]) == (1007, 1, "Denied", "Blocked")
    assert e["actor"]["process"] == {"pid": 42, "cmd_line": "unshare -U true",
                                     "file": {"path": "/usr/bin/unshare", "name": "unshare"}}
    assert e["firewall_rule"]["uid"] == "seccomp:namespaces" and e["severity_id"] == 4 and e["is_alert"]
    assert e["unmapped"]["errno"] == "EPERM" and e["time"] == 10500
    chained = {"kind": "syscall.denied", "time": 10.5, "sandbox": "run-x", "seq": 7, "hash": "h", "prev": "p",
               "data": {k: v for k, v in rec.items() if k not in ("kind", "time", "sandbox")}}
    c = ocsf.audit_record(chained)
    assert c["class_uid"] == 1007 and c["actor"] == e["actor"] and c["unmapped"]["seq"] == 7
    w = ocsf.syscall({**rec, "kind": "syscall.watched", "alert": False, "errno": None})
    assert w["action"] == "Allowed" and w["severity_id"] == 1


def test_logs_syscalls_cli(tmp_path, monkeypatch):
    import json as _json

    from click.testing import CliRunner

    from agentvm.cli import history_cmds

    monkeypatch.setenv("AGENTVM_HOME", str(tmp_path))
    (tmp_path / "logs").mkdir()
    rec = {"kind": "syscall.denied", "time": 1.0, "sandbox": "web-0123abcd", "pid": 9, "syscall": "mount",
           "errno": "EPERM", "rule": "seccomp:mount", "args": {"flags": "MS_BIND"}, "verified": True,
           "argv": ["sh", "-c", "\x1b[2Jevil"], "exe": "/bin/sh", "repeats": 2}
    (tmp_path / "logs" / "web-0123abcd.syscalls.jsonl").write_text(_json.dumps(rec) + "\n{torn")
    r = CliRunner().invoke(history_cmds.logs, ["web", "--syscalls"])
    assert r.exit_code == 0, r.output
    assert "mount EPERM rule=seccomp:mount flags=MS_BIND" in r.output and "(+2 repeats)" in r.output
    assert "\x1b" not in r.output, "what the sandbox chose is printed as printable ASCII only"
    r = CliRunner().invoke(history_cmds.logs, ["web-0123abcd", "--syscalls", "--json"])
    assert _json.loads(r.output) == [rec]
    r = CliRunner().invoke(history_cmds.logs, ["other", "--syscalls"])
    assert "no syscall records" in r.output
    r = CliRunner().invoke(history_cmds.logs, ["../etc", "--syscalls", "--json"])
    assert _json.loads(r.output) == []


def test_sink_factories_are_asked_for_each_new_sandbox():
    seen = []

    def factory(sid):
        if sid == "broken":
            raise RuntimeError("x")
        seen.append(sid)
        return lambda rec: None

    unregister = sysaudit.register_sink_factory(factory)
    try:
        assert len(sysaudit.sinks_for("run-a")) == 1 and seen == ["run-a"]
        assert sysaudit.sinks_for("broken") == []
    finally:
        unregister()
    assert sysaudit.sinks_for("run-b") == [] and seen == ["run-a"]


def test_a_listener_of_the_agents_own_is_refused_in_the_bpf_in_both_programs():
    """seccomp(SECCOMP_SET_MODE_FILTER, NEW_LISTENER) -> an ERRNO return (outranks any USER_NOTIF),
    in the plain and the notify program alike; never classified as a notification."""
    for notify in (False, True):
        [r] = [r for r in sc.rules(sc.SeccompOptions(notify=notify)) if r.id == "seccomp:seccomp-listener"]
        assert r.action == "refuse" and r.errno == errno.EBUSY
        assert r.matches((1, 8, 0, 0, 0, 0)) and r.matches((1 | 1 << 32, 8 | 1 << 40, 0, 0, 0, 0))
        assert not r.matches((1, 0, 0, 0, 0, 0)) and not r.matches((1, 1, 0, 0, 0, 0))  # ordinary / TSYNC filters
        rets = {i[3] for i in _insns(sc._build(sc.SeccompOptions(notify=notify))) if i[0] == 0x06}
        assert 0x00050000 | errno.EBUSY in rets
    c = sysaudit.Classifier(OPTS)
    assert 317 not in c.by_nr or all(r.action != "refuse" for r in c.by_nr[317])


def test_int_arguments_are_compared_on_their_low_word_only():
    """The kernel reads socket's family/type/protocol and prctl's option as int: a rule's
    equality must ignore bits 32-63 (AF_VSOCK | 1 << 32 is AF_VSOCK to the kernel)."""
    hi = 1 << 32
    for notify in (False, True):
        rs = sc.rules(sc.SeccompOptions(notify=notify, watch=sc.DEFAULT_WATCH))
        for r in rs:
            for cond in r.conds:
                assert cond[1] != "eq" or r.syscall not in ("socket", "prctl", "seccomp"), (r, cond)
        sock = [r for r in rs if r.syscall == "socket"]
        for fam, typ, proto in ((40, 1, 0), (15, 3, 2), (17, 3, 0), (2, 3, 1), (16, 3, 9), (16, 3, 0 | hi)):
            assert any(r.matches((fam | hi, typ | hi, proto, 0, 0, 0)) for r in sock), (fam, typ, proto)
        assert not any(r.matches((16 | hi, 3, 0, 0, 0, 0)) for r in sock), "NETLINK_ROUTE stays allowed"
    c = sysaudit.Classifier(OPTS)
    assert c.classify(41, (40 | hi, 1, 0, 0, 0, 0)).rule == "seccomp:socket-vsock"
    if any(r.syscall == "prctl" for r in sc.rules(OPTS)):
        assert c.classify(157, (sc.PR_SET_MM | hi, 0, 0, 0, 0, 0)).action == "watch"

"""The gateway's audit sink: one chain per (sandbox, replica), merged per sandbox by verify().
Replicas write independently (no lock across them); the merge checks each chain whole and
orders the records into one deterministic head."""

from __future__ import annotations

import json
import shutil

from agentvm.gateway.audit import AuditSink, verify


def _rec(sb: str, t: float, path: str) -> dict:
    return {"time": t, "sandbox": sb, "rule": "allow[0]", "verdict": "allow", "path": path}


def test_two_replicas_merge_into_one_verifiable_chain_per_sandbox(tmp_path):
    r1, r2 = AuditSink(tmp_path, "r1"), AuditSink(tmp_path, "r2")
    for i in range(5):
        r1(_rec("ns.sb-1", 100 + 2 * i, f"/r1/{i}"))
        r2(_rec("ns.sb-1", 101 + 2 * i, f"/r2/{i}"))
        r2(_rec("ns.sb-2", 101 + 2 * i, f"/other/{i}"))
    r1.close()
    r2.close()
    merged: list = []
    v = verify(tmp_path, "ns.sb-1", merged=merged)
    assert v.ok, v.problems
    assert v.replicas == ["r1", "r2"] and v.records == 10
    assert [m["path"] for m in merged] == [p for i in range(5) for p in (f"/r1/{i}", f"/r2/{i}")]
    assert verify(tmp_path, "ns.sb-1").head == v.head  # deterministic
    assert verify(tmp_path, "ns.sb-2").records == 5  # the other sandbox's records are its own

    # a replica restarted under its name continues its chain
    again = AuditSink(tmp_path, "r1")
    again(_rec("ns.sb-1", 200, "/r1/after-restart"))
    again.close()
    v2 = verify(tmp_path, "ns.sb-1")
    assert v2.ok and v2.records == 11 and v2.head != v.head


def test_tampering_in_any_replica_breaks_the_sandbox_chain(tmp_path):
    r1, r2 = AuditSink(tmp_path, "r1"), AuditSink(tmp_path, "r2")
    for i in range(4):
        r1(_rec("ns.sb", 10 + i, f"/a/{i}"))
        r2(_rec("ns.sb", 10 + i, f"/b/{i}"))
    r2(_rec("ns.x", 1, "/x"))
    r1.close()
    r2.close()
    assert verify(tmp_path, "ns.sb").ok

    def broken(edit) -> bool:
        d = tmp_path.parent / f"copy-{edit.__name__}"
        shutil.copytree(tmp_path, d)
        edit(d)
        return not verify(d, "ns.sb").ok

    def swap_lines(d):
        f = d / "ns.sb" / "r2.jsonl"
        lines = f.read_text().splitlines()
        lines[1], lines[2] = lines[2], lines[1]
        f.write_text("\n".join(lines) + "\n")

    def drop_first(d):
        f = d / "ns.sb" / "r1.jsonl"
        f.write_text("\n".join(f.read_text().splitlines()[1:]) + "\n")

    def edit_verdict(d):
        f = d / "ns.sb" / "r1.jsonl"
        lines = f.read_text().splitlines()
        rec = json.loads(lines[2])
        rec["rec"]["verdict"] = "deny"
        f.write_text("\n".join(lines[:2] + [json.dumps(rec)] + lines[3:]) + "\n")

    def cut_tail(d):
        f = d / "ns.sb" / "r2.jsonl"
        f.write_text("\n".join(f.read_text().splitlines()[:-1]) + "\n")

    def foreign_chain(d):  # another sandbox's whole chain passed off as this one's
        shutil.copy(d / "ns.x" / "r2.jsonl", d / "ns.sb" / "r3.jsonl")
        shutil.copy(d / "ns.x" / "r2.head", d / "ns.sb" / "r3.head")

    for edit in (swap_lines, drop_first, edit_verdict, cut_tail, foreign_chain):
        assert broken(edit), edit.__name__

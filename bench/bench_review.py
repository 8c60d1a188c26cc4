#!/usr/bin/env python3
"""What a review-mode grant costs, against an rw grant of the same folder in the same run.

    python3 bench/bench_review.py [--runs N] [--files F] [--changed C] [--json]

Rows (median of N runs; root; a private AGENTVM_HOME under /tmp, removed after):
  rw grant start-to-exit       `/bin/true` in a sandbox with the folder granted rw (the baseline)
  review grant start-to-exit   the same with `mode: review`: the layer opened (its baseline walk
                               of F files on the first run of a layer, a fresh layer each run:
                               an anonymous run) and the overlay mounted by bwrap
  write C files (rw / review)  a sandbox that rewrites C files of the folder (copy-up in review)
  diff (C changed files)       review.load + render of the layer
  accept (C changed files)     review.accept: staged, checked, renamed into place
The ratios are review / rw for the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--changed", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_review: needs root (dedicated uids, idmapped grants)", file=sys.stderr)
        return 2
    home = Path(f"/tmp/agentvm-test-bench-{secrets.token_hex(4)}")
    home.mkdir(mode=0o711)
    os.environ["AGENTVM_HOME"] = str(home)
    os.environ.setdefault("AGENTVM_UID_BASE", "3950000")
    folder = Path(f"/tmp/agentvm-grant-bench-{secrets.token_hex(4)}")
    folder.mkdir(mode=0o755)
    try:
        for i in range(a.files):
            d = folder / f"d{i % 50:02d}"
            d.mkdir(exist_ok=True)
            (d / f"f{i:05d}.txt").write_text(f"line {i}\n" * 20)
        rows = run(home, folder, a)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for name, v in rows.items():
            print(f"{name:<34} {v}")
    return 0


def run(home: Path, folder: Path, a) -> dict:
    from agentvm import review
    from agentvm.policy import MountGrant, Policy
    from agentvm.runtime import Runtime

    rt = Runtime()
    changed = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.txt"))[: a.changed]
    write = "cd /src && for f in " + " ".join(changed) + "; do echo changed >> $f; done"

    def once(mount, script) -> float:
        pol = Policy(name="run", command=("/bin/sh", "-c", script), mounts=(mount,), network="none", workspace=None)
        t = time.perf_counter()
        res = rt.run(pol, tty=False, stdio=(0, 1, 2))
        dt = time.perf_counter() - t
        assert res.exit_code == 0, res
        return dt

    def drop_layers():
        for x in review.list_layers(home):
            review.discard(home, x["name"])

    out: dict = {"files": a.files, "changed": a.changed, "runs": a.runs}
    for label, script in (("start-to-exit", "true"), (f"write {a.changed} files", write)):
        rw, rv = [], []
        for _ in range(a.runs):  # interleaved, so drift hits both alike
            rw.append(once(MountGrant(str(folder), "/src", True), script))
            if script != "true":  # put the folder back for the next round
                for f in changed:
                    p = folder / f
                    p.write_text(p.read_text().replace("changed\n", ""))
            rv.append(once(review.review_mount(str(folder), "/src"), script))
            drop_layers()
        m_rw, m_rv = statistics.median(rw), statistics.median(rv)
        out[f"rw grant {label} (ms)"] = round(m_rw * 1000, 1)
        out[f"review grant {label} (ms)"] = round(m_rv * 1000, 1)
        out[f"ratio review/rw {label}"] = round(m_rv / m_rw, 2)
    diffs, accepts = [], []
    for _ in range(a.runs):
        once(review.review_mount(str(folder), "/src"), write)
        name = review.list_layers(home)[0]["name"]
        t = time.perf_counter()
        review.render(review.load(home, name))
        diffs.append(time.perf_counter() - t)
        t = time.perf_counter()
        review.accept(home, name)
        accepts.append(time.perf_counter() - t)
        drop_layers()
        for f in changed:
            p = folder / f
            p.write_text(p.read_text().replace("changed\n", ""))
    out[f"diff of {a.changed} changed files (ms)"] = round(statistics.median(diffs) * 1000, 1)
    out[f"accept of {a.changed} changed files (ms)"] = round(statistics.median(accepts) * 1000, 1)
    rt.close()
    return out


if __name__ == "__main__":
    raise SystemExit(main())

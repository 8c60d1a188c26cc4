"""Filesystem: a review-mode grant (``mode: review``) - the agent edits the folder, but nothing it
writes reaches the host until the operator accepts it (agentvm.review). Kept apart from
filesystem.py (same category)."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from agentvm.selftest.framework import WEAKENINGS, Env, Verdict, case

# A policy-level weakening, registered with the others by this module (the cases package is
# imported before any Env is made): the review grant is given as a plain read-write grant.
WEAKENINGS.setdefault("review-as-rw", "review-mode grants are given as plain read-write grants (no layer)")

SCRIPT = r"""
cd /g || exit 3
echo "changed-$M" >> keep.txt && echo EDITED
rm -f gone.txt && echo DELETED
echo "new-$M" > new.txt && echo CREATED
chmod 0777 mode.sh && echo CHMOD
ln -s /etc/passwd passwd-link 2>/dev/null && echo LINKED
mkdir -p deep/er && echo "deep-$M" > deep/er/f && echo DEEP
cp /bin/true suid && chmod 4755 suid 2>/dev/null && echo SUID
ln keep.txt hard 2>/dev/null && echo HARD
grep -q "changed-$M" keep.txt && echo SEES-OWN
"""


def _snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = os.lstat(p)
            body = p.read_bytes() if stat.S_ISREG(st.st_mode) else (os.readlink(p) if stat.S_ISLNK(st.st_mode) else "")
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), body)
    return out


@case("fs.review-writes-held", "filesystem",
      "review-mode grant: edit, delete, create, chmod, link out, setuid, hardlink in the folder - nothing may reach "
      "the host before `agentvm accept`",
      weakened_by="review-as-rw",
      not_on={"gvisor": "review-mode grants are refused on gvisor (policy.review-unsupported): no sandbox starts "
                        "with one, so there is nothing to attack"})
def _(env: Env) -> Verdict:
    from agentvm import review
    from agentvm.policy import MountGrant

    mark = "REVIEW-" + secrets.token_hex(6)
    g = Path(tempfile.mkdtemp(prefix="agentvm-selftest-review-", dir="/tmp"))
    try:
        os.chmod(g, 0o755)
        (g / "keep.txt").write_text("original\n")
        (g / "gone.txt").write_text("still here\n")
        (g / "mode.sh").write_text("#!/bin/sh\n")
        os.chmod(g / "mode.sh", 0o644)
        before = _snapshot(g)
        mount = (MountGrant(str(g), "/g", True) if "review-as-rw" in env.weakens else review.review_mount(str(g), "/g"))
        o = env.sandbox(SCRIPT.replace("$M", mark), egress=False, mounts=(mount,))
        if "SEES-OWN" not in o.stdout or "CREATED" not in o.stdout:
            return Verdict.error("control failed: the agent could not edit the folder it was granted: " + o.out[-400:])
        after = _snapshot(g)
        for layer in review.list_layers(env.paths.home):
            if str(g) in layer["grants"]:
                review.discard(env.paths.home, layer["name"])
    finally:
        shutil.rmtree(g, ignore_errors=True)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        return Verdict.escaped(f"the agent's writes reached the host folder without accept: {', '.join(changed)} "
                               f"(agent said: {' '.join(o.stdout.split())[:200]})")
    return Verdict.contained("edits, a deletion, a new file and folder, a chmod, a link to /etc/passwd, a setuid "
                             "copy and a hardlink stayed in the review layer: the host folder is byte for byte as before "
                             "(the agent saw its own edit)")

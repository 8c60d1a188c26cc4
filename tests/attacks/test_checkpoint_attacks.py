"""Attacks on a suspended sandbox's checkpoint (issue 37), from inside real sandboxes run by the
daemon: the checkpoint of agent A (gVisor, suspended) is not reachable from agent A itself once
resumed, nor from another agent on either substrate - not by its host path, not through
/proc/*/root, not by searching the filesystem; and an image edited on the host between
suspend and resume is refused."""

from __future__ import annotations

import os

import pytest

from tests.helpers import needs_root
from tests.integration.test_daemon import av, daemon_up
from tests.integration.test_suspend import STATEFUL, _agent, _probe, _row, needs_gvisor

pytestmark = [pytest.mark.integration, needs_root]

ATTACK = r"""
P="$CKPT"
c=$(head -c 64 "$P/checkpoint.img" 2>/dev/null | od -An -c); [ -n "$c" ] && echo READ
ls "$P" 2>/dev/null && echo LISTED
ls "$(dirname "$(dirname "$P")")" 2>/dev/null && echo LISTED-ROOT
for q in /proc/1/root"$P" /proc/self/root"$P"; do cat "$q/checkpoint.img" >/dev/null 2>&1 && echo READ-PROC; done
find / -xdev -name checkpoint.img 2>/dev/null | grep . && echo FOUND
printf X 2>/dev/null >> "$P/checkpoint.img" && echo WROTE
echo done
"""


@needs_gvisor
def test_no_sandbox_reaches_a_checkpoint(avm_home, tmp_path):
    with daemon_up(avm_home) as home:
        av("create", "-f", str(_agent(tmp_path, "ck-a", "gvisor", ["python3", "-c", STATEFUL])), "--start")
        av("create", "-f", str(_agent(tmp_path, "ck-b", "bwrap", ["sleep", "600"])), "--start")
        av("create", "-f", str(_agent(tmp_path, "ck-c", "gvisor", ["sleep", "600"])), "--start")
        try:
            _probe("ck-a")
            av("suspend", "ck-a")
            img = next((home / "checkpoints" / "ck-a").rglob("checkpoint.img"))
            d = img.parent
            before = img.read_bytes()
            for attacker in ("ck-b", "ck-c"):
                r = av("exec", attacker, "--", "/bin/sh", "-c", ATTACK.replace("$CKPT", str(d)), check=False)
                out = r.stdout.decode()
                assert "done" in out, (attacker, out, r.stderr)
                for word in ("READ", "LISTED", "READ-PROC", "FOUND", "WROTE"):
                    assert f"{word}\n" not in out.replace("LISTED-ROOT", ""), (attacker, word, out)
                assert "LISTED-ROOT" not in out, (attacker, out)
            assert img.read_bytes() == before, "the checkpoint changed"
            assert oct(os.stat(d).st_mode & 0o777) == "0o700" and oct(os.stat(img).st_mode & 0o777) == "0o600"
            av("resume", "ck-a")
            assert _row("ck-a")["state"] == "running"
            # the resumed agent itself: its (spent) checkpoint path leads nowhere
            r = av("exec", "ck-a", "--", "/bin/sh", "-c", ATTACK.replace("$CKPT", str(d)), check=False)
            out = r.stdout.decode()
            assert "done" in out and "READ\n" not in out and "WROTE" not in out and "FOUND" not in out, out
        finally:
            for n in ("ck-a", "ck-b", "ck-c"):
                av("rm", n, check=False)


@needs_gvisor
def test_resume_refuses_an_image_swapped_for_another_agents(avm_home, tmp_path):
    """Two suspended agents; A's image is replaced by B's (a valid checkpoint, of another
    sandbox): A's resume is refused (the binding names A's sandbox and image)."""
    with daemon_up(avm_home) as home:
        for n in ("sw-a", "sw-b"):
            av("create", "-f", str(_agent(tmp_path, n, "gvisor", ["python3", "-c", STATEFUL])), "--start")
        try:
            for n in ("sw-a", "sw-b"):
                _probe(n)
                av("suspend", n)
            ia = next((home / "checkpoints" / "sw-a").rglob("checkpoint.img"))
            ib = next((home / "checkpoints" / "sw-b").rglob("checkpoint.img"))
            ia.write_bytes(ib.read_bytes())
            r = av("resume", "sw-a", check=False)
            assert r.returncode != 0 and b"checkpoint.tampered" in r.stderr, r.stderr
            assert _row("sw-a")["state"] == "suspended"
            r = av("resume", "sw-b")
            assert _row("sw-b")["state"] == "running"
        finally:
            for n in ("sw-a", "sw-b"):
                av("rm", n, check=False)

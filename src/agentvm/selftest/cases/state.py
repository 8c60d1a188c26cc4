"""State you control (issue 37): a sandbox's checkpoint lives outside every sandbox, root-only,
and is bound to its sandbox by a digest the daemon keeps - an agent can neither read nor edit
one, and an image edited between suspend and resume is refused."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path

from agentvm.selftest.framework import Env, Verdict, case

ATTACK = r"""
for P in "$CKPT" "$ALT"; do
cat "$P/checkpoint.img" 2>/dev/null | head -c 200 && echo
ls -la "$(dirname "$P")" 2>/dev/null
for q in /proc/1/root"$P" /proc/self/root"$P"; do cat "$q/checkpoint.img" 2>/dev/null | head -c 200; done
find / -xdev -name checkpoint.img 2>/dev/null | head -5
printf 'TAMPERED' 2>/dev/null > "$P/checkpoint.img" && echo WROTE
printf 'x' 2>/dev/null > "$P/other.img" && echo WROTE2
done
"""


def _fake_checkpoint(env: Env, mark: str, home=None):
    from agentvm import checkpoint

    name = "selftest-" + secrets.token_hex(4)
    d = checkpoint.new_dir(home or env.paths.home, name, name + "-00000000")
    (d / "checkpoint.img").write_bytes(b"SENTRY-MEMORY " + mark.encode() + b" " + secrets.token_bytes(4096))
    cp = checkpoint.seal(name, name + "-00000000", env.substrate, "0" * 64, d)
    return name, d, cp


@case("state.checkpoint-unreachable", "state",
      "read, list, find or rewrite a sandbox's checkpoint (<home>/checkpoints/...) from inside a sandbox",
      weakened_by="checkpoint-granted")
def _(env: Env) -> Verdict:
    from agentvm import checkpoint
    from agentvm.policy import MountGrant

    mark = "CKPT-" + secrets.token_hex(8)
    weak = "checkpoint-granted" in env.weakens
    # (weakened: the checkpoints kept in a folder the agent is granted; the home itself cannot
    # be granted at all - fsutil.check_grant_target refuses it - so it is a folder beside it)
    other = Path(tempfile.mkdtemp(prefix="agentvm-selftest-ckpt-", dir="/tmp")) if weak else None
    name, d, cp = _fake_checkpoint(env, mark, other)
    try:
        mounts = (MountGrant(str(d.parent.parent), "/checkpoints", True),) if weak else ()
        alt = f"/checkpoints/{d.parent.name}/{d.name}"  # where the weakened grant puts it
        o = env.sandbox(ATTACK.replace("$CKPT", str(d)).replace("$ALT", alt), egress=False, mounts=mounts)
        try:
            checkpoint.verify(cp, name, "0" * 64)
            intact = True
        except Exception:  # noqa: BLE001 - any refusal: it was changed
            intact = False
    finally:
        shutil.rmtree(d.parent, ignore_errors=True)
        if other is not None:
            shutil.rmtree(other, ignore_errors=True)
    if mark in o.out or "WROTE" in o.stdout or not intact:
        return Verdict.escaped("the agent reached the checkpoint: "
                               + ("read its memory image; " if mark in o.out else "")
                               + ("wrote into it; " if "WROTE" in o.stdout or not intact else "")
                               + " ".join(w for w in o.stdout.split() if w.isascii() and w.isprintable())[-200:])
    return Verdict.contained("the checkpoint under the agent-vm home is neither readable, listable, findable nor "
                             "writable from inside (not mounted; /proc/1/root leads nowhere); its digest is unchanged")


@case("state.tampered-checkpoint-refused", "state",
      "edit a checkpoint image between suspend and resume (one byte, an added file, another sandbox's image)",
      weakened_by="unbound-checkpoint")
def _(env: Env) -> Verdict:
    from agentvm import checkpoint
    from agentvm.errors import AgentVMError

    name, d, cp = _fake_checkpoint(env, "x")
    accepted = []
    try:
        for how in ("byte", "file", "swap"):
            img = d / "checkpoint.img"
            original = img.read_bytes()
            rec = cp
            if how == "byte":
                img.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
            elif how == "file":
                (d / "pages.img").write_bytes(b"\0" * 64)
            else:  # the same image presented as another sandbox's
                rec = checkpoint.Checkpoint(**{**cp.to_dict(), "sandbox_id": "other-00000000"})
            if "unbound-checkpoint" in env.weakens:  # trust what is found: recompute the binding from it
                rec = checkpoint.seal(name, rec.sandbox_id, rec.substrate, rec.policy_digest, d)
            try:
                checkpoint.verify(rec, name, "0" * 64)
                accepted.append(how)
            except AgentVMError as exc:
                if exc.code != "checkpoint.tampered":
                    return Verdict.error(f"refused, but as {exc.code}: {exc.message}")
            img.write_bytes(original)
            (d / "pages.img").unlink(missing_ok=True)
    finally:
        shutil.rmtree(d.parent, ignore_errors=True)
    if accepted:
        return Verdict.escaped("a tampered checkpoint was accepted for resume: " + ", ".join(accepted))
    return Verdict.contained("an edited byte, an added file and an image claimed for another sandbox were each "
                             "refused (checkpoint.tampered): the binding is read from the daemon's state, not the image")


@case("state.fork-parent-placeholder", "state",
      "a fork replays its parent's credential placeholder (found in the forked workspace) to the bound host",
      weakened_by="no-lineage")
def _(env: Env) -> Verdict:
    """The fork's gate (its CredentialSet, as the daemon builds it for a forked agent) is asked
    to forward a request carrying the parent's placeholder in the very header the credential is
    injected in, to the host it is bound to: it must refuse it as a leak, never swap it."""
    from agentvm import snapshot
    from agentvm.gate.brokers import CredentialError
    from agentvm.gate.credentials import CredentialBinding, make_placeholder
    from agentvm.sessioncreds import vault_credentials

    real = "SELFTEST-REAL-" + secrets.token_hex(12)
    d = Path(tempfile.mkdtemp(prefix="agentvm-selftest-lineage-", dir="/tmp"))
    try:
        (d / "secret").write_text(real + "\n")
        b = CredentialBinding(name="k", env="K", ref=f"file:{d / 'secret'}", hosts=("api.selftest",), header="x-api-key")
        parent_ph, child_ph = make_placeholder(b, len(real)), make_placeholder(b, len(real))
        child = vault_credentials((b,), {"k": child_ph}, d / "vault", "child-00000000")
        if "no-lineage" not in env.weakens:
            child = snapshot.with_ancestors(child, (b,), [("k.parent", parent_ph)], d / "vault", "child-00000000")
        own = child.apply(host="api.selftest", scheme="https", target="/", headers=[(b"x-api-key", child_ph.encode())])
        if (b"x-api-key", real.encode()) not in own.headers:
            return Verdict.error("control failed: the child's own placeholder was not swapped")
        try:
            sw = child.apply(host="api.selftest", scheme="https", target="/",
                             headers=[(b"x-api-key", parent_ph.encode())])
        except CredentialError as exc:
            if not exc.rule_id.startswith("credential:leak:"):
                return Verdict.error(f"refused, but not as a leak: {exc.rule_id}")
            return Verdict.contained(f"the parent's placeholder in the child: refused as {exc.rule_id} (the "
                                     "child's own placeholder is swapped beside it)")
        if any(real.encode() in v for _, v in sw.headers):
            return Verdict.escaped("the parent's placeholder was swapped for the real value in the child")
        return Verdict.escaped("the parent's placeholder passed the child's gate unrefused (forwarded upstream as is)")
    finally:
        shutil.rmtree(d, ignore_errors=True)

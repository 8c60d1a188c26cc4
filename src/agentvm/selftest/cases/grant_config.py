"""Filesystem: configuration the host executes or obeys, planted in a read-write grant - the
files an IDE, CI, git, package managers, build tools and version managers read from the top of
a project folder (agentvm.grants.HOST_TRUSTED). Kept apart from filesystem.py (same category)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

from agentvm.selftest.framework import WEAKENINGS, Env, Verdict, case

# A policy-level weakening, registered with the others by this module (the cases package is
# imported before any Env is made): the grant lifts every protected name, as an agent file
# listing them all in mounts[].writableTrusted would.
WEAKENINGS.setdefault("trusted-writable", "read-write grants keep no host-trusted name read-only "
                                          "(every name in mounts[].writableTrusted)")

# (path in the grant, content): what the agent tries to create; $M is the run's marker
PLANTS = (
    (".devcontainer/devcontainer.json", '{"initializeCommand": "echo $M"}'),
    (".devcontainer.json", '{"initializeCommand": "echo $M"}'),
    (".github/workflows/x.yml", "on: push # $M"),
    (".npmrc", "script-shell=/tmp/$M.sh"),
    (".yarnrc.yml", "yarnPath: ./$M.js"),
    (".gitattributes", "* filter=$M"),
    (".gitconfig", "[core] fsmonitor = /tmp/$M.sh"),
    (".cargo/config.toml", "[build]\nrustc-wrapper = '/tmp/$M.sh'"),
    (".bazelrc", "build --run_under=/tmp/$M.sh"),
    (".tool-versions", "nodejs path:/tmp/$M"),
    (".python-version", "/tmp/$M/python"),
    (".envrc", "echo $M"),
    (".vscode/tasks.json", '{"label": "$M"}'),
)
# present on the host before the run: the agent tries to change, remove and replace them
EXISTING = {".npmrc": "registry=https://registry.npmjs.org/\n", ".github/workflows/ci.yml": "on: push\n",
            "pip.conf": "[global]\nindex-url = https://pypi.org/simple\n"}

SCRIPT = r"""
M="$MARK"
plant() {  # path content
  mkdir -p "/g/$(dirname "$1")" 2>/dev/null
  printf '%s\n' "$2" > "/g/$1" 2>/dev/null && echo "PLANTED $1"
  # around a read-only entry: remove or rename it, then create it again
  (rm -rf "/g/${1%%/*}" || mv "/g/${1%%/*}" "/g/moved-$M") 2>/dev/null
  mkdir -p "/g/$(dirname "$1")" 2>/dev/null
  printf '%s\n' "$2" > "/g/$1" 2>/dev/null && echo "PLANTED-AGAIN $1"
}
"""


@case("fs.planted-host-config", "filesystem",
      "planted host config: create what an IDE, CI, git or a package manager runs at the top of a read-write grant "
      "(.devcontainer/, .github/workflows/, .npmrc, .gitattributes, .cargo/...), or change an existing one",
      weakened_by="trusted-writable")
def _(env: Env) -> Verdict:
    from agentvm.grants import TRUSTED_NAMES
    from agentvm.policy import MountGrant

    mark = "PLANT-" + secrets.token_hex(6)
    g = Path(tempfile.mkdtemp(prefix="agentvm-selftest-config-", dir="/tmp"))
    try:
        os.chmod(g, 0o755)
        for rel, text in EXISTING.items():
            (g / rel).parent.mkdir(parents=True, exist_ok=True)
            (g / rel).write_text(text)
        lines = [SCRIPT.replace("$MARK", mark)]
        for rel, text in PLANTS:
            lines.append(f"plant {rel!r} \"{text.replace(chr(34), chr(92) + chr(34))}\"")
        for rel in EXISTING:
            lines.append(f"printf 'index-url = http://canary/%s\\n' \"$M\" >> /g/{rel} 2>/dev/null && echo \"CHANGED {rel}\"")
        lines.append("echo work > /g/work.txt && echo WROTE")
        lifted = TRUSTED_NAMES if "trusted-writable" in env.weakens else ()
        o = env.sandbox("\n".join(lines), egress=False, mounts=(MountGrant(str(g), "/g", True, lifted),))
        if "WROTE" not in o.stdout or not (g / "work.txt").is_file():
            return Verdict.error("control failed: the read-write grant was not writable: " + o.out[-400:])
        # judged on the host: what the agent left in the folder, and what it changed
        planted = sorted(str(p.relative_to(g)) for p in g.rglob("*")
                         if p.is_file() and not p.is_symlink() and mark.encode() in p.read_bytes())
        changed = sorted(rel for rel, text in EXISTING.items()
                         if not (g / rel).is_file() or (g / rel).read_text() != text)
    finally:
        shutil.rmtree(g, ignore_errors=True)
    if planted or changed:
        return Verdict.escaped(f"host-executed configuration planted in the grant: {', '.join(planted) or '-'}; "
                               f"existing changed or removed: {', '.join(changed) or '-'} "
                               f"(agent said: {' '.join(l for l in o.stdout.splitlines() if l.startswith(('PLANTED', 'CHANGED')))[:300]})")
    return Verdict.contained(f"{len(PLANTS)} host-executed files not created (nor after removing or renaming their "
                             f"placeholder), {len(EXISTING)} existing ones unchanged; the work tree was writable")

"""Persistence: nothing a session writes may survive into the next one, except a declared
agent's /workspace.

Each case plants something in session 1 (with a unique marker) and looks for it, or for its
effect, in session 2 - a fresh ``env.sandbox(...)``. Cases that share one environment use
their own markers, so they do not see each other's droppings.
"""

from __future__ import annotations

import secrets

from agentvm.selftest.framework import Env, Verdict, case


def _two(env: Env, plant: str, check: str, mark: str, *, plant_kw=None, check_kw=None):
    a = env.sandbox(["/bin/sh", "-c", plant, "plant", mark], lang="argv", egress=False, timeout=10, **(plant_kw or {}))
    b = env.sandbox(["/bin/sh", "-c", check, "check", mark], lang="argv", egress=False, timeout=10, **(check_kw or {}))
    return a, b


def _lines(o, prefix: str) -> list[str]:
    return [l for l in o.stdout.splitlines() if l.startswith(prefix)]


def _judge(what: str, a, b, *, planted_prefix="PLANTED", hit_prefix="SURVIVED") -> Verdict:
    if "DONE" not in a.stdout or "DONE" not in b.stdout:
        return Verdict.error(f"{what}: a session did not finish: {a.out[-200:]!r} / {b.out[-200:]!r}")
    hits = _lines(b, hit_prefix)
    planted = _lines(a, planted_prefix)
    if hits:
        return Verdict.escaped(f"{what}: survived into the next session: " + "; ".join(hits)[:500])
    return Verdict.contained(f"{what}: {len(planted)} plants in session 1, none visible or effective in session 2")


# ---------------------------------------------------------------------------- shell rc files

_RC_PLANT = r"""
M=$1
for f in ~/.bashrc ~/.profile ~/.bash_profile ~/.bash_login ~/.bash_logout ~/.zshrc ~/.zshenv ~/.shrc ~/.kshrc \
         ~/.config/fish/config.fish; do
  mkdir -p "$(dirname "$f")" 2>/dev/null
  printf '\necho HOOK-RAN-%s\n' "$M" >> "$f" 2>/dev/null && echo "PLANTED $f"
done
# ENV is read by an interactive sh; /etc/profile.d would hit every login shell
printf 'echo HOOK-RAN-%s\n' "$M" > /etc/profile.d/zz-hook.sh 2>/dev/null && echo "PLANTED /etc/profile.d"
printf 'echo HOOK-RAN-%s\n' "$M" >> /etc/bash.bashrc 2>/dev/null && echo "PLANTED /etc/bash.bashrc"
echo DONE
"""

_RC_CHECK = r"""
M=$1
grep -l "HOOK-RAN-$M" ~/.bashrc ~/.profile ~/.bash_profile ~/.bash_login ~/.bash_logout ~/.zshrc ~/.zshenv ~/.shrc \
  ~/.kshrc ~/.config/fish/config.fish /etc/profile.d/zz-hook.sh /etc/bash.bashrc 2>/dev/null | sed 's/^/SURVIVED file /'
# the shells a developer tool would start
out=$( (bash -lc true; bash -ic true; ENV=~/.shrc sh -ic true; sh -lc true) 2>/dev/null </dev/null)
case "$out" in *"HOOK-RAN-$M"*) echo "SURVIVED a new shell ran the hook";; esac
echo DONE
"""


@case("persist.shell-rc", "persistence", "hooks in ~/.bashrc, ~/.profile and friends (and /etc/profile.d) run in the next session",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    a, b = _two(env, _RC_PLANT, _RC_CHECK, mark)
    return _judge("shell rc hooks", a, b)


# ---------------------------------------------------------------------------- caches and user site

_CACHE_PLANT = r"""
M=$1
SITE=$(python3 -c 'import site; print(site.getusersitepackages())')
mkdir -p "$SITE" ~/.cache/pip/http ~/.npm/_cacache ~/.cache/node-gyp ~/.local/bin ~/.cargo/bin ~/.config/git 2>/dev/null
printf 'import sys; print("HOOK-RAN-%s", file=sys.stderr)\n' "$M" > "$SITE/zz_$M.pth" && echo "PLANTED $SITE"
echo "poison-$M" > ~/.cache/pip/http/poison-$M && echo "PLANTED pip cache"
echo "poison-$M" > ~/.npm/_cacache/poison-$M && echo "PLANTED npm cache"
printf '#!/bin/sh\necho HOOK-RAN-%s\n' "$M" > ~/.local/bin/git && chmod +x ~/.local/bin/git && echo "PLANTED ~/.local/bin/git"
echo DONE
"""

_CACHE_CHECK = r"""
M=$1
ls -a ~/.cache/pip/http ~/.npm/_cacache 2>/dev/null | grep "$M" | sed 's/^/SURVIVED cache /'
# does the planted .pth run in the next python? does a planted binary shadow git?
out=$( (python3 -c pass; PATH=$HOME/.local/bin:$PATH git --version) 2>&1)
case "$out" in *"HOOK-RAN-$M"*) echo "SURVIVED code from ~/.local ran";; esac
echo DONE
"""


@case("persist.caches-and-user-site", "persistence",
      "a .pth in the user site-packages, poisoned pip/npm caches and a ~/.local/bin shim take effect in the next session",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    a, b = _two(env, _CACHE_PLANT, _CACHE_CHECK, mark)
    return _judge("caches and user site", a, b)


# ---------------------------------------------------------------------------- git hooks

_GIT_PLANT = r"""
M=$1
mkdir -p /tmp/.hooks-$M ~/.githooks-$M ~/.config/git 2>/dev/null
for d in /tmp/.hooks-$M ~/.githooks-$M; do
  printf '#!/bin/sh\necho HOOK-RAN-%s\n' "$M" > $d/pre-commit && chmod +x $d/pre-commit && echo "PLANTED $d/pre-commit"
done
# both user-level config files git reads (~/.gitconfig may already belong to someone else)
for f in ~/.gitconfig ~/.config/git/config; do
  git config --file $f core.hooksPath ~/.githooks-$M 2>/dev/null && echo "PLANTED $f hooksPath"
  git config --file $f alias.st '!echo HOOK-RAN-'$M 2>/dev/null && echo "PLANTED $f alias"
  git config --file $f core.fsmonitor "echo HOOK-RAN-$M >&2; false" 2>/dev/null && echo "PLANTED $f fsmonitor"
done
git config --system core.hooksPath /tmp/.hooks-$M 2>/dev/null && echo "PLANTED /etc/gitconfig"
echo DONE
"""

_GIT_CHECK = r"""
M=$1
cd /workspace && git init -q r 2>/dev/null && cd r && git -c user.email=a@b -c user.name=a commit -q --allow-empty -m x >/tmp/o 2>&1
git st >>/tmp/o 2>&1; git status >>/tmp/o 2>&1
grep -q "HOOK-RAN-$M" /tmp/o && echo "SURVIVED a hook/alias from the previous session ran in a new repository"
for f in ~/.githooks-$M/pre-commit /tmp/.hooks-$M/pre-commit; do [ -e "$f" ] && echo "SURVIVED hook $f"; done
git config --show-origin --get-all core.hooksPath 2>/dev/null | grep -- "$M" | sed 's/^/SURVIVED config /'
echo DONE
"""


@case("persist.git-hooks", "persistence",
      "git hooks and config outside the workspace (core.hooksPath, aliases, fsmonitor) run in the next session's repositories",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    a, b = _two(env, _GIT_PLANT, _GIT_CHECK, mark)
    return _judge("git hooks", a, b)


# ---------------------------------------------------------------------------- /tmp and /dev/shm

_TMP_PLANT = r"""
M=$1
for d in /tmp /dev/shm /var/tmp /run/user/1000 /tmp/.X11-unix /tmp/.ICE-unix; do
  mkdir -p "$d" 2>/dev/null
  (echo "dropped $M" > "$d/.drop-$M" && chmod 000 "$d/.drop-$M") 2>/dev/null && echo "PLANTED $d"
done
python3 - "$M" <<'EOF'
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.bind(f"/tmp/.sock-{sys.argv[1]}"); print("PLANTED unix socket")
except OSError:
    pass
EOF
echo DONE
"""

_TMP_CHECK = r"""
M=$1
for d in /tmp /dev/shm /var/tmp /run/user/1000 /tmp/.X11-unix /tmp/.ICE-unix; do
  ls -a "$d" 2>/dev/null | grep -- "$M" | sed "s|^|SURVIVED $d/|"
done
echo DONE
"""


@case("persist.tmp-and-shm", "persistence", "hidden, unreadable droppings and sockets in /tmp, /dev/shm and /var/tmp",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    a, b = _two(env, _TMP_PLANT, _TMP_CHECK, mark)
    return _judge("/tmp and /dev/shm", a, b)


# ---------------------------------------------------------------------------- every writable place

_SWEEP_PLANT = r"""
import os, sys
M = sys.argv[1]
skip = ("/proc", "/sys", "/dev")
written, tried = [], 0
def walk():
    # everything but /usr first (in a fixed order), then /usr to a shallow depth: the budget
    # below must not be spent in /usr's thousands of read-only folders
    tops = sorted(d for d in os.listdir("/") if d != "usr" and not os.path.islink("/" + d))
    yield "/", [], []
    for t in tops:
        yield from os.walk("/" + t, topdown=True)
    for root, dirs, files in os.walk("/usr", topdown=True):
        if root.count("/") >= 3:
            dirs[:] = []
        yield root, dirs, files
for root, dirs, files in walk():
    if root == "/dev":
        dirs[:] = [d for d in dirs if d == "shm"]
        continue
    if root.startswith(skip) and not root.startswith("/dev/shm"):
        dirs[:] = []
        continue
    if root.count("/") > 6:
        dirs[:] = []
    tried += 1
    p = os.path.join(root, f".persist-{M}")
    try:
        with open(p, "w") as f:
            f.write(M)
        written.append(root)
    except OSError:
        pass
    if tried > 4000:
        break
print("TRIED", tried)
print("WROTE", written)
for d in ("/", "/etc", "/usr/local/bin", "/opt", "/var/lib", "/.agentvm", "/root"):
    try:
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, f".persist-{M}"), "w").close()
        print("PLANTED", d)
    except OSError as e:
        pass
print("DONE")
"""

_SWEEP_CHECK = r"""
import os, sys
M = sys.argv[1]
name = f".persist-{M}"
# exactly where session 1 wrote, and a walk of everything else (a store that comes back at
# another path); /usr is left to the exact check - it is the host's own, at the same path
# every session, and walking it is slow under gVisor's ptrace platform
found = [d for d in sys.argv[2:] if os.path.exists(os.path.join(d, name))]
for root, dirs, files in os.walk("/", topdown=True):
    if root == "/dev":
        dirs[:] = [d for d in dirs if d == "shm"]
        continue
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("usr", "proc", "sys")]
    if root.count("/") > 6:
        dirs[:] = []
    if name in files and root not in found:
        found.append(root)
for f in found:
    print("SURVIVED", f)
print("CHECKED", len(sys.argv) - 2)
print("DONE")
"""


@case("persist.writable-sweep", "persistence",
      "write a marker into every writable directory of the sandbox (rootfs, /etc, /usr, mounts...); none survives",
      weakened_by="writable-audit")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    a = env.sandbox(["/usr/bin/python3", "-c", _SWEEP_PLANT, mark], lang="argv", egress=False, timeout=60)
    import ast

    wrote_line = next((l for l in a.stdout.splitlines() if l.startswith("WROTE ")), "WROTE []")
    dirs = list(ast.literal_eval(wrote_line[6:])) + [l.split(" ", 1)[1] for l in a.stdout.splitlines()
                                                      if l.startswith("PLANTED ")]
    b = env.sandbox(["/usr/bin/python3", "-c", _SWEEP_CHECK, mark, *dict.fromkeys(dirs)], lang="argv", egress=False,
                    timeout=60)
    v = _judge("writable sweep", a, b)
    wrote = next((l for l in a.stdout.splitlines() if l.startswith("WROTE")), "")
    if v.status == "contained":
        v.evidence += f"; session 1 could write only {wrote[6:300]}"
    return v


# ---------------------------------------------------------------------------- ephemeral workspace

_WS_PLANT = r"""
M=$1
echo "task-1 $M" > /workspace/result-$M && echo PLANTED /workspace
mkdir -p /workspace/.git/hooks && printf '#!/bin/sh\necho HOOK-RAN-%s\n' "$M" > /workspace/.git/hooks/post-checkout && echo PLANTED hook
echo DONE
"""

_WS_CHECK = r"""
M=$1
ls -a /workspace /workspace/.git/hooks 2>/dev/null | grep -- "$M" | sed 's/^/SURVIVED /'
grep -rl "$M" /workspace 2>/dev/null | sed 's/^/SURVIVED /'
echo DONE
"""


@case("persist.ephemeral-workspace", "persistence",
      "an ephemeral task never sees a previous task's /workspace (files, hooks)", weakened_by="shared-uid")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    a, b = _two(env, _WS_PLANT, _WS_CHECK, mark)
    return _judge("ephemeral /workspace", a, b)


# ---------------------------------------------------------------------------- declared agent

_AGENT_PLANT = r"""
M=$1
echo "kept $M" > /workspace/kept-$M && echo PLANTED /workspace
echo "echo HOOK-RAN-$M" >> ~/.profile && echo PLANTED ~/.profile
echo "gone $M" > /tmp/gone-$M && echo PLANTED /tmp
echo "gone $M" > ~/gone-$M && echo PLANTED HOME
echo DONE
"""

_AGENT_CHECK = r"""
M=$1
[ -f /workspace/kept-$M ] && echo "KEPT /workspace/kept-$M"
for f in ~/.profile ~/gone-$M /tmp/gone-$M; do grep -l "$M" "$f" 2>/dev/null | sed 's/^/SURVIVED /'; done
echo DONE
"""


@case("persist.agent-home-not-workspace", "persistence",
      "a declared agent keeps /workspace across sessions (declared), but never its HOME, shell rc or /tmp",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    mark = secrets.token_hex(6)
    kw = {"agent": True, "name": "persist-agent"}
    a, b = _two(env, _AGENT_PLANT, _AGENT_CHECK, mark, plant_kw=kw, check_kw=kw)
    v = _judge("declared agent", a, b)
    if v.status == "error":
        return v
    kept = _lines(b, "KEPT")
    if not kept:  # the positive control: the declared durable workspace must work
        return Verdict.error(f"positive control failed: the agent's /workspace did not persist ({b.out[-200:]!r})")
    if v.status == "contained":
        v.evidence += f"; positive control: {kept[0]} persisted, as declared"
    return v

"""Filesystem escapes: reading host secrets, writing outside grants, remounting, /proc/*/root,
symlinks and hardlinks out of granted folders, and another agent's workspace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _attacklib import body, dump, needs_root, token

pytestmark = [pytest.mark.attack, needs_root]


# ---------------------------------------------------------------------------------- reads


def test_read_root_canary_fails(sh, root_canary):
    path, secret = root_canary
    script = f"""
cat {path}; echo "cat=$?"
ls -la /root; echo "ls=$?"
cat /proc/1/root{path}; echo "p1=$?"
cat /proc/self/root{path}; echo "pself=$?"
grep -rs {secret[:16]} /root /home /tmp /workspace 2>/dev/null; echo "grep=$?"
"""
    r = sh(script)
    out = r.stdout + r.stderr
    assert secret not in out, "host /root canary leaked into the sandbox" + dump(r)
    assert "cat=0" not in r.stdout and "p1=0" not in r.stdout and "pself=0" not in r.stdout, dump(r)
    assert r.returncode == 0, dump(r)


def test_read_ssh_keys_fails(sh, ssh_canary):
    path, secret = ssh_canary
    script = f"""
cat {path}; echo "direct=$?"
cat /root/.ssh/* ~/.ssh/* /home/*/.ssh/* 2>&1; echo "glob=$?"
ls -la ~ /home; echo "HOME=$HOME"
cat /proc/1/root/root/.ssh/{path.name}; echo "p1=$?"
"""
    r = sh(script)
    assert secret not in r.stdout + r.stderr, "host ssh key leaked" + dump(r)
    assert "direct=0" not in r.stdout and "p1=0" not in r.stdout, dump(r)
    assert "HOME=/home/agent" in r.stdout, dump(r)


def test_read_host_shadow_fails(sh):
    host_shadow = Path("/etc/shadow").read_text()  # positive control: the file is real on the host
    secret_lines = [ln for ln in host_shadow.splitlines() if ln.count(":") >= 8]
    assert secret_lines
    script = """
ls -la /etc/shadow /etc/gshadow /etc/sudoers 2>&1; echo "ls=$?"
cat /etc/shadow; echo "cat=$?"
cat /proc/1/root/etc/shadow; echo "p1=$?"
cat /proc/self/root/etc/shadow; echo "pself=$?"
grep -rs '^root:' /etc 2>/dev/null
"""
    r = sh(script)
    out = r.stdout + r.stderr
    for ln in secret_lines:
        assert ln not in out, f"host shadow line leaked: {ln[:20]}..." + dump(r)
    for k in ("cat=0", "p1=0", "pself=0"):
        assert k not in r.stdout, dump(r)
    # the synthetic passwd is there instead, with no host accounts
    r2 = sh("cat /etc/passwd")
    assert "agent:x:1000:1000" in r2.stdout, dump(r2)
    host_users = [ln.split(":")[0] for ln in Path("/etc/passwd").read_text().splitlines()]
    leaked = [u for u in host_users if u not in ("root", "nobody") and f"\n{u}:" in "\n" + r2.stdout]
    assert not leaked, f"host accounts visible in the sandbox passwd: {leaked}" + dump(r2)


OTHER_AGENT_SEARCH = r"""
import os, sys, re
secret = os.environ["NEEDLE_REV"][::-1]  # reversed so our own environ does not match
victim = os.environ["VICTIM"]
hits = []
def check(path, data):
    if secret.encode() in data:
        hits.append(path)
# 1. the host layout, learnt from what the sandbox can see (bwrap's argv in /proc/1/cmdline)
paths = set()
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        for a in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"):
            if a.startswith(b"/"):
                paths.add(a.decode(errors="replace"))
    except OSError:
        pass
homes = set()
for p in paths:
    m = re.match(r"(.*)/(libexec|run/sandboxes|run/ws|workspaces)/", p)
    if m:
        homes.add(m.group(1))
homes.add(os.environ.get("GUESS_HOME", "/var/lib/agentvm"))
homes.add("/var/lib/agentvm")
guesses = []
for h in homes:
    guesses += [f"{h}/workspaces/{victim}.img", f"{h}/run/ws/{victim}/secret.txt", f"{h}/run/ws/{victim}",
                f"{h}/workspaces", f"{h}/state.db", f"/run/agentvm/ws/{victim}/secret.txt",
                # the workspace pool (the default backend): one btrfs for all, each agent a subvolume
                f"{h}/run/ws/.pool/{victim}/secret.txt", f"{h}/run/ws/.pool/{victim}", f"{h}/run/ws/.pool",
                f"{h}/workspaces/.pool.img", f"{h}/workspaces/.pool.lock", f"/run/agentvm/ws/.pool/{victim}/secret.txt",
                f"{h}/run/ws"]
for g in guesses:
    for target in (g, "/proc/1/root" + g, "/proc/self/root" + g):
        try:
            if os.path.isdir(target):
                print("LISTED", target, os.listdir(target))
                continue
            with open(target, "rb") as fh:
                check(target, fh.read(64 << 20))
                print("OPENED", target)
        except OSError as e:
            pass
# 2. block devices / loop images
for d in ("/dev/loop0", "/dev/loop1", "/dev/loop2", "/dev/loop3", "/dev/loop-control", "/dev/btrfs-control", "/dev/vda"):
    try:
        with open(d, "rb") as fh:
            check(d, fh.read(64 << 20)); print("OPENED", d)
    except OSError:
        pass
# 3. everything readable in the sandbox's view except the shared read-only /usr and /proc/sys
for root in ("/", "/proc/1/root", "/proc/1/cwd"):
    for dp, dns, fns in os.walk(root):
        if dp.startswith(("/usr", "/proc", "/sys", "/proc/1/root/usr", "/proc/1/root/proc")):
            dns[:] = []
            continue
        for fn in fns:
            p = os.path.join(dp, fn)
            try:
                if os.path.isfile(p):
                    with open(p, "rb") as fh:
                        check(p, fh.read(1 << 20))
            except OSError:
                pass
# 4. other processes' environment/cwd/root
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for f in ("environ", "cmdline"):
        try:
            check(f"/proc/{pid}/{f}", open(f"/proc/{pid}/{f}", "rb").read())
        except OSError:
            pass
print("HOMES", sorted(homes))
print("HITS", hits)
"""


def test_other_agent_workspace_unreachable(avm_home, agentvm, agent_file, agent_name):
    a, b = agent_name("victim"), agent_name("thief")
    secret = token("WS-SECRET")
    fa = agent_file(a, ["/bin/sh", "-c", f"echo {secret} > /workspace/secret.txt && echo ready && read x"])
    fb = agent_file(b)
    victim = subprocess.Popen(
        [sys.executable, "-m", "agentvm", "run", "-f", fa],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    try:
        line = victim.stdout.readline().decode()
        assert line.strip() == "ready", f"victim agent did not start: {line!r} {victim.stderr.read1(4000)!r}"
        # positive control: the secret really sits on the host, in the victim's mounted workspace
        ws = avm_home / "run" / "ws"  # an image mounted at ws/NAME, or the pool's subvolume ws/.pool/NAME
        found_on_host = [*ws.glob(f"{a}*/secret.txt"), *ws.glob(f".pool/{a}/secret.txt")]
        host_dirs = list((avm_home / "run" / "ws").iterdir()) if (avm_home / "run" / "ws").exists() else []
        assert any(p.read_text().strip() == secret for p in found_on_host), f"control failed: {host_dirs}"
        r = agentvm(
            "run", "-f", fb,
            "--env", f"NEEDLE_REV={secret[::-1]}", "--env", f"VICTIM={a}", "--env", f"GUESS_HOME={avm_home}",
            "--", "/usr/bin/python3", "-c", OTHER_AGENT_SEARCH,
        )
        r.stdout, r.stderr = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    finally:
        victim.stdin.close()
        victim.wait(timeout=30)
    assert r.returncode == 0, dump(r)
    assert "HITS []" in r.stdout, "another agent's workspace secret was readable" + dump(r)
    assert "OPENED" not in r.stdout and "LISTED" not in r.stdout, dump(r)
    # the victim's workspace persisted for the victim
    r2 = agentvm("run", "-f", fa, "--", "/bin/cat", "/workspace/secret.txt")
    assert r2.stdout.decode().strip() == secret, dump(r2)


# ---------------------------------------------------------------------------------- writes


@pytest.mark.parametrize(
    "target",
    ["/usr/agentvm-evil", "/usr/bin/agentvm-evil", "/etc/agentvm-evil", "/etc/passwd", "/agentvm-evil",
     "/.agentvm/init", "/home/agentvm-evil", "/bin/agentvm-evil"],
)
def test_write_outside_grants_fails(sh, target):
    r = sh(f"echo pwned > {target}; echo rc=$?; cat {target} 2>/dev/null")
    assert "rc=0" not in r.stdout and "pwned" not in r.stdout, f"wrote {target}" + dump(r)
    host = Path(target)
    if host.exists():
        assert b"pwned" not in host.read_bytes()[:1 << 16], f"host {target} modified"


def test_write_ro_grant_fails_rw_grant_works(sh, grant_dir):
    ro = grant_dir(0o777)  # even world-writable on the host: the ro grant must not be writable
    (ro / "existing.txt").write_text("original\n")
    os.chmod(ro / "existing.txt", 0o666)
    rw = grant_dir(0o777)
    script = """
echo pwned > /ro/new.txt; echo "new=$?"
echo pwned >> /ro/existing.txt; echo "append=$?"
rm -f /ro/existing.txt; echo "rm=$?"
mkdir /ro/d; echo "mkdir=$?"
ln -s /x /ro/l; echo "ln=$?"
echo ok > /rw/new.txt; echo "RW_WRITE=$?"
"""
    r = sh(script, "--mount", f"{ro}:/ro:ro", "--mount", f"{rw}:/rw:rw")
    for k in ("new", "append", "rm", "mkdir", "ln"):
        assert f"\n{k}=0" not in "\n" + r.stdout, f"ro grant: {k} succeeded" + dump(r)
    assert sorted(p.name for p in ro.iterdir()) == ["existing.txt"], dump(r)
    assert (ro / "existing.txt").read_text() == "original\n"
    # positive control: the same write on a rw grant works
    assert "RW_WRITE=0" in r.stdout, dump(r)
    assert (rw / "new.txt").read_text() == "ok\n"


def test_write_core_pattern_fails(sh):
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    r = sh(
        "echo '|/tmp/pwn %p' > /proc/sys/kernel/core_pattern; echo rc=$?; "
        "python3 -c \"open('/proc/sys/kernel/core_pattern','w').write('|/tmp/pwn')\"; echo py=$?"
    )
    assert "rc=0" not in r.stdout and "py=0" not in r.stdout, dump(r)
    assert Path("/proc/sys/kernel/core_pattern").read_text() == before, "host core_pattern changed!"


def test_write_sysrq_trigger_fails(sh):
    # 'h' only prints help to the kernel log; harmless even if it went through
    r = sh("echo h > /proc/sysrq-trigger; echo rc=$?; ls -la /proc/sysrq-trigger; "
           "python3 -c \"open('/proc/sysrq-trigger','w').write('h')\"; echo py=$?")
    assert "rc=0" not in r.stdout and "py=0" not in r.stdout, dump(r)


@pytest.mark.parametrize("target", ["/sys/devices/system/cpu/cpu0/online", "/sys/devices/system/cpu/cpu1/online",
                                    "/sys/kernel/uevent_helper", "/sys/agentvm-evil",
                                    "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"])
def test_write_sys_and_proc_sys_fails(sh, target):
    try:
        before = Path(target).read_text()
    except OSError:
        before = None
    value = {"/proc/sys/vm/drop_caches": "1", "/proc/sys/kernel/hostname": "pwned"}.get(target, "1")
    r = sh(f"echo {value} > {target}; echo rc=$?")
    assert "rc=0" not in r.stdout, f"write to {target} succeeded" + dump(r)
    if before is not None:
        assert Path(target).read_text() == before


# ---------------------------------------------------------------------------------- mounts


def test_remount_root_rw_fails(sh):
    r = sh("mount -o remount,rw /; echo m1=$?; mount -o remount,rw,bind /usr; echo m2=$?; "
           "mount -t tmpfs none /tmp; echo m3=$?; touch /agentvm-evil; echo t=$?; grep ' / ' /proc/mounts")
    for k in ("m1=0", "m2=0", "m3=0", "t=0"):
        assert k not in r.stdout, dump(r)
    assert "tmpfs / tmpfs ro," in r.stdout, dump(r)


RAW_MOUNT = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
def m(src, dst, fs, flags):
    rc = libc.mount(src, dst, fs, ctypes.c_ulong(flags), None)
    return rc, errno.errorcode.get(ctypes.get_errno(), "?") if rc else "OK"
print("remount_root", *m(None, b"/", None, MS_REMOUNT | MS_BIND))
print("remount_usr", *m(None, b"/usr", None, MS_REMOUNT | MS_BIND))
print("tmpfs_over_etc", *m(b"none", b"/etc", b"tmpfs", 0))
print("bind_proc_over_tmp", *m(b"/proc", b"/tmp", None, MS_BIND))
print("umount_etc_passwd", libc.umount2(b"/etc/passwd", 2), errno.errorcode.get(ctypes.get_errno()))
try:
    open("/agentvm-evil", "w"); print("WROTE_ROOT")
except OSError as e:
    print("write_root", errno.errorcode[e.errno])
"""


def test_raw_mount_syscall_fails(py):
    r = py(RAW_MOUNT)
    assert r.returncode == 0, dump(r)
    lines = dict(ln.split(" ", 1) for ln in r.stdout.strip().splitlines())
    for k in ("remount_root", "remount_usr", "tmpfs_over_etc", "bind_proc_over_tmp", "umount_etc_passwd"):
        assert lines[k].startswith("-1 EPERM"), f"{k}: {lines[k]}" + dump(r)
    assert "WROTE_ROOT" not in r.stdout, dump(r)


PROC_ROOT = r"""
import os, errno
targets = ["/proc/1/root/etc/shadow", "/proc/self/root/etc/shadow", "/proc/1/root/root", "/proc/1/cwd",
           "/proc/self/root/../../../etc/shadow", "/proc/1/root/proc/1/root/etc/shadow",
           "/proc/1/root/" + os.environ["CANARY"], "/proc/self/root/" + os.environ["CANARY"],
           "/proc/1/root/../" + os.environ["CANARY"], "/proc/1/root/usr/../../" + os.environ["CANARY"]]
for t in targets:
    try:
        if os.path.isdir(t):
            print("LISTED", t, os.listdir(t)[:5])
        else:
            print("READ", t, open(t).read()[:200])
    except OSError as e:
        print("DENIED", t, errno.errorcode.get(e.errno))
print("rootlink", os.readlink("/proc/self/root"))
"""


def test_proc_root_tricks_do_not_reach_host(py, root_canary):
    path, secret = root_canary
    shadow = [ln for ln in Path("/etc/shadow").read_text().splitlines() if ln.count(":") >= 8]
    r = py(PROC_ROOT, "--env", f"CANARY={str(path).lstrip('/')}")
    assert r.returncode == 0, dump(r)
    assert secret not in r.stdout + r.stderr, dump(r)
    for ln in shadow:
        assert ln not in r.stdout, dump(r)
    assert "READ /proc/1/root/etc/shadow" not in r.stdout, dump(r)
    assert "rootlink /" in r.stdout, dump(r)


# ---------------------------------------------------------------------------------- links


def test_symlink_out_of_grant_does_not_reach_host(sh, grant_dir, root_canary):
    path, secret = root_canary
    g = grant_dir(0o755)
    (g / "plain.txt").write_text("granted-content\n")
    os.chmod(g / "plain.txt", 0o644)
    os.symlink(str(path), g / "abs-link")
    os.symlink("../" * 8 + str(path).lstrip("/"), g / "rel-link")
    os.symlink("/etc/shadow", g / "shadow-link")
    os.symlink("/root", g / "root-dir-link")
    # positive control: on the host, the links do lead to the secrets
    assert (g / "abs-link").read_text().strip() == secret
    assert (g / "rel-link").read_text().strip() == secret
    script = f"""
cat /g/plain.txt
cat /g/abs-link; echo "abs=$?"
cat /g/rel-link; echo "rel=$?"
cat /g/shadow-link; echo "shadow=$?"
ls -la /g/root-dir-link/; echo "rootdir=$?"
cat /g/root-dir-link/{path.name}; echo "rootdirfile=$?"
"""
    for mode in ("ro", "rw"):
        if mode == "rw":
            os.chmod(g, 0o777)
        r = sh(script, "--mount", f"{g}:/g:{mode}")
        assert "granted-content" in r.stdout, dump(r)  # the grant itself works
        assert secret not in r.stdout + r.stderr, f"symlink in a {mode} grant leaked the host canary" + dump(r)
        for k in ("abs", "rel", "shadow", "rootdirfile"):
            assert f"{k}=0" not in r.stdout, f"{mode}: {k}" + dump(r)


HARDLINK = r"""
import os, errno
def tryl(src, dst):
    try:
        os.link(src, dst); print("LINKED", src, dst)
    except OSError as e:
        print("DENIED", src, errno.errorcode.get(e.errno))
open("/tmp/mine", "w").write("x")
tryl("/etc/hostname", "/g/l1")
tryl("/usr/bin/python3", "/g/l2")
tryl("/tmp/mine", "/g/l3")
tryl("/.agentvm/init", "/g/l4")
tryl("/g/inside.txt", "/tmp/l5")
tryl("/g/inside.txt", "/g/l6")  # positive control: within the grant
"""


def test_hardlink_out_of_grant_fails(py, grant_dir):
    g = grant_dir(0o777)
    (g / "inside.txt").write_text("in\n")
    os.chmod(g / "inside.txt", 0o666)
    r = py(HARDLINK, "--mount", f"{g}:/g:rw")
    assert r.returncode == 0, dump(r)
    for src in ("/etc/hostname", "/usr/bin/python3", "/tmp/mine", "/.agentvm/init"):
        line = next(ln for ln in r.stdout.splitlines() if f" {src} " in ln + " " and "/g/inside" not in ln)
        assert line.startswith("DENIED") and ("EXDEV" in line or "EPERM" in line), line + dump(r)
    assert "LINKED /g/inside.txt /tmp/l5" not in r.stdout, dump(r)
    assert "LINKED /g/inside.txt /g/l6" in r.stdout, dump(r)
    assert sorted(p.name for p in g.iterdir()) == ["inside.txt", "l6"], dump(r)


def test_agent_planted_symlink_in_rw_grant_stays_sandbox_relative(sh, grant_dir, root_canary):
    path, secret = root_canary
    g = grant_dir(0o777)
    script = f"""
ln -s {path} /g/evil-abs; echo "ln=$?"
ln -s ../../../../..{path} /g/evil-rel
ln -s /proc/1/root{path} /g/evil-proc
cat /g/evil-abs; echo "abs=$?"
cat /g/evil-rel; echo "rel=$?"
cat /g/evil-proc; echo "proc=$?"
"""
    r = sh(script, "--mount", f"{g}:/g:rw")
    assert "ln=0" in r.stdout, dump(r)  # planting the link itself is allowed
    assert secret not in r.stdout + r.stderr, "agent-planted symlink resolved to the host canary" + dump(r)
    for k in ("abs", "rel", "proc"):
        assert f"{k}=0" not in r.stdout, dump(r)
    # the link is on the host as a plain symlink (not followed by anything of agent-vm)
    assert os.readlink(g / "evil-abs") == str(path)
    # a second run does not resolve it either
    r2 = sh("cat /g/evil-abs /g/evil-rel; echo rc=$?", "--mount", f"{g}:/g:ro")
    assert secret not in r2.stdout + r2.stderr, dump(r2)


def test_host_state_dir_not_disclosed_by_process_args(sh, avm_home):
    """The launcher's argv (bwrap is pid 1 of the sandbox) must not hand the agent the host
    layout of agent-vm's state (AGENTVM_HOME: workspaces, run dirs, libexec), which turns
    'guessing' other agents' host paths into reading them off /proc/1/cmdline."""
    r = sh("cat /proc/[0-9]*/cmdline | tr '\\0' '\\n' | grep -v '^/bin/sh$' ; true")
    assert r.returncode == 0, dump(r)
    leaked = sorted({ln for ln in r.stdout.splitlines() if str(avm_home) in ln})
    assert not leaked, f"host state paths visible in the sandbox's process arguments: {leaked[:6]}" + dump(r)


def test_planted_symlink_cannot_redirect_a_later_grant(sh, grant_dir, root_canary):
    """Agent A, with a writable grant on a shared directory, replaces a subdirectory the
    operator grants to a later run with a symlink to a host directory. The later grant must
    be refused, not bind-mount whatever the link points at."""
    path, secret = root_canary
    g = grant_dir(0o777)
    (g / "ref").mkdir()
    r = sh(f"rm -rf /g/ref && ln -s {os.path.dirname(path)} /g/ref; echo planted=$?", "--mount", f"{g}:/g:rw")
    assert "planted=0" in r.stdout, dump(r)
    assert os.path.islink(g / "ref")
    r2 = sh(f"cat /ref/{os.path.basename(path)}; echo rc=$?", "--mount", f"{g}/ref:/ref:ro")
    assert secret not in r2.stdout + r2.stderr, "a planted link redirected a grant to the host" + dump(r2)
    assert r2.returncode != 0 and "grant-untrusted-link" in r2.stderr, dump(r2)


# ---------------------------------------------------------------------------------- planted host configuration

HOST_CONFIG_PLANT = r"""
t() { if sh -c "$1" 2>/dev/null; then echo "PLANTED: $1"; fi; }
t 'mkdir -p /g/.devcontainer && echo "{\"initializeCommand\": \"id\"}" > /g/.devcontainer/devcontainer.json'
t 'echo "{\"initializeCommand\": \"id\"}" > /g/.devcontainer.json'
t 'echo "script-shell=/g/evil.sh" > /g/.npmrc'
t 'echo "yarn-path \"./evil.js\"" > /g/.yarnrc'
t 'echo "yarnPath: ./evil.js" > /g/.yarnrc.yml'
t 'echo "* filter=evil diff=evil" > /g/.gitattributes'
t 'printf "[core]\n\tfsmonitor = /g/evil.sh\n" > /g/.gitconfig'
t 'mkdir -p /g/.github/workflows && echo "on: push" > /g/.github/workflows/x.yml'
t 'mkdir -p /g/.cargo && printf "[build]\nrustc-wrapper = \"/g/evil.sh\"\n" > /g/.cargo/config.toml'
t 'echo "build --run_under=/g/evil.sh" > /g/.bazelrc'
t 'echo "evilfork/6.0.0" > /g/.bazelversion'
t 'echo "nodejs path:/g/evil" > /g/.tool-versions'
t 'echo /g/evil/python > /g/.python-version'
t 'echo 22 > /g/.nvmrc'
t 'mkdir -p /g/.idea/runConfigurations && echo x > /g/.idea/runConfigurations/x.xml'
t 'mkdir -p /g/.husky && echo evil > /g/.husky/pre-commit'
t 'echo "repos: []" > /g/.pre-commit-config.yaml'
t 'mkdir -p /g/.cursor && echo "{}" > /g/.cursor/mcp.json'
t 'echo "[global]" > /g/pip.conf'
t 'echo "* filter=evil" >> /g/.gitattributes'
t 'rm -rf /g/.github/workflows'
t 'mv /g/.github /g/gh && mkdir -p /g/.github/workflows && echo x > /g/.github/workflows/x.yml'
t 'rm -f /g/.npmrc; echo evil > /g/.npmrc'
echo ok > /g/Makefile && echo WROTE
mkdir /g/sub && echo x > /g/sub/.npmrc && echo NESTED
"""


def test_planted_host_config_in_an_rw_grant_fails(sh, grant_dir):
    """Issue 35 item 5: files the host's IDE, CI, package managers and version managers run or
    obey cannot be created in a read-write grant, and existing ones stay unchanged; the
    project's own code (a Makefile) stays the agent's to write."""
    g = grant_dir(0o755)
    existing = {".npmrc": "registry=https://registry.npmjs.org/\n", "pip.conf": "[global]\nindex-url = https://pypi.org/simple\n",
                ".github/workflows/ci.yml": "on: push\n", ".gitattributes": "*.png binary\n"}
    for rel, text in existing.items():
        (g / rel).parent.mkdir(parents=True, exist_ok=True)
        (g / rel).write_text(text)
    before = sorted(str(p.relative_to(g)) for p in g.rglob("*"))
    r = sh(HOST_CONFIG_PLANT, "--mount", f"{g}:/g:rw")
    assert "PLANTED" not in r.stdout, dump(r)
    assert "WROTE" in r.stdout, dump(r)  # the work tree is the agent's
    assert "NESTED" in r.stdout, dump(r)  # only the grant's top is protected (documented)
    for rel, text in existing.items():
        assert (g / rel).read_text() == text, f"{rel} changed"
    after = sorted(str(p.relative_to(g)) for p in g.rglob("*"))
    assert after == sorted(before + ["Makefile", "sub", "sub/.npmrc"]), "nothing planted, every placeholder removed after the run"
    # inside, the absent names exist (read-only placeholders), the present ones are the host's
    r = sh("ls -A /g | tr '\\n' ' '; cat /g/.npmrc", "--mount", f"{g}:/g:rw")
    for n in (".devcontainer", ".devcontainer.json", ".yarnrc.yml", ".cargo", ".tool-versions", ".python-version"):
        assert f" {n} " in " " + r.stdout, dump(r)
    assert "registry=https://registry.npmjs.org/" in r.stdout, dump(r)

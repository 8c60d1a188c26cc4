"""Filesystem: host files outside every grant (the canary directory), the host's /etc, links in
grants, writes outside the writable set, device nodes, file handles, and state that must not
survive a session."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from agentvm.selftest.framework import Env, Verdict, case

# ---------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _canary_grant_usable(env: Env):
    """Under ``grant-canaries`` the framework grants the canary directory read-write, which the
    runtime refuses (PolicyDenied) unless the agent's uid can write it: open the directory (not
    secret.txt) for the duration of the run. Without that weakening nothing is touched."""
    if "grant-canaries" not in env.weakens:
        yield
        return
    old = stat.S_IMODE(os.stat(env.canary_dir).st_mode)
    os.chmod(env.canary_dir, 0o1777)
    try:
        yield
    finally:
        os.chmod(env.canary_dir, old)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _host_etc_secrets(limit: int = 40) -> dict[str, str]:
    """World-readable regular files of the host's /etc (one level deep) that the sandbox's /etc
    view must NOT contain: path -> sha256 of the content."""
    from agentvm.backends.hostview import ETC_ALLOW, PER_SANDBOX_ETC, VIEW_SYNTHETIC, etc_refused, usr_linked_etc

    skip = set(ETC_ALLOW) | set(PER_SANDBOX_ETC) | set(VIEW_SYNTHETIC)
    linked = usr_linked_etc(None)  # what the host's /usr points into /etc: in the view by design
    out: dict[str, str] = {}
    try:
        tops = sorted(os.listdir("/etc"))
    except OSError:
        return out
    first = ("machine-id", "login.defs", "fstab", "crontab", "sudoers", "environment", "ssh", "apt", "docker", "pip.conf")
    tops.sort(key=lambda t: (t not in first, os.path.isdir("/etc/" + t), t))
    for top in tops:
        if top in skip:
            continue
        p = "/etc/" + top
        paths = [p]
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                if not os.lstat(p).st_mode & 0o001:
                    continue
                paths = [os.path.join(p, n) for n in sorted(os.listdir(p))[:30]]
        except OSError:
            continue
        for q in paths:
            rel = q[len("/etc/"):]
            if any(rel == t or rel.startswith(t + "/") for t in linked) and not etc_refused(rel):
                continue
            try:
                st = os.lstat(q)
                if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o004 or not 0 < st.st_size <= 65536:
                    continue
                data = Path(q).read_bytes()
            except OSError:
                continue
            if len(data.strip()) >= 8:
                out[q] = _sha(data)
            if len(out) >= limit:
                return out
    return out


HASH_FILES = """
import hashlib, os, sys, errno
for p in sys.argv[1:] if len(sys.argv) > 1 else os.environ["FILES"].split("\\n"):
    if not p:
        continue
    try:
        print("READ", p, hashlib.sha256(open(p, "rb").read()).hexdigest())
    except OSError as e:
        print("DENIED", p, errno.errorcode.get(e.errno))
"""


# Every file of the sandbox's own /etc: its sha256 and whether it holds a private key (the marker
# is hostview.carries_private_key's, written out here so the probe does not trust the code it tests).
VIEW_WALK = r"""
import hashlib, os, re
mark = re.compile(rb"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY|PuTTY-User-Key-File-")
n = 0
for dp, dns, fns in os.walk("/etc"):
    for fn in sorted(fns):
        p = os.path.join(dp, fn)
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        try:
            data = open(p, "rb").read(16 << 20)
        except OSError:
            continue
        n += 1
        print("VIEW\t%s\t%s\t%d" % (p, hashlib.sha256(data).hexdigest(), bool(mark.search(data))))
print("WALKED\t%d" % n)
"""

NOBODY_OPENS = r"""
import sys
for p in sys.stdin.read().split("\0"):
    if p:
        try:
            open(p, "rb").close()
        except OSError:
            print("NO\t" + p)
print("DONE")
"""


def _unreadable_by_nobody(paths: list[str]) -> set[str]:
    """Which of the host's ``paths`` a non-root user (nobody, no groups) cannot open."""
    import subprocess

    if not paths:
        return set()
    kw = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    r = subprocess.run(["/usr/bin/python3", "-I", "-c", NOBODY_OPENS], input="\0".join(paths), capture_output=True,
                       text=True, timeout=60, cwd="/", **kw)
    lines = r.stdout.splitlines()
    if r.returncode != 0 or not lines or lines[-1] != "DONE":
        return set(paths)  # the check itself failed: every file counts as unreadable (fail closed)
    return {ln[3:] for ln in lines if ln.startswith("NO\t")}


def _etc_view_findings(out: str, host_etc: str = "/etc") -> tuple[int, list[str]]:
    """(files walked, findings) from VIEW_WALK's output: a file of the sandbox's /etc that holds
    a private key, or that has the content of a host file a non-root host user cannot read."""
    walked, findings, same = -1, [], []
    for ln in out.splitlines():
        parts = ln.split("\t")
        if parts[0] == "WALKED" and len(parts) == 2:
            walked = int(parts[1])
        if parts[0] != "VIEW" or len(parts) != 4 or not parts[1].startswith("/etc/"):
            continue
        p, h, marker = parts[1], parts[2], parts[3]
        if marker == "1":
            findings.append(f"{p}: holds a private key")
        host = host_etc + p[len("/etc"):]
        try:
            with open(host, "rb") as f:
                if _sha(f.read(16 << 20)) == h:
                    same.append(host)
        except OSError:
            pass
    for host in sorted(_unreadable_by_nobody(same)):
        findings.append(f"/etc{host[len(host_etc):]}: host content a non-root host user cannot read")
    return walked, findings


def _hash_hits(out: str, expected: dict[str, str]) -> list[str]:
    hits = []
    for ln in out.splitlines():
        parts = ln.split()
        if len(parts) == 3 and parts[0] == "READ":
            want = expected.get(parts[1])
            if want and want == parts[2]:
                hits.append(parts[1])
    return hits


def _leaked(env: Env, o) -> list[str]:
    return env.canary_seen(o.out)


# ---------------------------------------------------------------------------- the canary dir


CANARY_SEARCH = r"""
import os, sys
host = os.environ["CANARY_HOST_PATH"]
for t in (host, "/proc/self/root" + host, "/proc/1/root" + host, "/proc/1/cwd/../../../.." + host,
          "/proc/self/cwd/" + "../" * 12 + host.lstrip("/")):
    try:
        print("DIRECT", t, open(t).read().strip()[:80])
    except OSError as e:
        print("denied", t, e.strerror)
n = 0
for dp, dns, fns in os.walk("/"):
    if dp in ("/proc", "/sys", "/usr", "/dev"):
        dns[:] = []
        continue
    for fn in fns:
        p = os.path.join(dp, fn)
        try:
            if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) < (1 << 20):
                n += 1
                data = open(p, "rb").read()
                if b"CANARY-FILE-" in data:
                    print("HIT", p, data[:80].decode(errors="replace").strip())
        except OSError:
            pass
print("scanned", n)
"""


@case("fs.canary-search", "filesystem",
      "read a host file outside every grant: by its host path, through /proc/*/root and /proc/*/cwd, and by searching every readable file",
      weakened_by="grant-canaries")
def _(env: Env) -> Verdict:
    with _canary_grant_usable(env):
        o = env.sandbox(CANARY_SEARCH, lang="python", egress=False,
                        env={"CANARY_HOST_PATH": str(env.canary_dir / "secret.txt")})
    leaked = _leaked(env, o)
    if leaked:
        hit = next((ln for ln in o.stdout.splitlines() if ln.startswith(("HIT", "DIRECT"))), "")
        return Verdict.escaped(f"the host canary file was read inside: {hit[:200]}")
    scanned = next((ln for ln in o.stdout.splitlines() if ln.startswith("scanned")), "scanned ?")
    return Verdict.contained(f"canary not found ({scanned} files); direct paths: "
                             + "; ".join(ln for ln in o.stdout.splitlines() if ln.startswith("denied"))[:300])


MOUNTINFO = r"""
import os
mounts = []
for ln in open("/proc/self/mountinfo"):
    f = ln.split()
    mounts.append((f[3], f[4], f[5]))  # root within its filesystem, mount point, options
for root, mp, opts in mounts:
    print("MOUNT", mp, root, opts)
for root, mp, opts in mounts:
    if mp in ("/", "/usr", "/proc", "/sys/devices/system/cpu") or mp.startswith("/dev"):
        continue
    todo = [mp] if os.path.isdir(mp) else []
    if os.path.isfile(mp):
        todo = []
        try:
            d = open(mp, "rb").read(1 << 16)
            if b"CANARY-FILE-" in d:
                print("HIT", mp, d[:80].decode(errors="replace").strip())
        except OSError:
            pass
    for top in todo:
        for dp, dns, fns in os.walk(top):
            for fn in fns[:200]:
                p = os.path.join(dp, fn)
                try:
                    d = open(p, "rb").read(1 << 16)
                    if b"CANARY-FILE-" in d:
                        print("HIT", p, d[:80].decode(errors="replace").strip())
                except OSError:
                    pass
"""


@case("fs.canary-mountinfo", "filesystem",
      "enumerate every mount from /proc/self/mountinfo (with host source paths) and read the files under each",
      weakened_by="grant-canaries")
def _(env: Env) -> Verdict:
    with _canary_grant_usable(env):
        o = env.sandbox(MOUNTINFO, lang="python", egress=False)
    if _leaked(env, o):
        hit = next((ln for ln in o.stdout.splitlines() if ln.startswith("HIT")), "")
        return Verdict.escaped(f"the host canary was read through a mount found in mountinfo: {hit[:200]}")
    n = sum(ln.startswith("MOUNT") for ln in o.stdout.splitlines())
    if n == 0:
        return Verdict.error("mountinfo could not be read: " + o.out[-300:])
    return Verdict.contained(f"{n} mounts enumerated, no canary under any of them")


TAMPER = r"""
import os, errno
tok = os.environ["TOK"]
host = os.environ["CANARY_DIR"]
own = ("/tmp", "/dev/shm", "/home/agent", "/workspace", "/dev", "/proc")
targets = [host, "/proc/self/root" + host, "/proc/1/root" + host]
for ln in open("/proc/self/mountinfo"):
    f = ln.split()
    if f[4] not in own and not f[4].startswith(("/dev/", "/proc/")) and os.path.isdir(f[4]):
        targets.append(f[4])
for d in targets:
    p = os.path.join(d, "selftest-tamper-" + tok)
    try:
        with open(p, "w") as fh:
            fh.write(tok)
        print("WROTE", p)
    except OSError as e:
        print("denied", p, errno.errorcode.get(e.errno))
    s = os.path.join(d, "secret.txt")
    if os.path.exists(s):
        try:
            with open(s, "a") as fh:
                fh.write(tok)
            print("APPENDED", s)
        except OSError as e:
            print("denied", s, errno.errorcode.get(e.errno))
"""


@case("fs.canary-tamper", "filesystem",
      "create and modify files in a host directory outside every grant (by host path, /proc/*/root, any rw mount)",
      weakened_by="grant-canaries")
def _(env: Env) -> Verdict:
    tok = secrets.token_hex(8)
    before = (env.canary_dir / "secret.txt").read_bytes()
    with _canary_grant_usable(env):
        o = env.sandbox(TAMPER, lang="python", egress=False, env={"TOK": tok, "CANARY_DIR": str(env.canary_dir)})
    planted = sorted(p.name for p in env.canary_dir.iterdir() if p.name != "secret.txt")
    after = (env.canary_dir / "secret.txt").read_bytes()
    for name in planted:  # restore the canary directory for the next cases
        (env.canary_dir / name).unlink(missing_ok=True)
    (env.canary_dir / "secret.txt").write_bytes(before)
    if planted or after != before:
        return Verdict.escaped(f"the host canary directory was modified from inside: new files {planted}, "
                               f"secret.txt {'changed' if after != before else 'unchanged'}")
    return Verdict.contained("host canary directory unchanged; " + "; ".join(
        ln for ln in o.stdout.splitlines() if ln.startswith("denied"))[:300])


# ---------------------------------------------------------------------------- the host's /etc


@case("fs.host-etc-files", "filesystem",
      "read host /etc files absent from the allowlisted view (world-readable configs, machine-id, /etc/shadow...)",
      weakened_by="host-etc")
def _(env: Env) -> Verdict:
    secrets_ = _host_etc_secrets()
    if not secrets_:
        return Verdict.error("no world-readable host /etc file outside the view's allowlist to test with")
    try:
        shadow = [ln for ln in Path("/etc/shadow").read_text().splitlines() if ln.count(":") >= 8]
    except OSError:
        shadow = []
    files = list(secrets_) + ["/etc/shadow", "/etc/gshadow", "/proc/1/root/etc/shadow"]
    # then every file the view holds (the allowlist and what /usr links to): none may hold a
    # private key or carry a host file a non-root host user cannot read
    o = env.sandbox(HASH_FILES + "\nimport subprocess\nsubprocess.run(['cat', '/etc/shadow'])\n" + VIEW_WALK,
                    lang="python", egress=False, env={"FILES": "\n".join(files)})
    hits = _hash_hits(o.stdout, secrets_)
    shadow_hits = [ln.split(":")[0] for ln in shadow if ln in o.out]
    walked, findings = _etc_view_findings(o.stdout)
    if hits or shadow_hits or findings:
        return Verdict.escaped(f"{len(hits)} of {len(secrets_)} host /etc files read with their host content "
                               f"(e.g. {', '.join(hits[:4])}); shadow entries leaked: {shadow_hits[:3]}; "
                               f"{len(findings)} files of the view: {'; '.join(findings[:4])}")
    if walked <= 0:
        return Verdict.error("control failed: the sandbox's /etc could not be walked: " + o.out[-300:])
    denied = sum(ln.startswith("DENIED") for ln in o.stdout.splitlines())
    return Verdict.contained(f"none of {len(secrets_)} host-only /etc files (e.g. {', '.join(list(secrets_)[:3])}) "
                             f"readable with host content; {denied} denied outright; none of the {walked} files "
                             f"of the view holds a private key or what a non-root host user cannot read")


@case("fs.host-accounts", "filesystem",
      "learn the host's accounts, groups and resolver from /etc/passwd, /etc/group, /etc/resolv.conf",
      weakened_by="host-etc")
def _(env: Env) -> Verdict:
    from agentvm.backends.hostview import VIEW_SYNTHETIC

    host_lines: dict[str, list[str]] = {}
    for name in ("passwd", "group", "resolv.conf", "nsswitch.conf"):
        try:
            lines = Path("/etc/" + name).read_text().splitlines()
        except OSError:
            continue
        synthetic = set(VIEW_SYNTHETIC.get(name, "").splitlines())
        host_lines[name] = [ln for ln in lines if ln.strip() and not ln.startswith("#") and ln not in synthetic]
    if not any(host_lines.values()):
        return Verdict.error("the host's account files are identical to the synthetic view: nothing to detect")
    o = env.sandbox("for f in passwd group resolv.conf nsswitch.conf; do echo \"== $f\"; cat /etc/$f; done; "
                    "getent passwd 0 1 2>/dev/null; ls /home 2>&1", egress=False)
    seen = [f"{name}: {ln[:60]}" for name, lines in host_lines.items() for ln in lines if ln in o.stdout]
    if seen:
        return Verdict.escaped(f"{len(seen)} host account/resolver lines visible, e.g. {seen[0]}")
    root_line = next((ln for ln in o.stdout.splitlines() if ln.startswith("root:")), "")
    return Verdict.contained(f"only the synthetic accounts are visible ({root_line}); "
                             f"{sum(len(v) for v in host_lines.values())} host lines absent")


@case("fs.etc-inventory", "filesystem",
      "list the host's /etc: installed services, users' tool configs, credentials stores",
      weakened_by="host-etc")
def _(env: Env) -> Verdict:
    from agentvm.backends.hostview import ETC_ALLOW, PER_SANDBOX_ETC, VIEW_SYNTHETIC, etc_refused, usr_linked_etc

    # the allowlist, and what the host's /usr points into /etc (in the view by design)
    view = {n.split("/")[0] for n in ETC_ALLOW + usr_linked_etc(None)} | set(PER_SANDBOX_ETC) | set(VIEW_SYNTHETIC)
    host_only = sorted(set(os.listdir("/etc")) - view)
    if not host_only:
        return Verdict.error("the host's /etc has nothing outside the view's allowlist")
    o = env.sandbox("ls -1a /etc; echo '== deep'; find /etc -mindepth 1 2>/dev/null", egress=False)
    top, _, deep = o.stdout.partition("== deep")
    listed = set(top.split())
    seen = [n for n in host_only if n in listed]
    # inside the folders /usr links to (and the allowlist's): no entry of a secret class
    # (settings.xml, *-site.xml, keys, key stores, ...) that the host has at that path
    refused = [p for p in deep.split("\n") if p.startswith("/etc/") and etc_refused(p[5:])
               and os.path.lexists(p) and p[5:] not in PER_SANDBOX_ETC and p[5:] not in VIEW_SYNTHETIC]
    if seen or refused:
        return Verdict.escaped(f"{len(seen)} of {len(host_only)} host-only /etc entries listed inside, e.g. {', '.join(seen[:8])}; "
                               f"{len(refused)} entries of a secret class, e.g. {', '.join(refused[:8])}")
    if not listed & view:
        return Verdict.error("control failed: /etc could not be listed: " + o.out[-300:])
    return Verdict.contained(f"/etc lists {len(listed) - 2} allowlisted entries; none of {len(host_only)} host-only ones "
                             f"(e.g. {', '.join(host_only[:5])})")


@case("fs.symlink-grant", "filesystem",
      "follow host-planted symlinks in a read-only grant to host /etc files, /root and the canary",
      weakened_by="host-etc")
def _(env: Env) -> Verdict:
    from agentvm.policy import MountGrant

    targets = dict(list(_host_etc_secrets(8).items()))
    for p in ("/root/.bashrc", "/root/.profile", str(env.canary_dir / "secret.txt")):
        try:
            targets[p] = _sha(Path(p).read_bytes())
        except OSError:
            pass
    if not targets:
        return Verdict.error("no host file to point a symlink at")
    g = Path(tempfile.mkdtemp(prefix="agentvm-selftest-links-", dir="/tmp"))
    try:
        os.chmod(g, 0o755)
        (g / "plain.txt").write_text("granted-content\n")
        os.chmod(g / "plain.txt", 0o644)
        expected: dict[str, str] = {}
        for i, (t, h) in enumerate(targets.items()):
            os.symlink(t, g / f"abs-{i}")
            os.symlink("../" * 10 + t.lstrip("/"), g / f"rel-{i}")
            expected[f"/g/abs-{i}"] = expected[f"/g/rel-{i}"] = h
            # positive control: on the host the link does lead to the file
            if _sha((g / f"abs-{i}").read_bytes()) != h:
                return Verdict.error(f"control failed: host symlink to {t} does not resolve")
        o = env.sandbox(HASH_FILES + "\nprint(open('/g/plain.txt').read().strip())\n", lang="python", egress=False,
                        mounts=(MountGrant(str(g), "/g", False),), env={"FILES": "\n".join(expected)})
    finally:
        shutil.rmtree(g, ignore_errors=True)
    if "granted-content" not in o.stdout:
        return Verdict.error("control failed: the grant itself was not readable: " + o.out[-300:])
    hits = _hash_hits(o.stdout, expected)
    if hits or _leaked(env, o):
        names = {f"/g/abs-{i}": t for i, t in enumerate(targets)} | {f"/g/rel-{i}": t for i, t in enumerate(targets)}
        return Verdict.escaped(f"{len(hits)} symlinks resolved to host content: "
                               + ", ".join(f"{h} -> {names.get(h)}" for h in hits[:4]))
    return Verdict.contained(f"{len(expected)} symlinks to {len(targets)} host files resolve only inside the view "
                             f"(no host content read)")


# ---------------------------------------------------------------------------- writes and nodes


@case("fs.dev-write", "filesystem", "create files, directories, symlinks and sockets in /dev (outside the writable set)",
      weakened_by="no-landlock")
def _(env: Env) -> Verdict:
    code = r"""
import os, errno, socket
def t(label, fn):
    try:
        fn(); print(label, "OK")
    except OSError as e:
        print(label, errno.errorcode.get(e.errno))
t("file", lambda: open("/dev/selftest-file", "w").write("x"))
t("mkdir", lambda: os.mkdir("/dev/selftest-dir"))
t("symlink", lambda: os.symlink("/tmp", "/dev/selftest-link"))
t("socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).bind("/dev/log"))
t("fifo", lambda: os.mkfifo("/dev/selftest-fifo"))
t("CONTROL_tmp", lambda: open("/tmp/ok", "w").write("x"))
"""
    o = env.sandbox(code, lang="python", egress=False)
    res = dict(ln.split(None, 1) for ln in o.stdout.splitlines() if " " in ln)
    if res.get("CONTROL_tmp") != "OK":
        return Verdict.error("control failed (writing /tmp): " + o.out[-300:])
    made = [k for k, v in res.items() if v == "OK" and not k.startswith("CONTROL")]
    if made:
        return Verdict.escaped(f"created in /dev: {', '.join(made)}")
    return Verdict.contained("/dev: " + ", ".join(f"{k} {v}" for k, v in res.items() if not k.startswith("CONTROL")))


@case("fs.mknod", "filesystem",
      "mknod character/block device nodes (mem, null, loop, and the capability-free 0:0 whiteout) in writable dirs",
      weakened_by="no-landlock+no-seccomp")
def _(env: Env) -> Verdict:
    code = r"""
import os, stat, errno
for d in ("/tmp", "/dev/shm", "/workspace", "/home/agent"):
    for kind, mode, dev in (("mem", stat.S_IFCHR, os.makedev(1, 1)), ("null", stat.S_IFCHR, os.makedev(1, 3)),
                            ("loop0", stat.S_IFBLK, os.makedev(7, 0)), ("whiteout", stat.S_IFCHR, os.makedev(0, 0))):
        p = f"{d}/node-{kind}"
        try:
            os.mknod(p, mode | 0o666, dev); st = os.lstat(p)
            print("CREATED", p, "char" if stat.S_ISCHR(st.st_mode) else "block", os.major(st.st_rdev), os.minor(st.st_rdev))
        except OSError as e:
            print("denied", p, errno.errorcode.get(e.errno))
os.mkfifo("/tmp/fifo"); print("CONTROL_fifo OK")
"""
    o = env.sandbox(code, lang="python", egress=False)
    if "CONTROL_fifo OK" not in o.stdout:
        return Verdict.error("control failed (mkfifo in /tmp): " + o.out[-300:])
    made = [ln[8:] for ln in o.stdout.splitlines() if ln.startswith("CREATED")]
    if made:
        return Verdict.escaped(f"{len(made)} device nodes created, e.g. {made[0]}")
    denied = [ln.split()[-1] for ln in o.stdout.splitlines() if ln.startswith("denied")]
    return Verdict.contained(f"{len(denied)} mknod attempts refused ({', '.join(sorted(set(denied)))})")


@case("fs.file-handles", "filesystem",
      "name_to_handle_at/open_by_handle_at: handles of host inodes (the 'shocker' container escape)",
      weakened_by="no-seccomp")
def _(env: Env) -> Verdict:
    from agentvm.selftest.cases.process import program

    code = program(r"""
class FH(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint), ("type", ctypes.c_int), ("h", ctypes.c_ubyte * 128)]
for p in (b"/etc/passwd", b"/usr/bin/python3"):
    fh = FH(); fh.bytes = 128; mid = ctypes.c_int()
    r = sc("name_to_handle_at", -100, p, ctypes.byref(fh), ctypes.byref(mid), 0)
    rep("name_to_handle_at:" + p.decode(), r)
    if r[0] == 0:
        print("handle", p.decode(), fh.type, bytes(fh.h[:fh.bytes]).hex())
        mfd = os.open(os.path.dirname(p), os.O_RDONLY)
        rr = sc("open_by_handle_at", mfd, ctypes.byref(fh), os.O_RDONLY)
        rep("open_by_handle_at:" + p.decode(), rr)
""")
    o = env.sandbox(code, lang="python", egress=False)
    handles = [ln for ln in o.stdout.splitlines() if ln.startswith("handle ")]
    opened = [ln.split()[0] for ln in o.stdout.splitlines() if ln.startswith("open_by_handle_at") and ln.endswith("OK")]
    if handles or opened:
        return Verdict.escaped(f"file handles of host inodes obtained: {handles[0][:120] if handles else ''}; "
                               f"opened by handle: {opened or 'no (needs CAP_DAC_READ_SEARCH)'}")
    lines = [ln for ln in o.stdout.splitlines() if ln.startswith("name_to_handle_at")]
    if not lines:
        return Verdict.error("the program did not run: " + o.out[-300:])
    return Verdict.contained("; ".join(lines))


# ---------------------------------------------------------------------------- state across sessions


@case("fs.tmp-across-sessions", "filesystem",
      "plant a file (and a symlink) in /tmp for the next session to find",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    tok = "TMP-PLANT-" + secrets.token_hex(8)
    env.sandbox(f"echo {tok} > /tmp/selftest-plant; ln -s /etc/passwd /tmp/selftest-link; echo done", egress=False)
    o = env.sandbox("cat /tmp/selftest-plant 2>&1; ls -la /tmp", egress=False)
    if tok in o.stdout:
        return Verdict.escaped(f"the next session read the planted /tmp file: {tok}")
    return Verdict.contained("the next session's /tmp is fresh: " + o.stdout.strip().replace("\n", " | ")[:200])


@case("fs.home-across-sessions", "filesystem",
      "plant ~/.profile, ~/.bashrc and a PATH-shadowing ~/.local/bin/ls for the next session",
      weakened_by="shared-state")
def _(env: Env) -> Verdict:
    tok = "HOME-PLANT-" + secrets.token_hex(8)
    plant = (f"echo 'echo {tok}' >> ~/.profile; echo 'echo {tok}' >> ~/.bashrc; mkdir -p ~/.local/bin; "
             f"printf '#!/bin/sh\\necho {tok}\\n' > ~/.local/bin/ls; chmod +x ~/.local/bin/ls; echo planted")
    env.sandbox(plant, egress=False)
    o = env.sandbox("cat ~/.profile ~/.bashrc ~/.local/bin/ls 2>&1; ls -la ~", egress=False)
    if tok in o.stdout:
        return Verdict.escaped(f"the next session's HOME still holds the planted dotfiles ({tok})")
    return Verdict.contained("the next session's HOME is fresh: " + o.stdout.strip().replace("\n", " | ")[:200])

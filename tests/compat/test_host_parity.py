"""Software that works on the host works the same inside the default sandbox - each test runs
the real program on the host (as an unprivileged user where privilege would change the answer)
and inside a real sandbox, and compares what the two print:

- Java: `javac`, `java A.java` and `java.security` (Debian keeps the JDK's configuration in
  /etc/java-*, reached through symlinks from /usr: the sandbox's /etc view holds what /usr
  points into /etc);
- POSIX message queues next to named semaphores and shm_open (the IPC namespace's mqueue
  filesystem has a Landlock rule);
- fakeroot, tar and chown to ids the sandbox does not map: EPERM, as for an unprivileged
  user on the host (not the kernel's EINVAL for an unmapped id);
- git in a read-write grant: the placeholders agent-vm makes for absent protected names
  (.envrc, .gitmodules, .mcp.json) are not untracked files, so `git add -A` does not commit them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

NOBODY = 65534


def _out(r) -> str:
    return r.stdout if isinstance(r.stdout, str) else r.stdout.decode(errors="replace")


def _ok(r) -> str:
    out, err = _out(r), r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    return out


def _host(script: str | list[str], *, user: int | None = None, cwd: str | None = None,
          env: dict | None = None) -> subprocess.CompletedProcess:
    """``script`` by /bin/sh (or an argv) on the host; as ``user`` (uid = gid, no groups) when given."""
    pre = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    argv = ["/bin/sh", "-c", script] if isinstance(script, str) else list(script)
    e = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd or "/tmp", **(env or {})}
    return subprocess.run(pre + argv, capture_output=True, text=True, timeout=300, cwd=cwd or "/", env=e)


@pytest.fixture
def host_dir():
    """A scratch directory for the host side, owned by the unprivileged user (removed after)."""
    import secrets

    d = Path(f"/tmp/agentvm-parity-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    os.chown(d, NOBODY, NOBODY)
    try:
        yield str(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------- Java

JAVA = textwrap.dedent("""
    set -e
    cd "$WORK"
    cat > A.java <<'EOF'
    import java.security.MessageDigest;
    import java.security.Security;
    public class A {
        public static void main(String[] args) throws Exception {
            byte[] d = MessageDigest.getInstance("SHA-256").digest("agent-vm".getBytes("UTF-8"));
            StringBuilder sb = new StringBuilder();
            for (byte b : d) sb.append(String.format("%02x", b));
            System.out.println("sha256 " + sb);
            System.out.println("securerandom " + Security.getProperty("securerandom.source"));
            System.out.println("providers " + Security.getProviders().length);
            // TLS: the default trust store (lib/security/cacerts -> /etc/ssl/certs/java/cacerts)
            javax.net.ssl.TrustManagerFactory tmf = javax.net.ssl.TrustManagerFactory.getInstance(
                javax.net.ssl.TrustManagerFactory.getDefaultAlgorithm());
            tmf.init((java.security.KeyStore) null);
            int anchors = 0;
            for (javax.net.ssl.TrustManager tm : tmf.getTrustManagers())
                if (tm instanceof javax.net.ssl.X509TrustManager) anchors += ((javax.net.ssl.X509TrustManager) tm).getAcceptedIssuers().length;
            System.out.println("trust-anchors " + anchors);
            System.out.println("tls-context " + javax.net.ssl.SSLContext.getDefault().getProtocol());
        }
    }
    EOF
    java A.java > launcher.out
    sed 's/^/source-launcher: /' launcher.out
    mkdir -p out && javac -d out A.java && java -cp out A > javac.out
    sed 's/^/javac: /' javac.out
    java -XshowSettings:properties -version > settings.out 2>&1
    grep -E '^ *java\\.(home|vm\\.name) ' settings.out | sed 's/^ */settings: /'
""")


def test_javac_java_source_launcher_and_java_security(sh, host_dir):
    if shutil.which("javac") is None:
        pytest.fail("no JDK on this host: install default-jdk-headless (scripts/install.sh --test does)")
    host = _ok(_host(JAVA.replace('"$WORK"', host_dir), user=NOBODY, cwd=host_dir))
    assert "source-launcher: sha256 " in host and "javac: providers " in host, host
    assert "javac: trust-anchors 0" not in host and "javac: trust-anchors " in host, host
    inside = _ok(sh(JAVA.replace('"$WORK"', "/tmp"), "--memory", "2G", timeout=300))
    assert inside == host


# ---------------------------------------------------------------------------- POSIX IPC

IPC = textwrap.dedent("""
    import ctypes, mmap, os, sys
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    pt = ctypes.CDLL("libc.so.6", use_errno=True)
    def err(what):
        print(what, "FAILED", os.strerror(ctypes.get_errno())); sys.exit(1)
    name = b"/agentvm-parity-%d" % os.getpid()
    # a message queue: create, send with priorities, receive in priority order, attributes, unlink
    class Attr(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
    rt.mq_open.restype = ctypes.c_int
    q = rt.mq_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, ctypes.byref(Attr(0, 4, 64, 0)))
    if q < 0: err("mq_open")
    for prio, msg in ((1, b"low"), (7, b"high"), (3, b"mid")):
        if rt.mq_send(q, msg, len(msg), prio) != 0: err("mq_send")
    a = Attr(); rt.mq_getattr(q, ctypes.byref(a)); print("mq attr", a.maxmsg, a.msgsize, a.curmsgs)
    buf, prio = ctypes.create_string_buffer(64), ctypes.c_uint()
    got = []
    for _ in range(3):
        n = rt.mq_receive(q, buf, 64, ctypes.byref(prio))
        if n < 0: err("mq_receive")
        got.append("%s:%d" % (buf.raw[:n].decode(), prio.value))
    print("mq received", " ".join(got))
    q2 = rt.mq_open(name, os.O_RDONLY)  # opened again by name
    print("mq reopen", q2 >= 0)
    if rt.mq_unlink(name) != 0: err("mq_unlink")
    print("mq unlinked", rt.mq_open(name, os.O_RDONLY) < 0 and ctypes.get_errno() == 2)
    # a named semaphore and shm_open, for comparison
    pt.sem_open.restype = ctypes.c_void_p
    s = pt.sem_open(name, os.O_CREAT, 0o600, 2)
    if not s or s == ctypes.c_void_p(-1).value: err("sem_open")
    pt.sem_wait(ctypes.c_void_p(s)); v = ctypes.c_int(); pt.sem_getvalue(ctypes.c_void_p(s), ctypes.byref(v))
    print("sem value", v.value, "unlink", pt.sem_unlink(name))
    fd = rt.shm_open(name, os.O_CREAT | os.O_RDWR, 0o600)
    if fd < 0: err("shm_open")
    os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); m[:5] = b"hello"
    print("shm", bytes(mmap.mmap(rt.shm_open(name, os.O_RDONLY, 0), 4096, prot=mmap.PROT_READ)[:5]).decode(), "unlink", rt.shm_unlink(name))
""")


def test_posix_message_queues_semaphores_and_shm(py):
    host = _ok(_host(["/usr/bin/python3", "-c", IPC], user=NOBODY))
    assert "mq received high:7 mid:3 low:1" in host, host
    assert _ok(py(IPC)) == host


# ---------------------------------------------------------------------------- chown / fakeroot

CHOWN = textwrap.dedent("""
    cd "$WORK"
    mkdir -p d/sub && echo x > d/f && echo y > d/sub/g
    # fakeroot: chown to any id, remembered for tar; the real chown underneath is refused (EPERM)
    fakeroot sh -c 'chown 0:0 d/f && chown -R 123:456 d/sub && tar --sort=name --mtime=@0 -cf t.tar d && tar --numeric-owner -tvf t.tar' \\
      | awk '{print "fakeroot:", $1, $2, $6}'
    # tar extracting as an unprivileged user: keeps going (chown fails with EPERM, which tar tolerates)
    mkdir -p x && tar -xf t.tar -C x && echo "tar -x: $?" && ls x/d | sed 's/^/extracted: /'
    # tools that tolerate EPERM only: cp -p and a plain chown
    cp -p t.tar t2.tar && echo "cp -p: ok"
    python3 -c '
import errno, os
for args in ((0, 0), (0, -1), (-1, 0), (12345, -1), (-1, -1), (os.getuid(), os.getgid()), (os.getuid(), -1)):
    who = ["me" if a == os.getuid() else a for a in args]
    for fn, target in ((os.chown, "d/f"), (os.lchown, "d/f"), (lambda p, u, g: os.chown(p, u, g, dir_fd=os.open(".", os.O_RDONLY)), "d/f")):
        try:
            fn(target, *args); res = "ok"
        except OSError as e:
            res = errno.errorcode[e.errno]
        print("chown", *who, res)
fd = os.open("d/f", os.O_RDONLY)
for args in ((0, 0), (-1, -1)):
    try:
        os.fchown(fd, *args); print("fchown", *args, "ok")
    except OSError as e:
        print("fchown", *args, errno.errorcode[e.errno])
'
""")


def test_fakeroot_tar_and_chown_to_unmapped_ids_get_eperm(sh, host_dir):
    if shutil.which("fakeroot") is None:
        pytest.fail("fakeroot is not installed: scripts/install.sh --test installs it")
    host = _ok(_host(CHOWN.replace('"$WORK"', host_dir), user=NOBODY, cwd=host_dir))
    assert "fakeroot: -rw-r--r-- 0/0" in host and "chown 0 0 EPERM" in host and "chown -1 -1 ok" in host, host
    inside = _ok(sh(CHOWN.replace('"$WORK"', "/tmp")))
    assert inside == host


# ---------------------------------------------------------------------------- git in a rw grant

GIT = textwrap.dedent("""
    set -e
    cd "$REPO"
    git() { command git -c user.email=agent@example.com -c user.name=agent -c safe.directory='*' "$@"; }
    echo "status before:"; git status --porcelain --untracked-files=all
    echo change >> README && echo new > notes.txt && mkdir -p sub && echo s > sub/.envrc
    echo "status after edits:"; git status --porcelain --untracked-files=all
    git add -A && git commit -q -m "agent work"
    echo "committed:"; git show --name-status --format= HEAD
    echo "clean after commit:"; git status --porcelain --untracked-files=all
    git ls-files | sed 's/^/tracked: /'
""")

USER_EXCLUDES = textwrap.dedent("""
    set -e
    cd "$REPO"
    echo junk > build.log
    printf '*.log\\n' > "$HOME/my-ignore"
    git -c safe.directory='*' config --global core.excludesFile "$HOME/my-ignore"
    echo "with the user's own excludes file:"; git -c safe.directory='*' status --porcelain --untracked-files=all | grep -v '^?? \\.' || true
    rm build.log
""")


def _repo(d: Path, owner: int) -> Path:
    d.mkdir()
    (d / "README").write_text("hello\n")
    (d / "src").mkdir()
    (d / "src" / "main.py").write_text("print('hi')\n")
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(d.parent)}
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"],
                ["-c", "user.email=a@example.com", "-c", "user.name=a", "commit", "-q", "-m", "init"]):
        subprocess.run(["git", "-C", str(d), *cmd], check=True, env=env, capture_output=True)
    subprocess.run(["chown", "-R", f"{owner}:{owner}", str(d)], check=True)
    return d


def test_git_in_a_rw_grant_does_not_see_agentvms_placeholders(agentvm, grant_dir, host_dir):
    """The same repository on the host and in a read-write grant (the agent may commit): git
    status, git add -A and the commit are the same; the host's repository is clean afterwards."""
    host_repo = _repo(Path(host_dir) / "repo", NOBODY)
    host = _ok(_host(GIT.replace('"$REPO"', str(host_repo)), user=NOBODY, cwd=host_dir))
    assert "A\tnotes.txt" in host and ".mcp.json" not in host, host

    grant = _repo(grant_dir(0o755) / "repo", NOBODY)
    spec = (f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: gitparity}}\nspec:\n  command: [/bin/true]\n"
            f"  mounts:\n    - {{host: {grant}, path: /src, mode: rw, writableTrusted: [.git]}}\n")
    f = Path(host_dir) / "gitparity.yaml"
    f.write_text(spec)
    r = agentvm("run", "-f", str(f), "--", "/bin/sh", "-c", GIT.replace('"$REPO"', "/src"))
    assert _ok(r) == host
    after = subprocess.run(["git", "-c", f"safe.directory={grant}", "-C", str(grant), "status", "--porcelain",
                            "--untracked-files=all"], capture_output=True, text=True)
    assert after.stdout == "", "the host's repository shows what the agent committed, nothing deleted: " + after.stdout

    # read-only .git (the default): status is the same as on the host too
    r = agentvm("run", "--mount", f"{grant}:/src:rw", "--", "/bin/sh", "-c",
                "cd /src && git -c safe.directory='*' status --porcelain --untracked-files=all && echo STATUS-DONE")
    assert _ok(r) == "STATUS-DONE\n"

    # a core.excludesFile of the user's own replaces git's default file, as git documents: it
    # works inside as on the host (the placeholders are then the user's to list, see compatibility.md)
    host = _ok(_host(USER_EXCLUDES.replace('"$REPO"', str(host_repo)), user=NOBODY, cwd=host_dir))
    r = agentvm("run", "-f", str(f), "--", "/bin/sh", "-c", USER_EXCLUDES.replace('"$REPO"', "/src"))
    assert _ok(r) == host == "with the user's own excludes file:\n"

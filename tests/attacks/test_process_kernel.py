"""Process and kernel attack surface: namespaces, ptrace, the seccomp deny list (driven from
agentvm.seccomp so it stays in sync), 32-bit syscalls, terminal injection, device nodes,
signals to the host and host abstract unix sockets."""

from __future__ import annotations

import errno
import os
import secrets
import signal
import socket
import subprocess

import pytest

from _attacklib import dump, needs_root, parse_table

import agentvm.seccomp as sc

pytestmark = [pytest.mark.attack, needs_root]

# Harmless arguments per syscall: chosen so that, WITHOUT the filter, the call would return
# something other than EPERM where possible (0 / EINVAL / EFAULT / EBADF / ENOSYS), which makes
# an EPERM answer evidence of the filter rather than of missing capabilities.
SPECIAL_ARGS = {
    "unshare": "0",  # a no-op unshare(0) succeeds unfiltered
    "setns": "-1, 0",  # EBADF unfiltered
    "ptrace": "3 /*PTRACE_PEEKUSER*/, 999999, 0, 0",  # ESRCH unfiltered
    "kcmp": "getpid(), getpid(), 0 /*KCMP_FILE*/, 0, 0",  # 0 unfiltered
    "process_vm_readv": "getpid(), 0, 0, 0, 0, 0",  # 0 unfiltered
    "process_vm_writev": "getpid(), 0, 0, 0, 0, 0",
    "pidfd_getfd": "-1, 0, 0",  # EBADF unfiltered
    "userfaultfd": "1 /*UFFD_USER_MODE_ONLY*/",  # a new fd unfiltered
    "io_uring_setup": "1, &uring_params",  # a new ring unfiltered
    "io_uring_enter": "-1, 0, 0, 0, 0, 0",
    "io_uring_register": "-1, 0, 0, 0",
    "keyctl": "0 /*KEYCTL_GET_KEYRING_ID*/, -3 /*KEY_SPEC_SESSION_KEYRING*/, 0",
    "add_key": "\"user\", \"agentvm-test\", \"x\", 1, -3",
    "request_key": "\"user\", \"agentvm-test\", 0, 0",
    "bpf": "0 /*BPF_MAP_CREATE*/, 0, 0",
    "perf_event_open": "0, 0, -1, -1, 0",
    "iopl": "0",  # a no-op unfiltered
    "ioperm": "0, 0, 0",
    "settimeofday": "0, 0",  # a no-op unfiltered
    "syslog": "10 /*SYSLOG_ACTION_SIZE_BUFFER*/, 0, 0",
    "reboot": "0, 0, 0, 0",  # bad magic: EINVAL/EPERM
    "open_tree": "-100 /*AT_FDCWD*/, \"/tmp\", 1 /*OPEN_TREE_CLONE*/",
    "fsopen": "\"tmpfs\", 0",
    "fspick": "-100, \"/tmp\", 0",
    "chroot": "\"/tmp\"",
    "pivot_root": "\"/tmp\", \"/tmp\"",
    "mount": "\"none\", \"/tmp\", \"tmpfs\", 0, 0",
    "umount2": "\"/tmp\", 2 /*MNT_DETACH*/",
    "name_to_handle_at": "-100, \"/tmp\", 0, 0, 0",
    "open_by_handle_at": "-1, 0, 0",
    "sethostname": "\"pwned\", 5",
    "setdomainname": "\"pwned\", 5",
}

CALL_ALL = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
static unsigned char uring_params[120];
static void one(const char *name, long nr, long rc) {
    printf("%s %ld %ld %s\n", name, nr, rc, rc == -1 ? strerrorname_np(errno) : "OK");
}
int main(int argc, char **argv) {
    const char *only = argc > 1 ? argv[1] : NULL;
    /* controls: an allowed syscall works and an allowed one with bad args is not EPERM */
    one("CONTROL_getpid", SYS_getpid, syscall(SYS_getpid) > 0 ? 0 : -1);
    one("CONTROL_close_bad_fd", SYS_close, syscall(SYS_close, -1));
    fflush(stdout);
@CALLS@
    return 0;
}
"""


def call_all_source(names: list[str]) -> str:
    calls = []
    for n in names:
        args = SPECIAL_ARGS.get(n, "0, 0, 0, 0, 0, 0")
        calls.append(
            f"#ifdef SYS_{n}\n"
            f'    if (!only || !strcmp(only, "{n}")) {{ errno = 0; long rc = syscall(SYS_{n}, {args}); one("{n}", SYS_{n}, rc); fflush(stdout); }}\n'
            f"#else\n"
            f'    if (!only || !strcmp(only, "{n}")) printf("{n} ABSENT\\n");\n'
            f"#endif"
        )
    return CALL_ALL.replace("@CALLS@", "\n".join(calls))


ALL_DENIED = sorted({n for g in sc.DENY_GROUPS.values() for n in g} | set(sc.DEBUG_GROUP))


@pytest.fixture(scope="module")
def syscalls_bin(cbin):
    return cbin("syscalls", call_all_source(ALL_DENIED))




def test_every_denied_syscall_returns_eperm(agentvm, syscalls_bin):
    """Every name in seccomp.DENY_GROUPS + DEBUG_GROUP answers EPERM (the list is read from the
    module, so a syscall added there is covered here)."""
    r = agentvm("run", *syscalls_bin, "--", "/attack/syscalls")
    out = r.stdout.decode(errors="replace")
    res = parse_table(out)
    assert res.get("CONTROL_getpid", [None, None, None])[2] == "OK", dump(r)
    assert res["CONTROL_close_bad_fd"][2] == "EBADF", dump(r)
    tested, wrong = [], []
    for n in ALL_DENIED:
        v = res.get(n)
        assert v is not None, f"{n}: no result (the program died before it?)" + dump(r)
        if v[0] == "ABSENT":
            continue
        tested.append(n)
        if not (v[1] == "-1" and v[2] == "EPERM"):
            wrong.append(f"{n}: rc={v[1]} {v[2]}")
    assert not wrong, "denied syscalls NOT answering EPERM: " + ", ".join(wrong) + dump(r)
    assert len(tested) >= 50, f"only {len(tested)} syscalls tested" + dump(r)
    assert r.returncode == 0, dump(r)


@pytest.mark.parametrize(
    "name",
    ["io_uring_setup", "bpf", "perf_event_open", "keyctl", "add_key", "userfaultfd", "kexec_load", "init_module",
     "pivot_root", "setns", "unshare", "open_tree", "fsopen", "chroot", "ptrace", "process_vm_readv"],
)
def test_specific_syscall_denied(agentvm, syscalls_bin, name):
    r = agentvm("run", *syscalls_bin, "--", "/attack/syscalls", name)
    res = parse_table(r.stdout.decode(errors="replace"))
    assert res[name][0] != "ABSENT"
    assert res[name][1:] == ["-1", "EPERM"], f"{name}: {res[name]}" + dump(r)


# ---------------------------------------------------------------------------------- namespaces


def test_unshare_user_namespace_fails(sh):
    r = sh("which unshare; unshare -U true; echo U=$?; unshare -r id; echo r=$?; unshare -m true; echo m=$?; "
           "unshare -n true; echo n=$?; unshare -p -f true; echo p=$?")
    assert "/usr/bin/unshare" in r.stdout, dump(r)  # the tool exists: the kernel said no
    for k in ("U", "r", "m", "n", "p"):
        assert f"{k}=0" not in r.stdout, f"unshare -{k} succeeded" + dump(r)
    assert "uid=0" not in r.stdout, dump(r)


OS_UNSHARE = r"""
import ctypes, errno, os
# os.unshare exists from Python 3.12; Debian 12's python3 is 3.11: call libc directly
libc = ctypes.CDLL(None, use_errno=True)
FLAGS = {"CLONE_NEWUSER": 0x10000000, "CLONE_NEWNS": 0x00020000, "CLONE_NEWNET": 0x40000000,
         "CLONE_NEWPID": 0x20000000, "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000,
         "CLONE_NEWCGROUP": 0x02000000}
for name, flag in FLAGS.items():
    if hasattr(os, "unshare"):
        try:
            os.unshare(flag); print(name, "OK")
        except OSError as e:
            print(name, errno.errorcode[e.errno])
    else:
        rc = libc.unshare(flag)
        print(name, "OK" if rc == 0 else errno.errorcode[ctypes.get_errno()])
"""


def test_os_unshare_fails(py):
    r = py(OS_UNSHARE)
    assert r.returncode == 0, dump(r)
    res = parse_table(r.stdout)
    assert len(res) == 7, dump(r)
    for k, v in res.items():
        assert v == ["EPERM"], f"{k}: {v}" + dump(r)


CLONE_NS = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
static void try(const char *name, unsigned long flags) {
    long rc = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
    if (rc == 0) _exit(42);
    if (rc > 0) { int st; waitpid(rc, &st, 0); printf("%s CLONED\n", name); return; }
    printf("%s %s\n", name, strerrorname_np(errno));
}
int main(void) {
    try("NEWUSER", CLONE_NEWUSER);
    try("NEWNS", CLONE_NEWNS);
    try("NEWNET", CLONE_NEWNET);
    try("NEWPID", CLONE_NEWPID);
    try("NEWUSER_NEWNS", CLONE_NEWUSER | CLONE_NEWNS);
    try("NEWTIME", 0x80);
    try("PLAIN", 0); /* control: a plain fork works */
    struct { unsigned long long flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls; } a = {0};
    a.flags = CLONE_NEWUSER; a.exit_signal = SIGCHLD;
    long rc = syscall(SYS_clone3, &a, sizeof a);
    if (rc == 0) _exit(0);
    printf("CLONE3 %s\n", rc > 0 ? "CLONED" : strerrorname_np(errno));
    return 0;
}
"""


def test_clone_newuser_fails(agentvm, cbin):
    r = agentvm("run", *cbin("clone_ns", CLONE_NS), "--", "/attack/clone_ns")
    res = parse_table(r.stdout.decode())
    assert res.get("PLAIN") == ["CLONED"], dump(r)
    for k in ("NEWUSER", "NEWNS", "NEWNET", "NEWPID", "NEWUSER_NEWNS", "NEWTIME"):
        assert res.get(k) == ["EPERM"], f"clone({k}): {res.get(k)}" + dump(r)
    assert res.get("CLONE3") in (["ENOSYS"], ["EPERM"]), dump(r)


# ---------------------------------------------------------------------------------- ptrace


PTRACE = r"""
import ctypes, errno, os, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_SEIZE, PTRACE_DETACH = 16, 0x4206, 17
sib = subprocess.Popen(["/usr/bin/sleep", "30"])
time.sleep(0.05)
def attach(pid, req, name):
    rc = libc.ptrace(ctypes.c_long(req), ctypes.c_long(pid), None, None)
    print(name, "OK" if rc == 0 else errno.errorcode.get(ctypes.get_errno()))
    if rc == 0:
        libc.ptrace(ctypes.c_long(PTRACE_DETACH), ctypes.c_long(pid), None, None)
attach(1, PTRACE_ATTACH, "attach_pid1")
attach(sib.pid, PTRACE_ATTACH, "attach_sibling")
attach(sib.pid, PTRACE_SEIZE, "seize_sibling")
attach(os.getppid(), PTRACE_ATTACH, "attach_parent")
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(64)
local = iovec(ctypes.cast(buf, ctypes.c_void_p), 64)
remote = iovec(0x400000, 64)
rc = libc.process_vm_readv(sib.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print("vm_readv_sibling", "OK" if rc >= 0 else errno.errorcode.get(ctypes.get_errno()))
rc = libc.process_vm_readv(1, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print("vm_readv_pid1", "OK" if rc >= 0 else errno.errorcode.get(ctypes.get_errno()))
for f in ("mem", "environ"):
    try:
        open(f"/proc/1/{f}", "rb").read(16); print("read_pid1_" + f, "OK")
    except OSError as e:
        print("read_pid1_" + f, errno.errorcode[e.errno])
sib.kill(); sib.wait()
"""


def test_ptrace_and_process_vm_readv_fail(py):
    r = py(PTRACE)
    assert r.returncode == 0, dump(r)
    res = parse_table(r.stdout)
    for k in ("attach_pid1", "attach_sibling", "seize_sibling", "attach_parent", "vm_readv_sibling", "vm_readv_pid1"):
        assert res.get(k) == ["EPERM"], f"{k}: {res.get(k)}" + dump(r)
    for k in ("read_pid1_mem",):
        assert res.get(k) != ["OK"], dump(r)


# ---------------------------------------------------------------------------------- 32-bit ABI


INT80 = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    printf("before\n"); fflush(stdout);
    long ret;
    /* i386 getpid (20) through the 32-bit entry point */
    __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(20L) : "memory");
    printf("SURVIVED %ld\n", ret); fflush(stdout);
    /* i386 setuid(0) (23), just to be sure nothing 32-bit is ever served */
    __asm__ volatile ("int $0x80" : "=a"(ret) : "a"(23L), "b"(0L) : "memory");
    printf("SURVIVED2 %ld\n", ret);
    return 0;
}
"""


def test_int80_32bit_syscall_is_killed(avm_json, cbin):
    r, res = avm_json("run", *cbin("int80", INT80), "--", "/attack/int80")
    assert "before" in r.stdout, dump(r)
    assert "SURVIVED" not in r.stdout, "a 32-bit int $0x80 syscall was served" + dump(r)
    assert r.returncode == 128 + signal.SIGSYS, dump(r)  # 159
    assert res["exit_code"] == 159 and res["teardown_verified"], res


def test_int80_via_shell_reports_sigsys(sh, cbin):
    # control through a shell: the child is killed by SIGSYS and the shell sees 128+31
    r = sh("/attack/int80; echo rc=$?", *cbin("int80", INT80))
    assert "rc=159" in r.stdout and "SURVIVED" not in r.stdout, dump(r)


# ---------------------------------------------------------------------------------- tty / devices


TIOCSTI = r"""
import ctypes, errno, fcntl, os, termios, pty
libc = ctypes.CDLL(None, use_errno=True)
m, s = pty.openpty()
for fd, name in ((s, "pty_slave"), (m, "pty_master"), (0, "stdin"), (1, "stdout")):
    c = ctypes.c_char(b"x")
    rc = libc.ioctl(fd, ctypes.c_ulong(0x5412), ctypes.byref(c))
    print("TIOCSTI_" + name, "OK" if rc == 0 else errno.errorcode.get(ctypes.get_errno()))
    rc = libc.ioctl(fd, ctypes.c_ulong(0x541C), ctypes.byref(ctypes.c_char(b"\x06")))
    print("TIOCLINUX_" + name, "OK" if rc == 0 else errno.errorcode.get(ctypes.get_errno()))
try:
    fd = os.open("/dev/tty", os.O_RDWR); print("DEVTTY OPENED")
except OSError as e:
    print("DEVTTY", errno.errorcode[e.errno])
# control: an ordinary tty ioctl on the pty works
rc = libc.ioctl(s, ctypes.c_ulong(termios.TIOCGWINSZ), ctypes.create_string_buffer(8))
print("CONTROL_TIOCGWINSZ", "OK" if rc == 0 else errno.errorcode.get(ctypes.get_errno()))
"""


def test_tiocsti_injection_fails(py):
    r = py(TIOCSTI)
    assert r.returncode == 0, dump(r)
    res = parse_table(r.stdout)
    assert res.get("CONTROL_TIOCGWINSZ") == ["OK"], dump(r)
    for fd in ("pty_slave", "pty_master", "stdin", "stdout"):
        assert res.get("TIOCSTI_" + fd) == ["EPERM"], f"TIOCSTI on {fd}: {res.get('TIOCSTI_' + fd)}" + dump(r)
        assert res.get("TIOCLINUX_" + fd) == ["EPERM"], dump(r)


MKNOD = r"""
import os, stat, errno
for path in ("/tmp/mem", "/dev/shm/kmsg", "/workspace/sda", "/home/agent/null"):
    for kind, mode, dev in (("chr_mem", stat.S_IFCHR, os.makedev(1, 1)), ("chr_null", stat.S_IFCHR, os.makedev(1, 3)),
                            ("blk_vda", stat.S_IFBLK, os.makedev(253, 0))):
        p = f"{path}-{kind}"
        try:
            os.mknod(p, mode | 0o666, dev); print(p, "CREATED")
        except OSError as e:
            print(p, errno.errorcode[e.errno])
os.mkfifo("/tmp/fifo"); print("CONTROL_fifo OK")
"""


def test_mknod_device_fails(py):
    r = py(MKNOD)
    assert r.returncode == 0, dump(r)
    assert "CONTROL_fifo OK" in r.stdout, dump(r)
    assert "CREATED" not in r.stdout, "a device node was created" + dump(r)
    assert r.stdout.count("EPERM") + r.stdout.count("EACCES") == 12, dump(r)


# ---------------------------------------------------------------------------------- signals


def test_kill_minus_one_does_not_reach_host(agentvm):
    sleeper = subprocess.Popen(["sleep", "60"])
    # a host process of an unrelated unprivileged uid too (the sandbox's uid range neighbour)
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    try:
        r = agentvm(
            "run", "--", "/usr/bin/python3", "-c",
            "import os, signal, errno\n"
            "for sig in (signal.SIGKILL, signal.SIGTERM):\n"
            "    try:\n"
            "        os.kill(-1, sig); print('kill-1 sent', sig)\n"
            "    except OSError as e: print('kill-1', errno.errorcode[e.errno])\n"
            f"for pid in ({sleeper.pid}, {other.pid}, 1):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL); print('KILLED', pid)\n"
            "    except OSError as e: print('kill', pid, errno.errorcode[e.errno])\n",
        )
        assert sleeper.poll() is None, "host sleeper was killed from inside the sandbox" + dump(r)
        assert other.poll() is None, "host process of another uid was killed" + dump(r)
        assert b"KILLED" not in r.stdout.replace(b"KILLED 1\n", b""), dump(r)
    finally:
        for p in (sleeper, other):
            p.kill()
            p.wait()


def test_host_abstract_unix_socket_unreachable(py):
    name = f"agentvm-canary-{secrets.token_hex(6)}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(8)
    srv.setblocking(False)
    dsrv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dsrv.bind("\0" + name + "-dgram")
    dsrv.setblocking(False)
    try:
        # positive control: the listener is reachable from the host
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect("\0" + name)
        conn, _ = srv.accept()
        conn.close()
        c.close()
        code = (
            "import socket, errno\n"
            f"n = {name!r}\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "try:\n"
            "    s.connect('\\0' + n); print('CONNECTED'); s.send(b'pwn')\n"
            "except OSError as e: print('stream', errno.errorcode[e.errno])\n"
            "d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "try:\n"
            "    d.sendto(b'pwn', '\\0' + n + '-dgram'); print('SENT')\n"
            "except OSError as e: print('dgram', errno.errorcode[e.errno])\n"
            # control inside: an abstract socket of the sandbox's own works
            "a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); a.bind('\\0inner'); a.listen(1)\n"
            "b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); b.connect('\\0inner'); print('CONTROL_inner OK')\n"
        )
        r = py(code)
        assert "CONTROL_inner OK" in r.stdout, dump(r)
        assert "CONNECTED" not in r.stdout and "SENT" not in r.stdout, dump(r)
        with pytest.raises(BlockingIOError):
            srv.accept()
        with pytest.raises(BlockingIOError):
            dsrv.recv(64)
    finally:
        srv.close()
        dsrv.close()

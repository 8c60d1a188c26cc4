"""Identity (uids, capabilities, no_new_privs, seccomp, Landlock), workspace durability and
isolation between runs, and the environment the sandbox receives."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from _attacklib import body, dump, last_json, needs_root, token

pytestmark = [pytest.mark.attack, needs_root]


def _uid_base() -> int:
    return int(os.environ["AGENTVM_UID_BASE"])


# ---------------------------------------------------------------------------------- identity


def test_uid_is_1000_and_maps_to_dedicated_host_uid(avm_home):
    marker = f"uidprobe-{secrets.token_hex(4)}"
    script = f"id -u; id -g; cat /proc/self/uid_map; cat /proc/self/gid_map; echo ready; read x # {marker}"
    p = subprocess.Popen(
        [sys.executable, "-m", "agentvm", "run", "--json", "--", "/bin/sh", "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ),
    )
    inside = []
    host_view = {}
    try:
        while True:
            ln = p.stdout.readline().decode()
            assert ln, p.stderr.read1(4000)
            if ln.strip() == "ready":
                break
            inside.append(ln.split())
        # the host's view of the sandboxed shell: find it by the marker in its argv
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if argv[0] == b"/bin/sh" and any(marker.encode() in a for a in argv):
                status = open(f"/proc/{pid}/status").read()
                host_view = {
                    "uids": [int(x) for x in next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1:]],
                    "gids": [int(x) for x in next(l for l in status.splitlines() if l.startswith("Gid:")).split()[1:]],
                    "uid_map": open(f"/proc/{pid}/uid_map").read().split(),
                }
                break
        out, err = p.communicate(b"\n", timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    res = last_json(out)
    host_uid = res["host_uid"]
    assert inside[0] == ["1000"] and inside[1] == ["1000"], inside
    # inside: exactly one uid (1000) is mapped; no other uid - in particular no root - exists
    assert len(inside[2]) == 3 and inside[2][0] == "1000" and inside[2][2] == "1", inside
    assert len(inside[3]) == 3 and inside[3][0] == "1000" and inside[3][2] == "1", inside
    assert host_view, "sandboxed shell not found on the host"
    assert host_uid >= _uid_base() and host_uid != 0, res
    assert host_view["uids"] == [host_uid] * 4, host_view
    assert host_view["gids"][0] != 0, host_view
    # read from the initial namespace, the map shows where 1000 really lands on the host
    assert host_view["uid_map"] == ["1000", str(host_uid), "1"], host_view
    assert res["teardown_verified"] is True


def test_file_in_rw_grant_owned_by_the_folders_owner(avm_json, grant_dir):
    """Idmapped grant: whatever the agent creates lands owned by the folder's owner (here an
    ordinary user), never by root, never by the run's throwaway uid."""
    g = grant_dir(0o755)
    os.chown(g, 4243, 4243)
    r, res = avm_json("run", "--mount", f"{g}:/g:rw", "--", "/bin/sh", "-c",
                      "echo hi > /g/made-inside; mkdir /g/dir-inside; ln -s /etc/shadow /g/link; "
                      "stat -c '%u %g' /g/made-inside")
    assert r.returncode == 0, dump(r)
    assert body(r.stdout).strip() == "1000 1000", dump(r)
    for name in ("made-inside", "dir-inside", "link"):
        st = os.lstat(g / name)
        assert (st.st_uid, st.st_gid) == (4243, 4243), (name, st.st_uid, st.st_gid, res["host_uid"])


def test_no_capabilities_no_new_privs_seccomp_filter(sh):
    r = sh("grep -E '^(Cap|NoNewPrivs|Seccomp)' /proc/self/status")
    assert r.returncode == 0, dump(r)
    st = dict(ln.split(":\t") for ln in r.stdout.strip().splitlines())
    for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[k], 16) == 0, f"{k}={st[k]}" + dump(r)
    assert st["NoNewPrivs"].strip() == "1", dump(r)
    assert st["Seccomp"].strip() == "2", dump(r)


SUID_PROBE = r"""
#include <stdio.h>
#include <unistd.h>
#include <fcntl.h>
int main(void) {
    printf("ruid=%d euid=%d\n", getuid(), geteuid());
    int fd = open("/etc/shadow", O_RDONLY);
    printf("shadow=%s\n", fd >= 0 ? "OPENED" : "denied");
    if (setuid(0) == 0) printf("SETUID0\n");
    return 0;
}
"""


def test_setuid_root_binary_in_grant_gives_nothing(sh, cbin, bin_dir, grant_dir):
    cbin("suid_probe", SUID_PROBE)
    g = grant_dir(0o755)
    dst = g / "suid_probe"
    dst.write_bytes((bin_dir / "suid_probe").read_bytes())
    os.chown(dst, 0, 0)
    os.chmod(dst, 0o4755)
    # positive control: on the host, an unprivileged user running it does become root
    ctl = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(dst)],
                         capture_output=True, text=True)
    assert "euid=0" in ctl.stdout, ctl
    r = sh("/g/suid_probe; ls -ln /g/suid_probe", "--mount", f"{g}:/g:ro")
    assert "euid=1000" in r.stdout, dump(r)
    assert "euid=0" not in r.stdout and "SETUID0" not in r.stdout and "OPENED" not in r.stdout, dump(r)


LANDLOCK_DEV = r"""
import errno, os, stat
st = os.stat("/dev")
mnt = [l.split() for l in open("/proc/self/mounts") if l.split()[1] == "/dev"][0]
print("dev_owner", st.st_uid, oct(st.st_mode & 0o777), "mount_opts", mnt[3].split(",")[0])
for op, fn in (("create", lambda: open("/dev/agentvm-evil", "w")), ("mkdir", lambda: os.mkdir("/dev/agentvm-evil-dir")),
               ("symlink", lambda: os.symlink("/tmp", "/dev/agentvm-evil-link")), ("mkfifo", lambda: os.mkfifo("/dev/agentvm-fifo"))):
    try:
        fn(); print(op, "OK")
    except OSError as e:
        print(op, errno.errorcode[e.errno])
# control: the same operations in a read-write path
open("/tmp/ok", "w").write("x"); os.mkdir("/tmp/okd"); print("CONTROL_tmp OK")
"""


def test_landlock_denies_what_dac_and_mounts_allow(py):
    """/dev is a writable tmpfs owned by the agent's own uid: only Landlock stands between the
    agent and creating files there (EACCES, not EROFS)."""
    r = py(LANDLOCK_DEV)
    assert r.returncode == 0, dump(r)
    lines = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines()}
    assert "CONTROL_tmp" in lines, dump(r)
    owner = lines["dev_owner"]
    assert owner[0] == "1000" and owner[1] == "0o755" and owner[3] == "rw", f"precondition changed: {owner}" + dump(r)
    for op in ("create", "mkdir", "symlink", "mkfifo"):
        assert lines[op] == ["EACCES"], f"{op} in /dev: {lines[op]}" + dump(r)


def test_hostname_is_sandbox_own(sh):
    import socket

    host = socket.gethostname()
    r = sh("hostname; cat /proc/sys/kernel/hostname; hostname pwned; echo rc=$?; hostname")
    assert host not in r.stdout.split() or host == "run", dump(r)
    assert "rc=0" not in r.stdout, dump(r)
    assert socket.gethostname() == host


# ---------------------------------------------------------------------------------- workspace


def test_named_agent_workspace_persists(agentvm, agent_file, agent_name):
    name = agent_name("durable")
    f = agent_file(name)
    secret = token("DURABLE")
    r1 = agentvm("run", "-f", f, "--", "/bin/sh", "-c", f"echo {secret} > /workspace/keep.txt && mkdir -p /workspace/d")
    assert r1.returncode == 0, dump(r1)
    r2 = agentvm("run", "-f", f, "--", "/bin/sh", "-c", "cat /workspace/keep.txt; ls /workspace")
    assert r2.returncode == 0 and secret in r2.stdout.decode(), dump(r2)
    # another agent does not see it
    other = agent_file(agent_name("other"))
    r3 = agentvm("run", "-f", other, "--", "/bin/sh", "-c", "ls -la /workspace; cat /workspace/keep.txt")
    assert secret not in r3.stdout.decode() + r3.stderr.decode(), dump(r3)


def test_anonymous_runs_do_not_share_state(sh):
    secret = token("ANON")
    r1 = sh(f"for d in /workspace /tmp /dev/shm /home/agent; do echo {secret} > $d/left-behind; done; "
            "ls /workspace /tmp /dev/shm /home/agent")
    assert r1.returncode == 0 and r1.stdout.count("left-behind") == 4, dump(r1)
    r2 = sh(f"ls -la /workspace /tmp /dev/shm /home/agent; grep -rs {secret} /workspace /tmp /dev/shm /home/agent; "
            "cat /workspace/left-behind /tmp/left-behind; echo done")
    assert "done" in r2.stdout, dump(r2)
    assert secret not in r2.stdout and "left-behind" not in r2.stdout, dump(r2)


# ---------------------------------------------------------------------------------- environment


ALLOWED = {"PATH", "HOME", "LANG", "TERM", "USER", "LOGNAME", "SHELL", "TMPDIR", "AGENTVM", "AGENTVM_SANDBOX_ID",
           "AGENTVM_AGENT", "PWD", "SHLVL", "_"}
# the route through the egress gate (every sandbox has one unless --network none): where the
# proxy is and which CA to trust - never a credential
GATE_ENV = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY", "no_proxy",
            "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT", "AWS_CA_BUNDLE",
            "NODE_EXTRA_CA_CERTS", "NODE_USE_ENV_PROXY", "NODE_OPTIONS", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"}


def _canary_env() -> dict[str, str]:
    return {
        "AWS_SECRET_ACCESS_KEY": f"fake-canary-{secrets.token_hex(10)}",
        "AWS_ACCESS_KEY_ID": f"AKIAFAKECANARY{secrets.token_hex(4).upper()}",
        "GITHUB_TOKEN": f"ghp_fakecanary{secrets.token_hex(10)}",
        "OPENAI_API_KEY": f"sk-fakecanary-{secrets.token_hex(10)}",
        "SSH_AUTH_SOCK": f"/tmp/ssh-fakecanary-{secrets.token_hex(4)}/agent.1",
        "DATABASE_URL": f"postgres://admin:fakecanary-{secrets.token_hex(6)}@db.internal/prod",
        "PYTHONPATH": f"/tmp/fakecanary-{secrets.token_hex(4)}",
    }


ENV_PROBE = r"""
import os, sys
needles = [v for k, v in os.environ.items() if k == "REVERSED"][0].split(",")
needles = [n[::-1] for n in needles]
hits = []
for k, v in os.environ.items():
    for n in needles:
        if n in v or n in k:
            hits.append("env:" + k)
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self", "1"]:
    for f in ("environ", "cmdline"):
        try:
            data = open(f"/proc/{pid}/{f}", "rb").read().decode(errors="replace")
        except OSError:
            continue
        if pid != "self" and int(pid if pid.isdigit() else 0) == os.getpid():
            data = data.replace(os.environ["REVERSED"], "")
        if f == "environ":
            data = data.replace(os.environ["REVERSED"], "")
        for n in needles:
            if n in data:
                hits.append(f"/proc/{pid}/{f}")
print("HITS", sorted(set(hits)))
"""


def test_caller_environment_does_not_leak(agentvm):
    canaries = _canary_env()
    reversed_list = ",".join(v[::-1] for v in canaries.values())
    r = agentvm("run", "--env", f"REVERSED={reversed_list}", "--", "/bin/sh", "-c",
                "env; echo ----; cat /proc/1/environ | tr '\\0' '\\n'; echo ----; "
                "cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '; echo; "
                "/usr/bin/python3 -c \"$PROBE\"", env={**canaries, "PROBE": ENV_PROBE})
    out = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
    for k, v in canaries.items():
        assert v not in out, f"caller's {k} leaked into the sandbox" + dump(r)
        assert f"\n{k}=" not in "\n" + out, f"caller's {k} name visible" + dump(r)
    # PROBE itself is a caller variable too: it must not arrive
    assert "HITS" not in out, "caller's PROBE variable reached the sandbox" + dump(r)


def test_caller_environment_does_not_leak_deep_search(agentvm):
    canaries = _canary_env()
    reversed_list = ",".join(v[::-1] for v in canaries.values())
    r = agentvm("run", "--env", f"REVERSED={reversed_list}", "--", "/usr/bin/python3", "-c", ENV_PROBE,
                env=canaries)
    assert r.returncode == 0, dump(r)
    assert "HITS []" in r.stdout.decode(), dump(r)


@pytest.mark.parametrize("network", ["gate", "none"])
def test_env_is_allowlist_plus_declared(agentvm, network):
    r = agentvm("run", "--network", network, "--env", "FOO=bar", "--env", "EMPTY=", "--", "/bin/sh", "-c", "env -0",
                env={"LEAKY_CALLER_VAR": "x", "AWS_SECRET_ACCESS_KEY": "fake-canary-allowlist"})
    assert r.returncode == 0, dump(r)
    items = [x for x in r.stdout.decode().split("\0") if x]
    env = dict(x.split("=", 1) for x in items)
    assert env.get("FOO") == "bar" and env.get("EMPTY") == "", env
    extra = set(env) - ALLOWED - {"FOO", "EMPTY"} - (GATE_ENV if network == "gate" else set())
    assert not extra, f"unexpected variables in the sandbox: {sorted(extra)}"
    if network == "gate":
        assert env["HTTPS_PROXY"].startswith("http://127.0.0.1:"), env
    assert env["HOME"] == "/home/agent" and env["USER"] == "agent" and env["AGENTVM"] == "1", env
    assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin", env


PRELOAD_SO = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* Records where it was loaded: pid, uids, seccomp mode, network namespace. */
__attribute__((constructor)) static void ctor(void) {
    char net[64] = "?", line[256], seccomp[16] = "?", path[512];
    ssize_t n = readlink("/proc/self/ns/net", net, sizeof net - 1);
    if (n > 0) net[n] = 0;
    FILE *f = fopen("/proc/self/status", "r");
    if (f) {
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "Seccomp:", 8)) { sscanf(line + 8, "%15s", seccomp); break; }
        fclose(f);
    }
    const char *dir = getenv("PRELOAD_DIR");
    if (!dir) return;
    snprintf(path, sizeof path, "%s/ran pid=%d uid=%d seccomp=%s %s", dir, getpid(), getuid(), seccomp, net);
    int fd = open(path, O_CREAT | O_WRONLY, 0666);
    if (fd >= 0) close(fd);
}
"""


def test_declared_ld_preload_never_runs_outside_the_sandbox(agentvm, grant_dir):
    """An env var declared for the agent (--env / spec.env) must only reach the sandboxed
    command. If it is also in the environment of the host-side launcher chain (bwrap is
    dynamically linked and runs as the agent uid before any namespace, seccomp or Landlock is in
    place), LD_PRELOAD runs code on the host, unconfined."""
    import shutil

    # outside /tmp: a read-write grant may not sit inside the sandbox's own /tmp (and the test
    # needs the same path inside as outside)
    g = Path(f"/srv/agentvm-preload-{os.getpid()}")
    g.mkdir(mode=0o777, parents=True, exist_ok=True)
    os.chmod(g, 0o777)
    try:
        _preload_case(agentvm, g)
    finally:
        shutil.rmtree(g, ignore_errors=True)


def _preload_case(agentvm, g):
    src = g / "p.c"
    src.write_text(PRELOAD_SO)
    so = g / "p.so"
    cc = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    os.chmod(so, 0o755)
    host_net = os.readlink("/proc/self/ns/net")
    # the grant is mounted at the same path inside, so the library resolves in both worlds
    r = agentvm("run", "--mount", f"{g}:{g}:rw", "--env", f"LD_PRELOAD={so}", "--env", f"PRELOAD_DIR={g}",
                "--", "/bin/true")
    assert r.returncode == 0, dump(r)
    runs = sorted(p.name for p in g.iterdir() if p.name.startswith("ran "))
    assert runs, "control: the preload did not run at all (not even inside)" + dump(r)
    inside = [x for x in runs if "seccomp=2" in x and host_net not in x]
    outside = [x for x in runs if x not in inside]
    assert inside, f"control: no sandboxed load recorded: {runs}"
    assert not outside, (
        f"declared LD_PRELOAD executed OUTSIDE the sandbox (host netns {host_net}, no seccomp): {outside}" + dump(r)
    )

"""The bwrap backend's compile() is pure: its LaunchPlan is snapshot-tested and its
security-relevant structure asserted directly (a snapshot alone would bless a regression)."""

import json
import os
from pathlib import Path

import pytest

from agentvm.backends.base import GateAttachment, HostContext, LaunchContext
from agentvm.backends.bwrap import BwrapBackend
from agentvm.paths import Paths
from agentvm.policy import MountGrant, Policy

SNAP = Path(__file__).parent / "snapshots" / "bwrap_plan.json"

HELPER = "/var/lib/agentvm/libexec/agentvm-helper-x"
BWRAP = "/var/lib/agentvm/libexec/bwrap"
TOOLS = {"helper": HELPER, "bwrap": BWRAP}
HOST = HostContext(uid=2100007, gid=2100007, dedicated=True, run_dir="/run/agentvm/sandboxes/demo-0000",
                   etc_view="/run/agentvm/etc-view-0123456789abcdef")
KEY = "0123456789abcdef" * 2  # the bridge's key (an obviously fake one)
CTX = LaunchContext(
    sandbox_id="demo-0000",
    workspace="/run/agentvm/ws/demo",
    gate=GateAttachment("unix", "/run/agentvm/sandboxes/demo-0000/gate.sock", key=KEY),
    host=HOST,
)


def backend(paths=None):
    return BwrapBackend(paths or Paths(Path("/x"), Path("/y")), tools=TOOLS)
POLICY = Policy(
    name="demo",
    command=("python3", "-c", "print(1)"),
    agent=True,
    mounts=(MountGrant("/srv/data", "/data", False), MountGrant("/srv/out", "/out", True)),
    env=(("FOO", "bar"),),
    local_ports=(8000,),
)


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    return backend(Paths(Path("/nonexistent"), Path("/nonexistent/run"))).compile(POLICY, CTX).body


def _section(argv, start, end):
    a = argv.index(start)
    b = argv.index(end, a + 1) if end else len(argv)
    return argv[a:b]


def test_snapshot(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    full = backend(Paths(Path("/nonexistent"), Path("/nonexistent/run"))).compile(POLICY, CTX)
    data = json.loads(json.dumps(full.to_dict()))
    if os.environ.get("UPDATE_SNAPSHOTS") == "1" or not SNAP.exists():
        SNAP.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    assert data == json.loads(SNAP.read_text()), "plan changed: review, then UPDATE_SNAPSHOTS=1"


def test_the_bridge_key_reaches_init_through_a_descriptor_never_the_plan(monkeypatch):
    """The bridge's key is what makes its hand-off channel its own (gate.server.HANDOFF_PREFIX):
    it goes to init as a descriptor launch opens (kept through bwrap), never into the printable
    plan, an argv or the environment - anything the agent or a plan's reader could see."""
    monkeypatch.delenv("TERM", raising=False)
    full = backend(Paths(Path("/nonexistent"), Path("/nonexistent/run"))).compile(POLICY, CTX)
    assert KEY not in json.dumps(full.to_dict()) and KEY not in repr(full) and KEY not in repr(CTX)
    argv = list(full.body.argv)
    assert ["--keep-fd", "@fd:bridgekey@"] == argv[argv.index("@fd:bridgekey@") - 1:argv.index("@fd:bridgekey@") + 1]
    init = argv[argv.index("init"):]
    assert init[init.index("--bridge-key-fd") + 1] == "@fd:bridgekey@"
    assert full.body.fds["bridge_key"] == KEY
    # no key (gVisor's attachment, a run without one): the bridge relays, nothing to pass
    from dataclasses import replace

    keyless = backend(Paths(Path("/nonexistent"), Path("/nonexistent/run"))).compile(
        POLICY, replace(CTX, gate=GateAttachment("unix", "/run/agentvm/sandboxes/demo-0000/gate.sock")))
    assert "--bridge-key-fd" not in keyless.body.argv and "@fd:bridgekey@" not in keyless.body.argv


def test_etc_view_is_an_allowlist_with_synthetic_accounts(tmp_path):
    from agentvm.backends.hostview import ETC_ALLOW, etc_view, usr_linked_etc

    view = etc_view(tmp_path)
    assert etc_view(tmp_path) == view, "cached while the host's /etc is unchanged"
    names = {p.name for p in view.iterdir()}
    # the allowlist, and what the host's /usr points into /etc (tests/unit/test_hostview_etc.py)
    tops = {n.split("/")[0] for n in ETC_ALLOW + usr_linked_etc(tmp_path)}
    assert names <= tops | {"passwd", "group", "resolv.conf", "nsswitch.conf", "hosts", "hostname", "ld.so.preload"}
    assert (view / "ld.so.preload").read_text() == "", "nothing is preloaded (gVisor binds its own over it)"
    for sub in (n for n in ETC_ALLOW if "/" in n):  # only the named file of such a folder
        parent = view / sub.split("/")[0]
        if parent.is_dir():
            assert {p.name for p in parent.iterdir()} <= {sub.split("/", 1)[1]}, sub
    for secret in ("shadow", "gshadow", "sudoers", "ssh", "machine-id", "environment", "pip.conf", "npmrc"):
        assert secret not in names
    assert not list(view.rglob("private")), "private key directories are never copied"
    assert "agent:x:1000:1000" in (view / "passwd").read_text()
    assert "nameserver" not in (view / "resolv.conf").read_text()
    assert oct(view.stat().st_mode & 0o777) == "0o755"


def test_compile_is_pure(plan):
    again = backend().compile(POLICY, CTX).body
    assert again.to_dict() == plan.to_dict()


def test_every_namespace_and_hardening_flag(plan):
    argv = list(plan.argv)
    bw = list(plan.bwrap_args)
    assert argv[argv.index(BWRAP) : argv.index(BWRAP) + 4] == [BWRAP, "--args", "@fd:bwrapargs@", "--"], (
        "bwrap's options (host paths) never appear on a command line the sandbox can read"
    )
    assert not any(a.startswith("/var/lib") or a.startswith("/run/") for a in argv[argv.index(BWRAP) + 1 :])
    for flag in ("--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--unshare-cgroup", "--die-with-parent", "--new-session", "--disable-userns"):
        assert flag in bw, flag
    assert bw[bw.index("--cap-drop") + 1] == "ALL"
    assert not any(f.endswith("-try") and f.startswith("--unshare") for f in bw)
    assert "--share-net" not in bw
    # the rootfs is made read-only after everything is mounted
    assert bw[-2:] == ["--remount-ro", "/"]


def test_privileges_dropped_before_bwrap(plan):
    argv = list(plan.argv)
    launch = argv[: argv.index(BWRAP)]
    assert launch[:2] == [HELPER, "launch"]
    assert launch[launch.index("--uid") + 1] == str(HOST.uid)
    assert launch[launch.index("--gid") + 1] == str(HOST.gid)
    assert "--cgroup-procs" in launch
    assert ("core", 0, 0) in plan.rlimits
    nproc = next(r for r in plan.rlimits if r[0] == "nproc")
    assert nproc[1] > POLICY.limits.pids, "the cgroup must refuse first, so the hit is recorded"
    assert launch[launch.index("--argv0") + 1] == "bwrap"


def test_view_hides_host_secrets(plan):
    dests = {m.dest for m in plan.mounts}
    srcs = {m.src for m in plan.mounts}
    assert "/root" not in dests and "/home" not in dests
    assert "/etc" not in srcs, "host /etc must never be bound wholesale"
    assert not any(d.startswith("/etc/") and d.split("/")[2] in ("shadow", "gshadow", "sudoers", "ssh") for d in dests)
    assert "/" not in srcs and "/root" not in srcs
    etc = next(m for m in plan.mounts if m.dest == "/etc")
    assert etc.kind == "ro-bind" and etc.src == HOST.etc_view, "the allowlisted view, never the host's /etc"
    for e in ("hosts", "hostname"):
        m = next(m for m in plan.mounts if m.dest == "/etc/" + e)
        assert m.src.startswith(HOST.run_dir), "per sandbox, not the host's"
    kinds = {m.dest: m.kind for m in plan.mounts}
    # as root, grants are the helper's idmapped mounts staged in the run dir (never the host path)
    assert kinds["/data"] == "ro-bind" and kinds["/out"] == "bind" and kinds["/workspace"] == "bind-fd"
    src = {m.dest: m.src for m in plan.mounts}
    assert src["/data"] == HOST.run_dir + "/grants/0" and src["/out"] == HOST.run_dir + "/grants/1"
    launch = list(plan.argv[: plan.argv.index("--")])
    grants = [launch[i + 1] for i, a in enumerate(launch) if a == "--grant"]
    assert grants == [f"@fd:grant0@,ro,{HOST.run_dir}/grants/0", f"@fd:grant1@,rw,{HOST.run_dir}/grants/1"]
    assert kinds["/usr"] == "ro-bind"
    tmp = next(m for m in plan.mounts if m.dest == "/tmp")
    assert tmp.kind == "tmpfs" and tmp.size == POLICY.limits.tmp


def test_landlock_and_seccomp_in_init(plan):
    argv = list(plan.argv)
    start = argv.index("--", argv.index(BWRAP)) + 1
    init = argv[start : len(argv) - len(POLICY.command) - 1]
    assert init[:2] == ["/.agentvm/init", "init"]
    pairs = {(init[i], init[i + 1]) for i in range(len(init) - 1)}
    assert ("--ro", "/data") in pairs and ("--rw", "/workspace") in pairs
    # a granted host folder: read-write without the right to make FIFOs and sockets there
    assert ("--rw-host", "/out") in pairs and ("--rw", "/out") not in pairs
    assert ("--ro", "/usr") in pairs and ("--rw", "/usr") not in pairs
    assert "--net" in init and ("--tcp-connect", "8000") in pairs and ("--tcp-bind", "8000") in pairs
    assert "--scope" in init and ("--min-abi", "6") in pairs
    assert "--seccomp-fd" in init and "--no-landlock" not in init
    assert list(plan.argv[-3:]) == list(POLICY.command)
    for s in ("bpf", "io_uring_setup", "ptrace", "unshare", "setns", "mount", "keyctl", "userfaultfd"):
        assert s in plan.seccomp_denied


def test_environment_reaches_only_the_command(plan):
    argv = list(plan.argv)
    init = argv[argv.index("/.agentvm/init") :]
    assert init[init.index("--env-fd") + 1] == "@fd:env@"
    assert not any("FOO" in a for a in argv[: argv.index("/.agentvm/init")] + list(plan.bwrap_args))


def test_environment_is_built_from_the_spec_only(plan, monkeypatch):
    import dataclasses

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-operator-secret")
    p = backend().compile(POLICY, CTX)
    env = dict(p.env)
    assert "AWS_SECRET_ACCESS_KEY" not in env
    base = {"PATH", "HOME", "LANG", "TERM", "USER", "LOGNAME", "SHELL", "TMPDIR", "AGENTVM", "AGENTVM_SANDBOX_ID",
            "AGENTVM_AGENT", "FOO"}
    gate = {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY", "no_proxy",
            "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT", "AWS_CA_BUNDLE",
            "NODE_EXTRA_CA_CERTS", "NODE_USE_ENV_PROXY", "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"}
    assert set(env) == base | gate
    none = backend().compile(dataclasses.replace(POLICY, network="none", egress=None), CTX)
    assert set(dict(none.env)) == base, "network none: no route, so no proxy variables either"
    assert "fake-operator-secret" not in json.dumps(p.to_dict())


def test_trusted_entries_are_bound_over_themselves():
    import dataclasses

    from agentvm.grants import Protect

    prot = (Protect(".git", "dir"), Protect(".envrc", "file"))
    p = backend().compile(POLICY, dataclasses.replace(CTX, protected=((), prot))).body
    stage = HOST.run_dir + "/grants/1"
    # as root the helper makes each entry read-only on the dentry it finds in the staged grant
    # (no path is bound later, so nothing can be swapped in between)
    launch = list(p.argv[: p.argv.index("--")])
    assert [launch[k + 1] for k, a in enumerate(launch) if a == "--protect"] == ["1,d,.git", "1,f,.envrc"]
    assert not any(m.dest.startswith("/out/") for m in p.mounts)
    # without root (no idmap) the same entries come from the host folder itself
    q = backend().compile(
        POLICY, dataclasses.replace(CTX, protected=((), prot), host=dataclasses.replace(HOST, dedicated=False))).body
    assert ("ro-bind", "/out/.envrc", "/srv/out/.envrc") in [(m.kind, m.dest, m.src) for m in q.mounts]
    assert "--grant" not in q.argv


def test_command_arguments_are_never_substituted():
    from agentvm.backends.hostview import substitute as _substitute

    argv = ("h", "launch", "--keep-fd", "@fd:a@", "--grant", "@fd:a@,rw,/s", "--", "bwrap", "--args", "@fd:b@", "--",
            "init", "--", "echo", "@fd:a@")
    out = _substitute(argv, {"a": 5, "b": 6}, [])
    assert out[3] == "5" and out[5] == "5,rw,/s" and out[9] == "6" and out[-1] == "@fd:a@"


def test_degrade_is_explicit_in_the_plan():
    import dataclasses

    ctx = dataclasses.replace(CTX, degraded=("landlock", "seccomp"))
    p = backend().compile(POLICY, ctx).body
    assert "--no-landlock" in p.argv and "--seccomp-fd" not in p.argv
    assert p.landlock is None and p.seccomp_denied == ()


def test_ptrace_allowed_only_when_asked():
    import dataclasses

    p = backend().compile(dataclasses.replace(POLICY, allow_ptrace=True, risk_tier="L4"), CTX).body
    assert "ptrace" not in p.seccomp_denied and "bpf" in p.seccomp_denied


def test_doctor_says_how_to_lift_ubuntus_apparmor_userns_restriction(tmp_path):
    """Ubuntu 23.10+ (24.04) forbids unconfined user namespaces: the check names the cause and
    the exact fix (a profile for agent-vm's own bwrap, or the sysctl)."""
    from agentvm.backends.bwrap import _userns_ok

    knob = tmp_path / "apparmor_restrict_unprivileged_userns"
    knob.write_text("1\n")
    ok, detail = _userns_ok("/opt/x/bwrap", knob)
    assert not ok
    assert "profile agentvm-bwrap /opt/x/bwrap flags=(unconfined)" in detail and "userns," in detail
    assert "apparmor_parser -r /etc/apparmor.d/agentvm-bwrap" in detail
    assert "kernel.apparmor_restrict_unprivileged_userns=0" in detail
    knob.write_text("0\n")
    assert _userns_ok("/opt/x/bwrap", knob)[0]


def test_posix_message_queues_have_their_filesystem_and_a_landlock_rule(plan):
    """mq_open(3) opens the queue on the IPC namespace's mqueue filesystem: bwrap mounts it at
    /dev/mqueue (right after /dev) and Landlock has a rule for it (else EACCES)."""
    kinds = [(m.kind, m.dest) for m in plan.mounts]
    assert kinds.index(("mqueue", "/dev/mqueue")) == kinds.index(("dev", "/dev")) + 1
    bw = list(plan.bwrap_args)
    assert bw[bw.index("--mqueue") + 1] == "/dev/mqueue" and "--unshare-ipc" in bw
    pairs = {(plan.confine[i], plan.confine[i + 1]) for i in range(len(plan.confine) - 1)}
    assert ("--rw", "/dev/mqueue") in pairs


def test_git_excludes_only_with_a_rw_grant():
    """git's default excludes file in the sandbox's home names the rw grants' placeholders; a
    sandbox without a rw grant gets none (nothing to hide)."""
    import dataclasses

    p = backend().compile(POLICY, CTX).body
    f = [m for m in p.mounts if m.kind == "file"]
    assert [(m.dest, m.src, m.perms) for m in f] == [("/home/agent/.config/git/ignore", "@fd:gitexcludes@", "0644")]
    home = [m.dest for m in p.mounts].index("/home/agent")
    assert [m.dest for m in p.mounts].index(f[0].dest) > home, "written into the home's tmpfs, after it is mounted"
    launch = list(p.argv[: p.argv.index("--")])
    assert ("--keep-fd", "@fd:gitexcludes@") in set(zip(launch, launch[1:]))
    assert p.fds["git_excludes"] == (("grant1", "/out"),)
    ro_only = dataclasses.replace(POLICY, mounts=(MountGrant("/srv/data", "/data", False),))
    q = backend().compile(ro_only, CTX).body
    assert not [m for m in q.mounts if m.kind == "file"] and "@fd:gitexcludes@" not in q.argv


def test_git_excludes_name_each_placeholder_at_every_possible_repository_top():
    from agentvm.grants import git_excludes

    text = git_excludes([("/out", [".envrc", ".mcp.json"]), ("/workspace/lib", [".gitmodules"])])
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines == ["/.envrc", "/.mcp.json", "/.gitmodules", "/lib/.gitmodules"]
    assert git_excludes([]).strip().startswith("#")

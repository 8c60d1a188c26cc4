"""Folder grants on the real default substrate: idmapped ownership, host-trusted entries kept
read-only, no setuid/FIFO/socket on the host's disk, and clear refusals - each tested by
doing it from inside a real sandbox and looking at the host afterwards."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, last_json, needs_root
from tests.integration.test_run_cli import write_agent

pytestmark = [pytest.mark.integration, needs_root]

USER = 4242  # an ordinary host user owning a project folder (no account needed)


def _owned(d: Path, uid: int) -> Path:
    os.chown(d, uid, uid)
    return d


@pytest.mark.parametrize("owner", [0, USER], ids=["root-owned", "user-owned"])
def test_rw_grant_keeps_the_folder_owner_across_runs_and_agents(agentvm, grant_dir, tmp_path, owner):
    d = _owned(grant_dir(0o755), owner)
    # two anonymous runs (each leases a fresh uid) and a named agent, each changing the others' files
    r1 = agentvm("run", "--json", "--mount", f"{d}:/out:rw", "--", "/bin/sh", "-c",
                 "id -u; stat -c %u /out; echo one > /out/a; mkdir /out/sub; echo x > /out/sub/f")
    assert r1.returncode == 0, r1.stderr
    inside_uid, seen_owner = r1.stdout.split()[:2]
    assert seen_owner == inside_uid == b"1000", "inside, the granted folder is the agent's own"
    r2 = agentvm("run", "--json", "--mount", f"{d}:/out:rw", "--", "/bin/sh", "-c",
                 "echo two >> /out/a && rm /out/sub/f && echo y > /out/b")
    assert r2.returncode == 0, r2.stderr
    assert last_json(r1.stdout)["host_uid"] != last_json(r2.stdout)["host_uid"], "anonymous runs lease fresh uids"
    f = write_agent(tmp_path, f"g{secrets.token_hex(3)}",
                    extra=f"  mounts:\n    - {{host: {d}, path: /out, mode: rw}}\n")
    r3 = agentvm("run", "-f", str(f), "--", "/bin/sh", "-c", "echo three >> /out/a && echo z > /out/c")
    assert r3.returncode == 0, r3.stderr
    assert (d / "a").read_text() == "one\ntwo\nthree\n"
    for p in [d / "a", d / "b", d / "c", d / "sub"]:
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (owner, owner), f"{p} is owned by {st.st_uid}:{st.st_gid} on the host"
    assert not (d / "sub" / "f").exists()


def test_read_only_grant_under_a_0700_parent(agentvm, tmp_path):
    """The helper opens the grant as root: a parent the agent's uid could not traverse is no
    obstacle, and nothing of bwrap's own text reaches the user."""
    top = Path(f"/tmp/agentvm-locked-{secrets.token_hex(3)}")
    (top / "proj").mkdir(parents=True)
    (top / "proj" / "f").write_text("hi\n")
    os.chmod(top, 0o700)
    os.chmod(top / "proj", 0o700)
    try:
        r = agentvm("run", "--mount", f"{top}/proj:/src:ro", "--", "/bin/sh", "-c",
                    "cat /src/f; echo no > /src/g 2>/dev/null && echo WROTE")
        assert r.stdout == b"hi\n" and r.returncode != 0 and b"Read-only" in r.stderr, (r.stdout, r.stderr)
        assert not (top / "proj" / "g").exists()
        r = agentvm("run", "--mount", f"{top}/proj:/src:rw", "--", "/bin/sh", "-c", "echo new > /src/g")
        assert r.returncode == 0, r.stderr
        assert (top / "proj" / "g").stat().st_uid == 0
    finally:
        subprocess.run(["rm", "-rf", str(top)])


def test_extra_path_under_a_0700_parent_is_refused_with_our_own_error(agentvm, tmp_path):
    """rootfs.extraPaths are bound by path as the agent's uid: refused before launch, exit 77."""
    top = Path(f"/tmp/agentvm-locked-{secrets.token_hex(3)}")
    (top / "tool").mkdir(parents=True)
    os.chmod(top, 0o700)
    try:
        f = write_agent(tmp_path, "xp", extra=f"  rootfs: {{extraPaths: [{top}/tool]}}\n")
        r = agentvm("run", "-f", str(f), "--json", "--", "true")
        assert r.returncode == 77, (r.stdout, r.stderr)
        res = last_json(r.stdout)
        assert res["error"] == "policy.grant-unreachable" and str(top) in res["message"] and "0700" in res["message"]
        assert "bwrap" not in r.stderr.decode()
    finally:
        subprocess.run(["rm", "-rf", str(top)])


def test_a_filesystem_that_cannot_be_idmapped_is_refused_by_name(agentvm):
    mnt = Path(f"/tmp/agentvm-ramfs-{secrets.token_hex(3)}")
    mnt.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], check=True)
    try:
        os.chmod(mnt, 0o755)
        (mnt / "d").mkdir()
        r = agentvm("run", "--json", "--mount", f"{mnt}/d:/out:rw", "--", "/bin/sh", "-c", "echo x > /out/f")
        assert r.returncode == 77, (r.stdout, r.stderr)
        err = last_json(r.stdout)["setup_error"]
        assert err["step"] == "grant-idmap" and "ramfs" in err["message"] and str(mnt) in err["message"], err
        assert not (mnt / "d" / "f").exists() and list((mnt / "d").iterdir()) == [], "nothing left behind"
    finally:
        subprocess.run(["umount", str(mnt)])
        mnt.rmdir()


def _git_repo(d: Path) -> None:
    subprocess.run(["git", "init", "-q", str(d)], check=True)
    (d / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nexit 0\n")


PLANT = r"""
t() { if sh -c "$1" 2>/dev/null; then echo "PLANTED: $1"; fi; }
t 'echo "#!/bin/sh" > /out/.git/hooks/post-checkout'
t 'echo ../evil > /out/.git/commondir'
t 'echo x > /out/.git/index'
t 'mkdir -p /out/.git/modules/m && echo x > /out/.git/modules/m/config'
t 'echo "ref: refs/heads/evil" > /out/.git/HEAD'
t 'echo evil >> /out/.git/hooks/pre-commit'
t 'printf "[core]\n\tfsmonitor = /tmp/x\n" >> /out/.git/config'
t 'mv /out/.git /out/.git-old'
t 'rm -rf /out/.git/hooks'
t 'mv /out/.git/config /out/.git/c2'
t 'echo x > /out/.envrc'
t 'echo "{}" > /out/.mcp.json'
t 'mkdir -p /out/.claude && echo x > /out/.claude/settings.json'
t 'echo x > /out/.vscode/tasks.json'
t 'mv /out/.vscode /out/vs && mkdir /out/.vscode'
t 'touch /out/su && chmod 4755 /out/su'
t 'touch /out/sg && chmod 2755 /out/sg'
t 'python3 -c "import os; os.close(os.open(\"/out/su2\", os.O_CREAT|os.O_WRONLY, 0o4755))"'
t 'mkfifo /out/fifo'
t 'python3 -c "import socket; socket.socket(socket.AF_UNIX).bind(\"/out/sock\")"'
echo ok > /out/normal-file && echo WROTE
git -C /out -c user.email=a@b -c user.name=a commit -qm agent 2>/dev/null && echo COMMITTED
"""


def test_host_trusted_entries_stay_read_only_in_an_rw_grant(agentvm, grant_dir):
    d = _owned(grant_dir(0o755), USER)
    _git_repo(d)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(d)], check=True)  # the user's own repository
    before = {p: p.read_bytes() for p in (d / ".git" / "config", d / ".git" / "hooks" / "pre-commit")}
    r = agentvm("run", "--mount", f"{d}:/out:rw", "--", "/bin/sh", "-c", PLANT)
    out = r.stdout.decode()
    assert "PLANTED" not in out, out
    assert "WROTE" in out and "COMMITTED" not in out, (out, r.stderr)  # the work tree is the agent's; .git is not
    for p, data in before.items():
        assert p.read_bytes() == data, f"{p} changed"
    assert not (d / ".git" / "hooks" / "post-checkout").exists()
    for name in (".envrc", ".mcp.json", ".claude", ".vscode", ".idea", ".gitmodules", ".git-old", "su", "sg",
                 "su2", "fifo", "sock"):
        if (d / name).exists():
            st = (d / name).lstat()
            assert name in ("su", "sg", "su2") and not st.st_mode & (stat.S_ISUID | stat.S_ISGID), name
    assert (d / "normal-file").stat().st_uid == USER


def test_placeholders_do_not_outlive_the_run_and_writable_trusted_lifts_one(agentvm, grant_dir, tmp_path):
    d = grant_dir(0o755)
    (d / "keep.txt").write_text("k\n")
    r = agentvm("run", "--mount", f"{d}:/out:rw", "--", "/bin/sh", "-c",
                "ls -A /out | tr '\\n' ' '; git init -q /out 2>/dev/null && echo INIT")
    assert b".git" in r.stdout and b".envrc" in r.stdout, "inside, the trusted names exist (read-only)"
    assert b"INIT" not in r.stdout, "no new repository at the grant's root"
    assert sorted(p.name for p in d.iterdir()) == ["keep.txt"], "placeholders removed after the run"
    f = write_agent(tmp_path, f"wt{secrets.token_hex(3)}",
                    extra=f"  mounts:\n    - {{host: {d}, path: /out, mode: rw, writableTrusted: [.git, .envrc]}}\n")
    r = agentvm("run", "-f", str(f), "--", "/bin/sh", "-c",
                "git init -q /out && echo 'export A=1' > /out/.envrc && echo x > /out/.mcp.json 2>/dev/null; true")
    assert (d / ".git" / "HEAD").exists() and (d / ".envrc").read_text() == "export A=1\n"
    assert not (d / ".mcp.json").exists()
    assert (d / ".git" / "HEAD").stat().st_uid == 0


def test_host_config_cannot_be_planted_git_does_not_see_its_placeholders_and_writable_trusted_lifts_it(
        agentvm, grant_dir, tmp_path):
    """Issue 35 item 5: dev containers, CI workflows, package-manager, build-tool and git
    attribute files are placeholders the agent cannot replace; git status in the grant stays
    clean of them; ``writableTrusted`` lets the agent write the ones it names (only those)."""
    d = _owned(grant_dir(0o755), USER)
    _git_repo(d)
    (d / "README").write_text("hi\n")
    git = ["git", "-c", f"safe.directory={d}", "-C", str(d)]
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init"], check=True)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(d)], check=True)
    names = (".devcontainer/devcontainer.json", ".devcontainer.json", ".npmrc", ".gitattributes", ".yarnrc.yml",
             ".github/workflows/x.yml", ".cargo/config.toml", ".bazelrc", ".tool-versions")
    plant = "; ".join(f"(mkdir -p /out/{os.path.dirname(n) or '.'}; echo evil > /out/{n}) 2>/dev/null && echo PLANTED {n}"
                      for n in names)
    r = agentvm("run", "--mount", f"{d}:/out:rw", "--", "/bin/sh", "-c",
                f"cd /out && ls -A | tr '\\n' ' ' && echo; git -c safe.directory='*' status --porcelain --untracked-files=all; "
                f"echo STATUS-DONE; {plant}; true")
    out = r.stdout.decode()
    listing, status = out.split("\n", 1)
    assert all(n in listing.split() for n in (".npmrc", ".gitattributes", ".devcontainer", ".github", ".cargo")), out
    assert status.startswith("STATUS-DONE\n"), "git status shows agent-vm's placeholders: " + out
    assert "PLANTED" not in out, out
    assert sorted(p.name for p in d.iterdir()) == [".git", "README"], "nothing planted, placeholders removed"
    host = subprocess.run([*git, "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True)
    assert host.stdout == "", host.stdout

    lifted = (".devcontainer", ".npmrc", ".gitattributes", ".github")
    f = write_agent(tmp_path, f"wh{secrets.token_hex(3)}",
                    extra=f"  mounts:\n    - {{host: {d}, path: /out, mode: rw, writableTrusted: [{', '.join(lifted)}]}}\n")
    r = agentvm("run", "-f", str(f), "--", "/bin/sh", "-c", plant + "; true")
    out = r.stdout.decode()
    for n in (".devcontainer/devcontainer.json", ".npmrc", ".gitattributes", ".github/workflows/x.yml"):
        assert f"PLANTED {n}\n" in out and (d / n).read_text() == "evil\n", (n, out, r.stderr)
        assert (d / n).stat().st_uid == USER
    for n in (".devcontainer.json", ".yarnrc.yml", ".cargo/config.toml", ".bazelrc", ".tool-versions"):
        assert f"PLANTED {n}\n" not in out and not (d / n.split("/")[0]).exists(), (n, out)


def test_writable_git_lets_the_agent_commit(agentvm, grant_dir, tmp_path):
    d = _owned(grant_dir(0o755), USER)
    _git_repo(d)
    subprocess.run(["chown", "-R", f"{USER}:{USER}", str(d)], check=True)
    f = write_agent(tmp_path, f"wg{secrets.token_hex(3)}",
                    extra=f"  mounts:\n    - {{host: {d}, path: /out, mode: rw, writableTrusted: [.git]}}\n")
    r = agentvm("run", "-f", str(f), "--", "/bin/sh", "-c",
                "cd /out && echo ok > n && git add n && git -c user.email=a@b -c user.name=a commit -qm agent && echo COMMITTED")
    assert b"COMMITTED" in r.stdout, (r.stdout, r.stderr)
    log = subprocess.run(["git", "-c", f"safe.directory={d}", "-C", str(d), "log", "--format=%s"], capture_output=True)
    assert log.stdout == b"agent\n"


def test_two_sandboxes_sharing_a_folder_keep_each_others_protection(agentvm, grant_dir):
    """The first one out must not remove placeholders the other still has mounted."""
    import time

    d = grant_dir(0o755)
    first = subprocess.Popen(agentvm_cmd() + ["run", "--mount", f"{d}:/out:rw", "--", "/bin/sleep", "2"])
    try:
        deadline = time.monotonic() + 20
        while not (d / ".mcp.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = agentvm("run", "--mount", f"{d}:/out:rw", "--", "/bin/sh", "-c",
                    "sleep 4; echo '{}' > /out/.mcp.json 2>/dev/null && echo PLANTED; mkdir /out/.claude/x 2>/dev/null && echo PLANTED2; true")
    finally:
        first.wait(30)
    assert first.returncode == 0
    assert b"PLANTED" not in r.stdout, r.stdout
    assert sorted(p.name for p in d.iterdir()) == [], "the last one out removed the placeholders"


def test_grants_that_would_hand_over_the_host_are_refused(agentvm, tmp_path, grant_dir):
    for host in ("/etc", "/etc/ssl", "/root", "/root/.x-missing-is-fine", "/home", "/usr", "/proc/1"):
        r = agentvm("run", "--json", "--mount", f"{host}:/h:ro", "--", "true")
        assert r.returncode in (77, 78), (host, r.stdout, r.stderr)
        if r.returncode == 77:
            want = "policy.grant-home" if host.startswith("/root") else "policy.grant-forbidden"
            assert last_json(r.stdout)["error"] == want, (host, r.stdout)


@pytest.fixture
def root_project():
    """A project folder in root's home (/root/NAME, removed after)."""
    d = Path(f"/root/agentvm-proj-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    (d / "main.py").write_text("print('hi')\n")
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", "--", str(d)], check=False)


def test_a_project_folder_in_roots_home_can_be_granted(agentvm, root_project):
    """Run as root from /root/proj: `agentvm run --mount $PWD:/src:ro` works as from /home/x/proj."""
    r = agentvm("run", "--mount", f"{root_project}:/src:ro", "--", "ls", "/src")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [b"main.py"], r.stdout


def test_roots_home_its_dot_directories_and_agentvm_state_stay_refused(agentvm, avm_home):
    """Attack-style: whatever exists in /root, the home itself, its dot-directories (ssh keys,
    cloud credentials, tool configuration, agent-vm's own state) cannot be granted, ro or rw."""
    made = []
    for name in (".ssh", ".agentvm", ".aws", ".config"):  # made (empty) when absent, removed after
        p = Path("/root") / name
        if not p.exists():
            p.mkdir(mode=0o700)
            made.append(p)
    try:
        for host in ("/root", "/root/.ssh", "/root/.agentvm", "/root/.aws", "/root/.config"):
            for mode in ("ro", "rw"):
                r = agentvm("run", "--json", "--mount", f"{host}:/h:{mode}", "--", "true")
                assert r.returncode == 77, (host, mode, r.stdout, r.stderr)
                assert last_json(r.stdout)["error"] == "policy.grant-home", (host, r.stdout)
    finally:
        for p in made:
            p.rmdir()
    # agent-vm's state home under /root cannot even be used while /root is 0700 (the sandbox's
    # uid must reach the helper: refused as not traversable); were it, a grant of it or of
    # anything in it is refused as agent-vm's own state (tests/unit/test_fsutil_grants.py)


def test_a_user_home_directory_is_refused(agentvm):
    import pwd

    homes = [p.pw_dir for p in pwd.getpwall() if p.pw_dir.startswith("/") and os.path.isdir(p.pw_dir)
             and p.pw_dir not in ("/", "/nonexistent") and not p.pw_dir.startswith(("/proc", "/sys", "/dev", "/run", "/etc",
                                                                                        "/root", "/usr", "/var"))]
    target = homes[0] if homes else None
    if target is None:
        pytest.skip("no user home directory on this host outside the system trees")  # pragma: no cover
    r = agentvm("run", "--json", "--mount", f"{target}:/h:ro", "--", "true")
    assert r.returncode == 77 and last_json(r.stdout)["error"] == "policy.grant-home", r.stdout


def test_rw_grant_inside_the_sandboxs_scratch_space_is_refused(agentvm, grant_dir):
    d = grant_dir(0o755)
    for where in ("/tmp/out", "/home/agent/out", "/workspace/src"):
        r = agentvm("run", "--json", "--mount", f"{d}:{where}:rw", "--", "true")
        assert r.returncode == 78 and last_json(r.stdout)["error"] == "policy.grant-path", (where, r.stdout)
    r = agentvm("run", "--mount", f"{d}:/tmp/ref:ro", "--", "true")
    assert r.returncode == 0, r.stderr  # read-only there is fine: nothing can be made in it


def test_a_single_file_can_be_granted_read_write(agentvm, grant_dir):
    d = grant_dir(0o755)
    (d / "notes.txt").write_text("a\n")
    r = agentvm("run", "--mount", f"{d}/notes.txt:/notes.txt:rw", "--", "/bin/sh", "-c", "echo b >> /notes.txt")
    assert r.returncode == 0, r.stderr
    assert (d / "notes.txt").read_text() == "a\nb\n"


def test_a_trusted_name_that_is_a_symlink_is_refused(agentvm, grant_dir):
    d = grant_dir(0o755)
    (d / "real-envrc").write_text("")
    (d / ".envrc").symlink_to("real-envrc")
    r = agentvm("run", "--json", "--mount", f"{d}:/out:rw", "--", "true")
    assert r.returncode == 77
    res = last_json(r.stdout)
    assert res["error"] == "policy.grant-trusted-link" and ".envrc" in res["message"], res


def test_writable_trusted_names_are_validated(agentvm, tmp_path, grant_dir):
    d = grant_dir(0o755)
    f = write_agent(tmp_path, "wtbad", extra=f"  mounts:\n    - {{host: {d}, path: /out, mode: rw, writableTrusted: [.ssh]}}\n")
    r = agentvm("run", "-f", str(f), "--", "true")
    assert r.returncode == 78 and b"writableTrusted" in r.stderr and b".ssh" in r.stderr, r.stderr

"""Attacks on review-mode grants: an agent whose folder is granted in review mode plants what
would hurt the host if `agentvm accept` applied it naively - links to /etc/passwd and out of
the folder, hardlinks, FIFOs, setuid files, host-trusted names, accept's own temporary names -
or races the operator's accept from a running sandbox. Each test runs the real sandbox, then
the real accept, and judges the host: nothing outside the folder changes, nothing special or
setuid lands in it, nothing unreviewed is applied.

The sandbox is started by a small script on the public runtime (a review grant is not yet
expressible on `agentvm run`'s command line); diff/accept through the real CLI."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _attacklib import needs_root

pytestmark = [pytest.mark.attack, needs_root]

LAUNCH = textwrap.dedent("""
    import sys
    from agentvm import review
    from agentvm.policy import Policy
    from agentvm.runtime import Runtime
    folder, script = sys.argv[1], sys.argv[2]
    pol = Policy(name="run", command=("/bin/sh", "-c", script), mounts=(review.review_mount(folder, "/src"),),
                 network="none", workspace=None)
    rt = Runtime()
    try:
        res = rt.run(pol, tty=False, stdio=(0, 1, 2))
    finally:
        rt.close()
    sys.exit(res.exit_code)
""")


@pytest.fixture
def folder():
    d = Path(f"/tmp/agentvm-grant-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "a.txt").write_text("original\n")
    (d / ".git").mkdir()
    (d / ".git" / "hooks").mkdir()
    (d / "sub").mkdir()
    (d / "sub" / "f").write_text("f\n")
    yield d
    home = os.environ.get("AGENTVM_HOME")
    if home:  # the layers over it go too: the session's home is shared with later tests
        for x in layers_of(Path(home), d):
            subprocess.run([sys.executable, "-m", "agentvm", "discard", x["name"]], capture_output=True, timeout=60)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def outside():
    """A host folder outside the grant, next to it: nothing may appear or change there."""
    d = Path(f"/tmp/agentvm-outside-{secrets.token_hex(4)}")
    d.mkdir(mode=0o755)
    (d / "victim").write_text("untouched\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sandbox(folder: Path, script: str, *, background: bool = False, timeout: float = 120):
    args = [sys.executable, "-c", LAUNCH, str(folder), script]
    if background:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentvm", *args], capture_output=True, text=True, timeout=120)


def layers_of(home: Path, folder: Path) -> list[dict]:
    from agentvm import review

    return [x for x in review.list_layers(home) if str(folder) in x["grants"]]


def layer_name(home: Path, folder: Path) -> str:
    names = [x["name"] for x in layers_of(home, folder)]
    assert len(names) == 1, names
    return names[0]


def digest(p: str) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def host_state(folder: Path, outside: Path) -> dict:
    return {"passwd": digest("/etc/passwd"), "shadow": digest("/etc/shadow"),
            "outside": sorted(os.listdir(outside)), "victim": (outside / "victim").read_text()}


def links_out(folder: Path) -> list[str]:
    bad = []
    for dirpath, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                t = os.readlink(p)
                if t.startswith("/") or not os.path.realpath(p).startswith(str(folder) + "/"):
                    bad.append(f"{p} -> {t}")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                bad.append(f"{p}: special file")
            elif st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                bad.append(f"{p}: setuid/setgid")
    return bad


def test_links_out_of_the_folder_gain_nothing(avm_home, folder, outside):
    before = host_state(folder, outside)
    script = f"""
    cd /src
    ln -s /etc/passwd passwd; ln -s ../../../../../etc/shadow shadow
    ln -s {outside} out; ln -s {outside}/victim victim
    rm -rf sub && ln -s /etc sub                       # a folder of the host's replaced by a link out
    echo pwned > passwd; echo pwned > out/victim; echo new > out/new; echo x > sub/agentvm-planted
    echo fine > a.txt
    """
    code, out = sandbox(folder, textwrap.dedent(script))
    name = layer_name(avm_home, folder)
    r = cli("accept", name)
    assert r.returncode != 0 and "review.refused" in r.stderr, r.stdout + r.stderr
    for n in ("passwd", "shadow", "out", "victim", "sub"):
        assert f"  {n}:" in r.stderr, (n, r.stderr)
    assert (folder / "a.txt").read_text() == "original\n", "refused as a whole: nothing applied"
    r = cli("accept", name, "a.txt")  # the rest, by name
    assert r.returncode == 0, r.stderr
    assert (folder / "a.txt").read_text() == "fine\n"
    assert host_state(folder, outside) == before
    assert not links_out(folder) and (folder / "sub" / "f").read_text() == "f\n"
    assert not Path("/etc/agentvm-planted").exists()


def test_chains_of_links_each_inside_as_text_gain_nothing(avm_home, folder, outside):
    """The security review's chains: each link is "inside the folder" read as text alone, but
    followed together they lead out - ``x/l -> ..`` + ``esc -> x/l/..``, a deep ``l -> ../../../..``
    used as ``pw -> a/b/c/d/l/../../../../etc/passwd``, and a host folder's own link out
    (``vendor -> <outside>``) used as ``e -> vendor/..`` / ``v2 -> vendor/victim``. accept
    refuses each; the innocent ones (``x/l``, ``a/b/c/d/l`` stay inside, ``ok -> sub/f``) apply."""
    os.symlink(str(outside), folder / "vendor")  # the host folder's own link out (not the agent's)
    before = host_state(folder, outside)
    script = """
    cd /src
    mkdir x && ln -s .. x/l && ln -s x/l/.. esc
    mkdir -p a/b/c/d && ln -s ../../../.. a/b/c/d/l && ln -s a/b/c/d/l/../../../../etc/passwd pw
    ln -s vendor/.. e; ln -s vendor/victim v2; ln -s esc esc2; ln -s loop1 loop2; ln -s loop2 loop1
    ln -s sub/f ok
    """
    code, out = sandbox(folder, textwrap.dedent(script))
    assert code == 0, out
    name = layer_name(avm_home, folder)
    r = cli("accept", name)
    assert r.returncode != 0 and "review.refused" in r.stderr, r.stdout + r.stderr
    for n in ("esc", "pw", "e", "v2", "esc2", "loop1", "loop2"):
        assert f"  {n}:" in r.stderr, (n, r.stderr)
    assert not (folder / "esc").exists() and not (folder / "pw").is_symlink(), "refused as a whole"
    r = cli("accept", name, "x", "a", "ok")  # the rest, by name
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.readlink(folder / "x" / "l") == ".." and os.readlink(folder / "ok") == "sub/f"
    for n in ("esc", "pw", "e", "v2", "esc2", "loop1", "loop2"):
        assert not os.path.lexists(folder / n), n
    assert host_state(folder, outside) == before
    (folder / "vendor").unlink()  # the host's own link, planted by this test
    # x/l and a/b/c/d/l lead to the folder itself (links_out wants strictly below it)
    assert os.path.realpath(folder / "x" / "l") == os.path.realpath(folder / "a/b/c/d/l") == str(folder)
    assert [b for b in links_out(folder) if not b.endswith(("x/l -> ..", "a/b/c/d/l -> ../../../.."))] == []


def test_hardlinks_fifos_setuid_and_reserved_names(avm_home, folder, outside):
    before = host_state(folder, outside)
    script = """
    cd /src
    ln a.txt hard && echo HARD
    ln /etc/passwd pw 2>/dev/null && echo HARD-PASSWD
    mkfifo fifo 2>/dev/null && echo FIFO
    python3 -c "import socket; s=socket.socket(socket.AF_UNIX); s.bind('/src/sock')" 2>/dev/null && echo SOCK
    cp /bin/true suid && chmod 4755 suid 2>/dev/null; chmod 6755 suid 2>/dev/null; ls -l suid
    echo planted > .agentvm-accept-hidden && echo RESERVED
    echo edit >> a.txt
    """
    code, out = sandbox(folder, textwrap.dedent(script))
    assert "HARD" in out.split() and "HARD-PASSWD" not in out
    assert "FIFO" not in out and "SOCK" not in out, "no FIFO or socket in a grant's layer (Landlock)"
    name = layer_name(avm_home, folder)
    d = cli("diff", name).stdout
    assert "REFUSED /src/.agentvm-accept-hidden" in d, d
    r = cli("accept", name, "a.txt", "hard", "suid")
    assert r.returncode == 0, r.stderr
    st_a, st_h = os.lstat(folder / "a.txt"), os.lstat(folder / "hard")
    assert st_a.st_ino != st_h.st_ino and st_a.st_nlink == 1 and st_h.st_nlink == 1, "a hardlink lands as a copy"
    assert (folder / "hard").read_text() == "original\nedit\n"
    if (folder / "suid").exists():
        assert not os.lstat(folder / "suid").st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert not (folder / ".agentvm-accept-hidden").exists()
    assert not links_out(folder) and host_state(folder, outside) == before


def test_host_trusted_names_are_never_applied(avm_home, folder, outside):
    script = """
    cd /src
    echo evil > .git/hooks/pre-commit 2>/dev/null && echo HOOK
    mv .git .git-old 2>/dev/null && echo MOVED
    rm -rf .git 2>/dev/null; echo evil > .envrc 2>/dev/null && echo ENVRC
    mkdir .github 2>/dev/null; mkdir -p .github/workflows 2>/dev/null && echo GITHUB
    echo '[core] fsmonitor = /tmp/x' > .gitconfig 2>/dev/null && echo GITCONFIG
    """
    code, out = sandbox(folder, textwrap.dedent(script))
    for w in ("HOOK", "MOVED", "ENVRC", "GITHUB", "GITCONFIG"):
        assert w not in out.split(), (w, out)
    name = layer_name(avm_home, folder)
    cli("accept", name)
    assert sorted(os.listdir(folder)) == [".git", "a.txt", "sub"]
    assert os.listdir(folder / ".git" / "hooks") == []


def test_racing_accept_from_a_running_sandbox_gains_nothing(avm_home, folder, outside):
    """The agent keeps swapping what the operator looks at (a file <-> a link to /etc/shadow, a
    folder <-> a link out) while the operator diffs and accepts with --expect: only what a diff
    showed is ever applied, and nothing is written through a link."""
    from agentvm import review

    before = host_state(folder, outside)
    script = f"""
    cd /src
    end=$(( $(date +%s) + 6 ))
    while [ $(date +%s) -lt $end ]; do
      rm -rf x; echo "benign" > x
      rm -rf x; ln -s /etc/shadow x
      rm -rf d; mkdir d; echo inner > d/f
      rm -rf d; ln -s {outside} d
    done
    rm -rf x d; echo "benign" > x
    """
    proc = sandbox(folder, textwrap.dedent(script), background=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not layers_of(avm_home, folder):
            time.sleep(0.05)
        name = layer_name(avm_home, folder)
        assert layers_of(avm_home, folder)[0]["running"]
        plain = cli("accept", name)
        assert plain.returncode != 0 and "review.running" in plain.stderr, "a running layer needs --expect"
        tries = accepted = 0
        while proc.poll() is None and tries < 200:
            tries += 1
            d = cli("diff", name).stdout
            rid = d.strip().splitlines()[-1].split()[2]
            r = cli("accept", name, "--expect", rid)
            accepted += r.returncode == 0
            assert not links_out(folder), (d, r.stdout, r.stderr)
            assert host_state(folder, outside) == before
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"race: {tries} diff+accept rounds, {accepted} accepted")
    assert tries > 3, "the race did not run"
    # after the sandbox stopped, the layer holds its last word: a plain file, accepted cleanly
    r = cli("accept", name)
    assert r.returncode == 0, r.stderr
    assert (folder / "x").read_text() == "benign\n" and not (folder / "d").exists()
    assert not links_out(folder) and host_state(folder, outside) == before
    cli("discard", name)


def test_a_partial_accept_judges_links_against_the_host_as_it_stays(avm_home, folder, outside):
    """A link judged only against the whole layer is not safe to apply alone: the host's
    ``vendor -> <outside>/sub`` replaced in the layer by ``vendor -> lib`` makes ``esc -> vendor/..``
    look inside, but ``agentvm accept NAME esc`` leaves the host's vendor in place and esc leads
    out; a whiteout of the host's link ``vend2`` makes ``esc2 -> vend2/..`` look inside the same
    way. Each is refused, alone or with everything; once the host's links are replaced (accepted
    by name), the same links stay inside and apply."""
    (outside / "sub").mkdir()
    os.symlink(f"../{outside.name}/sub", folder / "vendor")  # the host folder's own links out
    os.symlink(f"../{outside.name}", folder / "vend2")
    before = host_state(folder, outside)
    script = """
    cd /src
    rm vendor && mkdir lib && ln -s lib vendor && ln -s vendor/.. esc
    rm vend2 && ln -s vend2/.. esc2
    """
    code, out = sandbox(folder, textwrap.dedent(script))
    assert code == 0, out
    name = layer_name(avm_home, folder)
    for sel in (("esc",), ("esc2",), ("esc", "esc2"), ()):
        r = cli("accept", name, *sel)
        assert r.returncode != 0 and "review.refused" in r.stderr, (sel, r.stdout + r.stderr)
        for n in sel or ("esc", "esc2"):
            assert f"  {n}:" in r.stderr, (sel, n, r.stderr)
        assert not os.path.lexists(folder / "esc") and not os.path.lexists(folder / "esc2"), sel
        assert os.readlink(folder / "vendor") == f"../{outside.name}/sub", "refused as a whole"
    assert host_state(folder, outside) == before
    r = cli("accept", name, "lib", "vendor", "vend2")  # the host's links out go first
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.readlink(folder / "vendor") == "lib" and not os.path.lexists(folder / "vend2")
    r = cli("accept", name, "esc", "esc2")  # now inside as the host is and as the layer is
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.realpath(folder / "esc") == os.path.realpath(folder / "esc2") == str(folder)
    assert host_state(folder, outside) == before and sorted(os.listdir(outside / "sub")) == []

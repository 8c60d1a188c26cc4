"""Which symlinks on a granted path are trusted: only those in root-owned directories nobody
else can write (the operator's own). A link in a directory another user can write could be
re-pointed between our check and our open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentvm.errors import PolicyDenied
from agentvm.fsutil import check_grant_target, untrusted_symlink

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks need root to set up")


def test_plain_paths_and_root_owned_links_are_trusted(tmp_path):
    os.chmod(tmp_path, 0o755)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert untrusted_symlink(str(tmp_path / "real")) is None
    assert untrusted_symlink(str(tmp_path / "link")) is None
    assert untrusted_symlink(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "owned-by-a-user"])
def test_links_in_directories_others_can_write_are_not(tmp_path, how):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    if how == "world-writable":
        os.chmod(shared, 0o777)
    elif how == "group-writable":
        os.chmod(shared, 0o775)
    else:
        os.chmod(shared, 0o755)
        os.chown(shared, 4321, 4321)
    (shared / "ref").symlink_to("/etc")
    assert untrusted_symlink(str(shared / "ref")) == str(shared / "ref")
    assert untrusted_symlink(str(shared / "ref" / "ssl")) == str(shared / "ref")


def test_relative_and_chained_links_are_followed(tmp_path):
    os.chmod(tmp_path, 0o755)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    (open_dir / "evil").symlink_to("/etc")
    (tmp_path / "a" / "hop").symlink_to("../open/evil")  # trusted hop into an untrusted one
    assert untrusted_symlink(str(tmp_path / "a" / "hop")) == str(open_dir / "evil")


@pytest.mark.parametrize("real", ["/", "/proc", "/sys", "/dev", "/run", "/boot"])
def test_host_critical_targets_are_refused(real, tmp_path):
    with pytest.raises(PolicyDenied):
        check_grant_target(real, [tmp_path], real)


def test_agentvm_state_is_refused_both_ways(tmp_path):
    home = tmp_path / "home"
    with pytest.raises(PolicyDenied):
        check_grant_target(str(home / "workspaces" / "x"), [home], "x")
    with pytest.raises(PolicyDenied):
        check_grant_target(str(tmp_path), [home], "parent")
    check_grant_target(str(tmp_path / "elsewhere"), [home], "ok")


def test_sticky_directory_trusts_only_roots_links(tmp_path):
    os.chmod(tmp_path, 0o755)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    (sticky / "mine").symlink_to("/etc")  # root's: others cannot replace it
    (sticky / "theirs").symlink_to("/etc")
    os.chown(sticky / "theirs", 4321, 4321, follow_symlinks=False)
    assert untrusted_symlink(str(sticky / "mine")) is None
    assert untrusted_symlink(str(sticky / "theirs")) == str(sticky / "theirs")


@pytest.mark.parametrize("path,writable,refused", [
    ("/usr/share/doc", False, False),       # read-only documentation: fine
    ("/usr/local/bin", True, True),          # what root executes
    ("/usr/lib/systemd/system", True, True),
    ("/var/spool/cron", False, True),
    ("/var/lib/postgresql", False, True),
    ("/var/log", False, True),
    ("/var/www/site", True, False),          # a web root is data
    ("/srv/proj", True, False),
    ("/opt/app", True, False),
    ("/etc/ssl", False, True),
    ("/opt", False, True),
    ("/nix/store", False, False),            # world-readable store: read-only is fine
    ("/nix/store", True, True),
])
def test_system_trees_are_not_grantable(path, writable, refused):
    from agentvm.errors import PolicyDenied
    from agentvm.fsutil import check_grant_target

    if refused:
        with pytest.raises(PolicyDenied):
            check_grant_target(path, [], path, writable)
    else:
        check_grant_target(path, [], path, writable)


# /root is a home like any other: the home itself and its dotfiles / dot-directories (and
# anything under them) are refused, project folders inside it are grants like /home/x/proj.
@pytest.mark.parametrize("path", [
    "/root", "/root/", "/root/.ssh", "/root/.ssh/id_ed25519", "/root/.config", "/root/.config/gh/hosts.yml",
    "/root/.aws", "/root/.aws/credentials", "/root/.bashrc", "/root/.agentvm", "/root/.agentvm/vault",
    "/root/.docker/config.json", "/root/.gnupg", "/root/.netrc", "/root/.git-credentials",
])
@pytest.mark.parametrize("writable", [False, True])
def test_root_home_and_its_dotfiles_are_refused(path, writable):
    from agentvm.errors import PolicyDenied
    from agentvm.fsutil import check_grant_target

    real = path.rstrip("/") or "/"
    with pytest.raises(PolicyDenied) as ei:
        check_grant_target(real, [], path, writable)
    assert ei.value.code == "policy.grant-home", ei.value.message


@pytest.mark.parametrize("path", ["/root/proj", "/root/src/app", "/root/proj/.git", "/root/proj/.env",
                                  "/root/work.d/x", "/root/proj/.ssh"])
@pytest.mark.parametrize("writable", [False, True])
def test_project_folders_in_root_home_are_grantable(path, writable):
    from agentvm.fsutil import check_grant_target

    check_grant_target(path, [], path, writable)  # no exception


def test_every_home_follows_the_same_rule(monkeypatch):
    """/home/x and /root: the home and its dot entries are refused, project folders are not."""
    from agentvm import fsutil
    from agentvm.errors import PolicyDenied

    monkeypatch.setattr(fsutil, "_home_dirs", lambda: {"/root", "/home/ann", "/srv/home/bob"})
    for home in ("/root", "/home/ann", "/srv/home/bob"):
        for bad in (home, f"{home}/.ssh", f"{home}/.ssh/id_rsa", f"{home}/.config/git", f"{home}/.profile"):
            with pytest.raises(PolicyDenied) as ei:
                fsutil.check_grant_target(bad, [], bad, False)
            assert ei.value.code == "policy.grant-home", bad
        fsutil.check_grant_target(f"{home}/proj", [], f"{home}/proj", True)
    assert fsutil.home_part("/home/annex/.ssh", {"/home/ann"}) is None, "a sibling is not inside the home"


def test_root_is_a_home_even_when_the_account_database_says_otherwise(monkeypatch):
    import pwd

    monkeypatch.setattr(pwd, "getpwall", lambda: [])
    from agentvm.fsutil import _home_dirs, home_part

    assert "/root" in _home_dirs()
    assert home_part("/root/.ssh") == ("/root", ".ssh")
    assert home_part("/root/proj") is None


def test_agentvm_state_under_root_is_refused(tmp_path):
    """A state home under /root (AGENTVM_HOME=/root/avm, or /root/.agentvm): neither it, nor a
    folder holding it, nor anything inside it can be granted."""
    from agentvm.fsutil import check_grant_target

    for state in (Path("/root/avm-state"), Path("/root/.agentvm")):
        for p in (str(state), str(state / "workspaces" / "x"), "/root"):
            with pytest.raises(PolicyDenied):
                check_grant_target(p, [state], p, True)
    check_grant_target("/root/proj", [Path("/root/avm-state")], "/root/proj", True)


# ---------------------------------------------------------------------------- host-trusted names (agentvm.grants)

ROOT = Path(__file__).resolve().parents[2]


def test_host_trusted_names_are_one_list_with_a_reason_each_and_the_docs_table_is_generated_from_it():
    from agentvm import grants

    names = [t.name for t in grants.HOST_TRUSTED]
    assert len(names) == len(set(names)) and tuple(names) == grants.TRUSTED_NAMES
    assert all(t.reason and t.absent in ("dir", "file", None) and "/" not in t.name for t in grants.HOST_TRUSTED)
    doc = (ROOT / "docs" / "policy-reference.md").read_text()
    assert grants.docs_table() in doc, "regenerate: python -m agentvm.grants --write-docs"
    table = doc[doc.index(grants.DOCS_BEGIN):doc.index(grants.DOCS_END)]
    listed = [ln.split("`")[1] for ln in table.splitlines() if ln.startswith("| `")]
    assert listed == names, "docs/policy-reference.md lists exactly agentvm.grants.HOST_TRUSTED"
    # the host-executed configuration class of issue 35 item 5 is protected (placeholder when absent) ...
    absent = {t.name: t.absent for t in grants.HOST_TRUSTED}
    for n in (".devcontainer", ".devcontainer.json", ".npmrc", ".yarnrc", ".yarnrc.yml", ".gitattributes",
              ".gitconfig", ".bazelrc", ".cargo", ".tool-versions", ".python-version", ".nvmrc", ".idea",
              ".vscode", ".github", ".envrc", ".mcp.json", ".claude"):
        assert absent.get(n) in ("dir", "file"), n
    # ... the project's own code is not (review-mode grants, docs/threat-model.md)
    for n in ("Makefile", "GNUmakefile", "conftest.py", "sitecustomize.py", ".editorconfig"):
        assert n not in absent, n
    tm = (ROOT / "docs" / "threat-model.md").read_text()
    assert "agentvm.grants.HOST_TRUSTED" in tm and all(n in tm for n in ("Makefile", "conftest.py", "sitecustomize.py"))


def test_plan_protects_every_trusted_name_at_the_top_and_lifts_only_what_is_writable(tmp_path):
    from agentvm import grants

    g = tmp_path / "proj"
    (g / "sub").mkdir(parents=True)
    (g / ".npmrc").write_text("registry=x\n")
    (g / "pip.conf").write_text("[global]\n")
    (g / "sub" / ".envrc").write_text("x\n")  # a subfolder's: the agent's
    got = {p.rel: p.kind for p in grants.plan(str(g))}
    want = {t.name: t.absent for t in grants.HOST_TRUSTED if t.absent} | {".npmrc": "file", "pip.conf": "file"}
    assert got == want
    assert not any(r.startswith("sub") for r in got)
    got = {p.rel for p in grants.plan(str(g), (".npmrc", ".github", "pip.conf"))}
    assert got == set(want) - {".npmrc", ".github", "pip.conf"}
    (g / ".devcontainer").symlink_to(g / "sub")
    with pytest.raises(PolicyDenied) as e:
        grants.plan(str(g))
    assert e.value.code == "policy.grant-trusted-link"

"""Which symlinks on a granted path are trusted: only those in root-owned directories nobody
else can write (the operator's own). A link in a directory another user can write could be
re-pointed between our check and our open."""

from __future__ import annotations

import os

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

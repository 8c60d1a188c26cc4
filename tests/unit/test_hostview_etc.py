"""The sandbox's /etc view holds what /usr points into /etc (Debian's JDK keeps its configuration
in /etc/java-*), never a secret class (hostview.ETC_REFUSED is the one list), and the scan of
/usr that finds those links runs once: cached until a cheap stamp changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentvm.backends import hostview as hv


def _tree(tmp_path: Path) -> Path:
    """A root with a JDK-like layout: /usr links into /etc, some of them to secret classes."""
    root = tmp_path / "root"
    etc = root / "etc"
    (etc / "java-99" / "security").mkdir(parents=True)
    (etc / "java-99" / "security" / "java.security").write_text("securerandom.source=file:/dev/random\n")
    (etc / "java-99" / "jvm.cfg").write_text("-server KNOWN\n")
    (etc / "java-99" / "security" / "server.key").write_text("KEY")  # a key beside config: never copied
    (etc / "tool").mkdir()
    (etc / "tool" / "tool.conf").write_text("x=1\n")
    (etc / "tool" / "private").mkdir()
    (etc / "tool" / "private" / "k").write_text("KEY")
    (etc / "tool" / "credentials.json").write_text("{}")
    (etc / "chain").symlink_to("tool")  # a link in /etc: its end is copied too
    (etc / "ssh").mkdir()
    (etc / "ssh" / "ssh_host_ed25519_key").write_text("HOSTKEY")
    (etc / "shadow").write_text("root:$6$x:1::::::\n")
    (etc / "environment").write_text("API_TOKEN=sk-live\n")
    (etc / "ssl").mkdir()
    (etc / "ssl" / "openssl.cnf").write_text("# allowlisted\n")
    conf = root / "usr" / "lib" / "jvm" / "java-99" / "conf" / "security"
    conf.mkdir(parents=True)
    (conf / "java.security").symlink_to("/etc/java-99/security/java.security")
    (conf.parent.parent / "lib").mkdir()
    (conf.parent.parent / "lib" / "jvm.cfg").symlink_to("../../../../../etc/java-99/jvm.cfg")  # relative
    share = root / "usr" / "share" / "tool"
    share.mkdir(parents=True)
    (share / "conf").symlink_to("/etc/chain")
    for secret in ("/etc/shadow", "/etc/ssh/ssh_host_ed25519_key", "/etc/environment", "/etc/ssh",
                   "/etc/java-99/security/server.key", "/etc/tool/private/k"):
        (share / secret.replace("/", "_")).symlink_to(secret)
    (share / "certs").symlink_to("/etc/ssl/openssl.cnf")  # allowlisted already
    (share / "etc-itself").symlink_to("/etc")
    (share / "up").symlink_to("/etc/../root/.ssh")
    return root


def test_what_usr_points_into_etc_is_found_minus_the_secret_classes(tmp_path):
    root = _tree(tmp_path)
    targets, dirs = hv._usr_links_scan(str(root))
    assert targets == ["chain", "java-99/jvm.cfg", "java-99/security/java.security"], targets
    assert str(root / "usr" / "lib" / "jvm" / "java-99" / "conf" / "security") in dirs


def test_the_view_holds_linked_targets_and_no_secret(tmp_path):
    root = _tree(tmp_path)
    view = hv.etc_view(tmp_path / "runtime", root=str(root))
    assert (view / "java-99" / "security" / "java.security").read_text().startswith("securerandom")
    assert (view / "java-99" / "jvm.cfg").is_file()
    assert os.readlink(view / "chain") == "tool" and (view / "tool" / "tool.conf").is_file()
    for absent in ("shadow", "ssh", "environment", "java-99/security/server.key", "tool/private", "tool/credentials.json"):
        assert not os.path.lexists(view / absent), absent
    assert "root:x:0:0" in (view / "passwd").read_text(), "accounts stay synthetic"
    assert hv.etc_view_holds("java-99/security/java.security", tmp_path / "runtime", str(root))
    assert not hv.etc_view_holds("ssh/ssh_host_ed25519_key", tmp_path / "runtime", str(root))


@pytest.mark.parametrize("rel,refused", [
    ("shadow", True), ("gshadow", True), ("sudoers.d/x", True), ("ssh", True), ("ssh/ssh_config", True),
    ("ssl/private/x.pem", True), ("machine-id", True), ("environment", True), ("security/limits.conf", True),
    ("pip.conf", True), ("docker/daemon.json", True), ("x/y/id_ed25519", True), ("a/server.key", True),
    ("a/../shadow", True), ("maven/settings-security.xml", True), ("tool/credentials", True),
    ("java-17-openjdk/security/java.security", False), ("maven/m2.conf", False), ("X11/rgb.txt", False),
    ("ssl/certs/ca-certificates.crt", False),
])
def test_the_refusal_list_is_the_authority(rel, refused):
    assert hv.etc_refused(rel) is refused
    if refused:
        assert not hv.etc_view_holds(rel), "not even an allowlisted folder can bring a secret class in"


def test_the_allowlist_brings_in_no_secret_class():
    """Every allowlisted entry is outside the refused classes (else the list would contradict itself)."""
    for name in hv.ETC_ALLOW:
        assert not hv.etc_refused(name), name


def test_the_scan_runs_once_and_again_only_when_its_stamp_changes(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    runtime = tmp_path / "runtime"
    calls = []
    real = hv._usr_links_scan
    monkeypatch.setattr(hv, "_usr_links_scan", lambda r: calls.append(r) or real(r))
    first = hv.usr_linked_etc(runtime, str(root))
    assert hv.usr_linked_etc(runtime, str(root)) == first and len(calls) == 1, "cached"
    # a package installed: the package database changes
    (root / "var" / "lib" / "dpkg").mkdir(parents=True)
    (root / "var" / "lib" / "dpkg" / "status").write_text("Package: x\n")
    hv.usr_linked_etc(runtime, str(root))
    assert len(calls) == 2
    assert hv.usr_linked_etc(runtime, str(root)) == first and len(calls) == 2
    # a runtime unpacked by hand next to the known one: its parent folder changes
    other = root / "usr" / "lib" / "jvm" / "java-100" / "conf"
    (root / "etc" / "java-100").mkdir()
    (root / "etc" / "java-100" / "net.properties").write_text("x\n")
    other.mkdir(parents=True)
    (other / "net.properties").symlink_to("/etc/java-100/net.properties")
    again = hv.usr_linked_etc(runtime, str(root))
    assert len(calls) == 3 and "java-100/net.properties" in again
    # a tampered cache cannot bring a secret class in
    cache = next(runtime.glob("usr-etc-links-*.json"))
    import json

    data = json.loads(cache.read_text())
    data["targets"].append("shadow")
    cache.write_text(json.dumps(data))
    assert "shadow" not in hv.usr_linked_etc(runtime, str(root))


def test_a_changed_linked_file_rebuilds_the_view(tmp_path):
    root = _tree(tmp_path)
    runtime = tmp_path / "runtime"
    v1 = hv.etc_view(runtime, root=str(root))
    hv._VIEW_CACHE.clear()
    (root / "etc" / "java-99" / "jvm.cfg").write_text("-server KNOWN\n-client IGNORE\n")
    v2 = hv.etc_view(runtime, root=str(root))
    assert v1 != v2 and "client" in (v2 / "java-99" / "jvm.cfg").read_text()

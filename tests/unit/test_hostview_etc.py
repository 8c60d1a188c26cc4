"""The sandbox's /etc view holds what /usr points into /etc (Debian's JDK keeps its configuration
in /etc/java-*), never a secret class (hostview.ETC_REFUSED is the one list), and the scan of
/usr that finds those links runs once: cached until a cheap stamp changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agentvm.backends import hostview as hv
from agentvm.errors import LaunchError


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


# ---------------------------------------------------------------------------- linked folders, file by file

PEM_KEY = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----\n"


def _linked_tree(tmp_path: Path) -> Path:
    """A root whose /usr links to whole /etc folders holding credentials with generic names
    (Maven, a Hadoop-style conf folder) and files a non-root user cannot read."""
    root = tmp_path / "root"
    etc = root / "etc"
    for d in ("maven/logging", "hadoop/conf", "java-99/security", "java-99/management", "ssl/certs/java"):
        (etc / d).mkdir(parents=True)
    (etc / "maven" / "m2.conf").write_text("main is org.apache.maven.cli.MavenCli from plexus.core\n")
    (etc / "maven" / "logging" / "simplelogger.properties").write_text("x=1\n")
    (etc / "maven" / "settings.xml").write_text("<settings><servers><server><password>hunter2</password></server></servers></settings>\n")
    (etc / "maven" / "settings-security.xml").write_text("<settingsSecurity><master>x</master></settingsSecurity>\n")
    (etc / "hadoop" / "conf" / "core-site.xml").write_text("<property><name>fs.s3a.secret.key</name><value>AKIA</value></property>\n")
    (etc / "hadoop" / "conf" / "log4j.properties").write_text("log4j.rootLogger=INFO\n")
    (etc / "hadoop" / "conf" / ".pgpass").write_text("db:5432:*:app:pw\n")
    (etc / "hadoop" / "conf" / "tls.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n" * 40 + PEM_KEY)
    (etc / "hadoop" / "conf" / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (etc / "hadoop" / "conf" / "server.keystore").write_bytes(b"\xfe\xed\xfe\xed")
    (etc / "hadoop" / "conf" / "client.p12").write_bytes(b"0\x82")
    (etc / "hadoop" / "conf" / "only-root.properties").write_text("s3.key=abc\n")
    os.chmod(etc / "hadoop" / "conf" / "only-root.properties", 0o600)
    (etc / "hadoop" / "conf" / "fifo").mkdir()  # a folder the world cannot enter: nothing in it
    (etc / "hadoop" / "conf" / "fifo" / "f.xml").write_text("<x/>\n")
    os.chmod(etc / "hadoop" / "conf" / "fifo", 0o700)
    os.mkfifo(etc / "hadoop" / "conf" / "pipe")  # never opened (copytree would block on it)
    (etc / "java-99" / "security" / "java.security").write_text("securerandom.source=file:/dev/random\n")
    (etc / "java-99" / "management" / "jmxremote.password").write_text("monitorRole QED\n")
    (etc / "java-99" / "management" / "management.properties").write_text("# x\n")
    (etc / "ssl" / "certs" / "java" / "cacerts").write_bytes(b"\xfe\xed\xfe\xed trust store")
    usr = root / "usr"
    (usr / "share" / "maven").mkdir(parents=True)
    (usr / "share" / "maven" / "conf").symlink_to("/etc/maven")
    (usr / "lib" / "hadoop").mkdir(parents=True)
    (usr / "lib" / "hadoop" / "conf").symlink_to("/etc/hadoop/conf")
    jdk = usr / "lib" / "jvm" / "java-99"
    (jdk / "conf").mkdir(parents=True)
    (jdk / "conf" / "security").symlink_to("/etc/java-99/security")
    (jdk / "conf" / "management").symlink_to("/etc/java-99/management")
    (jdk / "lib" / "security").mkdir(parents=True)
    (jdk / "lib" / "security" / "cacerts").symlink_to("/etc/ssl/certs/java/cacerts")
    return root


def test_linked_folders_never_bring_credentials_or_what_the_world_cannot_read(tmp_path):
    root = _linked_tree(tmp_path)
    view = hv.etc_view(tmp_path / "runtime", root=str(root))
    for present in ("maven/m2.conf", "maven/logging/simplelogger.properties", "hadoop/conf/log4j.properties",
                    "hadoop/conf/ca.pem", "java-99/security/java.security", "java-99/management/management.properties",
                    "ssl/certs/java/cacerts"):
        assert (view / present).is_file(), present
    for absent in ("maven/settings.xml", "maven/settings-security.xml", "hadoop/conf/core-site.xml",
                   "hadoop/conf/.pgpass", "hadoop/conf/tls.pem", "hadoop/conf/server.keystore", "hadoop/conf/client.p12",
                   "hadoop/conf/only-root.properties", "hadoop/conf/fifo", "hadoop/conf/pipe",
                   "java-99/management/jmxremote.password"):
        assert not os.path.lexists(view / absent), absent
    for dirpath, dirnames, filenames in os.walk(view):  # what is there, the world can read
        for n in filenames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                assert os.lstat(p).st_mode & 0o004, p
                assert b"PRIVATE KEY" not in Path(p).read_bytes(), p


@pytest.mark.parametrize("rel,refused", [
    ("maven/settings.xml", True), ("hadoop/conf/hdfs-site.xml", True), ("x/.pgpass", True),
    ("x/app.keystore", True), ("java-17-openjdk/management/jmxremote.password", True),
    ("ssl/certs/java/cacerts", False), ("pki/java/cacerts", False), ("maven/toolchains.xml", False),
])
def test_credential_bearing_config_names_are_refused(rel, refused):
    assert hv.etc_refused(rel) is refused


def test_the_private_key_marker(tmp_path):
    assert hv.carries_private_key(PEM_KEY.encode())
    assert hv.carries_private_key(b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbn\n")
    assert hv.carries_private_key(b"-----BEGIN PGP PRIVATE KEY BLOCK-----\n")
    assert hv.carries_private_key(b"-----BEGIN ENCRYPTED PRIVATE KEY-----\n")
    assert not hv.carries_private_key(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert not hv.carries_private_key(b"# the private key lives elsewhere\n")


# ---------------------------------------------------------------------------- the cache of /usr's links

@pytest.mark.parametrize("bad", ["/tmp/agentvm-poison/x", "../../tmp/x", "java/../../x", "a//b", "./a", "a/", ""])
def test_a_poisoned_links_cache_is_ignored(tmp_path, bad):
    root = _tree(tmp_path)
    runtime = tmp_path / "runtime"
    first = hv.usr_linked_etc(runtime, str(root))
    cache = next(runtime.glob("usr-etc-links-*.json"))
    import json

    data = json.loads(cache.read_text())
    data["targets"].append(bad)
    cache.write_text(json.dumps(data))
    assert hv.usr_linked_etc(runtime, str(root)) == first, "the whole cache is distrusted and the scan runs again"


def test_the_view_never_writes_outside_its_folder(tmp_path, monkeypatch):
    """Whatever the list of linked targets says (an absolute path from a poisoned cache), no
    folder is made outside the view - for the host's own root, read (never written) here."""
    outside = tmp_path / "outside"
    monkeypatch.setattr(hv, "usr_linked_etc", lambda runtime, root="/": (str(outside / "made" / "f"),))
    try:
        hv.etc_view(tmp_path / "runtime", root="/")
    except LaunchError:
        pass
    assert not outside.exists(), "a destination outside the view"


def test_a_destination_through_a_link_in_the_view_is_refused(tmp_path):
    """A linked target whose path runs through a link already copied into the view (/etc/chain
    -> /etc/tool, then chain/x) is never written through it."""
    root = _tree(tmp_path)
    (root / "etc" / "tool" / "x").write_text("1\n")
    (root / "usr" / "share" / "tool" / "x").symlink_to("/etc/chain/x")
    view = hv.etc_view(tmp_path / "runtime", root=str(root))
    assert os.readlink(view / "chain") == "tool" and (view / "tool" / "x").is_file()


# ---------------------------------------------------------------------------- the host's root, for real

NS_SCRIPT = r"""
import json, os, subprocess, sys
from pathlib import Path
fake, outside, runtime = sys.argv[1:4]
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "--bind", fake, "/etc"], check=True)
from agentvm.backends import hostview as hv
hv.usr_linked_etc = lambda runtime, root="/": ("jdk/management/management.properties", "jdk/security", "maven", "apps")
view = hv.etc_view(Path(runtime))
out = {}
for dirpath, dirnames, filenames in os.walk(view):
    for n in dirnames + filenames:
        p = os.path.join(dirpath, n)
        st = os.lstat(p)
        out[os.path.relpath(p, view)] = oct(st.st_mode & 0o7777) if not os.path.islink(p) else "link"
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare (a private mount namespace)")
def test_the_hosts_own_etc_is_read_without_following_a_linked_folder_out(tmp_path):
    """For the host's root (not only images'): a folder of a linked path that is a symlink out of
    /etc is never followed (it once was, with the link's 0777 & 0755 as the view's mode), and
    what a non-root host user cannot read never lands in the view. Run in a private mount
    namespace with a fake /etc bound over the real one: the host's /etc is never touched."""
    fake, outside, runtime = tmp_path / "etc", tmp_path / "outside", tmp_path / "runtime"
    (fake / "jdk" / "security").mkdir(parents=True)
    (fake / "jdk" / "security" / "java.security").write_text("securerandom.source=file:/dev/random\n")
    (fake / "jdk" / "security" / "root-only.properties").write_text("s=1\n")
    os.chmod(fake / "jdk" / "security" / "root-only.properties", 0o600)
    outside.mkdir(mode=0o700)
    os.chmod(outside, 0o700)
    (outside / "management.properties").write_text("jmx.password=secret-outside\n")
    os.chmod(outside / "management.properties", 0o644)
    (fake / "jdk" / "management").symlink_to(outside)
    (fake / "maven").mkdir()
    (fake / "maven" / "m2.conf").write_text("x\n")
    (fake / "maven" / "settings.xml").write_text("<password>p</password>\n")
    (fake / "apps").mkdir(mode=0o700)
    os.chmod(fake / "apps", 0o700)
    (fake / "apps" / "a.conf").write_text("x\n")
    import json
    import subprocess
    import sys

    r = subprocess.run(["unshare", "-m", sys.executable, "-c", NS_SCRIPT, str(fake), str(outside), str(runtime)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert "jdk/security/java.security" in got and "maven/m2.conf" in got
    for absent in ("jdk/management", "jdk/management/management.properties", "jdk/security/root-only.properties",
                   "maven/settings.xml", "apps", "apps/a.conf"):
        assert absent not in got, (absent, got)


def test_a_linked_folder_closed_to_the_world_later_rebuilds_the_view(tmp_path):
    """The view is cached by a fingerprint: a folder above or below a linked entry whose mode
    changes (closed to the world) makes a new view without what it holds."""
    root = _linked_tree(tmp_path)
    runtime = tmp_path / "runtime"
    v1 = hv.etc_view(runtime, root=str(root))
    assert (v1 / "maven" / "logging" / "simplelogger.properties").is_file()
    assert (v1 / "java-99" / "security" / "java.security").is_file()
    hv._VIEW_CACHE.clear()
    os.chmod(root / "etc" / "maven" / "logging", 0o700)
    os.chmod(root / "etc" / "java-99", 0o700)
    v2 = hv.etc_view(runtime, root=str(root))
    assert v1 != v2
    assert not os.path.lexists(v2 / "maven" / "logging") and not os.path.lexists(v2 / "java-99")


# ---------------------------------------------------------------------------- the selftest's check of the view

@pytest.mark.skipif(os.geteuid() != 0, reason="opens the host files as nobody")
def test_the_selftest_flags_view_files_a_non_root_user_cannot_read_or_holding_a_key():
    """fs.host-etc-files walks the sandbox's /etc: a file with the content of a host file that
    nobody cannot read (a 0600 file, or under a 0700 folder) or holding a private key is an
    escape; world-readable configuration is not."""
    import hashlib
    import tempfile

    from agentvm.selftest.cases import filesystem as fs

    host = Path(tempfile.mkdtemp(prefix="agentvm-test-etc-", dir="/tmp"))
    try:
        os.chmod(host, 0o755)
        (host / "open.conf").write_text("x=1\n")
        (host / "closed.properties").write_text("s3.key=abc\n")
        os.chmod(host / "closed.properties", 0o600)
        (host / "mgmt").mkdir(mode=0o700)
        os.chmod(host / "mgmt", 0o700)
        (host / "mgmt" / "m.properties").write_text("jmx=1\n")
        os.chmod(host / "open.conf", 0o644)
        os.chmod(host / "mgmt" / "m.properties", 0o644)

        def line(rel, data, marker=0):
            return f"VIEW\t/etc/{rel}\t{hashlib.sha256(data).hexdigest()}\t{marker}"

        out = "\n".join([line("open.conf", b"x=1\n"), line("closed.properties", b"s3.key=abc\n"),
                         line("mgmt/m.properties", b"jmx=1\n"), line("other.conf", b"synthetic\n"),
                         line("tls.pem", PEM_KEY.encode(), 1), "WALKED\t5"])
        walked, findings = fs._etc_view_findings(out, str(host))
        assert walked == 5
        assert sorted(f.split(":")[0] for f in findings) == ["/etc/closed.properties", "/etc/mgmt/m.properties", "/etc/tls.pem"], findings
        # a view file whose content differs from the host's (synthetic) is not host content
        walked, findings = fs._etc_view_findings(line("closed.properties", b"other\n") + "\nWALKED\t1", str(host))
        assert findings == []
    finally:
        shutil.rmtree(host, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="opens the host files as nobody")
def test_the_selftests_readability_check_fails_closed(monkeypatch):
    """If the check as nobody cannot run (it once ran from an unreadable cwd and said nothing),
    every file counts as unreadable."""
    from agentvm.selftest.cases import filesystem as fs

    monkeypatch.setattr(fs, "NOBODY_OPENS", "import sys; sys.exit(3)")
    assert fs._unreadable_by_nobody(["/etc/os-release"]) == {"/etc/os-release"}


def test_every_destination_is_checked_to_resolve_inside_the_view(tmp_path):
    view = tmp_path / "view"
    view.mkdir()
    (tmp_path / "outside").mkdir()
    (view / "x").symlink_to(tmp_path / "outside")
    copy = hv._EtcCopy("/", view)
    assert copy.dst("a/b") == view / "a" / "b"
    for bad in ("x/y", "/abs", "../up", "a//b", "a/./b", ""):
        with pytest.raises(LaunchError):
            copy.dst(bad)

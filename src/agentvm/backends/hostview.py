"""What every host-local sandbox (bwrap, gVisor) sees, whatever the substrate: the root view
(the host's /usr, an allowlisted /etc with synthetic accounts and resolver, private scratch
space), the per-sandbox files, and the environment (the gate's proxy and CA variables).

One definition, so two substrates behind the same agent file give the agent the same world.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
import time
from pathlib import Path

from agentvm import defaults as D
from agentvm.backends.base import HostContext, LaunchContext, MountOp
from agentvm.errors import LaunchError
from agentvm.policy import Policy, append_env

HOME_IN_SANDBOX = D.HOME_PATH
HELPER_IN_SANDBOX = "/.agentvm/init"
GATE_IN_SANDBOX = "/.agentvm/gate.sock"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # system CAs + the gate's CA (see etc_view)
GATE_CA_FILE = "/etc/ssl/certs/agentvm-gate-ca.pem"
NODE_SHIM_IN_SANDBOX = "/.agentvm/node"
MCP_SHIM_DIR_IN_SANDBOX = "/.agentvm/bin"
MCP_SHIM_IN_SANDBOX = MCP_SHIM_DIR_IN_SANDBOX + "/agentvm-mcp"
REQUEST_IN_SANDBOX = MCP_SHIM_DIR_IN_SANDBOX + "/agentvm-request"  # the same file: it looks at its name
# /etc entries visible in the sandbox (read-only, if they exist). Everything else of the
# host's /etc - shadow, sudoers, ssh keys, machine-id, pip/npm configs with tokens - is absent.
ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf",
    # Debian's chromium wrapper sources chromium.d (default flags, Debian's public API keys);
    # not /etc/chromium/policies (managed policies may hold enrollment tokens)
    "chromium.d", "chromium/master_preferences",
    "debian_version", "fonts",
    "gai.conf", "host.conf", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias",
    "localtime", "magic", "magic.mime", "mime.types", "os-release", "profile", "protocols", "python3",
    "python3.11", "services", "ssl", "terminfo", "timezone", "vim", "wgetrc", "xattr.conf",
)
# Secret classes never copied into the view, whatever asks for them - the allowlist above or a
# symlink of /usr into /etc (usr_linked_etc): glob patterns matched against every prefix of a
# path relative to /etc ("ssh" refuses ssh/ssh_host_ed25519_key), and against each single name
# (ETC_REFUSED_NAMES: private key folders and files, credential stores, anywhere). This is the
# one list (etc_refused): tests and docs/compatibility.md refer to it rather than keep copies.
ETC_REFUSED = (
    "shadow", "shadow-", "gshadow", "gshadow-", "passwd-", "group-", "subuid", "subuid-", "subgid", "subgid-",
    "sudoers", "sudoers.d", "security", "pam.d", "login.defs", "ssh", "ssl/private", "machine-id",
    "environment", "environment.d", "default", "profile.d", "krb5.keytab", "pip.conf", "npmrc", "netrc",
    "docker", "containers", "apt", "crontab", "cron.*", "fstab", "crypttab", "wireguard", "openvpn",
    "NetworkManager", "ppp", "ipsec.*", "strongswan*", "letsencrypt", "credstore", "credstore.encrypted",
    "gitconfig", "agentvm",
)
ETC_REFUSED_NAMES = (
    "private", "*.key", "*.pem.key", "*.keytab", "*.p12", "*.pfx", "*.jks", "*.kdbx", "*credential*",
    "*secret*", "*token*", "*passw*", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "auth.json",
    ".netrc", ".npmrc", ".pypirc", ".git-credentials", "settings-security.xml",
    # configuration that keeps credentials under a generic name, in the folders /usr links to:
    # Maven's settings.xml (<servers><password>), Hadoop/Spark/Hive *-site.xml (S3 keys, JDBC
    # passwords), PostgreSQL's .pgpass, key and trust stores, JMX's password file
    "settings.xml", "*-site.xml", ".pgpass", "pgpass", "*.keystore", "keystore", "*.bcfks", "*.pkcs12",
    "jmxremote.password",
)
# CA trust stores Java reads (Debian's, Fedora's): public certificates, never refused by name
# (ETC_REFUSED still applies to their folders). The JDK's lib/security/cacerts links here.
ETC_TRUST_STORES = ("ssl/certs/java/cacerts", "pki/java/cacerts", "pki/ca-trust/extracted/java/cacerts")
PER_SANDBOX_ETC = ("hosts", "hostname")
# Synthetic files in the shared view: the sandbox never sees the host's accounts or resolver.
VIEW_SYNTHETIC = {
    "passwd": "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
    "agent:x:1000:1000:agent:/home/agent:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n",
    "resolv.conf": "# agent-vm: no resolver inside the sandbox; names resolve at the egress gate\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    # empty: nothing is preloaded (the gVisor substrate binds its compatibility shim's name over it)
    "ld.so.preload": "",
}
ETC_VIEW_VERSION = 4
MERGED_USR = (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin"))
BASE_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin"



def hostname(name: str) -> str:
    return (name or "sandbox")[:63]




def host_uid_text(host: HostContext) -> str:
    """Who a host-local sandbox runs as, for people (``-1``: a plan previewed before launch)."""
    return f"host uid {host.uid}" if host.uid >= 0 else "a dedicated host uid (leased at launch)"


def close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def base_mounts(policy: Policy, host: HostContext) -> list[MountOp]:
    """The read-only root view every host-local sandbox starts from: the host's /usr, the
    allowlisted /etc view with per-sandbox hosts/hostname, and private scratch space."""
    lim = policy.limits
    # the image's /usr (checked a real directory when the image was resolved), or the host's
    usr = f"{host.image_root}/usr" if host.image_root else "/usr"
    mounts: list[MountOp] = [MountOp("ro-bind", "/usr", usr)]
    for name, target in MERGED_USR:
        mounts.append(MountOp("symlink", "/" + name, target))
    mounts.append(MountOp("ro-bind", "/etc", host.etc_view))
    for e in PER_SANDBOX_ETC:
        mounts.append(MountOp("ro-bind", "/etc/" + e, f"{host.run_dir}/etc/{e}"))
    mounts += [
        MountOp("proc", "/proc"),
        MountOp("dev", "/dev"),
        MountOp("tmpfs", "/dev/shm", size=lim.shm, perms="1777"),
        MountOp("tmpfs", "/tmp", size=lim.tmp, perms="1777"),
        MountOp("tmpfs", HOME_IN_SANDBOX, size=min(lim.tmp, 64 * 1024**2), perms="0700"),
        MountOp("ro-bind-try", "/sys/devices/system/cpu", "/sys/devices/system/cpu"),
    ]
    return mounts


def sandbox_files(policy: Policy, ctx: LaunchContext) -> tuple[tuple[str, str], ...]:
    """Per-sandbox files, relative to the run dir: /etc/hosts, /etc/hostname, session files."""
    name = hostname(policy.name)
    return (
        ("etc/hosts", f"127.0.0.1\tlocalhost {name}\n::1\tlocalhost ip6-localhost\n"),
        ("etc/hostname", name + "\n"),
    ) + tuple((f"files/{i}", content) for i, (_, content) in enumerate(ctx.extra_files))


def sandbox_env(policy: Policy, ctx: LaunchContext, *, term: str | None = None) -> dict[str, str]:
    """The sandbox's environment: a clean base, the gate's proxy and CA variables, the agent
    file's variables, then the session's placeholders (which nothing can shadow)."""
    env = {
        "PATH": BASE_PATH,
        "HOME": HOME_IN_SANDBOX,
        "LANG": "C.UTF-8",
        "TERM": (term or os.environ.get("TERM", "dumb")) if ctx.tty else "dumb",
        "USER": "agent",
        "LOGNAME": "agent",
        "SHELL": "/bin/sh",
        "TMPDIR": "/tmp",
        "AGENTVM": "1",
        "AGENTVM_SANDBOX_ID": ctx.sandbox_id,
        "AGENTVM_AGENT": policy.name,
    }
    if ctx.gate is not None and policy.egress is not None:
        proxy = f"http://127.0.0.1:{ctx.gate.port}"
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[k] = env[k.lower()] = proxy
        env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
        # trust the gate's CA (TLS-terminated hosts) through every common knob
        for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT", "AWS_CA_BUNDLE"):
            env[k] = CA_BUNDLE
        env["NODE_EXTRA_CA_CERTS"] = GATE_CA_FILE
        env["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = CA_BUNDLE  # gRPC's own TLS stack (BoringSSL)
        env["NODE_USE_ENV_PROXY"] = "1"  # Node >= 24 honours the proxy variables natively
        if policy.tools is not None:
            # the tool gateway: the same port, path /mcp (streamable HTTP); NO_PROXY covers it
            env["AGENTVM_MCP_URL"] = f"{proxy}/mcp"
            if ctx.host is not None and ctx.host.mcp_shim:
                env["PATH"] = f"{BASE_PATH}:{MCP_SHIM_DIR_IN_SANDBOX}"  # agentvm-mcp, the stdio shim
        if ctx.host is not None and ctx.host.node_shim:
            env["NODE_OPTIONS"] = f"--require {NODE_SHIM_IN_SANDBOX}/proxy.js"
        if ctx.telemetry:
            # the agent's own OpenTelemetry export: to the gate's /otlp door (relayed to the
            # operator's collector); an agent file may still name another endpoint
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"{proxy}/otlp"
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
    env.update(dict(ctx.session_env))  # the session's trace context: the agent's spans join its trace
    spec_env = dict(policy.env)
    if "NODE_OPTIONS" in env and spec_env.get("NODE_OPTIONS"):
        # the agent's Node options (a preset's heap size...) join the gate's preload: a
        # replaced NODE_OPTIONS would leave Node's fetch with no route out
        spec_env["NODE_OPTIONS"] = append_env("NODE_OPTIONS", env["NODE_OPTIONS"], spec_env["NODE_OPTIONS"])
    env.update(spec_env)
    env.update(dict(ctx.extra_env))  # placeholders win: the spec cannot shadow them
    return env


def write_run_files(run_dir: Path, files: tuple[tuple[str, str], ...]) -> None:
    """Write the per-sandbox files (readable by the sandbox's uid, owned by root)."""
    etc = run_dir / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    os.chmod(run_dir, 0o711)
    os.chmod(etc, 0o755)
    for rel, content in files:
        f = run_dir / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(f.parent, 0o755)
        f.write_text(content)
        os.chmod(f, 0o644)


def etc_refused(rel: str) -> bool:
    """Whether ``rel`` (a path relative to /etc) is of a secret class the view never holds
    (ETC_REFUSED for it or a folder above it, ETC_REFUSED_NAMES for any of its names)."""
    paths, names = _refused_patterns()
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        return True
    for i in range(1, len(parts) + 1):
        if paths.match("/".join(parts[:i])):
            return True
    if "/".join(parts) in ETC_TRUST_STORES:
        return False
    return any(names.match(p) for p in parts)


_PRIVATE_KEY = []


def carries_private_key(data: bytes) -> bool:
    """Whether ``data`` holds a private key in a text form (PEM, OpenSSH, PGP, PuTTY): the
    view never holds such a file, whatever its name (a certificate and its key in one .pem)."""
    if not _PRIVATE_KEY:
        import re

        _PRIVATE_KEY.append(re.compile(rb"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY|PuTTY-User-Key-File-"))
    return _PRIVATE_KEY[0].search(data) is not None


def _clean_rel(rel) -> bool:
    """Whether ``rel`` is a relative, normalised path (no leading /, no . or .., no empty part)."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return False
    return all(p not in ("", ".", "..") for p in rel.split("/"))


_REFUSED_RE: list = []


def _refused_patterns():
    """ETC_REFUSED and ETC_REFUSED_NAMES as two compiled expressions (built on first use)."""
    if not _REFUSED_RE:
        import fnmatch
        import re

        _REFUSED_RE[:] = [re.compile("|".join(fnmatch.translate(p) for p in pats)) for pats in (ETC_REFUSED, ETC_REFUSED_NAMES)]
    return _REFUSED_RE[0], _REFUSED_RE[1]


def _etc_allowed(rel: str) -> bool:
    return any(rel == a or rel.startswith(a + "/") for a in ETC_ALLOW)


# ---------------------------------------------------------------------- what /usr points into /etc
# Distributions keep a runtime's configuration in /etc behind symlinks from /usr (Debian's JDK:
# /usr/lib/jvm/*/conf/security/java.security -> /etc/java-17-openjdk/security/java.security;
# Maven's /usr/share/maven/conf -> /etc/maven). The view holds those targets too (minus the
# secret classes), so the next runtime with the same layout works unchanged. Finding them means
# reading every link of /usr (~0.3 s): done once and kept in <runtime>/usr-etc-links-*.json,
# valid while a cheap stamp holds - the package database, /usr and its folders, and every folder
# on the way to a link found (a runtime unpacked by hand into /usr/lib/jvm changes that folder).
USR_LINKS_VERSION = 2
PACKAGE_DBS = ("var/lib/dpkg/status", "var/lib/rpm", "usr/lib/sysimage/rpm", "lib/apk/db/installed",
               "var/lib/pacman/local")


def _usr_links_scan(root: str) -> tuple[list[str], list[str]]:
    """(targets relative to /etc, folders of /usr holding those links): every symlink under
    ``root``/usr whose target, resolved by name (never followed), lies in /etc, minus what the
    allowlist already holds and the secret classes."""
    import subprocess

    usr = os.path.join(root, "usr")
    pairs: list[tuple[str, str]] = []
    try:  # find reads 150k entries in a quarter of the time os.walk takes
        r = subprocess.run(["find", usr, "-type", "l", "-printf", "%h\\0%l\\0"], capture_output=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})
        fields = r.stdout.split(b"\0")
        pairs = [(os.fsdecode(fields[i]), os.fsdecode(fields[i + 1])) for i in range(0, len(fields) - 1, 2)]
    except (OSError, subprocess.SubprocessError):
        for dirpath, dirnames, filenames in os.walk(usr):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                if os.path.islink(p):
                    try:
                        pairs.append((dirpath, os.readlink(p)))
                    except OSError:
                        pass
    targets: set[str] = set()
    dirs: set[str] = set()
    for d, target in pairs:
        rel_dir = os.path.relpath(d, root)  # usr/lib/jvm/...: as the sandbox sees it
        a = os.path.normpath(target if target.startswith("/") else os.path.join("/", rel_dir, target))
        if not a.startswith("/etc/"):
            continue
        rel = a[len("/etc/"):]
        if _etc_allowed(rel) or etc_refused(rel):
            continue
        targets.add(rel)
        dirs.add(d)
    # keep the top-most of nested targets (a folder linked and a file in it)
    top = sorted(t for t in targets if not any(t.startswith(o + "/") for o in targets if o != t))
    return top, sorted(dirs)


def _usr_links_stamp(root: str, dirs: list[str]) -> str:
    """The cheap identity the scan is valid for: the package databases, /usr and its folders,
    and every folder on the way from /usr to a link found."""
    import hashlib

    usr = os.path.join(root, "usr")
    watch = {os.path.join(root, p) for p in PACKAGE_DBS} | {usr}
    try:
        with os.scandir(usr) as it:
            watch |= {e.path for e in it if e.is_dir(follow_symlinks=False)}
    except OSError:
        pass
    for d in dirs:
        while len(d) > len(usr) and d.startswith(usr + "/"):
            watch.add(d)
            d = os.path.dirname(d)
    h = hashlib.sha256(f"{USR_LINKS_VERSION}:{root}:{ETC_ALLOW}:{ETC_REFUSED}:{ETC_REFUSED_NAMES}:{ETC_TRUST_STORES}".encode())
    for p in sorted(watch):
        try:
            st = os.lstat(p)
        except OSError:
            h.update(f"{p}:-".encode())
            continue
        h.update(f"{p}:{st.st_mtime_ns}:{st.st_ino}:{st.st_size}".encode())
    return h.hexdigest()[:20]


def usr_linked_etc(runtime: Path | None, root: str = "/") -> tuple[str, ...]:
    """What ``root``/usr points into /etc (paths relative to /etc) that the view holds besides
    the allowlist: from ``runtime``'s cache while its stamp holds, else scanned and cached."""
    import hashlib
    import json

    cache = None
    if runtime is not None:
        cache = Path(runtime) / f"usr-etc-links-{hashlib.sha256(root.encode()).hexdigest()[:12]}.json"
        try:
            data = json.loads(cache.read_text())
            targets, dirs = data["targets"], data["dirs"]
            # only relative, normalised paths (never /abs, .., or an empty part), and folders
            # of /usr: anything else and the whole file is distrusted (scanned again)
            if (isinstance(targets, list) and isinstance(dirs, list) and all(_clean_rel(t) for t in targets)
                    and all(isinstance(d, str) for d in dirs) and data.get("stamp") == _usr_links_stamp(root, dirs)):
                return tuple(t for t in targets if not etc_refused(t))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    targets, dirs = _usr_links_scan(root)
    if cache is not None:
        from agentvm.fsutil import write_atomic

        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache, json.dumps({"stamp": _usr_links_stamp(root, dirs), "dirs": dirs,
                                            "targets": targets}).encode(), 0o600)
        except OSError:
            pass
    return tuple(targets)


def etc_view_holds(rel: str, runtime: Path | None = None, root: str = "/") -> bool:
    """Whether the sandbox's /etc view may hold ``rel`` (relative to /etc) with the host's
    content: allowlisted or pointed to by /usr, and not of a secret class. By path only: the
    view still leaves out what a non-root host user cannot read and files holding a private
    key (_EtcCopy)."""
    rel = rel.strip("/")
    if etc_refused(rel):
        return False
    return _etc_allowed(rel) or any(rel == t or rel.startswith(t + "/") for t in usr_linked_etc(runtime, root))


def _etc_fingerprint(extra_ca: bytes = b"", root: str = "/", linked: tuple[str, ...] = ()) -> str:
    """Cheap identity of the host's (or an image's) allowlisted /etc entries and of the ones
    /usr points to (lstat of each and of the entries one level down), so the view is rebuilt
    when they change."""
    import hashlib

    h = hashlib.sha256(f"v{ETC_VIEW_VERSION}:{sorted(VIEW_SYNTHETIC.items())}:{root}:{linked}".encode())
    h.update(extra_ca)
    etc = os.path.join(root, "etc")
    # the folders above every entry (/etc included): a folder made a link, or closed to the
    # world, changes what the view may hold (_EtcCopy)
    above = {os.path.dirname(n) for n in ETC_ALLOW + linked}
    for d in sorted({"/".join(a.split("/")[: i + 1]) for a in above if a for i in range(a.count("/") + 1)} | {""}):
        try:
            st = os.lstat(os.path.join(etc, d) if d else etc)
        except OSError:
            continue
        h.update(f"dir {d}:{st.st_mode}:{st.st_ino}".encode())
    budget = [4096]  # entries read below linked folders (the allowlist: one level, as always)
    for name in ETC_ALLOW + linked:
        p = os.path.join(etc, name)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        h.update(f"{name}:{st.st_mode}:{st.st_mtime_ns}:{st.st_size}:{st.st_ino}".encode())
        if stat.S_ISDIR(st.st_mode):
            _fingerprint_dir(h, p, name, 0 if name in ETC_ALLOW else 8, budget)
    return h.hexdigest()[:16]


def _fingerprint_dir(h, path: str, rel: str, depth: int, budget: list[int]) -> None:
    """lstat of the entries of ``path`` (and of its folders' down to ``depth`` more levels)."""
    try:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        try:
            est = e.stat(follow_symlinks=False)
        except OSError:
            continue
        h.update(f"{rel}/{e.name}:{est.st_mode}:{est.st_mtime_ns}:{est.st_size}".encode())
        budget[0] -= 1
        if depth > 0 and budget[0] > 0 and stat.S_ISDIR(est.st_mode):
            _fingerprint_dir(h, e.path, f"{rel}/{e.name}", depth - 1, budget)


# how long a process trusts its last check of the host's /etc (a change is picked up after that)
VIEW_CACHE_SECONDS = 2.0
_VIEW_CACHE: dict = {}


def _in_tree(root: str, rel: str) -> Path | None:
    """``root/rel`` when no component of it but the last is a symlink (an image's tree is
    never followed out of), else None."""
    p = Path(root)
    parts = rel.split("/")
    for i, part in enumerate(parts):
        p = p / part
        if i < len(parts) - 1:
            try:
                if not stat.S_ISDIR(os.lstat(p).st_mode):
                    return None
            except OSError:
                return None
    return p


CA_BUNDLE_MAX = 16 * 1024 * 1024


def _write_new(path: Path, data: bytes) -> None:
    """Replace whatever is at ``path`` (a file, a symlink, a tree) with a new regular file,
    0644: written beside it and renamed over it (``fsutil.write_atomic``), so nothing is ever
    written through a link an image put there."""
    import shutil

    from agentvm.fsutil import write_atomic

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    write_atomic(path, data, 0o644)


def _mask_tree(top: Path) -> None:
    """Clear group/world write and setuid/setgid in a directory agent-vm just wrote (links skipped)."""
    for dirpath, dirnames, filenames in os.walk(top):
        for n in [*dirnames, *filenames]:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            new = mode & ~0o022 & ~(stat.S_ISUID | stat.S_ISGID)
            if new != mode:
                os.chmod(p, new)  # not a link (lstat): the view is agent-vm's own, written just now


# what the view takes of a host file, and how much of it
VIEW_MAX_FILES = 20000
VIEW_MAX_FILE_BYTES = 16 * 1024 * 1024
VIEW_MAX_DEPTH = 24
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class _EtcCopy:
    """Copies ``root``/etc entries into the view ``tmp``, file by file, with one rule for the
    allowlist and what /usr links to, for the host's root and an image's alike:

    - every folder from /etc down is opened with O_NOFOLLOW relative to its parent (a symlinked
      folder along the way: the entry is skipped), so the path read is the path checked, and
      ``etc_refused`` sees the real path, never one a link leads out of /etc;
    - a file is taken only if it is world-readable and every folder above it (/etc included)
      world-traversable on the host: the sandbox never reads what a non-root host user could not;
      a folder the world cannot enter is left out with all it holds;
    - a file of a secret class (``etc_refused``: names and paths) or holding a private key
      (``carries_private_key``) is never taken; neither are FIFOs, sockets, devices, or files
      over VIEW_MAX_FILE_BYTES;
    - links are copied as links (resolved inside the sandbox's own view); a linked entry that
      is itself a link into /etc has its target taken too (a chain, under the same rule);
    - modes are the host's, never wider than 0755, never setuid/setgid;
    - every destination is checked to resolve inside the view's folder (LaunchError if not)."""

    def __init__(self, root: str, tmp: Path) -> None:
        self.etc = os.path.join(root, "etc")
        self.tmp = Path(tmp)
        self.tmp_real = os.path.realpath(tmp)
        self.files = 0

    def run(self, names: list[str]) -> None:
        todo = list(names)
        seen: set[str] = set()
        while todo:
            name = todo.pop(0)
            if name in seen or len(seen) > 4096 or not _clean_rel(name) or etc_refused(name):
                continue
            seen.add(name)
            target = self.entry(name)
            if target is not None and name not in ETC_ALLOW:
                a = os.path.normpath(target if target.startswith("/") else os.path.join("/etc", os.path.dirname(name), target))
                if a.startswith("/etc/") and not _etc_allowed(a[5:]):
                    todo.append(a[5:])  # a chain inside /etc: its end too

    def dst(self, rel: str) -> Path:
        """``tmp``/rel, after checking it resolves inside the view (no link along the way)."""
        if not _clean_rel(rel):
            raise LaunchError("etc-view", f"refusing the destination {rel!r} (not a relative, normalised path)")
        p = self.tmp / rel
        parent = os.path.realpath(p.parent)
        if parent != os.path.join(self.tmp_real, os.path.dirname(rel)).rstrip("/") or not parent.startswith(self.tmp_real):
            raise LaunchError("etc-view", f"refusing the destination {rel!r} (it resolves outside the view)")
        return p

    def entry(self, rel: str) -> str | None:
        """Copy /etc/``rel``; the link's target when it is a link (for the caller's chain)."""
        parts = rel.split("/")
        try:
            fd = os.open(self.etc, _O_DIR)
        except OSError:
            return None
        fds = [fd]
        try:
            if not os.fstat(fd).st_mode & 0o001:
                return None
            for i, part in enumerate(parts[:-1]):
                try:
                    nfd = os.open(part, _O_DIR, dir_fd=fds[-1])  # a symlinked folder: ELOOP/ENOTDIR
                except OSError:
                    return None
                fds.append(nfd)
                st = os.fstat(nfd)
                if not st.st_mode & 0o001:
                    return None
                sub = "/".join(parts[: i + 1])
                d = self.dst(sub)
                if not os.path.lexists(d):
                    d.mkdir()
                    os.chmod(d, stat.S_IMODE(st.st_mode) & 0o755)
                elif d.is_symlink() or not d.is_dir():
                    return None
            return self.one(fds[-1], parts[-1], rel, 0)
        finally:
            for f in fds:
                os.close(f)

    def one(self, dfd: int, name: str, rel: str, depth: int) -> str | None:
        """Copy the entry ``name`` of the open host folder ``dfd`` to ``rel`` in the view."""
        if etc_refused(rel) or self.files >= VIEW_MAX_FILES:
            return None
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return None
        dst = self.dst(rel)
        if os.path.lexists(dst):
            return None
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                return None
            os.symlink(target, dst)
            self.files += 1
            return target
        if stat.S_ISDIR(st.st_mode):
            if not st.st_mode & 0o001 or depth >= VIEW_MAX_DEPTH:
                return None  # the world cannot enter it: nothing in it
            try:
                cfd = os.open(name, _O_DIR, dir_fd=dfd)
            except OSError:
                return None
            try:
                cst = os.fstat(cfd)
                if (cst.st_dev, cst.st_ino) != (st.st_dev, st.st_ino) or not cst.st_mode & 0o001:
                    return None
                dst.mkdir()
                try:
                    names = sorted(os.listdir(cfd))
                except OSError:
                    names = []
                for n in names:
                    self.one(cfd, n, f"{rel}/{n}", depth + 1)
                os.chmod(dst, stat.S_IMODE(cst.st_mode) & 0o755)
            finally:
                os.close(cfd)
            return None
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o004 and st.st_size <= VIEW_MAX_FILE_BYTES:
            self.file(dfd, name, dst)
        return None  # FIFOs, sockets, devices: never opened

    def file(self, dfd: int, name: str, dst: Path) -> None:
        try:
            fd = os.open(name, _O_FILE, dir_fd=dfd)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o004 or st.st_size > VIEW_MAX_FILE_BYTES:
                return
            chunks, n = [], 0
            while n <= VIEW_MAX_FILE_BYTES:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                chunks.append(b)
                n += len(b)
        except OSError:
            return
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if n > VIEW_MAX_FILE_BYTES or carries_private_key(data):
            return
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(out, view):]
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o755)
        finally:
            os.close(out)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
        self.files += 1


def etc_view(runtime: Path, gate_ca_pem: bytes = b"", root: str = "/") -> Path:
    """A host directory holding copies of the allowlisted /etc entries plus synthetic
    accounts/resolver files, bound read-only as the sandbox's /etc in one mount.

    What is copied, and what never is, is _EtcCopy's rule: only what a non-root host user can
    read, never a secret class (``etc_refused``) or a private key. With ``gate_ca_pem``
    the view's CA bundle also trusts the egress gate's CA (for TLS-terminated hosts), and the
    CA alone is at ``/etc/ssl/certs/agentvm-gate-ca.pem`` (for NODE_EXTRA_CA_CERTS)."""
    import shutil

    key = (str(runtime), hash(gate_ca_pem), root)
    hit = _VIEW_CACHE.get(key)
    if hit is not None and time.monotonic() - hit[0] < VIEW_CACHE_SECONDS and hit[1].is_dir():
        return hit[1]  # a daemon starting sandboxes back to back: the host's /etc was checked just now
    linked = usr_linked_etc(runtime, root)
    fp = _etc_fingerprint(gate_ca_pem, root, linked)
    view = runtime / f"etc-view-{fp}"
    if view.is_dir():
        _VIEW_CACHE[key] = (time.monotonic(), view)
        return view
    runtime.mkdir(parents=True, exist_ok=True)
    import secrets
    import threading

    # unique per call: two threads of one process (two rt.run at once) build their own copy, and
    # the first rename wins; a copy left by a killed process is swept below once a day old
    tmp = runtime / f".etc-view-{fp}-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o755)
    try:
        _EtcCopy(root, tmp).run(list(ETC_ALLOW) + list(linked))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if root != "/":  # copied from an image: nothing in the view writable by others than root
        _mask_tree(tmp)
    for name, content in VIEW_SYNTHETIC.items():
        _write_new(tmp / name, content.encode())
    if gate_ca_pem:
        for d in (tmp / "ssl", tmp / "ssl" / "certs"):  # copied from an image: never write through its links
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                d.unlink()
        certs = tmp / "ssl" / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        bundle = certs / "ca-certificates.crt"
        src_bundle = _in_tree(root, CA_BUNDLE.lstrip("/")) if root != "/" else Path(CA_BUNDLE)
        try:
            if src_bundle is None or (root != "/" and not stat.S_ISREG(os.lstat(src_bundle).st_mode)):
                raise OSError
            with open(src_bundle, "rb") as f:
                system = f.read(CA_BUNDLE_MAX)
        except OSError:
            system = b""
        # new files, never written through whatever the image put at those names
        _write_new(bundle, system.rstrip(b"\n") + b"\n" + gate_ca_pem)
        _write_new(certs / "agentvm-gate-ca.pem", gate_ca_pem)
    for name in PER_SANDBOX_ETC:  # bind targets, overmounted per sandbox
        _write_new(tmp / name, b"")
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, view)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another launch won the race
    _VIEW_CACHE[key] = (time.monotonic(), view)
    # Old views may still be bound in running sandboxes: only remove day-old ones.
    for old in [*runtime.glob("etc-view-*"), *runtime.glob(".etc-view-*")]:
        if old != view:
            try:
                if time.time() - old.stat().st_mtime > 86400:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass
    return view


# ---------------------------------------------------------------------- processes and stale state


async def process_exit(pid: int) -> None:
    """Await a child's exit without holding a thread: a pidfd becomes readable when the
    process exits (thousands of idle sandboxes must not exhaust a thread pool)."""
    import asyncio

    try:
        pfd = os.pidfd_open(pid)
    except (ProcessLookupError, AttributeError, OSError):
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pfd)
        os.close(pfd)


def mark_run_dir(run_dir: Path, substrate: str) -> None:
    """Say which substrate a run dir belongs to and who supervises it (for stale-state reaping)."""
    (run_dir / "substrate").write_text(substrate + "\n")
    (run_dir / "supervisor.pid").write_text(f"{os.getpid()}\n")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed supervisor lingers as a zombie
    until its parent reaps it: it supervises nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    state = stat.rpartition(")")[2].split()[:1]
    return bool(state) and state[0] not in ("Z", "X")


def stale_run_dirs(sandboxes: Path, substrate: str) -> list[Path]:
    """Run dirs of ``substrate`` whose supervisor died (e.g. ``kill -9``). A run dir without
    a supervisor is stale only once it is a minute old (a launch in progress writes it quickly);
    one without a substrate mark is from before marks existed (bwrap)."""
    out: list[Path] = []
    try:
        entries = list(os.scandir(sandboxes))
    except FileNotFoundError:
        return out
    for e in entries:
        d = Path(e.path)
        try:
            mine = (d / "substrate").read_text().strip() == substrate
        except FileNotFoundError:
            mine = substrate == "bwrap"
        except OSError:
            continue
        if not mine:
            continue
        try:
            pid = int((d / "supervisor.pid").read_text())
        except (OSError, ValueError):
            try:
                if time.time() - e.stat().st_mtime < 60:
                    continue
            except OSError:
                continue
            pid = -1
        if pid > 0 and _alive(pid):
            continue
        out.append(d)
    return out


def reap_run_dir(run_dir: Path, runtime: Path) -> None:
    """Kill and remove what a dead supervisor's sandbox left: its cgroups, grant holds, run dir."""
    import shutil

    from agentvm import cgroups as cg
    from agentvm import grants

    layout = cg.detect()
    group = cg.SandboxCgroup(sandbox_id=run_dir.name, layout=layout)
    roots = [layout.v2_root] if layout.v2_root else []
    roots += list(layout.v1.values())
    group.dirs = [r / cg.PARENT / run_dir.name for r in dict.fromkeys(roots) if (r / cg.PARENT / run_dir.name).is_dir()]
    group.freezer_dir = next((d for d in group.dirs if "freezer" in str(d)), None)
    group.kill_dir = next((d for d in group.dirs if (d / "cgroup.kill").exists()), None)
    group.kill()
    group.destroy()
    grants.release_recorded(run_dir, runtime / "grants")
    shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------- the helper and its processes


def become_subreaper() -> None:
    """Orphans of a sandbox (its killed descendants) are re-parented to us, so we can reap
    them and verify teardown instead of leaving zombies to the host's init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def sweep_uid(uid: int, timeout: float = 2.0) -> list[int]:
    """Kill what is left of ``uid`` and reap the zombies re-parented to us (we are a
    subreaper). Returns live pids that survived (teardown NOT verified)."""
    from agentvm.identity import uid_processes

    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        live = []
        for pid, ppid, state in uid_processes(uid):
            if state in ("Z", "X"):
                if ppid == me:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                continue
            live.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.002)


def substitute(argv: tuple[str, ...], fds: dict[str, int], cgroup_files: list[str]) -> list[str]:
    """Fill in the launch-time values: ``@fd:NAME@`` tokens (a whole argument, or the head of a
    ``--grant`` value) and ``@cgroups@``. The agent's command (after init's own ``--``) is
    never touched: its arguments are the agent's, whatever they look like."""
    out: list[str] = []
    items = list(argv)
    seps = [k for k, a in enumerate(items) if a == "--"]
    # launch opts -- bwrap --args FD -- init opts -- COMMAND: the third separator starts the command
    stop = seps[2] + 1 if len(seps) >= 3 else len(items)
    i = 0
    while i < len(items):
        a = items[i]
        if i >= stop:
            out += items[i:]
            break
        if a == "--cgroup-procs" and i + 1 < len(items) and items[i + 1] == "@cgroups@":
            for f in cgroup_files:
                out += ["--cgroup-procs", f]
            i += 2
            continue
        if a.startswith("@fd:") and "@" in a[4:]:
            name, _, rest = a[4:].partition("@")
            if name not in fds:
                raise LaunchError("plan", f"no fd for {name}")
            a = str(fds[name]) + rest
        out.append(a)
        i += 1
    return out


def helper_status(raw: bytes) -> tuple[bool, dict | None]:
    """The helper's status pipe, read after the writer exited (so the pipe holds all of it):
    ``ready`` once init has put every layer in place and is about to exec the command, and
    ``STEP\tERRNO\tMESSAGE`` lines on failure (the first names the cause).
    Returns (ready, setup_error)."""
    lines = [ln for ln in raw.decode(errors="replace").splitlines() if ln.strip()]
    ready = "ready" in lines
    errors = [ln for ln in lines if ln != "ready"]
    return ready, (setup_error_line(errors[0]) if errors else None)


def setup_error_line(line: str) -> dict:
    step, _, rest = line.partition("\t")
    err, _, msg = rest.partition("\t")
    try:
        errno_ = int(err or 0)
    except ValueError:
        errno_ = 0
    return {"step": step, "errno": errno_, "message": msg}


# ---------------------------------------------------------------------- grants at launch, teardown


def open_grants(plan_fds: dict, paths, run_dir: Path, state: dict, opened: list[int]) -> dict[str, int]:
    """Open every granted folder ``O_PATH`` (as the supervisor: the agent's uid needs no way
    through the host path) and check what was opened - not the name checked earlier - so a
    path component swapped in between gains nothing; make the empty staging points the
    helper mounts the idmapped grants onto, and the placeholders of the host-trusted names a
    read-write grant lacks (held in ``state["grant_holds"]``). Opened fds go to ``opened``."""
    import stat as st_

    from agentvm.errors import AgentVMError

    fds: dict[str, int] = {}
    own = [paths.home.resolve(), paths.runtime.resolve()]
    writable = {n for n, _, _ in plan_fds.get("protects", ())}  # every rw grant has an entry
    for name, host in plan_fds.get("open_paths", ()):
        try:
            fd = os.open(host, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            raise LaunchError("grant", f"cannot open {host}: {exc.strerror}") from exc
        opened.append(fd)
        fds[name] = fd
        if name == "workspace":
            continue  # agent-vm's own mount, not a grant
        actual = os.readlink(f"/proc/self/fd/{fd}")
        if actual != host:
            raise LaunchError("grant", f"{host} changed since it was checked (it now leads to {actual}): refused")
        from agentvm.fsutil import check_grant_target  # (a grant: not on a plain run's import path)

        try:
            check_grant_target(actual, own, host, name in writable)
        except AgentVMError as exc:
            raise LaunchError("grant", exc.message) from None
    for name, _, stage in plan_fds.get("stages", ()):
        Path(stage).parent.mkdir(mode=0o711, exist_ok=True)
        if st_.S_ISDIR(os.fstat(fds[name]).st_mode):
            os.mkdir(stage, 0o700)
        else:
            os.close(os.open(stage, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    state["grant_holds"] = []
    if plan_fds.get("protects"):
        from agentvm import grants  # (read-write grants only: not on a plain run's import path)

        for name, host, prot in plan_fds["protects"]:
            state["grant_holds"].append(grants.ensure(fds[name], host, prot, paths.runtime / "grants"))
        grants.save(run_dir, state["grant_holds"])
    rv = plan_fds.get("reviews")
    if rv:  # review-mode grants: their layer made (or continued) and held while the sandbox lives
        from agentvm import review

        state["review_hold"] = review.open_layer(Path(rv["home"]), rv["kind"], rv["name"], list(rv["grants"]), fds,
                                                 int(rv["uid"]), int(rv["gid"]), sandbox_id=rv.get("sandbox", ""))
    return fds


def finish_teardown(rep, state: dict, host_uid: int, paths, t0: float):
    """The common end of a verified teardown: nothing of the agent's dedicated uid remains,
    the grants' placeholders are released (the last sandbox out removes them), the run dir
    is gone; then the verdict."""
    import shutil

    if host_uid != os.getuid():
        for pid in sweep_uid(host_uid):
            if pid not in rep.processes_left:
                rep.processes_left.append(pid)
    holds = state.pop("grant_holds", None) or []
    if holds:
        from agentvm import grants  # (read-write grants only: not on a plain run's import path)

        for hold in holds:
            grants.release(hold, paths.runtime / "grants")
    if state.get("review_hold") is not None:  # the layer stays, unheld, until accepted or discarded
        from agentvm import review

        review.close_layer(state.pop("review_hold"))
    run_dir = Path(state.get("run_dir", ""))
    if run_dir.name and run_dir.exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        if run_dir.exists():
            rep.files_left.append(str(run_dir))
    rep.verified = not (rep.processes_left or rep.cgroups_left or rep.mounts_left or rep.files_left)
    rep.duration = time.monotonic() - t0
    return rep


class ChildProcessSandbox:
    """``poll`` and ``wait_async`` for a backend whose sandbox is one child process of the
    supervisor (``handle.private["proc"]``, a ``subprocess.Popen``): bwrap's launcher, runsc."""

    def poll(self, handle) -> bool:
        proc = handle.private.get("proc")
        return proc is None or proc.poll() is not None

    async def wait_async(self, handle):
        import asyncio

        proc = handle.private.get("proc")
        if proc is not None:
            await process_exit(proc.pid)
        return await asyncio.to_thread(self.wait, handle, None)

    # ``pause``/``unpause``: the cgroup freezer - every process stopped where it is, memory and
    # every host resource kept (the gate endpoint, the workspace, the uid), no CPU. Not suspend
    # (which frees them): a paused sandbox comes back exactly as it was, at once.
    #: why a host-process sandbox (bubblewrap) is not suspended: CRIU, the only checkpointer
    #: for it, cannot checkpoint or restore a Landlock domain (nor can a restore be verified to
    #: carry one), so it would come back weaker - refused, never attempted (issue 37)
    suspend_refusal = ("CRIU cannot checkpoint or restore the sandbox's Landlock domain, so a resumed sandbox "
                       "would be weaker than the one suspended")

    def pause(self, handle, timeout: float = 5.0) -> None:
        self._cgroup_of(handle).freeze(timeout)

    def unpause(self, handle, timeout: float = 5.0) -> None:
        self._cgroup_of(handle).thaw(timeout)

    def paused(self, handle) -> bool:
        group = handle.private.get("cgroup")
        return bool(group is not None and group.frozen())

    def _cgroup_of(self, handle):
        from agentvm.errors import PrimitiveMissing

        group = handle.private.get("cgroup")
        if group is None or not group.can_freeze():
            raise PrimitiveMissing("this sandbox has no cgroup freezer (cgroups were degraded, or the host has none)",
                                   hint="pause needs cgroups with a freezer; stop the sandbox instead")
        if self.poll(handle):
            from agentvm.errors import AgentVMError

            raise AgentVMError("the sandbox is not running: nothing to pause or unpause", code="sandbox.not-running")
        return group

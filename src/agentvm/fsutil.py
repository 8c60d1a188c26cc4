"""Small filesystem helpers shared by the modules that keep secrets on disk (vault, gate CA)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int, *, mtime_ns: int | None = None) -> None:
    """Write ``data`` to ``path`` with exactly ``mode``: a private temp file (never wider than
    0600 while written), fsync, rename over ``path``, fsync the directory. Raises OSError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")  # (secrets.token_hex, without importing it)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode & 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    except OSError as exc:  # pragma: no cover - some filesystems refuse directory fsync
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(dfd)


# A grant is idmapped: inside it the agent acts as the folder's owner, with the owner's rights on
# the owner's files. So no grant may be - or be inside - a kernel interface, the host's
# configuration or the runtime sockets, nor be a whole system tree, a user's home directory
# or a home's dotfiles (grant a project folder inside it instead). /root is a home like any
# other: /root itself and /root/.* are refused, /root/proj is a project folder.
_BENEATH_FORBIDDEN = ("/proc", "/sys", "/dev", "/run", "/boot", "/etc", "/var/lib", "/var/spool",
                      "/var/log", "/var/cache", "/var/mail", "/var/backups", "/var/tmp")
# What the host executes or loads as root: not even read-write *inside* (merged /usr makes
# /bin, /lib... resolve here too)
_BENEATH_FORBIDDEN_RW = ("/usr", "/var", "/snap", "/nix", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_EXACT_FORBIDDEN = ("/", "/usr", "/var", "/home", "/tmp", "/opt", "/srv", "/mnt", "/media", "/snap", "/nix",
                    "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")


def bind_unix_listener(path: Path, uid: int | None, backlog: int):
    """A sandbox's gate socket at ``path``, bound and listening (blocking): any old file there
    removed first, and only ``uid`` (and root) may connect - owned by it, mode 0600, set before
    it listens. One binder for the daemon's gate, its gate workers and ``agentvm run``'s."""
    import socket

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        if uid is not None and os.geteuid() == 0:
            os.chown(path, uid, uid)
        os.chmod(path, 0o600)
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


ROOT_HOME = "/root"  # root's home whatever the account database says


def _home_dirs() -> set[str]:
    """Every account's home directory (resolved), and root's /root."""
    import pwd

    homes = {os.path.realpath(ROOT_HOME)}
    try:
        homes |= {os.path.realpath(p.pw_dir) for p in pwd.getpwall() if p.pw_dir not in ("", "/", "/nonexistent")}
    except OSError:
        pass
    homes.discard("/")
    return homes


def home_part(real: str, homes: set[str] | None = None) -> tuple[str, str] | None:
    """(home, dot entry) when the resolved path ``real`` is a home directory (dot entry ``""``)
    or a dotfile / dot-directory of one, or anything under those (``/root/.ssh/id_ed25519``:
    ``("/root", ".ssh")``); None for a project folder inside a home (``/root/proj``)."""
    for home in sorted(_home_dirs() if homes is None else homes, key=len, reverse=True):
        if real == home:
            return home, ""
        if real.startswith(home.rstrip("/") + "/"):
            first = real[len(home.rstrip("/")) + 1:].split("/", 1)[0]
            if first.startswith("."):
                return home, first
    return None


def check_grant_target(real: str, own: list[Path], shown: str, writable: bool = False) -> None:
    """Refuse a grant whose *resolved* host path is the whole host or a system tree, is under a
    kernel interface or the host's configuration, is a user's home directory, or holds
    agent-vm's own state (other agents' workspaces, keys). ``shown`` is the path as declared."""
    from agentvm.errors import PolicyDenied

    beneath = _BENEATH_FORBIDDEN + (_BENEATH_FORBIDDEN_RW if writable else ())
    under = next((b for b in beneath if real == b or real.startswith(b + "/")), None)
    if under == "/var" and real.startswith("/var/www/"):
        under = None  # web roots are data, not the system
    if real in _EXACT_FORBIDDEN or under:
        raise PolicyDenied(
            f"granting {shown} would expose the host" + (f" ({under} and everything in it)" if under else ""),
            hint="grant a project folder instead: inside a grant the agent has the rights of the folder's owner",
            code="policy.grant-forbidden")
    home = home_part(real)
    if home is not None and not home[1]:
        raise PolicyDenied(
            f"granting {shown} would hand the agent a user's whole home directory (ssh keys, shell and tool "
            "configuration the user's programs trust)",
            hint="grant the project folder inside it, e.g. --mount " + real.rstrip("/") + "/PROJECT:/src",
            code="policy.grant-home")
    if home is not None:
        raise PolicyDenied(
            f"granting {shown} would hand the agent a home directory's {home[1]} ({home[0]}/{home[1]}): a home's "
            "dotfiles and dot-directories hold keys, credentials and configuration the user's programs trust",
            hint="grant a project folder of the home instead, e.g. --mount " + home[0].rstrip("/") + "/PROJECT:/src",
            code="policy.grant-home")
    r = Path(real)
    for o in own:
        if o == r or o.is_relative_to(r) or r.is_relative_to(o):
            raise PolicyDenied(
                f"granting {shown} would expose agent-vm's own state ({o}): other agents' workspaces and keys",
                code="policy.grant-forbidden",
            )


def untrusted_symlink(path: str) -> str | None:
    """The first symlink on ``path`` that sits in a directory a non-root user can write (so an
    agent with a grant there could re-point it between our check and our open), or None.
    Links in root-owned, not group/other-writable directories are the operator's own (as is a
    root-owned link in a root-owned sticky directory such as /tmp)."""
    import stat

    cur = "/"
    parts = [p for p in os.path.abspath(path).split("/") if p]
    hops = 0
    while parts:
        p = parts.pop(0)
        nxt = os.path.join(cur, p)
        try:
            st = os.lstat(nxt)
        except OSError:
            return None  # does not exist: the open will fail on its own
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            d = os.stat(cur)
            # root's link in a root-owned sticky directory (/tmp) cannot be replaced by others
            sticky_safe = bool(d.st_mode & stat.S_ISVTX) and st.st_uid == 0
            if d.st_uid != 0 or (d.st_mode & 0o022 and not sticky_safe):
                return nxt
            if hops > 40:
                return nxt
            target = os.readlink(nxt)
            parts = [q for q in target.split("/") if q] + parts
            if target.startswith("/"):
                cur = "/"
            continue
        if p == "..":
            cur = os.path.dirname(cur) or "/"
        elif p != ".":
            cur = nxt
    return None


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount that holds ``path``, from this process's
    mountinfo (the longest mount point that is a prefix of the resolved path)."""
    real = os.path.realpath(path)
    best, fstype = "/", "?"
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4].encode().decode("unicode_escape")  # \040 -> space
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
    except OSError:
        pass
    return best, fstype

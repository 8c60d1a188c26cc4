"""Granted host folders: what the host trusts inside a read-write grant stays read-only.

A read-write grant lets the agent change files that the host's own tools later execute or
trust: git runs ``.git/hooks`` and obeys ``.git/config`` (``core.fsmonitor``, ``core.hooksPath``
run commands on a plain ``git status``), direnv loads ``.envrc``, editors and coding agents
load ``.vscode/``, ``.idea/``, ``.claude/`` and ``.mcp.json``, shells source their rc files.
Inside an rw grant these names are bound read-only over themselves; a name that does not
exist gets an empty placeholder for the sandbox's lifetime (removed afterwards when still
empty), so it cannot be *created* either. ``.git`` itself is pinned (bound onto itself) so
it cannot be renamed away and replaced. An agent file lifts this per name with
``mounts[].writableTrusted``.

Shell rc files are protected when present; placeholders are made for them only when the
grant is a user's home directory (an empty ``.bashrc`` in a project folder would be clutter
no shell reads).
"""

from __future__ import annotations

import json
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import LaunchError, PolicyDenied

# (name relative to the grant, kind when absent). Documented in docs/policy.md.
ALWAYS: tuple[tuple[str, str], ...] = (
    (".git", "dir"),
    (".gitmodules", "file"),
    (".envrc", "file"),
    (".vscode", "dir"),
    (".idea", "dir"),
    (".claude", "dir"),
    (".mcp.json", "file"),
)
GIT_INNER: tuple[tuple[str, str], ...] = ((".git/hooks", "dir"), (".git/config", "file"))
SHELL_RC: tuple[str, ...] = (
    ".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".profile",
    ".zshrc", ".zshenv", ".zprofile", ".zlogin",
)
TRUSTED_NAMES: tuple[str, ...] = tuple(n for n, _ in ALWAYS) + tuple(n for n, _ in GIT_INNER) + SHELL_RC


@dataclass(frozen=True)
class Protect:
    """One entry of a grant kept from the agent: ``ro`` binds it read-only over itself,
    ``pin`` binds it read-write onto itself (a mount point cannot be renamed or removed)."""

    rel: str
    kind: str  # "dir" | "file"
    how: str  # "ro" | "pin"


def plan(host: str, writable: tuple[str, ...] = ()) -> tuple[Protect, ...]:
    """What to protect in the rw grant ``host`` (its resolved path), from the host as it is now.
    A trusted name that is a symbolic link is refused: a link cannot be bound over, and the
    host would follow it to a file the agent may change."""
    out: list[Protect] = []
    home = _is_home(host)

    def kind_of(rel: str, absent_kind: str | None) -> str | None:
        try:
            st = os.lstat(os.path.join(host, rel))
        except FileNotFoundError:
            return absent_kind
        if stat.S_ISLNK(st.st_mode):
            raise PolicyDenied(
                f"{host}/{rel} is a symbolic link: agent-vm keeps that name read-only inside a read-write "
                "grant and cannot pin a link (the host would follow it to a file the agent may change)",
                hint=f"replace the link with the file it points to, or list {rel!r} in the grant's "
                "writableTrusted if the agent may change it",
                code="policy.grant-trusted-link",
            )
        return "dir" if stat.S_ISDIR(st.st_mode) else "file"

    def lifted(rel: str) -> bool:
        return any(rel == w or rel.startswith(w.rstrip("/") + "/") for w in writable)

    for rel, absent in ALWAYS:
        if lifted(rel):
            continue
        exists = kind_of(rel, None)
        kind = exists or absent
        if rel == ".git" and exists == "dir":
            inner = [(r, kind_of(r, k)) for r, k in GIT_INNER if not lifted(r)]
            out.append(Protect(rel, "dir", "pin"))
            out += [Protect(r, k, "ro") for r, k in inner if k]
            continue
        if kind:
            out.append(Protect(rel, kind, "ro"))
    for rel in SHELL_RC:
        if not lifted(rel):
            kind = kind_of(rel, "file" if home else None)
            if kind:
                out.append(Protect(rel, kind, "ro"))
    return tuple(out)


def _is_home(path: str) -> bool:
    try:
        return any(os.path.realpath(p.pw_dir) == path for p in pwd.getpwall() if p.pw_dir not in ("", "/"))
    except OSError:
        return False


@dataclass(frozen=True)
class Placeholder:
    """An empty entry made for the sandbox's lifetime, so a trusted name cannot be created."""

    grant: str  # the grant's host path
    rel: str
    kind: str
    dev: int
    ino: int


def ensure(grant_fd: int, grant: str, protects: tuple[Protect, ...]) -> list[Placeholder]:
    """Make every protected entry exist (placeholders owned like the grant, empty), checking
    that what exists is still what ``plan`` saw. ``grant_fd`` is the grant's O_PATH fd: every
    step is relative to it and follows no link."""
    made: list[Placeholder] = []
    owner = os.fstat(grant_fd)
    try:
        for p in protects:
            parent, _, name = p.rel.rpartition("/")
            dfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=grant_fd) if parent else grant_fd
            try:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None:
                    kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
                    if kind != p.kind:
                        raise LaunchError("grant", f"{grant}/{p.rel} changed since the sandbox was planned (now a {kind}): refused")
                    continue
                if p.kind == "dir":
                    os.mkdir(name, 0o755, dir_fd=dfd)
                else:
                    os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd))
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                made.append(Placeholder(grant, p.rel, p.kind, st.st_dev, st.st_ino))
                if os.geteuid() == 0:
                    os.chown(name, owner.st_uid, owner.st_gid, dir_fd=dfd, follow_symlinks=False)
            except OSError as exc:
                raise LaunchError("grant", f"cannot keep {grant}/{p.rel} read-only: {exc.strerror}") from exc
            finally:
                if dfd != grant_fd:
                    os.close(dfd)
    except BaseException:
        remove(made)
        raise
    return made


def remove(placeholders: list[Placeholder]) -> list[str]:
    """Remove the placeholders that are still the empty entries we made (deepest first).
    Returns what had to stay (changed on the host meanwhile, e.g. a real ``git init``)."""
    kept: list[str] = []
    for p in sorted(placeholders, key=lambda p: -p.rel.count("/")):
        path = os.path.join(p.grant, p.rel)
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) != (p.dev, p.ino):
                continue  # no longer ours
            if p.kind == "dir":
                os.rmdir(path)
            elif st.st_size == 0 and stat.S_ISREG(st.st_mode):
                os.unlink(path)
            else:
                kept.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            kept.append(path)
    return kept


def save(run_dir: Path, placeholders: list[Placeholder]) -> None:
    """Record the placeholders beside the sandbox, so a supervisor that died cannot leave them."""
    if placeholders:
        (run_dir / "placeholders.json").write_text(json.dumps([p.__dict__ for p in placeholders]))


def remove_recorded(run_dir: Path) -> list[str]:
    try:
        recs = json.loads((run_dir / "placeholders.json").read_text())
        return remove([Placeholder(**r) for r in recs])
    except (OSError, ValueError, TypeError):
        return []

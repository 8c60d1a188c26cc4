"""Granted host folders: what the host trusts inside a read-write grant stays read-only.

A read-write grant lets the agent change files that the host's own tools later execute or
trust: git runs hooks and obeys its config (``core.fsmonitor`` runs a command on a plain
``git status``) - and finds them through many files of ``.git`` (``commondir``, ``index``
entries of submodules, ``modules/*/config``, ``worktrees/``), so all of ``.git`` is kept
read-only; direnv loads ``.envrc``, editors, IDEs and coding agents load ``.vscode/``,
``.idea/``, ``.devcontainer/``, ``.claude/`` and ``.mcp.json``, CI runs ``.github/``, package
managers, build tools and version managers obey ``.npmrc``, ``.yarnrc.yml``, ``.cargo/``,
``.bazelrc``, ``.tool-versions``..., shells source their rc files: ``HOST_TRUSTED`` is the one
list, with a reason per name. Inside an rw grant these names, at the grant's top, are bound
read-only over themselves (a mount point cannot be renamed or removed either); a name that
does not exist gets an empty placeholder for the sandbox's lifetime (removed afterwards when
still empty and no other sandbox uses it), so it cannot be *created* either. A ``.git``
*file* (a worktree or submodule checkout) is kept read-only, and so is the directory it
points to when that is inside the grant. An agent file lifts this per name with
``mounts[].writableTrusted`` (``.git``: the agent may commit - and plant hooks).

Some names are protected only when present: shell rc files (a home directory itself cannot
be granted, so an absent one is read by nothing) and plain names that sit among the
project's own code (``pip.conf``, ``rust-toolchain``), which the agent edits anyway. The
same names in a *subfolder* are not protected (the agent's, as all of the project's code).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from agentvm.errors import LaunchError, PolicyDenied

@dataclass(frozen=True)
class Trusted:
    """A name the host trusts at the top of a read-write grant: what it does on the host."""

    name: str
    absent: str | None  # the placeholder's kind when absent ("dir" | "file"); None: protected only when present
    reason: str


# THE list (one place): every name the host executes or trusts at the top of a granted folder.
# docs/policy-reference.md carries the table generated from it (``docs_table``; a unit test
# checks it). Not here: the project's own code (Makefile, conftest.py, build.rs, package.json
# scripts...) - the agent edits code by design; see docs/threat-model.md.
HOST_TRUSTED: tuple[Trusted, ...] = (
    Trusted(".git", "dir", "git runs hooks and obeys its config (`core.fsmonitor` runs on `git status`), found through many files of `.git`: all of it"),
    Trusted(".gitmodules", "file", "submodule URLs and paths git fetches and checks out on the host"),
    Trusted(".gitattributes", "file", "selects filter, diff and merge drivers (git-lfs, textconv) the host's git runs on matching paths"),
    Trusted(".gitconfig", "file", "a repository's `.git/config` may include it (`include.path = ../.gitconfig`)"),
    Trusted(".envrc", "file", "direnv runs it in the host's shell on `cd`"),
    Trusted(".vscode", "dir", "VS Code tasks, launch configurations and settings naming executables"),
    Trusted(".idea", "dir", "JetBrains run configurations and tool paths"),
    Trusted(".devcontainer", "dir", "Dev Containers builds and runs it when the folder is opened (`initializeCommand` runs on the host)"),
    Trusted(".devcontainer.json", "file", "the single-file form of `.devcontainer/`"),
    Trusted(".claude", "dir", "Claude Code settings, hooks and commands"),
    Trusted(".cursor", "dir", "Cursor settings, rules and MCP servers it starts (`.cursor/mcp.json`)"),
    Trusted(".mcp.json", "file", "MCP servers a coding agent starts"),
    Trusted(".github", "dir", "CI workflows and actions run with the repository's secrets once pushed"),
    Trusted(".pre-commit-config.yaml", "file", "the commands pre-commit (installed as a git hook) runs at the next commit"),
    Trusted(".husky", "dir", "husky's git hooks (`core.hooksPath`), run at the next commit"),
    Trusted(".npmrc", "file", "npm/pnpm settings: registry, `script-shell`, `node-options`, `git` - redirect or run"),
    Trusted(".yarnrc", "file", "yarn 1: `yarn-path` runs the named script for every yarn command; registry"),
    Trusted(".yarnrc.yml", "file", "yarn 2+: `yarnPath` runs the named script for every yarn command; registry"),
    Trusted(".cargo", "dir", "cargo's `config.toml`: `runner`, `rustc-wrapper`, registries - run or redirect"),
    Trusted(".bazelrc", "file", "`--run_under`, `--workspace_status_command`... run commands on the host"),
    Trusted(".bazelversion", "file", "bazelisk downloads and runs the Bazel it names (`fork/version` from any GitHub fork)"),
    Trusted(".bazeliskrc", "file", "bazelisk's download URL for the Bazel it runs"),
    Trusted(".tool-versions", "file", "asdf/mise choose the tools that run (asdf takes `path:` versions)"),
    Trusted(".python-version", "file", "pyenv/uv choose the interpreter that runs (uv takes an interpreter's path)"),
    Trusted(".nvmrc", "file", "nvm/fnm choose (and fnm installs) the Node that runs"),
    Trusted(".node-version", "file", "fnm/nodenv choose (and fnm installs) the Node that runs"),
    # plain names sit among the project's own code (build.rs, Makefile: the agent's to edit), and
    # a placeholder there would show in `ls` and in git under a user's own excludes file
    Trusted("pip.conf", None, "pip reads it when the folder is a virtual environment (index redirect)"),
    Trusted("rust-toolchain", None, "rustup runs the toolchain it names (a custom toolchain's `path`)"),
    Trusted("rust-toolchain.toml", None, "rustup runs the toolchain it names (a custom toolchain's `path`)"),
    # a home directory itself cannot be granted: an absent one is read by nothing
    *(Trusted(n, None, "shells source it") for n in (
        ".bashrc", ".bash_profile", ".bash_login", ".bash_logout", ".profile",
        ".zshrc", ".zshenv", ".zprofile", ".zlogin")),
)
TRUSTED_NAMES: tuple[str, ...] = tuple(t.name for t in HOST_TRUSTED)
DOCS_BEGIN = "<!-- host-trusted names: generated from agentvm.grants.HOST_TRUSTED (python -m agentvm.grants --write-docs) -->"
DOCS_END = "<!-- end of host-trusted names -->"


def docs_table() -> str:
    """The table of docs/policy-reference.md (between DOCS_BEGIN and DOCS_END)."""
    lines = [DOCS_BEGIN, "", "| Name | Present: read-only. Absent: | What the host does with it |", "|---|---|---|"]
    for t in HOST_TRUSTED:
        when = {"dir": "empty read-only folder", "file": "empty read-only file", None: "none (it may be created)"}[t.absent]
        lines.append(f"| `{t.name}` | {when} | {t.reason} |")
    return "\n".join(lines + ["", DOCS_END])


@dataclass(frozen=True)
class Protect:
    """One entry of a grant kept from the agent: bound read-only over itself (a mount point
    cannot be renamed or removed either)."""

    rel: str
    kind: str  # "dir" | "file"


def plan(host: str, writable: tuple[str, ...] = ()) -> tuple[Protect, ...]:
    """What to protect in the rw grant ``host`` (its resolved path), from the host as it is now.
    A trusted name that is a symbolic link is refused: a link cannot be bound over, and the
    host would follow it to a file the agent may change."""
    out: list[Protect] = []

    def kind_of(rel: str) -> str | None:
        try:
            st = os.lstat(os.path.join(host, rel))
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise PolicyDenied(
                f"{host}/{rel} is a symbolic link: agent-vm keeps that name read-only inside a read-write "
                "grant and cannot make a link read-only in place (the host would follow it to a file the agent may change)",
                hint=f"replace the link with the file it points to, or list {rel!r} in the grant's "
                "writableTrusted if the agent may change it",
                code="policy.grant-trusted-link",
            )
        return "dir" if stat.S_ISDIR(st.st_mode) else "file"

    if not os.path.isdir(host):
        return ()  # a single granted file: nothing inside it to protect
    for t in HOST_TRUSTED:  # at the grant's top only (as every placeholder)
        rel, absent = t.name, t.absent
        if rel in writable:  # writableTrusted names (validated: exactly TRUSTED_NAMES)
            continue
        exists = kind_of(rel)
        if exists or absent:
            out.append(Protect(rel, exists or absent))
        if rel == ".git" and exists == "file":
            target = _gitdir_target(host)
            if target is not None:
                out.append(Protect(target, "dir"))
    return tuple(out)


def _gitdir_target(host: str) -> str | None:
    """The directory a ``.git`` file (``gitdir: PATH``) points to, relative to the grant, when it
    lies inside the grant; None when it is outside (not granted) or unreadable."""
    try:
        with open(os.path.join(host, ".git"), "rb") as fh:
            line = fh.read(4096).split(b"\n", 1)[0].decode("utf-8", "strict")
    except (OSError, UnicodeDecodeError):
        return None
    if not line.startswith("gitdir:"):
        return None
    target = os.path.realpath(os.path.join(host, line[7:].strip()))
    if target == host or not target.startswith(host.rstrip("/") + "/") or not os.path.isdir(target):
        return None
    return os.path.relpath(target, host)


@dataclass(frozen=True)
class Placeholder:
    """An empty entry made so a trusted name cannot be created while a sandbox uses the grant."""

    rel: str  # a name directly in the grant (placeholders are only ever made at its top)
    kind: str
    dev: int
    ino: int


# Several sandboxes may share a granted folder, and a placeholder is a mount point in each of
# them: removing it while another sandbox still uses it would detach that sandbox's read-only
# bind. Two flock files per folder (keyed by its dev:ino) coordinate, in <runtime>/grants/:
#   KEY.use  held shared by every sandbox using the folder, for its lifetime;
#   KEY.mut  held exclusively while placeholders are made, recorded or removed;
#   KEY.json the placeholders made (by whichever sandbox), removed by the last one out.
# Teardown takes .mut, drops its own .use, and removes only if .use can be taken exclusively
# without waiting (no other sandbox holds it); a starting sandbox takes .use before .mut, so
# it never sees a placeholder vanish.


@dataclass
class Hold:
    key: str
    grant: str
    use_fd: int


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}-{st.st_ino}"


def _flock(path: Path, how: int) -> int:
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _records(lock_dir: Path, key: str) -> list[Placeholder]:
    try:
        return [Placeholder(**r) for r in json.loads((lock_dir / f"{key}.json").read_text())]
    except (OSError, ValueError, TypeError):
        return []


def _write_records(lock_dir: Path, key: str, recs: list[Placeholder]) -> None:
    path = lock_dir / f"{key}.json"
    if not recs:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps([r.__dict__ for r in recs]))
    os.replace(tmp, path)


def ensure(grant_fd: int, grant: str, protects: tuple[Protect, ...], lock_dir: Path) -> Hold:
    """Make every protected entry exist (placeholders owned like the grant, empty), checking
    that what exists is still what ``plan`` saw, and hold the folder for this sandbox. Every
    step is relative to ``grant_fd`` (the grant's O_PATH fd) and follows no link."""
    import fcntl

    lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = os.fstat(grant_fd)
    key = _key(owner)
    use = _flock(lock_dir / f"{key}.use", fcntl.LOCK_SH)
    mut = _flock(lock_dir / f"{key}.mut", fcntl.LOCK_EX)
    try:
        recs = _records(lock_dir, key)
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
                if parent:  # only existing entries are protected below the top (a .git file's target)
                    raise LaunchError("grant", f"{grant}/{p.rel} disappeared since the sandbox was planned: refused")
                if p.kind == "dir":
                    os.mkdir(name, 0o755, dir_fd=dfd)
                else:
                    os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd))
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                recs.append(Placeholder(p.rel, p.kind, st.st_dev, st.st_ino))
                _write_records(lock_dir, key, recs)
                if os.geteuid() == 0:
                    os.chown(name, owner.st_uid, owner.st_gid, dir_fd=dfd, follow_symlinks=False)
            except OSError as exc:
                raise LaunchError("grant", f"cannot keep {grant}/{p.rel} read-only: {exc.strerror}") from exc
            finally:
                if dfd != grant_fd:
                    os.close(dfd)
    except BaseException:
        os.close(mut)
        release(Hold(key, grant, use), lock_dir)
        raise
    os.close(mut)
    return Hold(key, grant, use)


def placeholder_files(hold: Hold, lock_dir: Path) -> list[str]:
    """The empty files agent-vm made in the held folder (by this sandbox or another one using
    it): names at its top, for the sandbox's git excludes (``git_excludes``)."""
    return sorted({r.rel for r in _records(lock_dir, hold.key) if r.kind == "file" and "/" not in r.rel})


def git_excludes(placeholders: list[tuple[str, list[str]]]) -> str:
    """The sandbox's own git excludes file (git's default ``~/.config/git/ignore``): the
    placeholders of every read-write grant, so ``git status`` does not show them as untracked
    and ``git add -A`` does not commit them (on the host they are gone after the run, and the
    repository would show them deleted). ``placeholders``: (the grant's path in the sandbox,
    its placeholder names). A pattern is anchored at the repository's top, which is the grant
    itself or a folder above it: one line for each."""
    lines = ["# agent-vm: empty placeholders of protected names in read-write grants (see docs/compatibility.md).",
             "# Your own patterns may go here too; a core.excludesFile you set replaces this file (git's rule)."]
    for path, names in placeholders:
        parts = [p for p in path.split("/") if p]
        for name in names:
            for i in range(len(parts), 0, -1):
                lines.append("/" + "/".join(parts[i:] + [name]))
    return "\n".join(dict.fromkeys(lines)) + "\n"


def release(hold: Hold | None, lock_dir: Path) -> list[str]:
    """This sandbox is done with the folder: if no other sandbox uses it, remove the
    placeholders that are still the empty entries made (by any sandbox). Returns what had to
    stay (changed on the host meanwhile, e.g. a real ``git init``)."""
    import fcntl

    if hold is None:
        return []
    mut = _flock(lock_dir / f"{hold.key}.mut", fcntl.LOCK_EX)
    try:
        if hold.use_fd >= 0:
            os.close(hold.use_fd)
            hold.use_fd = -1
        try:
            last = _flock(lock_dir / f"{hold.key}.use", fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # another sandbox still uses the folder: the last one out removes them
        try:
            kept = _remove(hold.grant, hold.key, _records(lock_dir, hold.key))
            _write_records(lock_dir, hold.key, [])
            return kept
        finally:
            os.close(last)
    finally:
        os.close(mut)


def _remove(grant: str, key: str, recs: list[Placeholder]) -> list[str]:
    kept: list[str] = []
    if not recs:
        return kept
    try:
        gfd = os.open(grant, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return [f"{grant}/{r.rel}" for r in recs]
    try:
        if _key(os.fstat(gfd)) != key:
            return [f"{grant}/{r.rel}" for r in recs]  # the path leads elsewhere now: touch nothing
        for p in recs:
            try:
                st = os.stat(p.rel, dir_fd=gfd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != (p.dev, p.ino):
                    continue  # no longer ours
                if p.kind == "dir" and stat.S_ISDIR(st.st_mode):
                    os.rmdir(p.rel, dir_fd=gfd)
                elif st.st_size == 0 and stat.S_ISREG(st.st_mode):
                    os.unlink(p.rel, dir_fd=gfd)
                else:
                    kept.append(f"{grant}/{p.rel}")
            except FileNotFoundError:
                pass
            except OSError:
                kept.append(f"{grant}/{p.rel}")
    finally:
        os.close(gfd)
    return kept


def save(run_dir: Path, holds: list[Hold]) -> None:
    """Record which folders this sandbox holds, so the holds of a supervisor that died are
    released (and their placeholders removed, if nobody else uses the folder) by ``gc``."""
    if holds:
        (run_dir / "grants.json").write_text(json.dumps([{"key": h.key, "grant": h.grant} for h in holds]))


def release_recorded(run_dir: Path, lock_dir: Path) -> None:
    try:
        recs = json.loads((run_dir / "grants.json").read_text())
    except (OSError, ValueError):
        return
    for r in recs if isinstance(recs, list) else []:
        try:
            release(Hold(str(r["key"]), str(r["grant"]), -1), lock_dir)
        except (KeyError, TypeError, OSError):
            continue


def _write_docs(path: Path) -> bool:
    text = path.read_text()
    a, b = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    new = text[:a] + docs_table() + text[b:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-docs"]:
        doc = Path(__file__).resolve().parents[2] / "docs" / "policy-reference.md"
        print(f"{doc}: {'rewritten' if _write_docs(doc) else 'up to date'}")
    else:
        print(docs_table())

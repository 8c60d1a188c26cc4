"""A fleet is a git repository of agent files: plan and apply an exact commit.

Pure pieces (no daemon): resolving a ref to a commit, loading every agent *from git objects*
at that commit (never the work tree: what is applied is what the commit holds, byte for byte),
signature checks with git's own ``verify-commit``, the plan (a list of actions, with a policy
diff that calls out widening), and the replay of recorded decisions against a candidate policy.
The daemon applies a plan (``daemon/server.py``: ``/v1/fleet/...``).

Repository layout
    Every ``*.yaml``/``*.yml`` file whose ``kind`` is ``Agent`` is an agent (anywhere but
    under ``presets/``); ``presets/`` holds the fleet's presets (``kind: Preset``), found
    before the built-in ones. An optional ``agentvm-fleet.yaml`` at the root may say
    ``requireSigned: true`` (it can only switch the check on: the signers are the operator's,
    ``<home>/fleet.yaml``, never the repository's - a commit cannot vouch for itself) and
    ``pins: {PATH: sha256:HEX}`` (a file of the commit - a preset, a tool server's script -
    must have exactly that content).

An applied agent's stored spec is its *resolved* spec (presets merged, from that commit):
a restart next month runs exactly what was applied, whatever the presets on disk say then.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from agentvm.errors import ConfigError, PolicyDenied

FLEET_CONFIG = "agentvm-fleet.yaml"
GIT_TIMEOUT = 60
MAX_BLOB = 1024 * 1024
_SHA = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")
_KIND_AGENT = re.compile(r"""(?m)^kind:[ \t]*["']?Agent["']?[ \t]*(#.*)?$""")


class FleetError(ConfigError):
    code = "fleet.error"


# ---------------------------------------------------------------------------- git
# git never runs *in* the fleet's repository: its .git/config could name programs (a gpg or
# ssh signature program, a promisor remote's upload-pack fetched lazily, a pager...), and its
# refs/replace could swap objects under a verified commit. Every git command runs in a
# scratch repository agent-vm makes: the fleet's objects are reached through
# objects/info/alternates (read only), its refs are copied in as data (never refs/replace),
# the environment is clean (no system or global config, replace objects off), and there is
# no remote, so nothing is ever fetched.
_REF_NAME = re.compile(r"^[A-Za-z0-9._/-]{1,200}$")


def _gitdir(repo: Path) -> tuple[Path, Path]:
    """(git dir, common dir) of a work tree, a linked work tree or a bare repository."""
    dot = repo / ".git"
    if dot.is_dir():
        gitdir = dot
    elif dot.is_file():
        text = dot.read_text(errors="replace").strip()
        if not text.startswith("gitdir:"):
            raise FleetError(f"{dot} is not a git link file")
        gitdir = (repo / text[7:].strip()).resolve()
    elif (repo / "HEAD").is_file() and (repo / "objects").is_dir():
        gitdir = repo
    else:
        raise FleetError(f"{repo} is not a git repository", hint="--repo names the fleet's repository")
    common = gitdir
    if (gitdir / "commondir").is_file():
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    if not (common / "objects").is_dir():
        raise FleetError(f"{repo}: no object directory at {common / 'objects'}")
    return gitdir, common


class _Scratch:
    """A scratch repository reading the fleet repository's objects and refs (see above)."""

    def __init__(self, repo: Path) -> None:
        import shutil

        self.repo = repo
        try:
            gitdir, common = _gitdir(repo)
        except OSError as exc:  # a name too long, a loop of links, no permission: the operator's input
            raise FleetError(f"{str(repo)[:200]}: cannot be read as a git repository ({exc.strerror or exc})",
                             hint="--repo names the fleet's repository") from None
        self.tmp = Path(tempfile.mkdtemp(prefix="agentvm-fleet-git-"))
        try:
            self.dir = self.tmp / "scratch.git"
            self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.tmp), "LC_ALL": "C",
                        "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_NO_REPLACE_OBJECTS": "1",
                        "GIT_TERMINAL_PROMPT": "0", "GIT_NO_LAZY_FETCH": "1", "GIT_DIR": str(self.dir)}
            self._run("init", "--bare", "-q", str(self.dir), env={k: v for k, v in self.env.items() if k != "GIT_DIR"})
            (self.dir / "objects" / "info").mkdir(parents=True, exist_ok=True)
            (self.dir / "objects" / "info" / "alternates").write_text(str((common / "objects").resolve()) + "\n")
            # refs, as data: loose refs (not refs/replace), packed-refs (the same), HEAD
            for src in (common / "refs").rglob("*") if (common / "refs").is_dir() else ():
                rel = src.relative_to(common).as_posix()
                if rel.startswith("refs/replace") or src.is_symlink() or not src.is_file():
                    continue
                if not _REF_NAME.match(rel) or src.stat().st_size > 4096:
                    continue
                dst = self.dir / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
            packed = common / "packed-refs"
            if packed.is_file() and not packed.is_symlink():
                if packed.stat().st_size > 64 * 1024 * 1024:
                    raise FleetError(f"{packed} is over 64 MiB")
                keep = [ln for ln in packed.read_bytes().split(b"\n") if b" refs/replace/" not in ln]
                (self.dir / "packed-refs").write_bytes(b"\n".join(keep))
            head = gitdir / "HEAD"
            if head.is_file() and not head.is_symlink() and head.stat().st_size <= 4096:
                shutil.copyfile(head, self.dir / "HEAD")
        except OSError as exc:
            self.close()
            raise FleetError(f"{str(repo)[:200]}: its refs cannot be read ({exc.strerror or exc})") from None
        except BaseException:
            self.close()
            raise

    def _run(self, *args: str, input: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["git", *args], input=input, capture_output=True, timeout=GIT_TIMEOUT,
                                  env=env if env is not None else self.env, cwd=str(self.tmp))
        except FileNotFoundError:
            raise FleetError("git is not installed", hint="apt-get install git") from None
        except subprocess.TimeoutExpired:
            raise FleetError(f"git {args[0]} did not finish within {GIT_TIMEOUT}s for {self.repo}") from None

    def git(self, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
        r = self._run(*args, input=input)
        if check and r.returncode != 0:
            raise FleetError(f"git {' '.join(args[:2])} failed for {self.repo}: "
                             f"{r.stderr.decode(errors='replace').strip()[:300]}")
        return r

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "_Scratch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve(repo: str | Path, ref: str) -> str:
    """REF -> the full commit id it names (a branch, a tag, a short id, a full id)."""
    repo = Path(repo)
    if not ref or ref.startswith("-") or any(c in ref for c in "\n\0"):
        raise FleetError(f"{ref!r} is not a git ref")
    with _Scratch(repo) as g:
        r = g.git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}", check=False)
    if r.returncode != 0:
        raise FleetError(f"{ref!r} names no commit in {repo}", hint="give a branch, a tag or a commit id")
    return r.stdout.decode().strip()


def is_full_id(ref: str) -> bool:
    return bool(_SHA.match(ref or ""))


MAX_ENTRIES = 100_000


def _tree(g: _Scratch, sha: str) -> list[tuple[str, str, str, int]]:
    """(mode, blob id, path, size) of every blob of the commit."""
    out = g.git("ls-tree", "-r", "-z", "-l", "--full-tree", sha).stdout
    entries = []
    for item in out.split(b"\0"):
        if not item:
            continue
        meta, _, path = item.partition(b"\t")
        mode, kind, oid, size = meta.decode().split()
        if kind == "blob":
            entries.append((mode, oid, path.decode("utf-8", "surrogateescape"), int(size) if size.isdigit() else 0))
            if len(entries) > MAX_ENTRIES:
                raise FleetError(f"commit {sha[:12]} has over {MAX_ENTRIES} files")
    return entries


def _blobs(g: _Scratch, oids: list[str]) -> dict[str, bytes]:
    """Blobs by id; each at most MAX_BLOB bytes (checked before it is read: ``ls-tree -l``)."""
    if not oids:
        return {}
    out = g.git("cat-file", "--batch", input=("\n".join(oids) + "\n").encode()).stdout
    res, i = {}, 0
    for oid in oids:
        nl = out.find(b"\n", i)
        header = out[i:nl].decode(errors="replace").split() if nl >= 0 else []
        if len(header) != 3 or header[1] != "blob":
            raise FleetError(f"object {oid[:12]} is missing from the repository (a partial or shallow clone?)",
                             hint="fetch the whole history of the fleet's repository", code="fleet.missing-object")
        size = int(header[2])
        res[oid] = out[nl + 1:nl + 1 + size]
        i = nl + 1 + size + 1
    return res


# ---------------------------------------------------------------------------- loading
@dataclass
class FleetAgent:
    name: str
    path: str  # in the repository
    spec_text: str  # the resolved spec (presets merged), as stored by the daemon
    policy: object  # agentvm.policy.Policy
    digest: str  # the policy's digest


@dataclass
class Fleet:
    repo: str
    commit: str
    agents: dict[str, FleetAgent]
    config: dict = field(default_factory=dict)
    signed: str | None = None  # who signed the commit (when checked)


MAX_PINNED = 16 * 1024 * 1024  # a pinned file (a tool server's script) is hashed whole
MAX_CANARY_SECONDS = 600


def _config_doc(text: str, path: str) -> dict:
    """The fleet config: YAML without anchors or aliases (no alias bombs), a small mapping of
    known keys with the right types - checked at load, not halfway through an apply."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from None
    seen: set[int] = set()
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if id(n) in seen or getattr(n, "anchor", None):
            raise ValueError("anchors and aliases are not allowed")
        seen.add(id(n))
        if len(seen) > 10000:
            raise ValueError("over 10000 YAML nodes")
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack += [k, v]
        elif isinstance(n, yaml.SequenceNode):
            stack += list(n.value)
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        raise ValueError("not a mapping")
    unknown = set(doc) - {"requireSigned", "pins", "canary"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(map(str, unknown))} (requireSigned, pins, canary)")
    if not isinstance(doc.get("requireSigned", False), bool):
        raise ValueError("requireSigned is true or false")
    pins = doc.get("pins") or {}
    if not isinstance(pins, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pins.items()):
        raise ValueError("pins is a map PATH: sha256:HEX")
    canary = doc.get("canary") or {}
    if not isinstance(canary, dict) or set(canary) - {"agents", "seconds", "healthchecks"}:
        raise ValueError("canary takes agents, seconds and healthchecks")
    agents = canary.get("agents") or []
    if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
        raise ValueError("canary.agents is a list of names or globs")
    sec = canary.get("seconds", 3)
    if isinstance(sec, bool) or not isinstance(sec, (int, float)) or not 0 <= sec <= MAX_CANARY_SECONDS:
        raise ValueError(f"canary.seconds is a number from 0 to {MAX_CANARY_SECONDS}")
    hcs = canary.get("healthchecks") or {}
    if not isinstance(hcs, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and v and all(isinstance(x, (str, int)) for x in v)
            for k, v in hcs.items()):
        raise ValueError("canary.healthchecks maps an agent name to a command (a list of strings)")
    return doc


def load(repo: str | Path, commit: str, *, trust: dict | None = None) -> Fleet:
    """Every agent of ``commit``, validated (all problems of all files at once, with
    file:line), presets from the commit's ``presets/``; the signature and pins checked."""
    repo = Path(repo).resolve()
    with _Scratch(repo) as g:
        return _load(g, repo, commit, trust or {})


def _load(g: _Scratch, repo: Path, commit: str, trust: dict) -> Fleet:
    from agentvm.errors import SpecError
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import dump_resolved, load_agent_text

    if g.git("cat-file", "-t", commit, check=False).stdout.strip() != b"commit":
        raise FleetError(f"{commit[:12]} is not a commit of {repo}")
    entries = _tree(g, commit)
    wanted = [(m, o, p, n) for m, o, p, n in entries if p.endswith((".yaml", ".yml")) or p == FLEET_CONFIG]
    links = [p for m, _, p, _ in wanted if m == "120000"]
    problems: list[str] = []
    big = [p for m, _, p, n in wanted if m != "120000" and n > MAX_BLOB]
    problems += [f"{p}: over {MAX_BLOB} bytes" for p in big]
    blobs = _blobs(g, [o for m, o, p, n in wanted if m != "120000" and n <= MAX_BLOB])
    config: dict = {}
    for m, oid, path, n in wanted:
        if path == FLEET_CONFIG and m != "120000":
            if n > 65536:
                problems.append(f"{path}: over 64 KiB")
                continue
            try:
                config = _config_doc(blobs[oid].decode("utf-8"), path)
            except (ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{path}: {exc}")
    signed = verify(g, commit, trust, config)
    problems += _check_pins(g, config, entries)
    if trust.get("pins"):  # the operator's own pins: a commit cannot change these
        problems += [p.replace(FLEET_CONFIG, "<home>/fleet.yaml") for p in _check_pins(g, {"pins": trust["pins"]}, entries)]
    agents: dict[str, FleetAgent] = {}
    with tempfile.TemporaryDirectory(prefix="agentvm-fleet-") as tmp:
        pdir = Path(tmp) / "presets"
        pdir.mkdir()
        for m, oid, path, n in wanted:
            if path.startswith("presets/") and path.count("/") == 1 and m != "120000" and oid in blobs:
                (pdir / path.split("/", 1)[1]).write_bytes(blobs[oid])
        for m, oid, path, n in sorted(wanted, key=lambda e: e[2]):
            if m == "120000" or path.startswith("presets/") or path == FLEET_CONFIG or oid not in blobs:
                continue
            data = blobs[oid]
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                problems.append(f"{path}: not UTF-8")
                continue
            # an agent file says so at its top level; the loader (bounded, located errors) does the rest
            if not _KIND_AGENT.search(text):
                continue
            try:
                loaded = load_agent_text(text, path, preset_dirs=[pdir])
                policy = compile_policy(loaded.spec)
            except SpecError as exc:
                if exc.problems:
                    problems.extend(p.render() for p in exc.problems)
                else:
                    problems.append(f"{path}: {exc.message}")
                continue
            except (ConfigError, PolicyDenied, ValueError) as exc:
                problems.append(f"{path}: {getattr(exc, 'message', exc)}")
                continue
            resolved = dump_resolved(loaded)
            resolved["spec"]["presets"] = []  # merged already: the stored spec needs no preset files
            name = loaded.spec.metadata.name
            if name in agents:
                problems.append(f"{path}: the agent name {name!r} is also declared in {agents[name].path}")
                continue
            # in the file's order: a map whose order means something (the first matching price
            # glob of limits.budget.prices) must not be re-sorted into another meaning
            stored = yaml.safe_dump(resolved, sort_keys=False)
            # what runs is the stored text: it must compile to exactly the commit's policy
            # (a default written out can change a meaning - a deny rule without ports)
            try:
                again = compile_policy(load_agent_text(stored, path, preset_dirs=[]).spec)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{path}: its resolved form does not load again ({exc}): a bug in agent-vm")
                continue
            if again.digest() != policy.digest():
                problems.append(f"{path}: its resolved form compiles to another policy than the file: a bug in "
                                "agent-vm, refused rather than run something else")
                continue
            agents[name] = FleetAgent(name, path, stored, policy, policy.digest())
    if links:
        problems += [f"{p}: a symbolic link (agent files and presets must be regular files of the commit)" for p in links]
    if problems:
        raise FleetError(f"commit {commit[:12]} has {len(problems)} problem(s); nothing was applied:\n  "
                         + "\n  ".join(problems[:50]), hint="fix the files and commit again", code="fleet.invalid")
    return Fleet(str(repo), commit, agents, config, signed)


def _check_pins(g: _Scratch, config: dict, entries) -> list[str]:
    pins = config.get("pins") or {}
    by_path = {p: (m, o, n) for m, o, p, n in entries}
    out = []
    ok = [p for p in pins if p in by_path and by_path[p][0] != "120000" and by_path[p][2] <= MAX_PINNED]
    blobs = _blobs(g, [by_path[p][1] for p in ok])
    for path, want in sorted(pins.items()):
        if path not in by_path:
            out.append(f"{FLEET_CONFIG}: pinned {path} is not in the commit")
            continue
        if by_path[path][0] == "120000":
            out.append(f"{FLEET_CONFIG}: pinned {path} is a symbolic link")
            continue
        if by_path[path][2] > MAX_PINNED:
            out.append(f"{FLEET_CONFIG}: pinned {path} is over {MAX_PINNED} bytes")
            continue
        got = "sha256:" + hashlib.sha256(blobs[by_path[path][1]]).hexdigest()
        if str(want).lower() != got:
            out.append(f"{path}: content {got} does not match its pin {want}")
    return out


def _signed_payload(raw: bytes) -> tuple[bytes, bytes]:
    """A commit object -> (its signature, the bytes it signs: the object without the header)."""
    header, sep, message = raw.partition(b"\n\n")
    payload, sig, in_sig = [], [], False
    for ln in header.split(b"\n"):
        if ln.startswith((b"gpgsig ", b"gpgsig-sha256 ")):
            in_sig = True
            sig.append(ln.split(b" ", 1)[1])
            continue
        if in_sig and ln.startswith(b" "):
            sig.append(ln[1:])
            continue
        in_sig = False
        payload.append(ln)
    return (b"\n".join(sig) + b"\n" if sig else b""), b"\n".join(payload) + sep + message


def verify(g: _Scratch, commit: str, trust: dict, config: dict) -> str | None:
    """Check the commit's signature when the operator's trust (``<home>/fleet.yaml``) or the
    repository's config requires it: an SSH signature (only), checked by agent-vm with
    ``ssh-keygen -Y verify`` against the operator's allowed-signers file (never by a program
    the repository could name). -> the signer, or None when not required."""
    from agentvm.sshsig import check_signers_file, principals

    required = bool(trust.get("requireSigned")) or bool(config.get("requireSigned"))
    signers = trust.get("allowedSigners")
    if not required:
        return None
    if not signers:
        raise FleetError("signed commits are required, but no signers are configured",
                         hint="name an SSH allowed-signers file as allowedSigners in <home>/fleet.yaml",
                         code="fleet.unsigned")
    signers = check_signers_file(signers, "allowedSigners")
    raw = g.git("cat-file", "commit", commit).stdout
    sig, payload = _signed_payload(raw)
    if not sig:
        raise FleetError(f"commit {commit[:12]} is not signed", code="fleet.unsigned",
                         hint=f"sign it (git commit -S with an SSH key listed in {signers})")
    if not sig.startswith(b"-----BEGIN SSH SIGNATURE-----"):
        raise FleetError(f"commit {commit[:12]} has a GPG or X.509 signature: only SSH signatures are accepted "
                         "(checked against the operator's allowed signers)", code="fleet.unsigned",
                         hint="git config gpg.format ssh; sign with a key listed in " + str(signers))
    who = principals(sig, payload, signers, "git")
    if not who:
        raise FleetError(f"commit {commit[:12]} is not signed by a configured signer", code="fleet.unsigned",
                         hint=f"sign it (git commit -S with a key listed in {signers})")
    return who[0]


def load_trust(home: Path) -> dict:
    path = Path(home) / "fleet.yaml"
    if not path.exists():
        return {}
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise FleetError(f"{path}: {exc}") from None
    if not isinstance(doc, dict) or not set(doc) <= {"requireSigned", "allowedSigners", "pins"}:
        raise FleetError(f"{path}: only requireSigned, allowedSigners and pins are known")
    pins = doc.get("pins") or {}
    if not isinstance(pins, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pins.items()):
        raise FleetError(f"{path}: pins is a map PATH: sha256:HEX")
    return doc


# ---------------------------------------------------------------------------- the plan
@dataclass
class Action:
    kind: str  # create | update | remove | unchanged
    name: str
    path: str | None = None
    old_digest: str | None = None
    new_digest: str | None = None
    restart: bool = False  # an update of a running sandbox restarts it
    changes: list[str] = field(default_factory=list)
    widening: list[str] = field(default_factory=list)
    replay: dict | None = None


@dataclass
class Plan:
    repo: str
    commit: str
    previous: str | None  # the commit applied now (if any)
    actions: list[Action]
    unmanaged: list[str] = field(default_factory=list)  # sandboxes no commit declares (left alone)
    signed: str | None = None

    def digest(self) -> str:
        core = {"commit": self.commit, "actions": [
            {k: v for k, v in asdict(a).items() if k != "replay"} for a in self.actions if a.kind != "unchanged"]}
        return "sha256:" + hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"repo": self.repo, "commit": self.commit, "previous": self.previous, "digest": self.digest(),
                "signed": self.signed, "unmanaged": self.unmanaged, "actions": [asdict(a) for a in self.actions],
                "changes": sum(1 for a in self.actions if a.kind != "unchanged"),
                "widening": sum(1 for a in self.actions if a.widening)}


def make_plan(fleet: Fleet, current: dict[str, dict], previous: str | None) -> Plan:
    """``current``: name -> {"policy": Policy, "digest", "fleet": bool (applied from a fleet),
    "running": bool}. Safe order: creates, then updates, then removes."""
    creates, updates, removes, same = [], [], [], []
    for name, fa in sorted(fleet.agents.items()):
        cur = current.get(name)
        if cur is None:
            creates.append(Action("create", name, fa.path, None, fa.digest, changes=["new agent"],
                                  widening=widening(None, fa.policy)))
        elif cur["digest"] != fa.digest:
            changes = diff(cur["policy"], fa.policy)
            if cur.get("live"):
                changes.append("drops the live changes made with `agentvm policy`: " + cur["live"])
            # widening is judged against what runs now (live changes included)
            updates.append(Action("update", name, fa.path, cur["digest"], fa.digest, restart=bool(cur.get("running")),
                                  changes=changes, widening=widening(cur.get("effective") or cur["policy"], fa.policy)))
        else:
            same.append(Action("unchanged", name, fa.path, cur["digest"], fa.digest))
    unmanaged = []
    for name, cur in sorted(current.items()):
        if name in fleet.agents:
            continue
        if cur.get("fleet"):
            removes.append(Action("remove", name, None, cur["digest"], None, changes=["no longer declared"]))
        else:
            unmanaged.append(name)
    return Plan(fleet.repo, fleet.commit, previous, creates + updates + removes + same, unmanaged, fleet.signed)


def _egress_hosts(policy) -> set[str]:
    eg = getattr(policy, "egress", None)
    if eg is None:
        return set()
    return {f"{r.host}:{','.join(map(str, r.ports)) or '*'}" for r in eg.allow}


_TIERS = ("L0", "L1", "L2", "L3", "L4", "L5")


def widening(old, new) -> list[str]:
    """What ``new`` may do or spend that ``old`` may not. Every field of the compiled policy
    (and of its parts: limits, the LLM budget, egress rules and limits, credentials, grants,
    tool servers) has a rule in :data:`JUDGED`: a function naming what widens, or why a change
    of it never gives the agent more. A change a rule cannot call narrower is listed for
    review rather than passed over in silence."""
    out = []
    if old is None:
        if new.egress is not None and new.egress.allow:
            out.append("egress to " + ", ".join(sorted(_egress_hosts(new))))
        out += [f"grant {m.host} -> {m.path} ({'rw' if m.writable else 'ro'})" for m in new.mounts]
        out += [f"credential {b.name} for {', '.join(b.hosts)}" for b in new.credentials]
        if new.tools is not None:
            out += [f"tool server {s.name}: {', '.join(s.allow)}" for s in new.tools.servers]
        out += [f"read-only host path {p}" for p in new.extra_ro]
        if new.allow_ptrace:
            out.append("ptrace allowed")
        if new.risk_tier in ("L4", "L5"):
            out.append(f"risk tier {new.risk_tier}")
        return out
    return _judge("Policy", old, new, old, new)


# ---------------------------------------------------------------------------- the rules, field by field
def _judge(kind: str, a, b, old, new, review: str = "{name} changed (not known to be narrower: review it)"):
    """Every field of ``a``/``b`` (one kind of :data:`JUDGED`) that changed, through its rule;
    ``old``/``new`` are what the rule is given beside the two values (the policies, or the
    tool servers). A rule that cannot tell (None) leaves the change for review."""
    out = []
    for name, rule in JUDGED[kind].items():
        if isinstance(rule, str):
            continue
        x, y = getattr(a, name), getattr(b, name)
        if x == y:
            continue
        got = rule(x, y, old, new)
        out += got if got is not None else [review.format(name=name)]
    return out


def _more(a, b) -> bool:
    """A limit raised or removed (None or 0: no limit)."""
    if b is None or b == 0:
        return a is not None and a != 0
    return a is not None and a != 0 and b > a


def _lim(label: str):
    def rule(a, b, *_):
        return [f"{label}: {a} -> {b if b not in (None, 0) else 'no limit'}"] if _more(a, b) else []
    return rule


def _neutral(why: str) -> str:
    return "never widens: " + why


_SEVERITY = {"read": 0, "write": 1, "destructive": 2}


def _limits(a, b, old, new) -> list[str]:
    return _judge("Limits", a, b, old, new)


def _budget(a, b, old, new) -> list[str]:
    if a is None:
        return []
    if b is None:
        return ["no LLM budget any more"]
    return _judge("BudgetSpec", a, b, old, new)


def _budget_limit(k):
    def rule(a, b, *_):
        return [f"LLM budget {k}: {a} -> {b if b is not None else 'no limit'}"] if a is not None and (
            b is None or b > a) else []
    return rule


def _allowed_hosts(policy) -> list[str]:
    """The concrete hosts (a pattern as one name under it) the policy's egress allows."""
    eg = getattr(policy, "egress", None)
    hosts = []
    for r in (eg.allow if eg is not None else ()):
        hosts.append("x" + r.host[1:] if r.host.startswith("*.") else r.host)
    return hosts


def _budget_hosts(a, b, old, new) -> list[str]:
    """A host the old budget metered, still reachable, that the new one does not meter: its
    LLM calls are unmetered (no token, request or cost limit applies to them)."""
    ob, nb = old.limits.budget, new.limits.budget
    if ob is None or nb is None:
        return []
    return [f"LLM host {h} no longer metered by limits.budget (egress to it stays allowed)"
            for h in sorted(set(_allowed_hosts(new))) if ob.covers(h) and not nb.covers(h)]


def _budget_prices(a, b, old, new) -> list[str]:
    """A price lowered (or a priced model no longer priced) while a cost budget is in effect: the
    same calls count less against it."""
    ob, nb = old.limits.budget, new.limits.budget
    if ob is None or nb is None or (ob.cost is None and nb.cost is None):
        return []
    out = []
    for glob in sorted({g for g, _, _ in ob.prices} | {g for g, _, _ in nb.prices}):
        was, now = ob.price(glob), nb.price(glob)
        if was is None:
            continue
        if now is None:
            out.append(f"LLM price of {glob}: {was[0]}/{was[1]} -> none (its calls cost nothing against the budget)")
        elif now[0] < was[0] or now[1] < was[1]:
            out.append(f"LLM price of {glob}: {was[0]}/{was[1]} -> {now[0]}/{now[1]} per 1M tokens (lower: the cost "
                       "budget allows more)")
    return out


def _egress(a, b, old, new) -> list[str]:
    if b is None:
        return []
    if a is None:  # no route before (network: none, said by its own rule): every rule now is new
        from agentvm.gate.policy import EgressPolicy

        a = EgressPolicy()
    return _judge("EgressPolicy", a, b, old, new, "egress rules: {name} changed (not known to be narrower: review it)")


def _contains(r0, r) -> bool:
    """Old allow rule ``r0`` already allows everything new allow rule ``r`` does."""
    return (r0.host == r.host and set(r.ports) <= set(r0.ports)
            and (not r0.methods or (r.methods and set(r.methods) <= set(r0.methods)))
            and (not r0.paths or (r.paths and set(r.paths) <= set(r0.paths)))
            and (r0.max_body is None or (r.max_body is not None and r.max_body <= r0.max_body))
            and (r0.websocket or not r.websocket) and (r.ask or not r0.ask))


def _egress_allow(a, b, old, new) -> list[str]:
    out = []
    old_hp = {(r.host, p) for r in a for p in r.ports}
    for r in b:
        fresh = [p for p in r.ports if (r.host, p) not in old_hp]
        if fresh:
            out.append(f"new egress {r.host}:{','.join(map(str, fresh))}")
        elif not any(_contains(r0, r) for r0 in a):
            near = [r0 for r0 in a if r0.host == r.host]
            what = []
            for r0 in near[:1]:
                if r0.methods and set(r.methods or ("any",)) - set(r0.methods):
                    what.append("more methods")
                if r0.paths and set(r.paths or ("any",)) - set(r0.paths):
                    what.append("more paths")
                if r0.max_body is not None and (r.max_body is None or r.max_body > r0.max_body):
                    what.append("a larger maxBody")
                if r.websocket and not r0.websocket:
                    what.append("WebSockets")
                if r0.ask and not r.ask:
                    what.append("no human approval (action: ask removed)")
            out.append(f"egress rules: {r.id} to {r.host} allows more ({', '.join(what) or 'review it'})")
    return out


def _egress_deny(a, b, old, new) -> list[str]:
    have = set(b)
    return [f"egress rules: deny rule {r.id} ({r.host}) removed or changed" for r in a if r not in have]


def _egress_hosts_map(a, b, *_) -> list[str]:
    was = dict(a)
    return [f"egress rules: hosts maps {n} to {ip}" for n, ip in b if was.get(n) != ip]


def _egress_ca(a, b, *_) -> list[str]:
    return ["egress rules: upstreamCa changed (the gate trusts other servers)"] if b else []


def _egress_limits(a, b, old, new) -> list[str]:
    return _judge("EgressLimits", a, b, old, new)


_PROBE_RANK = {"log": 0, "alert": 1, "pause": 2, "stop": 3}  # security.onEscapeProbe, weakest first


def _grant_level(m) -> int:
    """ro < review (writes held in a layer until accepted) < rw (writes reach the host)."""
    return 1 if getattr(m, "review", False) else 2 if m.writable else 0


def _mounts(a, b, *_) -> list[str]:
    old_m = {(m.host, m.path): m for m in a}
    out = []
    for m in b:
        m0 = old_m.get((m.host, m.path))
        mode = ("ro", "review", "rw")[_grant_level(m)]
        if m0 is None:
            out.append(f"new grant {m.host} -> {m.path} ({mode})")
        elif _grant_level(m) > _grant_level(m0):
            out.append(f"grant {m.host} -> {m.path}: {('ro', 'review', 'rw')[_grant_level(m0)]} -> {mode}")
        elif set(m.writable_trusted) - set(m0.writable_trusted):
            out.append(f"grant {m.host} -> {m.path} lets the agent change "
                       f"{', '.join(sorted(set(m.writable_trusted) - set(m0.writable_trusted)))}")
    return out


def _credentials(a, b, *_) -> list[str]:
    from dataclasses import replace

    old_c = {c.name: c for c in a}
    out = []
    for c in b:
        c0 = old_c.get(c.name)
        if c0 is None:
            out.append(f"new credential {c.name} for {', '.join(c.hosts)}")
        elif set(c.hosts) - set(c0.hosts):
            out.append(f"credential {c.name} also for {', '.join(sorted(set(c.hosts) - set(c0.hosts)))}")
        elif replace(c, hosts=c0.hosts) != c0:  # (hosts only removed: narrower)
            out.append(f"credential {c.name} changed (reference or injection: review it)")
    return out


def _tools(a, b, old, new) -> list[str]:
    if b is None:
        return []
    if a is None:
        return [f"new tool server {s.name}: {', '.join(sorted(s.allow))}" for s in b.servers]
    return _judge("ToolPolicy", a, b, old, new)


def _tool_servers(a, b, old, new) -> list[str]:
    olds = {s.name: s for s in a}
    out = []
    for s in b:
        s0 = olds.get(s.name)
        if s0 is None:
            out.append(f"new tool server {s.name}: {', '.join(sorted(s.allow))}")
            continue
        out += [f"tool server {s.name} {x}" for x in _judge("ServerPolicy", s0, s, s0, s, "{name} changed (review it)")]
    return out


def _tier_approval(a, b, *_) -> list[str]:
    gone = sorted(set(a) - set(b))
    return [f"{c} tools no longer always need a human" for c in gone]


def _added(label):
    def rule(a, b, *_):
        more = [g for g in b if g not in a]
        return [f"{label} {', '.join(more)}"] if more else []
    return rule


def _removed(label):
    def rule(a, b, *_):
        gone = [g for g in a if g not in b]
        return [f"{label} {', '.join(gone)}"] if gone else []
    return rule


def _risk(a, b, s0, s) -> list[str]:
    """A risk class lowered. Each glob is probed as a name (the class it gets from each policy);
    a glob is not always a name that it matches (``[d]elete_repo`` does not match its own text),
    so every old entry whose class is more severe than the new policy's entry of the exact same
    key (or the default, ``write``, when the key is gone) is named too - unless the key is a
    plain name and the new policy still gives that name a class at least as severe."""
    from agentvm.tools import policy as tp

    out, named = [], set()
    for glob in sorted({g for g, _ in a} | {g for g, _ in b} | set(s.allow) | set(s.approve)):
        was, now = tp.risk_of(s0, glob), tp.risk_of(s, glob)
        if _SEVERITY.get(now, 1) < _SEVERITY.get(was, 1):
            out.append(f"risk of {glob}: {was} -> {now}")
            named.add(glob)
    new = dict(b)
    for key, was in sorted(dict(a).items()):
        now = new.get(key, "write")
        if key in named or _SEVERITY.get(now, 1) >= _SEVERITY.get(was, 1):
            continue
        if not any(c in key for c in "*?[") and _SEVERITY.get(tp.risk_of(s, key), 1) >= _SEVERITY.get(was, 1):
            continue  # a plain name: its class in the new policy is exactly what risk_of says
        out.append(f"risk of {key}: {was} -> {now}" + ("" if key in new else " (its entry is gone)"))
    return out


def _arguments(a, b, *_) -> list[str]:
    now = dict(b)
    return [f"argument constraints of {glob} loosened or removed" for glob, rules in a
            if not set(rules) <= set(now.get(glob, ()))]


def _changed(label):
    def rule(a, b, *_):
        return [f"{label} changed (review it)"]
    return rule


def _substrate(a, b, *_) -> list[str]:
    from agentvm.policy import SUBSTRATE_STRENGTH

    return [f"substrate {a} -> {b} (weaker isolation)"] if SUBSTRATE_STRENGTH.get(b, 0) < SUBSTRATE_STRENGTH.get(a, 0) \
        else []


def _min_substrate(a, b, *_) -> list[str]:
    from agentvm.policy import SUBSTRATE_STRENGTH

    return [f"minSubstrate {a} -> {b or 'none'}"] if SUBSTRATE_STRENGTH.get(b or "", 0) < \
        SUBSTRATE_STRENGTH.get(a or "", 0) else []


def _tier(a, b, *_) -> list[str]:
    return [f"risk tier {a} -> {b} (more is allowed)"] if _TIERS.index(b) > _TIERS.index(a) else []


def _local_ports(a, b, *_) -> list[str]:
    if a and not b:
        return ["security.localPorts restriction removed (every local port)"]
    return [f"new local port {p}" for p in sorted(set(b) - set(a))] if a else []


#: every field of the compiled policy and of its parts, with the rule that judges a change of
#: it: a function ``(old value, new value, old whole, new whole) -> [lines]`` (None: cannot tell,
#: listed for review), or a string saying why a change of it never gives the agent more.
#: ``tests/unit/test_fleet_unit.py`` enumerates the dataclasses' fields: a new field without an
#: entry here fails it.
JUDGED: dict[str, dict] = {
    "Policy": {
        "name": _neutral("the agent's identity (a rename is a remove and a create)"),
        "command": _neutral("what runs, inside the same boundary"),
        "agent": _neutral("a durable, named workspace of its own"),
        "lifecycle": lambda a, b, *_: [f"lifecycle {a} -> {b} (runs until stopped)"] if b == "persistent" else [],
        "substrate": _substrate,
        "min_substrate": _min_substrate,
        "image": lambda a, b, *_: [f"image {a or 'host /usr'} -> {b or 'host /usr'} (another root: review it)"],
        "image_signers": lambda a, b, *_: (["image signatures no longer required"] if a and not b else
                                           [f"image signer {x} trusted" for x in b if x not in a]),
        "risk_tier": _tier,
        "workdir": _neutral("the starting folder inside the sandbox"),
        "extra_ro": lambda a, b, *_: [f"new read-only host path {p}" for p in sorted(set(b) - set(a))],
        "mounts": _mounts,
        "workspace": lambda a, b, *_: [f"a workspace at {b} where there was none"] if a is None and b else [],
        "env": _neutral("values given to the sandbox, no access (credentials have their own field)"),
        "limits": _limits,
        "allow_ptrace": lambda a, b, *_: ["ptrace allowed"] if b else [],
        "on_escape_probe": lambda a, b, *_: ([f"escape probes: {a} -> {b} (a weaker response)"]
                                             if _PROBE_RANK.get(b, 0) < _PROBE_RANK.get(a, 0) else []),
        "local_ports": _local_ports,
        "network": lambda a, b, *_: ["network: none -> gate"] if a == "none" and b == "gate" else [],
        "egress": _egress,
        "credentials": _credentials,
        "tools": _tools,
        "approval_timeout": lambda a, b, *_: [f"approval timeout {a:g}s -> {b:g}s (review it)"],
        "approval_webhook": lambda a, b, *_: [f"approvals webhook -> {b}"] if b else [],
        "pending_features": _neutral("sections declared but not enforceable: a run that needs them is refused"),
        "version": _neutral("the policy format"),
    },
    "Limits": {
        "memory": _lim("limits.memory"), "cpus": _lim("limits.cpus"), "pids": _lim("limits.pids"),
        "disk": _lim("limits.disk"), "timeout": _lim("limits.timeout"), "tmp": _lim("limits.tmp"),
        "shm": _lim("limits.shm"), "nofile": _lim("limits.nofile"), "budget": _budget,
    },
    "BudgetSpec": {
        "tokens": _budget_limit("tokens"), "requests": _budget_limit("requests"), "cost": _budget_limit("cost"),
        "hosts": _budget_hosts, "prices": _budget_prices,
    },
    "EgressPolicy": {
        "allow": _egress_allow, "deny": _egress_deny, "hosts": _egress_hosts_map, "upstream_ca": _egress_ca,
        "limits": _egress_limits,
    },
    "EgressLimits": {
        "connections": _lim("egress.limits.connections"),
        "requests_per_second": _lim("egress.limits.requestsPerSecond"),
        "burst": _lim("egress.limits.burst"), "bytes_out": _lim("egress.limits.bytesOut"),
    },
    "Rule": {  # judged whole by _egress_allow (allow rules) and _egress_deny (deny rules)
        "id": _neutral("a name"), "host": "_egress_allow/_egress_deny", "ports": "_egress_allow/_egress_deny",
        "methods": "_egress_allow/_egress_deny", "paths": "_egress_allow/_egress_deny",
        "max_body": "_egress_allow/_egress_deny", "websocket": "_egress_allow/_egress_deny",
        "ask": "_egress_allow/_egress_deny",
    },
    "MountGrant": {"host": "_mounts", "path": "_mounts", "writable": "_mounts", "writable_trusted": "_mounts",
                   "review": "_mounts"},
    "CredentialBinding": {k: "_credentials (a new binding, more hosts, or any other change of one)" for k in (
        "name", "env", "ref", "hosts", "header", "format", "basic", "query", "file", "prefix", "length", "charset",
        "sigv4_access_key_id", "sigv4_key_env", "hmac", "inspect", "broker", "ssh_known_hosts")},
    "ToolPolicy": {
        "servers": _tool_servers,
        "tier_approval": _tier_approval,
        "approval_timeout": _neutral("the same as Policy.approval_timeout, judged there"),
        "webhook": _neutral("the same as Policy.approval_webhook, judged there"),
        "tier": _neutral("the same as Policy.risk_tier, judged there"),
    },
    "ServerPolicy": {
        "name": _neutral("a server's identity (a rename is a removal and a new server)"),
        "kind": _changed("kind"),
        "command": _changed("command"),
        "url": _changed("url"),
        "allow": _added("allows"),
        "deny": _removed("no longer denies"),
        "approve": _removed("no longer needs a human for"),
        "risk": _risk,
        "arguments": _arguments,
        "resources": _added("shows resources"),
        "prompts": _added("shows prompts"),
        "calls_per_minute": _lim("callsPerMinute"), "timeout": _lim("timeout"),
        "max_arguments": _lim("maxArguments"), "max_result": _lim("maxResult"),
        "sandbox_spec": _changed("sandbox (its grants, environment, egress or credentials)"),
        "remote_egress": _changed("egress endpoint"),
        "remote_credentials": _changed("credentials"),
    },
}


def diff(old, new) -> list[str]:
    """Every top-level field of the policy that differs (a short account for the plan)."""
    a, b = old.to_dict(), new.to_dict()
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            if k == "limits":
                out += [f"limits.{lk}: {a[k].get(lk)} -> {b[k].get(lk)}" for lk in sorted(set(a[k]) | set(b[k]))
                        if a[k].get(lk) != b[k].get(lk)]
            elif k in ("command", "risk_tier", "lifecycle", "substrate", "network"):
                out.append(f"{k}: {a.get(k)} -> {b.get(k)}")
            else:
                out.append(f"{k} changed")
    return out


# ---------------------------------------------------------------------------- replay
def replay(records: list[dict], old, new) -> dict:
    """Decide each recorded egress decision and tool call again under ``new``: what it would
    break (allowed today, denied - or, for a tool, held for a human - then) and widen (denied
    today, allowed then). Only decisions a policy made (rule ids of allow rules or of policy
    denials) are replayed; limits, credentials and protocol errors are not policy and are
    skipped. Tool calls are replayed by the tool's name (the log keeps a digest of the
    arguments, not the arguments: argument constraints are not replayed)."""
    from agentvm.gate.policy import RequestMeta, decide

    breakage, widened, n = {}, {}, 0
    for rec in records:
        if rec.get("phase") != "tool" or not rec.get("tool"):
            continue
        was = _was_tool(rec)
        if was is None:
            continue
        now = _tool_verdict(str(rec["tool"]), new)
        n += 1
        key = f"tool {rec['tool']}"
        if was == "allow" and now != "allow":
            k = key + (" (now needs a human)" if now == "ask" else "")
            breakage[k] = breakage.get(k, 0) + 1
        elif was == "deny" and now != "deny":
            widened[key] = widened.get(key, 0) + 1
    for rec in records:
        rule = str(rec.get("rule") or "")
        if new.egress is None:
            break
        if not rec.get("host") or rec.get("phase") not in ("request", "connect", "clienthello"):
            continue
        if rec.get("verdict") == "deny" and not (rule == "default-deny" or rule.startswith(("deny", "doh:"))
                                                 or rule in ("address-class",)):
            continue
        method = rec.get("method") or ("CONNECT" if rec.get("phase") != "request" else "GET")
        scheme = "connect" if method == "CONNECT" else ("https" if rec.get("port") == 443 else "http")
        meta = RequestMeta(host=rec["host"], port=int(rec.get("port") or 0), scheme=scheme,
                           method=None if method == "CONNECT" else method,
                           path=None if method == "CONNECT" else (rec.get("path") or "/"), body_size=None,
                           websocket=False, phase="request" if method != "CONNECT" else "connect", sni=None)
        try:
            now = decide(meta, new.egress)
        except Exception:  # noqa: BLE001
            continue
        n += 1
        was = rec.get("verdict") == "allow"
        key = f"{method} {rec['host']}:{rec.get('port')}{'' if method == 'CONNECT' else (rec.get('path') or '/').split('?')[0]}"
        if was and not now.allowed:
            breakage[key] = breakage.get(key, 0) + 1
        elif not was and now.allowed:
            widened[key] = widened.get(key, 0) + 1
    return {"replayed": n, "breakage": [{"request": k, "count": c} for k, c in sorted(breakage.items())],
            "widening": [{"request": k, "count": c} for k, c in sorted(widened.items())]}


def _was_tool(rec: dict) -> str | None:
    """A recorded tool call's verdict, when a policy made it by the tool's name: "allow",
    "deny", or None (arguments, limits, servers and approvals are not replayed: the log keeps
    only a digest of the arguments)."""
    rule = str(rec.get("rule") or "")
    if rec.get("verdict") == "allow" and rule.startswith("tools:allow:"):
        return "allow"
    if rec.get("verdict") == "deny" and (rule in ("tools:not-allowed", "tools:unknown-server")
                                         or rule.startswith("tools:deny:")):
        return "deny"
    return None


def _tool_verdict(target: str, policy) -> str:
    """What ``policy`` says of calling ``target`` (SERVER__TOOL) by its name alone."""
    from agentvm.tools import policy as tp

    tools = getattr(policy, "tools", None)
    split = tp.split_name(target)
    if tools is None or split is None:
        return "deny"
    sp = tools.server(split[0])
    if sp is None or not tp.visible(sp, split[1]):
        return "deny"
    if tp._match(sp.approve, split[1]) is not None or tp.risk_of(sp, split[1]) in tools.tier_approval:
        return "ask"
    return "allow"


def recorded(logs_dir: Path, agent: str, *, since: float | None = None, last: int = 1000) -> list[dict]:
    """The agent's last ``last`` gate decisions (its runs' logs, newest last)."""
    out: list[dict] = []
    files = sorted(Path(logs_dir).glob(f"{agent}-*.egress.jsonl"), key=lambda p: p.stat().st_mtime)
    for f in files:
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec.get("agent") != agent or (since is not None and float(rec.get("time") or 0) < since):
                        continue
                    out.append(rec)
        except OSError:
            continue
    return out[-last:]


def matches(name: str, patterns: list[str]) -> bool:
    from agentvm import names

    return any(names.match(name, p) for p in patterns)

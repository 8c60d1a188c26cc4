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

import fnmatch
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
def _git(repo: Path, *args: str, input: bytes | None = None, check: bool = True,
         env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C", **(env or {})}
    try:
        r = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, timeout=GIT_TIMEOUT, env=e)
    except FileNotFoundError:
        raise FleetError("git is not installed", hint="apt-get install git") from None
    except subprocess.TimeoutExpired:
        raise FleetError(f"git {args[0]} did not finish within {GIT_TIMEOUT}s in {repo}") from None
    if check and r.returncode != 0:
        raise FleetError(f"git {' '.join(args[:2])} failed in {repo}: {r.stderr.decode(errors='replace').strip()[:300]}")
    return r


def resolve(repo: str | Path, ref: str) -> str:
    """REF -> the full commit id it names (a branch, a tag, a short id, a full id)."""
    repo = Path(repo)
    if not (repo / ".git").exists() and not (repo / "HEAD").exists():
        raise FleetError(f"{repo} is not a git repository", hint="--repo names the fleet's repository")
    if not ref or ref.startswith("-") or any(c in ref for c in "\n\0"):
        raise FleetError(f"{ref!r} is not a git ref")
    r = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}", check=False)
    if r.returncode != 0:
        raise FleetError(f"{ref!r} names no commit in {repo}", hint="give a branch, a tag or a commit id")
    return r.stdout.decode().strip()


def is_full_id(ref: str) -> bool:
    return bool(_SHA.match(ref or ""))


def _tree(repo: Path, sha: str) -> list[tuple[str, str, str]]:
    """(mode, blob id, path) of every blob of the commit."""
    out = _git(repo, "ls-tree", "-r", "-z", "--full-tree", sha).stdout
    entries = []
    for item in out.split(b"\0"):
        if not item:
            continue
        meta, _, path = item.partition(b"\t")
        mode, kind, oid = meta.decode().split()
        if kind == "blob":
            entries.append((mode, oid, path.decode("utf-8", "surrogateescape")))
    return entries


def _blobs(repo: Path, oids: list[str]) -> dict[str, bytes]:
    if not oids:
        return {}
    out = _git(repo, "cat-file", "--batch", input=("\n".join(oids) + "\n").encode()).stdout
    res, i = {}, 0
    for oid in oids:
        nl = out.index(b"\n", i)
        header = out[i:nl].decode().split()
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


def load(repo: str | Path, commit: str, *, trust: dict | None = None) -> Fleet:
    """Every agent of ``commit``, validated (all problems of all files at once, with
    file:line), presets from the commit's ``presets/``; the signature and pins checked."""
    from agentvm.errors import SpecError
    from agentvm.policy import compile_policy
    from agentvm.spec.loader import dump_resolved, load_agent_text

    repo = Path(repo).resolve()
    entries = _tree(repo, commit)
    wanted = [(m, o, p) for m, o, p in entries if p.endswith((".yaml", ".yml")) or p == FLEET_CONFIG]
    links = [p for m, _, p in wanted if m == "120000"]
    blobs = _blobs(repo, [o for m, o, p in wanted if m != "120000"])
    config: dict = {}
    problems: list[str] = []
    for m, oid, path in wanted:
        if path == FLEET_CONFIG and m != "120000":
            if len(blobs[oid]) > 65536:
                problems.append(f"{path}: over 64 KiB")
                continue
            try:
                config = yaml.safe_load(blobs[oid].decode("utf-8")) or {}
                if not isinstance(config, dict):
                    raise ValueError("not a mapping")
            except (ValueError, yaml.YAMLError, UnicodeDecodeError) as exc:
                problems.append(f"{path}: {exc}")
    signed = verify(repo, commit, trust or {}, config)
    problems += _check_pins(repo, commit, config, entries)
    agents: dict[str, FleetAgent] = {}
    with tempfile.TemporaryDirectory(prefix="agentvm-fleet-") as tmp:
        pdir = Path(tmp) / "presets"
        pdir.mkdir()
        for m, oid, path in wanted:
            if path.startswith("presets/") and path.count("/") == 1 and m != "120000":
                (pdir / path.split("/", 1)[1]).write_bytes(blobs[oid])
        for m, oid, path in sorted(wanted, key=lambda e: e[2]):
            if m == "120000" or path.startswith("presets/") or path == FLEET_CONFIG:
                continue
            data = blobs[oid]
            if len(data) > MAX_BLOB:
                problems.append(f"{path}: over {MAX_BLOB} bytes")
                continue
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
            agents[name] = FleetAgent(name, path, yaml.safe_dump(resolved, sort_keys=True), policy, policy.digest())
    if links:
        problems += [f"{p}: a symbolic link (agent files and presets must be regular files of the commit)" for p in links
                     if not p.startswith(".")]
    if problems:
        raise FleetError(f"commit {commit[:12]} has {len(problems)} problem(s); nothing was applied:\n  "
                         + "\n  ".join(problems[:50]), hint="fix the files and commit again", code="fleet.invalid")
    return Fleet(str(repo), commit, agents, config, signed)


def _check_pins(repo: Path, commit: str, config: dict, entries) -> list[str]:
    pins = config.get("pins") or {}
    if not isinstance(pins, dict):
        return [f"{FLEET_CONFIG}: pins is a map PATH: sha256:HEX"]
    by_path = {p: (m, o) for m, o, p in entries}
    out = []
    blobs = _blobs(repo, [by_path[p][1] for p in pins if p in by_path and by_path[p][0] != "120000"])
    for path, want in sorted(pins.items()):
        if path not in by_path:
            out.append(f"{FLEET_CONFIG}: pinned {path} is not in the commit")
            continue
        if by_path[path][0] == "120000":
            out.append(f"{FLEET_CONFIG}: pinned {path} is a symbolic link")
            continue
        got = "sha256:" + hashlib.sha256(blobs[by_path[path][1]]).hexdigest()
        if str(want).lower() != got:
            out.append(f"{path}: content {got} does not match its pin {want}")
    return out


def verify(repo: Path, commit: str, trust: dict, config: dict) -> str | None:
    """Check the commit's signature when the operator's trust (``<home>/fleet.yaml``) or the
    repository's config requires it. -> the signer, or None when not required."""
    required = bool(trust.get("requireSigned")) or bool(config.get("requireSigned"))
    signers = trust.get("allowedSigners")
    if not required:
        return None
    if not signers:
        raise FleetError("signed commits are required, but no signers are configured",
                         hint="name an SSH allowed-signers file as allowedSigners in <home>/fleet.yaml",
                         code="fleet.unsigned")
    r = _git(repo, "-c", "gpg.format=ssh", "-c", f"gpg.ssh.allowedSignersFile={signers}", "verify-commit", "--raw",
             commit, check=False)
    text = (r.stderr + r.stdout).decode(errors="replace").strip()
    if r.returncode != 0:
        raise FleetError(f"commit {commit[:12]} is not signed by a configured signer: {text[:300] or 'no signature'}",
                         hint=f"sign it (git commit -S with a key listed in {signers})", code="fleet.unsigned")
    m = re.search(r'Good "git" signature for (\S+)', text)
    return m.group(1) if m else "verified"


def load_trust(home: Path) -> dict:
    path = Path(home) / "fleet.yaml"
    if not path.exists():
        return {}
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise FleetError(f"{path}: {exc}") from None
    if not isinstance(doc, dict) or not set(doc) <= {"requireSigned", "allowedSigners"}:
        raise FleetError(f"{path}: only requireSigned and allowedSigners are known")
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
            updates.append(Action("update", name, fa.path, cur["digest"], fa.digest, restart=bool(cur.get("running")),
                                  changes=diff(cur["policy"], fa.policy), widening=widening(cur["policy"], fa.policy)))
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
    """What ``new`` may do that ``old`` may not: new egress, grants, credentials, tools, a
    higher risk tier (more is allowed), a network where there was none."""
    out = []
    if old is None:
        if new.egress is not None and new.egress.allow:
            out.append("egress to " + ", ".join(sorted(_egress_hosts(new))))
        out += [f"grant {m.host} -> {m.path} ({'rw' if m.writable else 'ro'})" for m in new.mounts]
        out += [f"credential {b.name} for {', '.join(b.hosts)}" for b in new.credentials]
        if new.tools is not None:
            out += [f"tool server {s.name}: {', '.join(s.allow)}" for s in new.tools.servers]
        return out
    for h in sorted(_egress_hosts(new) - _egress_hosts(old)):
        out.append(f"new egress {h}")
    if old.network == "none" and new.network == "gate":
        out.append("network: none -> gate")
    old_m = {(m.host, m.path, m.writable) for m in old.mounts}
    for m in new.mounts:
        if (m.host, m.path, m.writable) not in old_m:
            out.append(f"new grant {m.host} -> {m.path} ({'rw' if m.writable else 'ro'})")
    old_c = {(b.name, tuple(b.hosts)) for b in old.credentials}
    for b in new.credentials:
        if (b.name, tuple(b.hosts)) not in old_c:
            out.append(f"new credential {b.name} for {', '.join(b.hosts)}")
    old_t = {s.name: set(s.allow) for s in (old.tools.servers if old.tools else ())}
    for s in (new.tools.servers if new.tools else ()):
        added = set(s.allow) - old_t.get(s.name, set())
        if s.name not in old_t:
            out.append(f"new tool server {s.name}: {', '.join(sorted(s.allow))}")
        elif added:
            out.append(f"tool server {s.name} allows {', '.join(sorted(added))}")
    if _TIERS.index(new.risk_tier) > _TIERS.index(old.risk_tier):
        out.append(f"risk tier {old.risk_tier} -> {new.risk_tier} (more is allowed)")
    ob, nb = old.limits.budget, new.limits.budget
    if ob is not None and nb is None:
        out.append("no LLM budget any more")
    return out


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
    """Decide each recorded egress decision again under ``new``: what it would break (allowed
    today, denied then) and widen (denied today, allowed then). Only decisions a policy made
    (rule ids of allow rules or of policy denials) are replayed; limits, credentials and
    protocol errors are not policy and are skipped."""
    from agentvm.gate.policy import RequestMeta, decide

    breakage, widened, n = {}, {}, 0
    if new.egress is None:
        return {"replayed": 0, "breakage": [], "widening": []}
    for rec in records:
        rule = str(rec.get("rule") or "")
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
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)

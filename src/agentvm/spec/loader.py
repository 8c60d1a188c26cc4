"""Load agent and preset files: YAML with line numbers -> presets merged -> validated models.

The pipeline, each step pure and testable::

    text --parse--> located tree (_Node: value + file:line + source)
         --resolve presets (depth-first, cycles/unknown names are errors)-->
         --merge (presets in order, then the agent; later wins; conflicts recorded)-->
         --check keys (unknown fields, with a suggestion)-->
         --AgentSpec.model_validate--> --check_tier--> LoadedAgent

Every problem becomes a :class:`~agentvm.errors.SpecProblem` with ``file:line`` and a dotted
field path in YAML spelling (``spec.mounts[1].host``); all problems of a file are raised
together in one :class:`~agentvm.errors.SpecError`.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from agentvm.errors import SpecError, SpecProblem
from agentvm.paths import default_preset_dirs  # noqa: F401 (part of this module's API)
from agentvm.policy import APPEND_ENV, append_env
from agentvm.spec.models import API_VERSION, AgentSpec, AgentSpecBody, PresetSpec, check_tier

__all__ = [
    "AGENT",
    "Conflict",
    "LoadedAgent",
    "LoadedPreset",
    "PresetInfo",
    "SourceRef",
    "FileReport",
    "builtin_preset_dir",
    "default_preset_dirs",
    "dump_resolved",
    "list_presets",
    "load_agent",
    "load_agent_text",
    "load_preset",
    "load_preset_text",
    "validate_file",
]

MAX_FILE_BYTES = 1024 * 1024  # an agent file is configuration, not data
MAX_NODES = 50_000  # after alias expansion ("billion laughs" stops here)
MAX_DEPTH = 64
AGENT = "(agent)"  # the source label of the agent file's own layer

_MERGE_TAG = "tag:yaml.org,2002:merge"
_MAP_TAG = "tag:yaml.org,2002:map"
_SEQ_TAG = "tag:yaml.org,2002:seq"

# How lists merge, by field path (indices dropped). Default: later replaces wholesale.
_KEYED_LISTS = {("spec", "mounts"): "path", ("spec", "credentials"): "name", ("spec", "tools"): "name"}
_CONCAT_LISTS = {("spec", "egress", "allow"), ("spec", "egress", "deny")}


# --------------------------------------------------------------------------- public types


class SourceRef(NamedTuple):
    """Where a value came from: ``(file, line, value repr)``."""

    file: str
    line: int
    value: str


@dataclass(frozen=True)
class Conflict:
    """Two layers set different values for the same field; the later one won.

    ``kind`` is ``"conflict"`` when two unrelated presets disagree, ``"override"`` when the
    agent (or a preset over a preset it includes) deliberately replaces a value.
    """

    field: str
    kind: str
    winner: SourceRef
    loser: SourceRef

    def render(self) -> str:
        w, lo = self.winner, self.loser
        return f"{self.kind}: {self.field}: {w.file}:{w.line} ({w.value}) wins over {lo.file}:{lo.line} ({lo.value})"

    def to_dict(self) -> dict:
        return {
            "field": self.field,
            "kind": self.kind,
            "winner": self.winner._asdict(),
            "loser": self.loser._asdict(),
        }


@dataclass(frozen=True)
class LoadedAgent:
    spec: AgentSpec
    source: str
    presets: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    origins: dict[str, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadedPreset:
    """A preset file checked standalone (merged into a minimal agent)."""

    preset: PresetSpec
    source: str
    resolved: AgentSpec  # the minimal 'preset-check' agent with the preset applied
    presets: list[str] = field(default_factory=list)  # nested presets, then this one
    conflicts: list[Conflict] = field(default_factory=list)
    origins: dict[str, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class PresetInfo:
    name: str
    description: str
    file: str
    builtin: bool
    shadows_builtin: bool = False
    error: str | None = None  # set when the file cannot be read/parsed

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "file": self.file,
            "builtin": self.builtin,
            "shadowsBuiltin": self.shadows_builtin,
            "error": self.error,
        }


@dataclass(frozen=True)
class FileReport:
    """Result of :func:`validate_file` for one file (never raises for spec problems)."""

    file: str
    kind: str | None
    problems: list[SpecProblem]
    conflicts: list[Conflict]
    presets: list[str]
    strict: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "kind": self.kind,
            "ok": self.ok,
            "presets": list(self.presets),
            "problems": [p.to_dict() for p in self.problems],
            "conflicts": [c.to_dict() for c in self.conflicts],
        }


# --------------------------------------------------------------------------- located tree


@dataclass
class _Node:
    """A YAML value with where it was written. Mappings hold ``dict[str, _Node]``, sequences
    ``list[_Node]``; scalars hold the constructed Python value."""

    value: Any
    file: str
    line: int
    source: str


def _plain(node: _Node) -> Any:
    v = node.value
    if isinstance(v, dict):
        return {k: _plain(c) for k, c in v.items()}
    if isinstance(v, list):
        return [_plain(c) for c in v]
    return v


def _canon(node: _Node) -> str:
    """A type-sensitive canonical form (``1`` != ``true`` != ``1.0``) for equality tests."""
    return json.dumps(_plain(node), sort_keys=True, default=lambda o: f"<{type(o).__name__}:{o!r}>")


def _short_repr(node: _Node, limit: int = 60) -> str:
    r = repr(_plain(node))
    return r if len(r) <= limit else r[: limit - 3] + "..."


class _Keyed(str):
    """A path segment naming a keyed-list item, rendered ``[path=/docs]``."""


_IDENT_RE = re.compile(r"^[A-Za-z0-9_\-]+$")


def _dotted(path: tuple | list) -> str:
    out = ""
    for seg in path:
        if isinstance(seg, int) and not isinstance(seg, bool):
            out += f"[{seg}]"
        elif isinstance(seg, _Keyed):
            out += f"[{seg}]"
        else:
            s = str(seg)
            if _IDENT_RE.match(s):
                out += ("." if out else "") + s
            else:
                out += f"[{json.dumps(s)}]"
    return out


_PATH_SEG_RE = re.compile(r"\[(\d+)\]|\[(\"(?:[^\"\\]|\\.)*\")\]|\.?([A-Za-z0-9_\-]+)")


def _undotted(dotted: str) -> list:
    segs: list = []
    for m in _PATH_SEG_RE.finditer(dotted):
        if m.group(1) is not None:
            segs.append(int(m.group(1)))
        elif m.group(2) is not None:
            segs.append(json.loads(m.group(2)))
        else:
            segs.append(m.group(3))
    return segs


def _walk_origins(node: _Node, path: tuple = (), out: dict | None = None) -> dict[str, tuple[str, int]]:
    out = {} if out is None else out
    if path:
        out[_dotted(path)] = (node.file, node.line)
    if isinstance(node.value, dict):
        for k, c in node.value.items():
            _walk_origins(c, path + (k,), out)
    elif isinstance(node.value, list):
        for i, c in enumerate(node.value):
            _walk_origins(c, path + (i,), out)
    return out


def _locate(root: _Node, segs: list) -> tuple[_Node, list, list]:
    """Descend as far as ``segs`` exist; return (deepest node, path found, rest)."""
    node, found = root, []
    for i, seg in enumerate(segs):
        v = node.value
        if isinstance(v, dict) and isinstance(seg, str) and seg in v:
            node = v[seg]
        elif isinstance(v, list) and isinstance(seg, int) and not isinstance(seg, bool) and 0 <= seg < len(v):
            node = v[seg]
        else:
            return node, found, list(segs[i:])
        found.append(seg)
    return node, found, []


# --------------------------------------------------------------------------- parsing


class _Builder:
    """Turns composed YAML nodes into a located tree, collecting problems."""

    def __init__(self, filename: str, source: str) -> None:
        self.filename = filename
        self.source = source
        self.problems: list[SpecProblem] = []
        self.count = 0
        self.constructor = yaml.constructor.SafeConstructor()

    def _fail(self, line: int, msg: str, fieldname: str = "") -> None:
        self.problems.append(SpecProblem(self.filename, line, fieldname, msg))

    def build(self, node: yaml.Node, line: int, path: tuple, stack: tuple) -> _Node | None:
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooBig(line)
        if len(path) > MAX_DEPTH:
            raise _TooDeep(line)
        if id(node) in stack:
            self._fail(node.start_mark.line + 1, "recursive alias: a value contains itself", _dotted(path))
            return None
        stack = stack + (id(node),)
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP_TAG:
                self._fail(node.start_mark.line + 1, f"unsupported YAML tag {node.tag}", _dotted(path))
                return None
            return self._mapping(node, line, path, stack)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                self._fail(node.start_mark.line + 1, f"unsupported YAML tag {node.tag}", _dotted(path))
                return None
            items = []
            for child in node.value:
                built = self.build(child, child.start_mark.line + 1, path + (len(items),), stack)
                if built is not None:
                    items.append(built)
            return _Node(items, self.filename, line, self.source)
        try:
            value = self.constructor.construct_object(node, deep=True)
        except Exception as exc:  # ConstructorError, ValueError from odd timestamps, ...
            msg = getattr(exc, "problem", None) or str(exc)
            self._fail(node.start_mark.line + 1, f"invalid value: {msg}", _dotted(path))
            return None
        return _Node(value, self.filename, line, self.source)

    def _mapping(self, node: yaml.MappingNode, line: int, path: tuple, stack: tuple) -> _Node:
        out: dict[str, _Node] = {}
        key_lines: dict[str, int] = {}
        merges: list[yaml.Node] = []
        for knode, vnode in node.value:
            kline = knode.start_mark.line + 1
            if knode.tag == _MERGE_TAG:
                merges.append(vnode)
                continue
            if not isinstance(knode, yaml.ScalarNode):
                self._fail(kline, "mapping keys must be plain strings", _dotted(path))
                continue
            key = knode.value
            if key in key_lines:
                self._fail(
                    kline,
                    f"duplicate key {key!r} (first defined at line {key_lines[key]})",
                    _dotted(path + (key,)),
                )
                continue
            key_lines[key] = kline
            built = self.build(vnode, kline, path + (key,), stack)
            if built is not None:
                out[key] = built
        # YAML merge keys ("<<: *base"): explicit keys win, then earlier merge sources.
        for mnode in merges:
            sources = mnode.value if isinstance(mnode, yaml.SequenceNode) else [mnode]
            for src in sources:
                if not isinstance(src, yaml.MappingNode):
                    self._fail(src.start_mark.line + 1, "a merge key ('<<') must refer to a mapping", _dotted(path))
                    continue
                built = self.build(src, line, path, stack)
                if built is None:
                    continue
                for k, v in built.value.items():
                    out.setdefault(k, v)
        return _Node(out, self.filename, line, self.source)


class _TooBig(Exception):
    def __init__(self, line: int) -> None:
        self.line = line


class _TooDeep(_TooBig):
    pass


def _yaml_problem(filename: str, text: str, exc: yaml.YAMLError) -> SpecProblem:
    line = None
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        if mark is not None:
            line = mark.line + 1
        parts = [p for p in (exc.context, exc.problem) if p]
        msg = "invalid YAML: " + ("; ".join(parts) if parts else "syntax error")
    elif isinstance(exc, yaml.reader.ReaderError):
        pos = max(0, min(int(exc.position), len(text)))
        line = text.count("\n", 0, pos) + 1
        msg = f"invalid YAML: unacceptable character #x{exc.character:04x}" if isinstance(
            exc.character, int
        ) else f"invalid YAML: {exc.reason}"
    else:
        msg = f"invalid YAML: {exc}"
    return SpecProblem(filename, line, "", msg)


def _parse(text: str, filename: str, source: str) -> _Node:
    """Parse one YAML document whose top level is a mapping, keeping lines. Raises SpecError."""
    if len(text) > MAX_FILE_BYTES:
        raise SpecError(f"{filename}: file too large", problems=[
            SpecProblem(filename, None, "", f"file is larger than {MAX_FILE_BYTES} bytes")
        ])
    try:
        docs = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise SpecError(f"{filename}: invalid YAML", problems=[_yaml_problem(filename, text, exc)]) from exc
    except RecursionError as exc:
        raise SpecError(f"{filename}: invalid YAML", problems=[
            SpecProblem(filename, None, "", "YAML nested too deeply")
        ]) from exc
    if not docs:
        raise SpecError(f"{filename}: empty file", problems=[
            SpecProblem(filename, 1, "", "the file is empty: expected a mapping with apiVersion, kind, metadata, spec")
        ])
    if len(docs) > 1:
        raise SpecError(f"{filename}: more than one YAML document", problems=[
            SpecProblem(filename, docs[1].start_mark.line + 1, "", "only one YAML document per file is allowed")
        ])
    doc = docs[0]
    if not isinstance(doc, yaml.MappingNode):
        raise SpecError(f"{filename}: not a mapping", problems=[
            SpecProblem(filename, doc.start_mark.line + 1, "",
                        "the top level must be a mapping with apiVersion, kind, metadata, spec")
        ])
    builder = _Builder(filename, source)
    try:
        root = builder.build(doc, doc.start_mark.line + 1, (), ())
    except _TooDeep as exc:
        raise SpecError(f"{filename}: too deep", problems=[
            SpecProblem(filename, exc.line, "", f"values nested deeper than {MAX_DEPTH} levels")
        ]) from None
    except _TooBig as exc:
        raise SpecError(f"{filename}: too large", problems=[
            SpecProblem(filename, exc.line, "", f"more than {MAX_NODES} values after expanding aliases")
        ]) from None
    except RecursionError as exc:
        raise SpecError(f"{filename}: invalid YAML", problems=[
            SpecProblem(filename, None, "", "YAML nested too deeply")
        ]) from exc
    if builder.problems:
        raise SpecError(f"{filename}: invalid YAML", problems=builder.problems)
    assert root is not None
    return root


def _read(path: Path, display: str) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecError(f"{display}: cannot read file", problems=[
            SpecProblem(display, None, "", f"cannot read file: {exc.strerror or exc}")
        ]) from exc
    if len(data) > MAX_FILE_BYTES:
        raise SpecError(f"{display}: file too large", problems=[
            SpecProblem(display, None, "", f"file is larger than {MAX_FILE_BYTES} bytes")
        ])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(f"{display}: not UTF-8", problems=[
            SpecProblem(display, line, "", "the file is not valid UTF-8")
        ]) from exc


# --------------------------------------------------------------------------- preset discovery


@dataclass(frozen=True)
class _PresetFile:
    name: str
    path: Path
    builtin: bool


def builtin_preset_dir() -> Path:
    """The directory of the presets shipped with agent-vm."""
    return Path(__file__).resolve().parent.parent / "presets"


def _discover(preset_dirs: list[Path] | None) -> dict[str, list[_PresetFile]]:
    """name -> files providing it, highest priority first (user dirs, then built-in)."""
    user = default_preset_dirs() if preset_dirs is None else [Path(p) for p in preset_dirs]
    found: dict[str, list[_PresetFile]] = {}
    for d, builtin in [(p, False) for p in user] + [(builtin_preset_dir(), True)]:
        try:
            entries = sorted(d.iterdir(), key=lambda p: (p.stem, p.suffix != ".yaml", p.name))
        except OSError:
            continue
        seen_here: set[str] = set()
        for f in entries:
            if f.suffix not in (".yaml", ".yml") or f.name.startswith("."):
                continue
            try:
                if not f.is_file():
                    continue
            except OSError:
                continue
            if f.stem in seen_here:  # x.yaml wins over x.yml in the same directory
                continue
            seen_here.add(f.stem)
            found.setdefault(f.stem, []).append(_PresetFile(f.stem, f, builtin))
    return found


def list_presets(preset_dirs: list[Path] | None = None) -> list[PresetInfo]:
    """The presets a load would see, sorted by name (the active file of each name)."""
    found = _discover(preset_dirs)
    out = []
    for name in sorted(found):
        files = found[name]
        active = files[0]
        shadows = (not active.builtin) and any(f.builtin for f in files[1:])
        desc, err = "", None
        try:
            root = _parse(_read(active.path, str(active.path)), str(active.path), name)
            d = root.value.get("description")
            if d is not None and isinstance(d.value, str):
                desc = d.value.strip().splitlines()[0] if d.value.strip() else ""
            kind = root.value.get("kind")
            if kind is None or kind.value != "Preset":
                err = "not a Preset file (kind must be Preset)"
        except SpecError as exc:
            err = "; ".join(p.render() for p in exc.problems) or exc.message
        out.append(PresetInfo(name, desc, str(active.path), active.builtin, shadows, err))
    return out


# --------------------------------------------------------------------------- key checking


def _model_of(ann: Any) -> tuple[str, type[BaseModel]] | None:
    """('model'|'list', Model) if an annotation holds a model (directly or as list items)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ("model", ann)
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Annotated:
        return _model_of(args[0])
    if origin is list and args:
        inner = _model_of(args[0])
        if inner and inner[0] == "model":
            return ("list", inner[1])
        return None
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is not type(None):
                r = _model_of(a)
                if r:
                    return r
    return None


def _aliases(model: type[BaseModel]) -> dict[str, Any]:
    """YAML name -> annotation for every field of ``model``."""
    out = {}
    for name, f in model.model_fields.items():
        out[f.alias or name] = f.annotation
    return out


def _check_keys(node: _Node, model: type[BaseModel], path: tuple, problems: list[SpecProblem],
                overrides: dict[tuple, type[BaseModel]] | None = None) -> None:
    """Report (and drop from ``node``) every key the model does not know, with a suggestion."""
    if not isinstance(node.value, dict):
        return
    fields = _aliases(model)
    snake = {name: (f.alias or name) for name, f in model.model_fields.items()}
    for key in list(node.value):
        child = node.value[key]
        if key not in fields:
            valid = sorted(fields)
            if key in snake and snake[key] != key:
                msg = f"unknown field {key!r}; field names are camelCase: did you mean {snake[key]!r}?"
            else:
                close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
                if not close:
                    low = {v.lower(): v for v in valid}
                    close = difflib.get_close_matches(key.lower(), list(low), n=1, cutoff=0.6)
                    close = [low[c] for c in close]
                if close:
                    msg = f"unknown field {key!r}; did you mean {close[0]!r}?"
                else:
                    msg = f"unknown field {key!r} (valid fields: {', '.join(valid)})"
            problems.append(SpecProblem(child.file, child.line, _dotted(path + (key,)), msg))
            del node.value[key]
            continue
        sub_path = path + (key,)
        target = (overrides or {}).get(sub_path)
        if target is not None:
            _check_keys(child, target, sub_path, problems, overrides)
            continue
        m = _model_of(fields[key])
        if m is None:
            continue
        if m[0] == "model":
            _check_keys(child, m[1], sub_path, problems, overrides)
        elif isinstance(child.value, list):
            for i, item in enumerate(child.value):
                _check_keys(item, m[1], sub_path + (i,), problems, overrides)


# --------------------------------------------------------------------------- validation


_TYPE_HINTS = {"string_type", "int_type", "int_parsing", "float_type", "float_parsing", "bool_type",
               "bool_parsing", "dict_type", "list_type", "literal_error", "enum", "int_from_float"}


def _message(err: dict) -> str:
    etype = err.get("type", "")
    if etype == "missing":
        return "required field is missing"
    if etype == "extra_forbidden":
        return "unknown field"
    msg = str(err.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    inp = err.get("input")
    if etype in _TYPE_HINTS and not isinstance(inp, (dict, list)):
        r = repr(inp)
        if len(r) > 60:
            r = r[:57] + "..."
        msg += f" (got {r})"
        if etype == "string_type" and isinstance(inp, (bool, int, float)):
            msg += "; quote the value in YAML to make it a string"
    return msg


def _validate(model: type[BaseModel], root: _Node, problems: list[SpecProblem]) -> Any:
    try:
        return model.model_validate(_plain(root))
    except ValidationError as exc:
        for err in exc.errors():
            loc = [s for s in err.get("loc", ())]
            node, found, rest = _locate(root, loc)
            path = list(found)
            if err.get("type") == "missing" and rest:
                path.append(rest[0])
            problems.append(SpecProblem(node.file, node.line, _dotted(path), _message(err)))
    return None


def _tier_problems(spec: AgentSpec, root: _Node) -> list[SpecProblem]:
    out = []
    for fieldname, msg in check_tier(spec.spec):
        node, _found, _rest = _locate(root, _undotted(fieldname))
        out.append(SpecProblem(node.file, node.line, fieldname, msg))
    return out


def _dedupe(problems: list[SpecProblem]) -> list[SpecProblem]:
    seen, out = set(), []
    for p in problems:
        k = (p.file, p.line, p.field, p.message)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


# --------------------------------------------------------------------------- merging


class _Merger:
    def __init__(self, includes: dict[str, set[str]]) -> None:
        self.includes = includes  # preset -> every preset it includes (transitively)
        self.conflicts: list[Conflict] = []

    def _record(self, path: tuple, old: _Node, new: _Node) -> None:
        if old.value is None or old.source == new.source:
            return
        if new.source == AGENT or old.source in self.includes.get(new.source, set()):
            kind = "override"
        else:
            kind = "conflict"
        self.conflicts.append(
            Conflict(
                _dotted(path),
                kind,
                SourceRef(new.file, new.line, _short_repr(new)),
                SourceRef(old.file, old.line, _short_repr(old)),
            )
        )

    def merge(self, old: _Node | None, new: _Node, path: tuple) -> _Node:
        if old is None:
            return new
        if isinstance(old.value, dict) and isinstance(new.value, dict):
            out = dict(old.value)
            for k, v in new.value.items():
                out[k] = self.merge(out.get(k), v, path + (k,))
            return _Node(out, new.file, new.line, new.source)
        if isinstance(old.value, list) and isinstance(new.value, list):
            shape = tuple(s for s in path if isinstance(s, str) and not isinstance(s, _Keyed))
            if shape in _KEYED_LISTS:
                return self._merge_keyed(old, new, path, _KEYED_LISTS[shape])
            if shape in _CONCAT_LISTS:
                items = list(old.value)
                seen = {_canon(i) for i in items}
                for item in new.value:
                    c = _canon(item)
                    if c not in seen:
                        seen.add(c)
                        items.append(item)
                return _Node(items, new.file, new.line, new.source)
        if (len(path) >= 2 and path[-2] == "env" and path[-1] in APPEND_ENV and isinstance(old.value, str)
                and isinstance(new.value, str)):
            # list-like variables compose: the node preset's heap size and another preset's
            # --require both stay (later ones go last, so they win where options clash)
            return _Node(append_env(path[-1], old.value, new.value), new.file, new.line, new.source)
        if _canon(old) != _canon(new):
            self._record(path, old, new)
        return new

    def _merge_keyed(self, old: _Node, new: _Node, path: tuple, keyname: str) -> _Node:
        def key_of(item: _Node) -> str | None:
            if isinstance(item.value, dict):
                k = item.value.get(keyname)
                if k is not None and isinstance(k.value, str):
                    if keyname == "path":
                        return "/" + "/".join(p for p in k.value.split("/") if p)
                    return k.value
            return None

        items = list(old.value)
        index: dict[str, int] = {}
        for i, item in enumerate(items):
            k = key_of(item)
            if k is not None:
                index.setdefault(k, i)
        replaced: set[str] = set()
        for item in new.value:
            k = key_of(item)
            if k is not None and k in index and k not in replaced:
                i = index[k]
                if _canon(items[i]) != _canon(item):
                    self._record(path + (_Keyed(f"{keyname}={k}"),), items[i], item)
                items[i] = item
                replaced.add(k)
            else:
                items.append(item)
        return _Node(items, new.file, new.line, new.source)


# --------------------------------------------------------------------------- presets


class _Resolver:
    """Finds, parses and orders presets (depth-first, each applied once)."""

    def __init__(self, preset_dirs: list[Path] | None) -> None:
        self.index = _discover(preset_dirs)
        self.cache: dict[str, _Node] = {}
        self.order: list[str] = []
        self.includes: dict[str, set[str]] = {}
        self.problems: list[SpecProblem] = []

    def available(self) -> str:
        return ", ".join(sorted(self.index)) or "(none)"

    def _load(self, name: str) -> _Node | None:
        if name in self.cache:
            return self.cache[name]
        pf = self.index[name][0]
        display = str(pf.path)
        try:
            root = _parse(_read(pf.path, display), display, name)
        except SpecError as exc:
            self.problems.extend(exc.problems)
            return None
        # Structure of the preset file itself (not the values of its spec: the merged agent
        # is validated, and `agentvm validate PRESET` checks a preset standalone).
        probs: list[SpecProblem] = []
        _check_keys(root, PresetSpec, (), probs, overrides={("spec",): AgentSpecBody})
        top = _Node({k: v for k, v in root.value.items() if k != "spec"}, root.file, root.line, root.source)
        _validate(PresetSpec, top, probs)
        md = root.value.get("metadata")
        nm = md.value.get("name") if md is not None and isinstance(md.value, dict) else None
        if nm is not None and nm.value != name:
            probs.append(SpecProblem(display, nm.line, "metadata.name",
                                     f"preset name {nm.value!r} does not match its file name {pf.path.name!r}"))
        spec = root.value.get("spec")
        if spec is not None and not isinstance(spec.value, dict):
            if spec.value is None:
                spec = None
            else:
                probs.append(SpecProblem(display, spec.line, "spec", "a preset's spec must be a mapping"))
                spec = None
        self.problems.extend(probs)
        if probs:
            return None
        node = spec if spec is not None else _Node({}, display, root.line, name)
        self.cache[name] = node
        return node

    def names_of(self, spec: _Node | None, where: str) -> list[tuple[str, _Node]]:
        """The preset names a spec mapping lists, as (name, node)."""
        if spec is None or not isinstance(spec.value, dict) or "presets" not in spec.value:
            return []
        lst = spec.value["presets"]
        if lst.value is None:
            return []
        if not isinstance(lst.value, list):
            self.problems.append(SpecProblem(lst.file, lst.line, f"{where}.presets", "must be a list of preset names"))
            return []
        out = []
        for i, item in enumerate(lst.value):
            if not isinstance(item.value, str):
                self.problems.append(SpecProblem(item.file, item.line, f"{where}.presets[{i}]",
                                                 f"a preset name must be a string (got {item.value!r})"))
                continue
            out.append((item.value, item))
        return out

    def visit(self, name: str, ref: _Node, stack: list[str]) -> set[str]:
        """Resolve ``name`` (and what it includes); return the set it stands for."""
        if name in stack:
            cycle = " -> ".join(stack[stack.index(name):] + [name])
            self.problems.append(SpecProblem(ref.file, ref.line, "spec.presets", f"preset cycle: {cycle}"))
            return set()
        if name in self.includes:
            return {name} | self.includes[name]
        if name not in self.index:
            close = difflib.get_close_matches(name, list(self.index), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            self.problems.append(SpecProblem(
                ref.file, ref.line, "spec.presets",
                f"unknown preset {name!r}{hint} (available: {self.available()})"))
            return set()
        spec = self._load(name)
        if spec is None:
            return set()
        inc: set[str] = set()
        for sub, sref in self.names_of(spec, "spec"):
            inc |= self.visit(sub, sref, stack + [name])
        self.includes[name] = inc
        self.order.append(name)
        return {name} | inc

    def layer(self, name: str) -> _Node:
        """A preset's spec without its own ``presets`` list (resolution handled that)."""
        spec = self.cache[name]
        return _Node({k: v for k, v in spec.value.items() if k != "presets"}, spec.file, spec.line, spec.source)


def _compose(root: _Node, resolver: _Resolver, own_name: str | None) -> tuple[_Node, list[Conflict]]:
    """Resolve the presets ``root.spec`` lists and merge them under it. Returns the merged root."""
    spec = root.value.get("spec")
    stack = [own_name] if own_name else []
    refs = resolver.names_of(spec, "spec")
    top_inc: set[str] = set()
    for name, ref in refs:
        top_inc |= resolver.visit(name, ref, stack)
    if not refs or spec is None or not isinstance(spec.value, dict):
        return root, []
    merger = _Merger(dict(resolver.includes))
    own_label = root.value["spec"].source
    if own_label != AGENT:
        merger.includes[own_label] = top_inc
    acc: _Node | None = None
    for name in resolver.order:
        acc = merger.merge(acc, resolver.layer(name), ("spec",))
    merged = merger.merge(acc, spec, ("spec",)) if acc is not None else spec
    out = dict(root.value)
    out["spec"] = merged
    return _Node(out, root.file, root.line, root.source), merger.conflicts


def _kind_of(root: _Node) -> str | None:
    k = root.value.get("kind")
    return k.value if k is not None and isinstance(k.value, str) else None


def _agent_from_root(root: _Node, filename: str, preset_dirs: list[Path] | None) -> LoadedAgent:
    kind = _kind_of(root)
    if kind == "Preset":
        k = root.value["kind"]
        raise SpecError(f"{filename}: not an agent", problems=[
            SpecProblem(filename, k.line, "kind", "this is a Preset file; an agent file needs kind: Agent")
        ])
    resolver = _Resolver(preset_dirs)
    merged, conflicts = _compose(root, resolver, None)
    problems = list(resolver.problems)
    _check_keys(merged, AgentSpec, (), problems)
    spec = _validate(AgentSpec, merged, problems)
    if spec is not None and not problems:
        problems.extend(_tier_problems(spec, merged))
    problems = _dedupe(problems)
    if problems or spec is None:
        raise SpecError(f"{filename}: invalid agent", problems=problems)
    return LoadedAgent(
        spec=spec,
        source=filename,
        presets=list(resolver.order),
        conflicts=conflicts,
        origins=_walk_origins(merged),
    )


def _preset_from_root(root: _Node, filename: str, preset_dirs: list[Path] | None) -> LoadedPreset:
    problems: list[SpecProblem] = []
    _check_keys(root, PresetSpec, (), problems, overrides={("spec",): AgentSpecBody})
    spec_node = root.value.get("spec")
    if spec_node is not None and spec_node.value is None:
        spec_node = None
    top = _Node({k: v for k, v in root.value.items() if k != "spec"}, root.file, root.line, root.source)
    preset = _validate(PresetSpec, top, problems)
    if spec_node is not None and not isinstance(spec_node.value, dict):
        problems.append(SpecProblem(filename, spec_node.line, "spec", "a preset's spec must be a mapping"))
        raise SpecError(f"{filename}: invalid preset", problems=_dedupe(problems))
    name = preset.metadata.name if preset is not None else None
    # The preset applied to a minimal agent; it is the top layer, its nested presets below.
    label = name or "(preset)"
    own_spec = spec_node if spec_node is not None else _Node({}, filename, root.line, label)
    own_spec = _relabel(own_spec, label)

    def syn(value: Any) -> _Node:
        return _Node(value, filename, root.line, label)

    agent_root = _Node(
        {
            "apiVersion": syn(API_VERSION),
            "kind": syn("Agent"),
            "metadata": syn({"name": syn("preset-check")}),
            "spec": own_spec,
        },
        filename, root.line, label,
    )
    resolver = _Resolver(preset_dirs)
    merged, conflicts = _compose(agent_root, resolver, name)
    problems.extend(resolver.problems)
    resolved = _validate(AgentSpec, merged, problems)
    ms = merged.value.get("spec")
    if resolved is not None and not problems and ms is not None and "riskTier" in ms.value:
        problems.extend(_tier_problems(resolved, merged))
    problems = _dedupe(problems)
    if problems or preset is None or resolved is None:
        raise SpecError(f"{filename}: invalid preset", problems=problems)
    return LoadedPreset(
        preset=preset,
        source=filename,
        resolved=resolved,
        presets=list(resolver.order) + [preset.metadata.name],
        conflicts=conflicts,
        origins=_walk_origins(merged),
    )


def _relabel(node: _Node, source: str) -> _Node:
    v = node.value
    if isinstance(v, dict):
        v = {k: _relabel(c, source) for k, c in v.items()}
    elif isinstance(v, list):
        v = [_relabel(c, source) for c in v]
    return _Node(v, node.file, node.line, source)


# --------------------------------------------------------------------------- public API


def load_agent_text(text: str, filename: str = "<input>", *, preset_dirs: list[Path] | None = None) -> LoadedAgent:
    """Like :func:`load_agent` for a string (``filename`` is used in messages)."""
    if not isinstance(text, str):
        raise SpecError(f"{filename}: not text", problems=[SpecProblem(filename, None, "", "expected text")])
    root = _parse(text, filename, AGENT)
    return _agent_from_root(root, filename, preset_dirs)


def load_agent(path: str | Path, *, preset_dirs: list[Path] | None = None) -> LoadedAgent:
    """Load, merge and validate an agent file. Raises :class:`SpecError` listing every problem.

    ``preset_dirs`` are the user preset directories searched before the built-in ones
    (default: :func:`default_preset_dirs`, i.e. ``$AGENTVM_PRESET_PATH`` and
    ``$AGENTVM_HOME/presets``).
    """
    display = str(path)
    return load_agent_text(_read(Path(path), display), display, preset_dirs=preset_dirs)


def load_preset_text(text: str, filename: str = "<input>", *, preset_dirs: list[Path] | None = None) -> LoadedPreset:
    root = _parse(text, filename, "(preset)")
    return _preset_from_root(root, filename, preset_dirs)


def load_preset(path: str | Path, *, preset_dirs: list[Path] | None = None) -> LoadedPreset:
    """Validate a preset file standalone: its spec merged into a minimal agent must be valid."""
    display = str(path)
    return load_preset_text(_read(Path(path), display), display, preset_dirs=preset_dirs)


def validate_file(path: str | Path, *, preset_dirs: list[Path] | None = None, strict: bool = False) -> FileReport:
    """Validate an Agent or a Preset file (by its ``kind``); never raises for spec problems.

    With ``strict``, every preset-vs-preset conflict is also a problem.
    """
    display = str(path)
    kind: str | None = None
    try:
        root = _parse(_read(Path(path), display), display, AGENT)
        kind = _kind_of(root)
        if kind == "Preset":
            loaded: LoadedAgent | LoadedPreset = _preset_from_root(root, display, preset_dirs)
        else:
            loaded = _agent_from_root(root, display, preset_dirs)
    except SpecError as exc:
        problems = exc.problems or [SpecProblem(display, None, "", exc.message)]
        return FileReport(display, kind, list(problems), [], [], strict)
    problems = []
    if strict:
        for c in loaded.conflicts:
            if c.kind == "conflict":
                problems.append(SpecProblem(c.winner.file, c.winner.line, c.field,
                                            f"presets conflict: {c.winner.value} here vs {c.loser.value} at "
                                            f"{c.loser.file}:{c.loser.line} (--strict)"))
    return FileReport(display, kind, problems, list(loaded.conflicts), list(loaded.presets), strict)


def dump_resolved(loaded: LoadedAgent) -> dict:
    """The resolved spec as plain YAML/JSON-able data in camelCase (sizes stay ints).

    Loading the result again gives the same policy: where a field's absence means something
    other than its default (a deny rule without ``ports`` denies every port), it stays absent."""
    data = loaded.spec.model_dump(by_alias=True, mode="json")
    _keep_absent(loaded.spec, data)
    return data


def _keep_absent(model: Any, data: Any) -> None:
    from pydantic import BaseModel

    from agentvm.spec.models import Egress

    if isinstance(model, Egress) and isinstance(data, dict):
        for rule, out in zip(model.deny, data.get("deny") or []):
            if "ports" not in rule.model_fields_set and isinstance(out, dict):
                out.pop("ports", None)
    if isinstance(model, BaseModel) and isinstance(data, dict):
        for name, info in type(model).model_fields.items():
            key = info.alias or name
            if key in data:
                _keep_absent(getattr(model, name), data[key])
    elif isinstance(model, (list, tuple)) and isinstance(data, list):
        for m, d in zip(model, data):
            _keep_absent(m, d)
    elif isinstance(model, dict) and isinstance(data, dict):
        for k, m in model.items():
            if k in data:
                _keep_absent(m, data[k])

"""The daemon's HTTP API as types: every route's body and query is a pydantic model.

A request is validated here, whole, before any handler reads it: a wrong JSON type, an
unknown field, a string where a list is expected or a number out of range is one
:class:`ApiInputError` (``config.invalid``, HTTP 400, exit 78) naming each field, never a
``TypeError`` deep in a handler (a 500) and never a string taken as a list of characters.
The same models publish the API as OpenAPI 3.1 (``GET /v1/openapi.json``,
:func:`openapi`), which the test suite fuzzes with Schemathesis against a real daemon.

Models are strict (JSON types as given: ``"5"`` is not a number, ``1`` is not ``true``),
forbid unknown fields, and are frozen. Handlers get the model, or for code that still
reads dicts, :meth:`Body.fields` (the fields that were given, nothing coerced).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from agentvm.errors import ConfigError, SpecProblem

# bounds a client cannot exceed (the body itself is bounded by the transport)
_NAME = 253  # a sandbox, rule, credential or tool name
_TEXT = 1 << 20  # an agent file's text
_LIST = 4096  # items of a list field
_ARG = 1 << 17  # one argument or value

Name = Annotated[str, Field(min_length=1, max_length=_NAME)]
Text = Annotated[str, Field(max_length=_ARG)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Strings = Annotated[list[Text], Field(max_length=_LIST)]


class ApiInputError(ConfigError):
    """A request's body or query does not match its route's model (HTTP 400, exit 78)."""

    code = "config.invalid"

    def __init__(self, what: str, problems: list[SpecProblem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p.field or '(the whole ' + what + ')'}: {p.message}" for p in problems)
        super().__init__(f"invalid {what}:\n{lines}",
                         hint="GET /v1/openapi.json describes every route's body; docs/daemon.md the API")

    def to_dict(self) -> dict:
        d = super().to_dict()
        d["problems"] = [p.to_dict() for p in self.problems]
        return d


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    def fields(self) -> dict[str, Any]:
        """The fields the client gave (as a dict of plain JSON values), for dict-reading code."""
        return self.model_dump(exclude_unset=True, mode="json")


# -- sandboxes -----------------------------------------------------------------------------


class CreateSandbox(Body):
    """``POST /v1/sandboxes``: declare a sandbox from an agent file's text."""

    spec: Annotated[str, Field(max_length=_TEXT, description="the agent file's text (YAML)")]
    file: Annotated[str, Field(max_length=4096, description="where the text came from (shown in errors)")] = "<api>"
    ttl: Seconds | None = Field(None, description="seconds from its start after which it is ended for good")
    idle_timeout: Seconds | None = Field(None, description="seconds without activity after which it is ended")


class Exec(Body):
    """``POST /v1/sandboxes/NAME/exec``: run a command in a running sandbox."""

    argv: Annotated[list[Text], Field(min_length=1, max_length=_LIST)]
    timeout: Seconds | None = None


class RunOptions(Body):
    """``agentvm run``'s options exactly as typed (parsed by the daemon with the embedded
    run's own code, ``agentvm.overrides``)."""

    mounts: Strings = []
    env: Strings = []
    timeout: Text | None = None
    memory: Text | None = None
    allow: Strings = []
    add_host: Strings = []
    network: Literal["gate", "none"] | None = None
    substrate: Name | None = None
    image: Text | None = None


class Mount(Body):
    host: Text
    path: Text
    writable: bool = False


class Run(Body):
    """``POST /v1/run`` (and ``/v1/run/frames``): one command in a fresh sandbox, output streamed.

    Options come either as typed (``cli``) or as values (``mounts``, ``env``, ...), not both."""

    command: Annotated[list[Text], Field(min_length=1, max_length=_LIST)] | None = None
    cli: RunOptions | None = None
    spec: Annotated[str, Field(max_length=_TEXT)] | None = None
    file: Annotated[str, Field(max_length=4096)] = "<api>"
    preset_dirs: Strings | None = None
    stdin: Annotated[str, Field(description="base64 of what the command reads on stdin")] | None = None
    mounts: Annotated[list[Mount], Field(max_length=_LIST)] = []
    env: Annotated[dict[Name, Text], Field(max_length=_LIST)] = {}
    timeout: Seconds | None = None
    memory: Annotated[int, Field(ge=16 * 1024 * 1024, le=1 << 50, description="bytes")] | None = None
    allow: Strings = []
    hosts: Annotated[dict[Name, Text], Field(max_length=_LIST)] = {}
    network: Literal["gate", "none"] | None = None
    substrate: Name | None = None

    @field_validator("stdin")
    @classmethod
    def _base64(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("not base64") from None
        return v

    @model_validator(mode="after")
    def _one_form(self) -> "Run":
        if self.cli is not None:
            both = [k for k in ("mounts", "env", "timeout", "memory", "allow", "hosts", "network", "substrate")
                    if k in self.model_fields_set]
            if both:
                raise ValueError(f"give the options either as typed ('cli') or as values, not both: {', '.join(both)}")
        return self


# -- live policy ---------------------------------------------------------------------------


class Tty(Body):
    """The client's terminal size: the sandbox's pty starts with it (``w`` frames change it)."""

    rows: Annotated[int, Field(ge=1, le=65535)]
    cols: Annotated[int, Field(ge=1, le=65535)]


class RunAttach(Run):
    """``POST /v1/run/attach`` (an upgraded connection, docs/daemon.md "Interactive sessions"):
    the run of ``POST /v1/run`` with its stdin relayed as frames, and with ``tty`` a terminal."""

    stdin: Annotated[None, Field(description="not used: stdin comes as frames")] = None
    tty: Tty | None = None
    report: Literal["text", "json"] = Field("text", description="the end frame's report: the stderr text, or "
                                            "the result as one JSON line (--json)")


class ExecAttach(Exec):
    """``POST /v1/sandboxes/{name}/exec/attach`` (an upgraded connection): ``exec`` with its stdin
    relayed as frames (``exec -i``), and with ``tty`` a terminal (``exec -it``)."""

    tty: Tty | None = None


class _Op(Body):
    pass


class PolicyShow(_Op):
    op: Literal["show"]


class PolicyRule(_Op):
    op: Literal["allow", "deny"]
    rule: Text | None = None
    rules: Annotated[list[Text], Field(min_length=1, max_length=_LIST)] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> "PolicyRule":
        if (self.rule is None) == (self.rules is None):
            raise ValueError("give 'rule' (HOST[:PORT]) or 'rules' (a list of them)")
        return self


class PolicyRemove(_Op):
    op: Literal["remove"]
    rule_id: Name


class PolicyPause(_Op):
    op: Literal["pause", "resume"]


class PolicyCredential(_Op):
    op: Literal["revoke", "restore"]
    credential: Name


class PolicyLimits(_Op):
    op: Literal["limits"]
    memory: Annotated[str, Field(max_length=64)] | Annotated[int, Field(gt=0, le=1 << 60)] | None = None
    pids: Annotated[int, Field(gt=0, le=1 << 22)] | None = None
    cpus: Annotated[float, Field(gt=0, le=4096, allow_inf_nan=False)] | None = None


class PolicyTools(_Op):
    op: Literal["tools"]
    action: Literal["allow", "deny", "approve"]
    tool: Name


class PolicyBudget(_Op):
    op: Literal["budget"]
    tokens: Annotated[int, Field(gt=0, le=1 << 53)] | None = None
    requests: Annotated[int, Field(gt=0, le=1 << 53)] | None = None
    cost: Annotated[float, Field(gt=0, le=1e15, allow_inf_nan=False)] | None = None
    reset: bool = False


PolicyChange = Annotated[Union[PolicyShow, PolicyRule, PolicyRemove, PolicyPause, PolicyCredential, PolicyLimits,
                               PolicyTools, PolicyBudget], Field(discriminator="op")]


# -- approvals, fleet, console ---------------------------------------------------------------


class ApprovalAnswer(Body):
    """``POST /v1/approvals/ID/approve|deny``."""

    note: Annotated[str, Field(max_length=1000)] | None = None
    via: Annotated[str, Field(min_length=5, max_length=100, pattern=r"^cli:[\x21-\x7e]+$",
                              description="the CLI's user (cli:USER), as the client says: recorded with "
                              "the API's own actor beside it (cli:USER via api:operator)")] | None = None
    digest: Annotated[str, Field(min_length=1, max_length=128,
                                 description="the digest of the request as it was shown: an approval of "
                                 "anything else is refused (approvals.digest-mismatch)")] | None = None


class Replay(Body):
    since: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    last: Annotated[int, Field(ge=1, le=100000)] | None = None
    all: bool = False


class FleetPlan(Body):
    """``POST /v1/fleet/plan``: what applying a commit would change."""

    repo: Annotated[str, Field(min_length=1, max_length=4096)]
    commit: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    replay: Replay | None = None


class FleetApply(Body):
    """``POST /v1/fleet/apply``: apply exactly one commit (40 hex digits)."""

    repo: Annotated[str, Field(min_length=1, max_length=4096)]
    commit: Annotated[str, Field(min_length=1, max_length=256)]
    digest: Annotated[str, Field(max_length=256)] | None = None
    canary: bool = False


class FleetRollback(Body):
    """``POST /v1/fleet/rollback``: go back to the previous (or a named) promotion."""

    to: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    canary: bool = False


class Empty(Body):
    """A route that takes no fields."""


class SnapshotTake(Body):
    """``POST /v1/sandboxes/NAME/snapshot``: its workspace, content-addressed (issue 37)."""

    tag: Name | None = None
    memory: bool = False  # its processes' memory too (gVisor: a checkpoint; refused elsewhere)


class SnapshotRestore(Body):
    """``POST /v1/sandboxes/NAME/restore``: roll it back to one of its snapshots (id or tag)."""

    snapshot: Name


class Fork(Body):
    """``POST /v1/fork``: a new agent from an agent (snapshotted now) or a snapshot."""

    source: Name
    new: Name
    memory: bool = False  # from an agent: snapshot its memory too, and restore it in the child (gVisor)


# -- queries -------------------------------------------------------------------------------


class LogsQuery(Body):
    tail: Annotated[int, Field(ge=0, le=1 << 40)] | None = None


class RmQuery(Body):
    keep_workspace: Literal["0", "1", "true", "false"] | None = None


class FilesQuery(Body):
    path: Annotated[str, Field(max_length=4096)] = ""
    tar: Literal["0", "1"] | None = Field(None, description="a folder as a tar stream (PUT: the body is one; "
                                          "GET: a folder's answer is one, kind 'tar')")


class AuditQuery(Body):
    since: Annotated[str, Field(max_length=64)] | None = None
    sandbox: Name | None = None


class ApprovalsQuery(Body):
    all: Literal["0", "1", "true", "false"] | None = None


_QUERY_INTS = {LogsQuery: ("tail",)}


_MAX_PROBLEMS = 20


def _problems(exc: ValidationError, tag: str | None = None) -> list[SpecProblem]:
    out = []
    if exc.error_count() > 200:  # never a dict per error of a huge body (errors() builds them all)
        return [SpecProblem(None, None, "", f"{exc.error_count()} values are wrong (too many to list)")]
    for e in exc.errors(include_url=False)[:_MAX_PROBLEMS]:
        loc = [str(x) for x in e.get("loc", ())]
        if tag is not None and loc[:1] == [tag]:
            loc = loc[1:]  # the union member chosen by its discriminator, not a field
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "not a field of this request"
        elif e.get("type") == "missing":
            msg = "required"
        out.append(SpecProblem(None, None, ".".join(loc), msg))
    return out


def parse(model, doc: Any, what: str = "request body"):
    """``doc`` (a decoded JSON value, or ``None`` for no body) as ``model``, or
    :class:`ApiInputError` naming every field that is wrong."""
    doc = {} if doc is None else doc
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(doc)
        return model.model_validate(doc)
    except ValidationError as exc:
        tag = doc.get("op") if isinstance(doc, dict) and isinstance(doc.get("op"), str) else None
        raise ApiInputError(what, _problems(exc, tag)) from None


def parse_query(model, q: dict[str, str]):
    """A query string's last value per key as ``model`` (whole numbers where it declares them)."""
    doc: dict[str, Any] = dict(q)
    for k in _QUERY_INTS.get(model, ()):
        if k in doc:
            try:
                doc[k] = int(doc[k])
            except ValueError:
                raise ApiInputError("query", [SpecProblem(None, None, k, "must be a whole number")]) from None
    return parse(model, doc, "query")


POLICY_CHANGE = TypeAdapter(PolicyChange)


# -- the published description -------------------------------------------------------------

# (method, path, body model or None, query model or None, what it answers, summary)
ROUTES: list[tuple[str, str, Any, Any, str, str]] = [
    ("GET", "/v1/sandboxes", None, None, "json", "list sandboxes"),
    ("POST", "/v1/sandboxes", CreateSandbox, None, "json", "declare a sandbox from an agent file"),
    ("GET", "/v1/sandboxes/{name}", None, None, "json", "one sandbox"),
    ("DELETE", "/v1/sandboxes/{name}", None, RmQuery, "json", "stop and remove a sandbox (and its workspace, "
     "unless ?keep_workspace=1 or the agent file's workspace.keep)"),
    ("POST", "/v1/sandboxes/{name}/start", Empty, None, "json", "start a sandbox"),
    ("POST", "/v1/sandboxes/{name}/stop", Empty, None, "json", "stop a sandbox"),
    ("POST", "/v1/sandboxes/{name}/restart", Empty, None, "json", "restart a sandbox"),
    ("POST", "/v1/sandboxes/{name}/pause", Empty, None, "json", "freeze a sandbox (cgroup freezer: memory kept)"),
    ("POST", "/v1/sandboxes/{name}/unpause", Empty, None, "json", "thaw a paused sandbox"),
    ("POST", "/v1/sandboxes/{name}/suspend", Empty, None, "json", "checkpoint a sandbox to disk, freeing it (gVisor)"),
    ("POST", "/v1/sandboxes/{name}/resume", Empty, None, "json", "restore a suspended sandbox (checkpoint checked)"),
    ("POST", "/v1/sandboxes/{name}/snapshot", SnapshotTake, None, "json", "snapshot its workspace (content-addressed)"),
    ("POST", "/v1/sandboxes/{name}/restore", SnapshotRestore, None, "json", "roll it back to one of its snapshots"),
    ("GET", "/v1/snapshots", None, None, "json", "list snapshots"),
    ("DELETE", "/v1/snapshots/{id}", None, None, "json", "remove a snapshot"),
    ("POST", "/v1/fork", Fork, None, "json", "a new agent from an agent or a snapshot (fresh uid and placeholders)"),
    ("POST", "/v1/sandboxes/{name}/exec", Exec, None, "stream", "run a command in a running sandbox"),
    ("POST", "/v1/sandboxes/{name}/exec/attach", ExecAttach, None, "attach",
     "exec with stdin and/or a terminal (Upgrade: agentvm-frames/1; docs/daemon.md)"),
    ("GET", "/v1/sandboxes/{name}/logs", None, LogsQuery, "json", "the sandbox's log"),
    ("GET", "/v1/sandboxes/{name}/files", None, FilesQuery, "json", "read a file of its workspace"),
    ("PUT", "/v1/sandboxes/{name}/files", "bytes", FilesQuery, "json", "write a file of its workspace"),
    ("POST", "/v1/sandboxes/{name}/policy", POLICY_CHANGE, None, "json", "show or change its policy live"),
    ("POST", "/v1/run", Run, None, "stream", "one command in a fresh sandbox"),
    ("POST", "/v1/run/frames", Run, None, "frames", "the same run, answered in frames (the compiled client's)"),
    ("POST", "/v1/run/attach", RunAttach, None, "attach",
     "the same run with stdin and/or a terminal (Upgrade: agentvm-frames/1; docs/daemon.md)"),
    ("GET", "/v1/approvals", None, ApprovalsQuery, "json", "pending (or all) approval requests"),
    ("GET", "/v1/approvals/{id}", None, None, "json", "one approval request"),
    ("POST", "/v1/approvals/{id}/approve", ApprovalAnswer, None, "json", "approve a request"),
    ("POST", "/v1/approvals/{id}/deny", ApprovalAnswer, None, "json", "deny a request"),
    ("POST", "/v1/fleet/plan", FleetPlan, None, "json", "plan a fleet commit (changes nothing)"),
    ("POST", "/v1/fleet/apply", FleetApply, None, "json", "apply exactly one fleet commit"),
    ("POST", "/v1/fleet/rollback", FleetRollback, None, "json", "roll the fleet back"),
    ("GET", "/v1/fleet/status", None, None, "json", "drift between the applied commit and what runs"),
    ("GET", "/v1/audit", None, AuditQuery, "json", "audit records"),
    ("GET", "/v1/audit/verify", None, None, "json", "verify the audit chain"),
    ("POST", "/v1/console/login", Empty, None, "json", "a one-time console login link"),
    ("GET", "/v1/events", None, None, "stream", "the event stream (does not end)"),
    ("POST", "/v1/shutdown", Empty, None, "json", "stop the daemon"),
    ("GET", "/v1/openapi.json", None, None, "json", "this description"),
    ("GET", "/metrics", None, None, "text", "Prometheus metrics"),
]

_ERROR = {
    "type": "object",
    "required": ["error", "message", "hint", "exit_code"],
    "properties": {
        "error": {"type": "string", "description": "a dotted code (docs/cli.md)"},
        "message": {"type": "string"},
        "hint": {"type": "string"},
        "exit_code": {"type": "integer"},
        "problems": {"type": "array", "items": {"type": "object"}},
    },
}


def openapi(version: str) -> dict:
    """The API as OpenAPI 3.1, generated from the models above."""
    from pydantic.json_schema import models_json_schema

    models = [(m, "validation") for m in {r[2] for r in ROUTES} | {r[3] for r in ROUTES}
              if isinstance(m, type) and issubclass(m, BaseModel)]
    keyed, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    change = POLICY_CHANGE.json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(change.pop("$defs", {}))
    schemas["PolicyChange"] = change
    schemas["Error"] = _ERROR
    paths: dict[str, dict] = {}
    for method, path, body, query, answers, summary in ROUTES:
        op: dict[str, Any] = {"summary": summary, "operationId": f"{method.lower()}_{path}".replace("/", "_")
                              .replace("{", "").replace("}", "").replace(".", "_"),
                              "responses": {"default": {"description": "an error",
                                                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}
        ok = {"json": {"application/json": {"schema": {}}}, "text": {"text/plain": {"schema": {"type": "string"}}},
              "stream": {"application/x-ndjson": {"schema": {"type": "string"}}},
              "frames": {"application/x-agentvm-frames": {"schema": {"type": "string"}}},
              "attach": None}[answers]
        if ok is None:
            op["responses"]["101"] = {"description": "switched to agentvm-frames/1: frames both ways"}
        else:
            op["responses"]["200"] = {"description": "done", "content": ok}
        params = [{"name": n, "in": "path", "required": True, "example": ex,
                   "schema": {"type": "string", "minLength": 1, "maxLength": _NAME}}
                  for n, ex in (("name", "hello-agent"), ("id", "apr-0123456789abcdef")) if "{" + n + "}" in path]
        if isinstance(query, type):
            for fname, f in query.model_fields.items():
                s = keyed[(query, "validation")]
                prop = schemas[s["$ref"].rsplit("/", 1)[1]]["properties"][fname]
                params.append({"name": fname, "in": "query", "required": False, "schema": prop})
        if params:
            op["parameters"] = params
        if body == "bytes":
            op["requestBody"] = {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
        elif body is POLICY_CHANGE:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PolicyChange"}}}}
        elif body is not None:
            op["requestBody"] = {"required": body is not Empty,
                                 "content": {"application/json": {"schema": keyed[(body, "validation")]}}}
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0",
            "info": {"title": "agent-vm daemon API", "version": version,
                     "description": "The local control-plane API of agent-vm (docs/daemon.md). Errors are "
                                    "{error, message, hint, exit_code} with a dotted code (docs/cli.md)."},
            "paths": paths, "components": {"schemas": schemas}}

"""E2B templates: agent files registered by name, and the narrowing of E2B's create options.

``agentvm template add FILE [--name N] [--port P] [--tenant T | --public]`` stores a validated agent file under
``<home>/templates/N.yaml`` (its ``--port`` list: the only ports ``get_host(port)`` reaches; a
``lifecycle: persistent`` template's command is started with each sandbox, E2B's start command); ``base`` is always there: the default anonymous policy (no egress,
no credentials, no grants). An E2B ``create`` names a template; its options can only *narrow*
what the template allows:

* ``allow_internet_access: true`` is refused: no agent file can allow the whole internet (egress
  rules name hosts), so the answer names the template and says to add the hosts to it;
* ``network.allowOut`` must name hosts the template's egress already allows (the sandbox then
  gets only those); ``allow_internet_access: false`` or ``denyOut: ["0.0.0.0/0"]`` without
  ``allowOut`` leaves no egress at all; other ``denyOut`` hosts become deny rules;
* ``envVars`` may not set a name the policy owns (a credential's placeholder variable, the proxy
  and CA variables, ``AGENTVM_*``): a real secret passed that way would sit in the sandbox in
  clear, past the vault. Credentials are given by reference in the template instead.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from agentvm.errors import ConfigError, PolicyDenied

NAME = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")
ALL_TRAFFIC = {"0.0.0.0/0", "::/0"}
RESERVED_ENV = {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY",
                "all_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO", "LD_PRELOAD", "LD_LIBRARY_PATH"}

BASE_TEXT = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {name: base}
spec:
  lifecycle: persistent
  command: [/bin/sleep, infinity]
  limits: {disk: 64M, memory: 512M, pids: 256}
"""


@dataclass(frozen=True)
class Template:
    name: str
    text: str
    ports: tuple[int, ...] = ()
    source: str = "<builtin>"
    # who may create from it (docs/e2b.md "Templates and tenants"): one tenant, or every tenant
    # (public); a template registered before templates had tenants and granting something
    # (mounts, credentials, tools, egress) has neither until `agentvm template set` assigns it
    tenant: str | None = None
    public: bool = False

    def usable_by(self, tenant: str) -> bool:
        return self.public or (self.tenant is not None and self.tenant == tenant)


@dataclass
class CreateOptions:
    template: str = "base"
    allow_internet_access: bool | None = None
    allow_out: list[str] = field(default_factory=list)
    deny_out: list[str] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)


def templates_dir(home: Path | None = None) -> Path:
    if home is None:
        from agentvm.paths import default_paths

        home = default_paths().home
    return Path(home) / "templates"


def _load(text: str, filename: str):
    from agentvm.spec.loader import load_agent_text

    return load_agent_text(text, filename)


DEFAULT_TENANT = "default"  # the tenant of the first API key (agentvm.e2b.api_keys)


def _owner(tenant: str | None, public: bool, text: str | None = None) -> tuple[str | None, bool]:
    """(tenant, public) as asked; neither asked (``text`` given): public when the template
    grants nothing (:func:`grants_anything`), else the ``default`` tenant's."""
    if public and tenant is not None:
        raise ConfigError("a template is either one tenant's (--tenant T) or every tenant's (--public), not both")
    if public:
        return None, True
    if tenant is None and text is not None and not grants_anything(text):
        return None, True
    tenant = DEFAULT_TENANT if tenant is None else tenant
    if not isinstance(tenant, str) or not tenant or len(tenant) > 200 or any(c in tenant for c in "\x00\n\r"):
        raise ConfigError(f"tenant {tenant!r} is not a tenant name", hint="`agentvm e2b key --tenant T` names them")
    return tenant, False


def _write_meta(d: Path, name: str, meta: dict) -> None:
    tmp = d / f".{name}.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, d / f"{name}.json")


def add(path: str | Path, name: str | None = None, ports: list[int] | None = None, home: Path | None = None, *,
        tenant: str | None = None, public: bool = False) -> Template:
    """Register ``path`` as template ``name`` for ``tenant``, or for every tenant (``public``):
    only what holds nothing of one tenant's (no grants, no credentials by reference) should be
    public. Neither given: public if it grants nothing, else tenant ``default``'s."""
    p = Path(path)
    text = p.read_text()
    loaded = _load(text, str(p))  # SpecError (file:line) when invalid
    name = name or loaded.spec.metadata.name
    if not NAME.fullmatch(name) or name == "base":
        raise ConfigError(f"template name {name!r} is not allowed",
                          hint="lower-case letters, digits, '-', '_' (and not 'base', which is built in)")
    for port in ports or []:
        if not 1 <= port <= 65535:
            raise ConfigError(f"port {port} out of range 1-65535")
    tenant, public = _owner(tenant, public, text)
    d = templates_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    (d / f"{name}.yaml").write_text(text)
    _write_meta(d, name, {"ports": sorted(set(ports or [])), "source": str(p.resolve()), "tenant": tenant,
                          "public": public})
    return Template(name, text, tuple(sorted(set(ports or []))), str(p.resolve()), tenant, public)


def assign(name: str, home: Path | None = None, *, tenant: str | None = None, public: bool = False) -> Template:
    """Give template ``name`` (already registered) to ``tenant``, or to every tenant (``public``)."""
    tpl = get(name, home)
    if tpl is None or name == "base":
        raise ConfigError(f"template {name!r} not found" if tpl is None else "the built-in base template is public",
                          hint="`agentvm template ls` lists them")
    if tenant is None and not public:
        raise ConfigError("say whose template it is: --tenant T, or --public for every tenant")
    tenant, public = _owner(tenant, public)
    d = templates_dir(home)
    _write_meta(d, name, {"ports": list(tpl.ports), "source": tpl.source, "tenant": tenant, "public": public})
    return get(name, home)


def grants_anything(text: str, name: str = "?") -> bool:
    """Whether an agent file gives a sandbox anything of someone's: host folders, credentials
    (by reference), tool servers, egress, an image, environment values. Fails closed (True)
    when it does not load."""
    from agentvm.spec.loader import dump_resolved

    try:
        spec = dump_resolved(_load(text, f"<template {name}>")).get("spec") or {}
    except Exception:  # noqa: BLE001 - fail closed
        return True
    egress = spec.get("egress") or {}
    return bool(spec.get("mounts") or spec.get("credentials") or spec.get("tools") or egress.get("allow")
                or spec.get("image") or spec.get("env"))


def get(name: str, home: Path | None = None) -> Template | None:
    if name == "base":
        return Template("base", BASE_TEXT, public=True)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return None
    d = templates_dir(home)
    y = d / f"{name}.yaml"
    if not y.is_file():
        return None
    meta = {}
    try:
        meta = json.loads((d / f"{name}.json").read_text())
    except (OSError, ValueError):
        pass
    if not isinstance(meta, dict):
        meta = {}
    text = y.read_text()
    if "tenant" in meta or "public" in meta:
        tenant, public = meta.get("tenant"), meta.get("public") is True
        tenant = tenant if isinstance(tenant, str) and not public else None
    else:  # registered before templates had tenants: public only if it grants nothing
        tenant, public = None, not grants_anything(text, name)
    return Template(name, text, tuple(meta.get("ports", ())), meta.get("source", str(y)), tenant, public)


def ls(home: Path | None = None) -> list[Template]:
    out = [get("base", home)]
    d = templates_dir(home)
    if d.is_dir():
        for y in sorted(d.glob("*.yaml")):
            t = get(y.stem, home)
            if t is not None:
                out.append(t)
    return out


def _pattern(raw: str) -> str | None:
    """A host pattern (name, ``*.suffix`` or IP literal) as the gate normalizes it, or None."""
    from agentvm.gate.policy import normalize_pattern

    try:
        return normalize_pattern(raw.strip().rstrip("."))
    except (ValueError, AttributeError):
        return None


def _covers(outer: str, inner: str) -> bool:
    """Whether every host ``inner`` (a normalized pattern) matches is matched by ``outer``."""
    from agentvm.gate.policy import host_matches

    return outer == inner or host_matches(outer, inner)


def _intersection(a: str, b: str) -> str | None:
    """The hosts both normalized patterns match, as one pattern, or None. Two patterns are
    either nested (a name under a ``*.suffix``, one suffix under the other, equal) or share no
    host, so the intersection is always one of them."""
    if _covers(a, b):
        return b
    if _covers(b, a):
        return a
    return None


def _host_allowed(host: str, allow_rules: list[dict]) -> list[dict]:
    h = _pattern(host)
    return [r for r in allow_rules if h is not None and r.get("host") and (p := _pattern(r["host"])) and _covers(p, h)]


def narrow_allow(allow_rules: list[dict], hosts: list[str]) -> list[dict]:
    """The template's allow rules narrowed to ``hosts`` (allowOut), in the TEMPLATE's order:
    each rule, in turn, once per host its pattern shares with an allowOut entry, with that
    intersection as its host and everything else (ports, methods, paths, maxBody, ``action:
    ask``) kept. The gate takes the first matching allow rule, so for any request this answers
    exactly what the template answers or, for a host outside ``hosts``, the default deny:
    never an allow where the template asks, whatever the order of ``hosts`` or its wildcards
    (review 8, finding 2: the rules were emitted in the caller's order, and a wildcard allowOut
    moved a plain allow in front of the template's ``ask`` rule)."""
    wanted = sorted({p for p in (_pattern(h) for h in hosts) if p is not None})
    kept = []
    for r in allow_rules:
        rp = _pattern(r.get("host") or "")
        if rp is None:
            continue
        for h in wanted:
            both = _intersection(rp, h)
            if both is not None:
                rr = dict(r)
                rr["host"] = both
                rr.pop("id", None)
                kept.append(rr)
    # one rule per (template rule, pattern): a pattern already kept for the same rule adds nothing
    out, seen = [], set()
    for rr in kept:
        key = json.dumps(rr, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(rr)
    return out


def check_envs(envs, spec: dict, template: str) -> None:
    """Refuse a variable the policy owns (a credential's placeholder variable, the proxy and CA
    variables, ``AGENTVM_*``, ``LD_*``): the one check of E2B ``envVars`` at create and of a
    command's ``envs`` (envd). ``spec``: the template's resolved spec."""
    creds = spec.get("credentials") or []
    reserved = set(RESERVED_ENV) | {c.get("env") for c in creds if c.get("env")}
    reserved |= {(c.get("sigv4") or {}).get("accessKeyIdEnv") for c in creds if c.get("sigv4")}
    for k in envs:
        if k in reserved or k.upper().startswith(("AGENTVM_", "LD_")):
            raise PolicyDenied(
                f"envs may not set {k}: template {template!r} (or agent-vm) owns that variable",
                hint="give a credential by reference in the template (credentials: [{name, env, ref: vault:NAME, "
                     "hosts}]): the sandbox gets a placeholder and the gate swaps in the real value",
                code="e2b.env-refused")


def check_command_envs(template: str, envs, home: Path | None = None) -> None:
    """:func:`check_envs` for a command's ``envs`` in a sandbox of ``template``. A template
    that no longer loads refuses every variable (its credentials' names are unknown)."""
    if not envs:
        return
    from agentvm.spec.loader import dump_resolved

    tpl = get(template, home)
    try:
        spec = (dump_resolved(_load(tpl.text, f"<template {tpl.name}>")).get("spec") or {}) if tpl else None
    except Exception:  # noqa: BLE001 - fail closed
        spec = None
    if spec is None:
        raise PolicyDenied(f"envs refused: template {template!r} cannot be read, so the variables it owns are unknown",
                           hint="run the command without envs, or register the template again", code="e2b.env-refused")
    check_envs(envs, spec, template)


def sandbox_spec(tpl: Template, sandbox_name: str, opts: CreateOptions) -> str:
    """The agent file of one E2B sandbox: the template, renamed, kept alive, narrowed by the
    E2B options (never widened). Raises PolicyDenied naming the template otherwise."""
    import yaml

    from agentvm.spec.loader import dump_resolved

    doc = dump_resolved(_load(tpl.text, f"<template {tpl.name}>"))
    spec = doc.setdefault("spec", {})
    spec["presets"] = []
    doc["metadata"] = {"name": sandbox_name, "labels": {"e2b-template": tpl.name}}
    # a persistent template's command is its start command (E2B's): the server its ports reach,
    # restarted by the daemon if it ends; any other template's sandbox just stays up
    if spec.get("lifecycle") != "persistent" or not spec.get("command"):
        spec["command"] = ["/bin/sleep", "infinity"]
    spec["lifecycle"] = "persistent"
    egress = spec.setdefault("egress", {}) or {}
    spec["egress"] = egress
    allow = list(egress.get("allow") or [])

    if opts.allow_internet_access is True:
        raise PolicyDenied(
            f"template {tpl.name!r} does not allow internet access (allow_internet_access=True refused)",
            hint=f"agent-vm never opens the whole internet: list the hosts the sandbox needs in the template's "
                 f"egress.allow (`agentvm template add FILE`) and pass network={{'allow_out': [...]}}",
            code="e2b.network-refused")
    hosts = [h for h in opts.allow_out if h not in ALL_TRAFFIC]
    for h in hosts:
        if "/" in h or not _host_allowed(h, allow):
            raise PolicyDenied(
                f"template {tpl.name!r} does not allow egress to {h!r}; E2B options can only narrow a template",
                hint=f"add an egress.allow rule for {h} to the template's agent file, or drop it from allow_out",
                code="e2b.network-refused")
    deny_all = opts.allow_internet_access is False or any(d in ALL_TRAFFIC for d in opts.deny_out)
    if hosts or deny_all:
        egress["allow"] = narrow_allow(allow, hosts)
    deny = list(egress.get("deny") or [])
    for d in opts.deny_out:
        if d in ALL_TRAFFIC:
            continue
        if "/" in d:
            raise ConfigError(f"deny_out {d!r}: agent-vm's egress rules name hosts or IP addresses, not CIDR ranges",
                              hint="list the hosts to deny, or deny everything with 0.0.0.0/0", code="e2b.bad-request")
        deny.append({"host": d.strip().lower().rstrip(".")})
    egress["deny"] = deny

    check_envs(opts.envs, spec, tpl.name)
    env = dict(spec.get("env") or {})
    env.update(opts.envs)
    spec["env"] = env
    text = yaml.safe_dump(doc, sort_keys=False)
    _load(text, f"<e2b sandbox of template {tpl.name}>")  # the result must still validate
    return text

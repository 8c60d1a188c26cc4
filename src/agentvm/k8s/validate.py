"""Rendered objects checked without a cluster.

* agent-sandbox kinds: against ``spec.versions[name=v1beta1].schema.openAPIV3Schema`` of the
  vendored CRDs (``shared/k8s/agent-sandbox``, PROVENANCE.md there), with ``jsonschema``. The
  structural schema is made strict the way the API server's strict field validation is:
  ``additionalProperties: false`` wherever ``properties`` are listed and unknown fields are not
  preserved (a misspelt field is an error, not silently pruned); ``x-kubernetes-int-or-string``
  is an integer or a string. ``metadata.name`` is checked as a DNS-1123 subdomain by hand.
* ``x-kubernetes-validations`` (CEL): the vendored CRDs carry one rule, on Sandbox
  (``volumeClaimTemplates is immutable``, a transition rule - ``oldSelf``): it constrains an
  update of a Sandbox, which agent-vm never renders nor updates (the controller creates
  Sandboxes from claims). :func:`cel_rules` lists them so a test notices a new one.
* core kinds: ``kubernetes-validate`` for a named Kubernetes version, strict.
"""

from __future__ import annotations

import copy
import os
import re
from functools import lru_cache
from pathlib import Path

KUBERNETES_VERSION = "1.35.0"
CRD_FILES = {
    "Sandbox": "agents.x-k8s.io_sandboxes.yaml",
    "SandboxTemplate": "extensions.agents.x-k8s.io_sandboxtemplates.yaml",
    "SandboxClaim": "extensions.agents.x-k8s.io_sandboxclaims.yaml",
    "SandboxWarmPool": "extensions.agents.x-k8s.io_sandboxwarmpools.yaml",
}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def crd_dir() -> Path:
    """The vendored CRDs: $AGENTVM_AGENT_SANDBOX_CRDS, else ``shared/k8s/agent-sandbox`` beside the repository."""
    env = os.environ.get("AGENTVM_AGENT_SANDBOX_CRDS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3].parent / "shared" / "k8s" / "agent-sandbox"


@lru_cache(maxsize=8)
def _crd(kind: str, directory: str) -> dict:
    import yaml

    return yaml.safe_load((Path(directory) / CRD_FILES[kind]).read_text())


def _version(crd: dict, name: str = "v1beta1") -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == name:
            return v
    raise KeyError(name)


def _strict(schema: dict) -> dict:
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("x-kubernetes-int-or-string"):
                node.pop("type", None)
                node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields") \
                    and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


@lru_cache(maxsize=8)
def schema(kind: str, directory: str | None = None) -> dict:
    return _strict(_version(_crd(kind, str(directory or crd_dir())))["schema"]["openAPIV3Schema"])


def cel_rules(directory: Path | None = None) -> dict[str, list[str]]:
    """Every ``x-kubernetes-validations`` rule of the v1beta1 schemas, by kind."""
    out: dict[str, list[str]] = {}

    def walk(node, kind):
        if isinstance(node, dict):
            for r in node.get("x-kubernetes-validations", ()):
                out.setdefault(kind, []).append(r["rule"])
            for v in node.values():
                walk(v, kind)
        elif isinstance(node, list):
            for v in node:
                walk(v, kind)

    for kind in CRD_FILES:
        walk(_version(_crd(kind, str(directory or crd_dir())))["schema"]["openAPIV3Schema"], kind)
    return out


def problems(obj: dict, *, k8s_version: str = KUBERNETES_VERSION) -> list[str]:
    """Everything wrong with ``obj`` (empty: valid)."""
    kind = obj.get("kind")
    name = (obj.get("metadata") or {}).get("name", "")
    where = f"{kind}/{name}"
    out = []
    if not isinstance(name, str) or not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
        out.append(f"{where}: metadata.name is not a DNS-1123 subdomain")
    if kind in CRD_FILES:
        import jsonschema

        if obj.get("apiVersion") != f"{'agents.x-k8s.io' if kind == 'Sandbox' else 'extensions.agents.x-k8s.io'}/v1beta1":
            out.append(f"{where}: apiVersion {obj.get('apiVersion')} is not the v1beta1 of its group")
        v = jsonschema.Draft7Validator(schema(kind))
        out += [f"{where}: {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in v.iter_errors(obj)]
        return out
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        out.append(f"{where}: {'.'.join(map(str, exc.path)) or '(root)'}: {exc.message}")
    return out

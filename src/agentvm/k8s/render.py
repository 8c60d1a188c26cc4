"""An agent file -> the Kubernetes objects that run it on agent-sandbox (v1beta1) behind the
shared egress gateway (docs/k8s.md). Pure: data in, a list of plain dicts out (the same input
gives the same output, byte for byte: golden files in tests/unit/k8s_golden/).

What is rendered, in apply order:

* the gateway (shared by every agent of the namespace): ConfigMap ``agentvm-gateway-config``
  (gateway.yaml and the agent file), Deployment and Service ``agentvm-gateway``; the gateway's
  credentials are references to the Secret ``agentvm-credentials`` (key ``AGENT.CREDENTIAL``),
  created by the operator, mounted by the gateway alone - never by a sandbox;
* per-claim identities (the default, ``identity_mode="claim"``): ConfigMap ``agentvm-gateway-ca``
  (the gateway CA's certificate, public); the gateway mounts the Secret ``agentvm-gateway-issuer``
  and serves enrolment on 8444; each sandbox's bridge enrols with its claim's bootstrap token,
  read from a downwardAPI volume of the pod's annotations that only the bridge mounts, and keeps
  its key and certificate in a memory volume only it mounts (agentvm.gateway.enroll);
* the agent: with ``identity_mode="template"`` a Secret ``AGENT-identity`` (one mTLS client
  certificate for every pod of the template: filled with ``--ca``, mounted only into the
  ``proxy-bridge`` container); ConfigMap ``AGENT-trust`` (the gate's
  interception CA, public), NetworkPolicy ``AGENT-egress`` (no ingress; egress to the gateway's
  pods on its port only - no DNS: the bridge finds the gateway by the Service's environment
  variables), SandboxTemplate ``AGENT``, and a SandboxWarmPool ``AGENT`` when asked.
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

from agentvm.errors import ConfigError

GROUP = "extensions.agents.x-k8s.io"
API = f"{GROUP}/v1beta1"
GATEWAY = "agentvm-gateway"
GATEWAY_PORT = 8443
ENROLL_PORT = 8444  # per-claim enrolment (agentvm.gateway.enroll)
GATEWAY_CA = "agentvm-gateway-ca"  # ConfigMap: the gateway CA's certificate (public) the bridge verifies the gateway with
ISSUER_SECRET = "agentvm-gateway-issuer"  # Secret: issuer.pem, issuer.key, enroll.key (agentvm gateway issuer)
BRIDGE_PORT = 3128
CREDENTIALS_SECRET = "agentvm-credentials"
AGENT_UID, BRIDGE_UID = 65532, 65533
ROLE = "agentvm.dev/role"
AGENT_LABEL = "agentvm.dev/agent"
# the RuntimeClass per risk tier (a user-space kernel at least; a VM from L4); --runtime-class overrides
RUNTIME_BY_TIER = {"L0": "gvisor", "L1": "gvisor", "L2": "gvisor", "L3": "gvisor", "L4": "kata", "L5": "kata"}
_CHARS = {"alnum": "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", "hex": "0123456789abcdef",
          "base64url": "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"}


def _hardened(uid: int) -> dict:
    return {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}}


def placeholder(namespace: str, agent: str, binding) -> str:
    """The placeholder a sandbox of ``agent`` holds for a credential: derived from the names (a
    placeholder is not a secret - the gateway swaps it only for this agent's identities, only
    towards the bound hosts), so a render is reproducible; its declared prefix, length, charset."""
    seed = hashlib.sha256(f"agentvm-placeholder|{namespace}|{agent}|{binding.name}".encode()).digest()
    rng = random.Random(seed)
    length = binding.length or max(len(binding.prefix) + 32, 40)
    alphabet = _CHARS.get(binding.charset, _CHARS["alnum"])
    return binding.prefix + "".join(rng.choice(alphabet) for _ in range(max(length - len(binding.prefix), 24)))


def _env_name(agent: str, cred: str) -> str:
    return "AGENTVM_CRED_" + re.sub(r"[^A-Z0-9]", "_", f"{agent}_{cred}".upper())


def _quantity(n: int) -> str:
    for unit, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _cpu(c: float) -> str:
    m = int(round(c * 1000))
    return str(m // 1000) if m % 1000 == 0 else f"{m}m"


def render(agent_path: Path | str, *, namespace: str = "default", warm_pool: int | None = None, image: str | None = None,
           gateway_image: str | None = None, runtime_class: str | None = None, gateway_replicas: int = 2,
           identity: dict | None = None, trust_pem: str | None = None, agent_text: str | None = None,
           identity_mode: str = "claim", gateway_ca_pem: str | None = None) -> list[dict]:
    """The objects for the agent file at ``agent_path``. ``identity_mode``: ``claim`` (each claim
    enrols its own certificate) or ``template`` (one Secret for every pod of the template);
    ``identity``: {"tls.crt", "tls.key", "ca.crt"} of a minted certificate for ``template``;
    ``gateway_ca_pem``: the gateway CA's certificate for ``claim``; ``trust_pem``: the gate's
    interception CA."""
    from agentvm import __version__
    from agentvm.gateway.identity import Identity
    from agentvm.policy import SUBSTRATE_STRENGTH, compile_policy
    from agentvm.spec.loader import load_agent

    path = Path(agent_path)
    loaded = load_agent(path)
    policy = compile_policy(loaded.spec)
    name = loaded.spec.metadata.name
    Identity(namespace, name)  # both DNS labels (raises gateway.identity-invalid)
    if identity_mode not in ("claim", "template"):
        raise ConfigError(f"identity mode {identity_mode!r}: claim or template", code="k8s.render-invalid")
    per_claim = identity_mode == "claim"
    if warm_pool is not None and warm_pool < 0:
        raise ConfigError("--warm-pool must be >= 0", code="k8s.render-invalid")
    if policy.network == "none":
        raise ConfigError(f"{name}: network none - a sandbox without the gateway needs no agent-vm on Kubernetes",
                          code="k8s.render-invalid")
    if policy.mounts:
        raise ConfigError(f"{name}: host folder grants (spec.mounts) have no meaning on a cluster node",
                          hint="put the data in the workspace, or in the image", code="k8s.render-invalid")
    img = image or policy.image
    if not img or ("/" not in img and ":" not in img and "@" not in img):
        raise ConfigError(f"{name}: no registry image to run", code="k8s.render-invalid",
                          hint="agentvm image export --oci, push it, and pass --image REGISTRY/NAME@sha256:...")
    runtime = runtime_class or RUNTIME_BY_TIER.get(policy.risk_tier, "gvisor")
    if policy.min_substrate and SUBSTRATE_STRENGTH.get(policy.min_substrate, 0) >= SUBSTRATE_STRENGTH["gvisor"] \
            and runtime in ("runc", ""):
        raise ConfigError(f"{name}: security.minSubstrate {policy.min_substrate} needs a gVisor or Kata RuntimeClass",
                          code="k8s.render-invalid")
    gw_image = gateway_image or f"agentvm/agentvm:{__version__}"
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "agentvm", AGENT_LABEL: name}
    meta = lambda n, extra=None: {"name": n, "namespace": namespace, "labels": dict(labels, **(extra or {}))}  # noqa: E731

    # -- the gateway --------------------------------------------------------------------------
    placeholders = {b.name: placeholder(namespace, name, b) for b in policy.credentials}
    gw_cfg = {"apiVersion": "agentvm/v1", "kind": "Gateway",
              "agents": {name: {"file": f"agent.{name}.yaml", "placeholders": placeholders,
                                "credentials": {b.name: f"env:{_env_name(name, b.name)}" for b in policy.credentials}}},
              "identities": [{"match": f"agentvm://{namespace}/{name}", "agent": name},
                             {"match": f"agentvm://{namespace}/{name}-*", "agent": name}]}
    import yaml

    gw_labels = {"app.kubernetes.io/name": GATEWAY, "app.kubernetes.io/managed-by": "agentvm", ROLE: "gateway"}
    gmeta = lambda n: {"name": n, "namespace": namespace, "labels": dict(gw_labels)}  # noqa: E731
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": gmeta(f"{GATEWAY}-config"),
                  "data": {"gateway.yaml": yaml.safe_dump(gw_cfg, sort_keys=False),
                           f"agent.{name}.yaml": agent_text if agent_text is not None else path.read_text()}}
    gw_env = [{"name": _env_name(name, b.name),
               "valueFrom": {"secretKeyRef": {"name": CREDENTIALS_SECRET, "key": f"{name}.{b.name}"}}}
              for b in policy.credentials]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": gmeta(GATEWAY),
        "spec": {
            "replicas": gateway_replicas,
            "selector": {"matchLabels": {ROLE: "gateway"}},
            "template": {
                "metadata": {"labels": dict(gw_labels)},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "fsGroup": AGENT_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": "gateway", "image": gw_image,
                        "command": ["agentvm", "gateway", "serve", "--config", "/etc/agentvm/gateway",
                                    "--ca", "/etc/agentvm/gateway-tls", "--listen", f"0.0.0.0:{GATEWAY_PORT}",
                                    "--state", "/var/lib/agentvm/gateway", "--audit", "/var/log/agentvm/audit"]
                        + (["--issuer", "/etc/agentvm/gateway-issuer", "--enroll-key",
                            "/etc/agentvm/gateway-issuer/enroll.key", "--enroll-port", str(ENROLL_PORT)]
                           if per_claim else []),
                        "env": gw_env + [{"name": "AGENTVM_HOME", "value": "/var/lib/agentvm"}],
                        "ports": [{"name": "mtls", "containerPort": GATEWAY_PORT, "protocol": "TCP"}]
                        + ([{"name": "enroll", "containerPort": ENROLL_PORT, "protocol": "TCP"}] if per_claim else []),
                        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
                        "securityContext": _hardened(AGENT_UID),
                        "volumeMounts": [
                            {"name": "config", "mountPath": "/etc/agentvm/gateway", "readOnly": True},
                            {"name": "gateway-tls", "mountPath": "/etc/agentvm/gateway-tls", "readOnly": True},
                            {"name": "intercept-ca", "mountPath": "/var/lib/agentvm/gateway/gate/ca", "readOnly": True},
                            {"name": "state", "mountPath": "/var/lib/agentvm"},
                            {"name": "audit", "mountPath": "/var/log/agentvm/audit"}]
                        + ([{"name": "issuer", "mountPath": "/etc/agentvm/gateway-issuer", "readOnly": True}]
                           if per_claim else [])}],
                    "volumes": [
                        {"name": "config", "configMap": {"name": f"{GATEWAY}-config"}},
                        {"name": "gateway-tls", "secret": {"secretName": f"{GATEWAY}-tls", "defaultMode": 0o440}},
                        {"name": "intercept-ca", "secret": {"secretName": f"{GATEWAY}-intercept-ca", "defaultMode": 0o440}},
                        {"name": "state", "emptyDir": {}},
                        {"name": "audit", "persistentVolumeClaim": {"claimName": f"{GATEWAY}-audit"}}]
                    + ([{"name": "issuer", "secret": {"secretName": ISSUER_SECRET, "defaultMode": 0o440}}]
                       if per_claim else [])}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": gmeta(GATEWAY),
               "spec": {"selector": {ROLE: "gateway"},
                        "ports": [{"name": "mtls", "port": GATEWAY_PORT, "targetPort": GATEWAY_PORT, "protocol": "TCP"}]
                        + ([{"name": "enroll", "port": ENROLL_PORT, "targetPort": ENROLL_PORT, "protocol": "TCP"}]
                           if per_claim else [])}}
    gateway_ca = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": gmeta(GATEWAY_CA),
                  "data": {"ca.pem": gateway_ca_pem or ""}}

    # -- the agent ------------------------------------------------------------------------------
    ident_uri = f"agentvm://{namespace}/{name}"
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
              "metadata": dict(meta(f"{name}-identity"), annotations={"agentvm.dev/identity": ident_uri}),
              "data": _b64(identity) if identity else {"tls.crt": "", "tls.key": "", "ca.crt": ""}}
    trust = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{name}-trust"),
             "data": {"ca.pem": trust_pem or ""}}
    netpol = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(f"{name}-egress"),
              "spec": {"podSelector": {"matchLabels": {AGENT_LABEL: name, ROLE: "sandbox"}},
                       "policyTypes": ["Ingress", "Egress"], "ingress": [],
                       "egress": [{"to": [{"podSelector": {"matchLabels": {ROLE: "gateway"}}}],
                                   "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]
                                   + ([{"protocol": "TCP", "port": ENROLL_PORT}] if per_claim else [])}]}}
    lim = policy.limits
    proxy = f"http://127.0.0.1:{BRIDGE_PORT}"
    env = [{"name": k, "value": v} for k, v in policy.env]
    env += [{"name": k, "value": proxy} for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")]
    env += [{"name": "NO_PROXY", "value": ""}]
    env += [{"name": k, "value": "/etc/agentvm/trust/ca.pem"} for k in
            ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE")]
    env += [{"name": b.env, "value": placeholders[b.name]} for b in policy.credentials]
    env += [{"name": b.sigv4_key_env, "value": b.sigv4_access_key_id} for b in policy.credentials if b.sigv4_access_key_id]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "trust", "mountPath": "/etc/agentvm/trust", "readOnly": True}]
    claims = []
    if policy.workspace:
        mounts.insert(0, {"name": "workspace", "mountPath": policy.workspace})
        claims.append({"metadata": {"name": "workspace", "labels": dict(labels)},
                       "spec": {"accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": _quantity(lim.disk)}}}})
    agent_c = {"name": "agent", "image": img, "command": list(policy.command) or None,
               "workingDir": policy.workdir or policy.workspace or "/tmp", "env": env,
               "resources": {"requests": {"cpu": _cpu(lim.cpus), "memory": _quantity(lim.memory)},
                             "limits": {"cpu": _cpu(lim.cpus), "memory": _quantity(lim.memory)}},
               "securityContext": _hardened(AGENT_UID), "volumeMounts": mounts}
    if agent_c["command"] is None:
        del agent_c["command"]
    bridge_cmd = ["agentvm", "gateway", "bridge", "--listen", f"127.0.0.1:{BRIDGE_PORT}",
                  "--identity", "/etc/agentvm/identity", "--server-name", f"{GATEWAY}.{namespace}.svc"]
    bridge_mounts = [{"name": "identity", "mountPath": "/etc/agentvm/identity", "readOnly": not per_claim}]
    if per_claim:  # the bridge enrols: the claim's token from the pod's annotations, its own key in memory
        bridge_cmd += ["--enroll-token-file", "/etc/agentvm/podinfo/annotations",
                       "--gateway-ca", "/etc/agentvm/gateway-ca/ca.pem", "--enroll-port", str(ENROLL_PORT)]
        bridge_mounts += [{"name": "podinfo", "mountPath": "/etc/agentvm/podinfo", "readOnly": True},
                          {"name": "gateway-ca", "mountPath": "/etc/agentvm/gateway-ca", "readOnly": True}]
    bridge_c = {"name": "proxy-bridge", "image": gw_image,
                "command": bridge_cmd,
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "128Mi"}},
                "securityContext": _hardened(BRIDGE_UID),
                "volumeMounts": bridge_mounts}
    pod_spec = {
        "runtimeClassName": runtime,
        "automountServiceAccountToken": False,
        "enableServiceLinks": True,  # AGENTVM_GATEWAY_SERVICE_HOST/PORT: the bridge needs no DNS
        "shareProcessNamespace": False,
        "hostNetwork": False, "hostPID": False, "hostIPC": False,
        "restartPolicy": "Never" if policy.lifecycle == "ephemeral" else "Always",
        "securityContext": {"runAsNonRoot": True, "runAsUser": AGENT_UID, "runAsGroup": AGENT_UID, "fsGroup": AGENT_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [agent_c, bridge_c],
        "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity(lim.tmp)}},
                    {"name": "trust", "configMap": {"name": f"{name}-trust"}},
                    *([{"name": "identity", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                       {"name": "podinfo", "downwardAPI": {"items": [
                           {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
                       {"name": "gateway-ca", "configMap": {"name": GATEWAY_CA}}] if per_claim else
                      [{"name": "identity", "secret": {"secretName": f"{name}-identity", "defaultMode": 0o440}}])],
    }
    if policy.lifecycle == "ephemeral" and lim.timeout:
        pod_spec["activeDeadlineSeconds"] = int(lim.timeout)
    template = {"apiVersion": API, "kind": "SandboxTemplate", "metadata": meta(name),
                "spec": {"networkPolicyManagement": "Unmanaged",  # the NetworkPolicy above is the one
                         "podTemplate": {"metadata": {"labels": dict(labels, **{ROLE: "sandbox"})}, "spec": pod_spec}}}
    if claims:
        template["spec"]["volumeClaimTemplates"] = claims
    out = [config_map, deployment, service, gateway_ca if per_claim else secret, trust, netpol, template]
    if warm_pool is not None:
        out.append({"apiVersion": API, "kind": "SandboxWarmPool", "metadata": meta(name),
                    "spec": {"replicas": warm_pool, "sandboxTemplateRef": {"name": name}}})
    return out


def _b64(files: dict) -> dict:
    import base64

    return {k: base64.b64encode(v if isinstance(v, bytes) else v.encode()).decode() for k, v in files.items()}


def to_yaml(objects: list[dict]) -> str:
    """One multi-document YAML stream (what ``kubectl apply -f -`` takes)."""
    import yaml

    return "".join("---\n" + yaml.safe_dump(o, sort_keys=False, default_flow_style=False) for o in objects)


def render_all(agent_paths, **kw) -> list[dict]:
    """Several agents sharing one gateway: one gateway ConfigMap and Deployment carrying every
    agent (a ConfigMap applied per agent would replace the others')."""
    import yaml

    out: list[dict] = []
    cm = dep = None
    for p in agent_paths:
        objs = render(p, **kw)
        if cm is None:
            cm, dep = objs[0], objs[1]
            out.extend(objs)
            continue
        new_cm, new_dep = objs[0], objs[1]
        cfg, add = yaml.safe_load(cm["data"]["gateway.yaml"]), yaml.safe_load(new_cm["data"]["gateway.yaml"])
        dup = set(cfg["agents"]) & set(add["agents"])
        if dup:
            raise ConfigError(f"two agent files named {sorted(dup)}", code="k8s.render-invalid")
        cfg["agents"].update(add["agents"])
        cfg["identities"] += add["identities"]
        cm["data"].update({k: v for k, v in new_cm["data"].items() if k != "gateway.yaml"})
        cm["data"]["gateway.yaml"] = yaml.safe_dump(cfg, sort_keys=False)
        dep["spec"]["template"]["spec"]["containers"][0]["env"][:0] = [
            e for e in new_dep["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e]
        out.extend(o for o in objs[3:] if not (o["kind"] == "ConfigMap" and o["metadata"]["name"] == GATEWAY_CA))
    return out

"""``agentvm k8s claim|exec|rm`` through the official ``kubernetes`` client.

The requests are built by pure functions (``claim_body``, ``claim_request``...) that the unit
tests check; :class:`Cluster` only hands them to the client's APIs. Live tests run them against
a cluster when ``KUBECONFIG`` is set."""

from __future__ import annotations

import os

from agentvm.errors import AgentVMError, ConfigError

GROUP, VERSION = "extensions.agents.x-k8s.io", "v1beta1"
SANDBOX_GROUP = "agents.x-k8s.io"


def enrolment_annotations(name: str, namespace: str, pool: str, enroll_key, *, ttl: float = 1800.0) -> dict:
    """The pod annotations that give a claim its own identity ``agentvm://NAMESPACE/NAME``: a
    bootstrap token bound to it (agentvm.gateway.enroll). The rendered gateway maps
    ``agentvm://NS/POOL`` and ``agentvm://NS/POOL-*`` to the agent, so NAME must be one of them."""
    from agentvm.gateway.enroll import ANNOTATION, IDENTITY_ANNOTATION, load_key, make_token
    from agentvm.gateway.identity import Identity

    ident = Identity(namespace, name)
    if name != pool and not name.startswith(pool + "-"):
        raise ConfigError(f"claim {name} of pool {pool}: the gateway maps only {pool} and {pool}-* to the agent",
                          hint=f"name the claim {pool}-SOMETHING", code="k8s.render-invalid")
    return {IDENTITY_ANNOTATION: ident.uri, ANNOTATION: make_token(load_key(enroll_key), ident, ttl=ttl)}


def claim_body(name: str, namespace: str, pool: str, *, ttl_after_finished: int | None = None,
               annotations: dict | None = None) -> dict:
    """A SandboxClaim (v1beta1 claims come from a warm pool: ``warmPoolRef``); the sandbox is
    deleted with the claim (``shutdownPolicy: Delete``). ``annotations`` go onto the claimed
    pod (``additionalPodMetadata``, which the controller applies to a warm pod it hands over):
    the per-claim enrolment token (:func:`enrolment_annotations`)."""
    from agentvm.gateway.identity import Identity

    Identity(namespace, name)  # DNS labels
    lifecycle: dict = {"shutdownPolicy": "Delete"}
    if ttl_after_finished is not None:
        lifecycle["ttlSecondsAfterFinished"] = int(ttl_after_finished)
    spec: dict = {"warmPoolRef": {"name": pool}, "lifecycle": lifecycle}
    if annotations:
        spec["additionalPodMetadata"] = {"annotations": dict(annotations)}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "SandboxClaim",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "agentvm", "agentvm.dev/agent": pool}},
            "spec": spec}


def claim_request(body: dict) -> dict:
    """The keyword arguments of CustomObjectsApi.create_namespaced_custom_object."""
    return {"group": GROUP, "version": VERSION, "namespace": body["metadata"]["namespace"], "plural": "sandboxclaims",
            "body": body}


def delete_request(name: str, namespace: str) -> dict:
    return {"group": GROUP, "version": VERSION, "namespace": namespace, "plural": "sandboxclaims", "name": name,
            "propagation_policy": "Foreground"}


def revoke_request(identity: str, namespace: str, data: dict, config_map: str = "agentvm-gateway-config") -> dict:
    """The keyword arguments of CoreV1Api.patch_namespaced_config_map adding ``identity`` to the
    gateway's ``revoked.yaml``."""
    from agentvm.gateway.config import REVOKED_FILE, add_revocations

    return {"name": config_map, "namespace": namespace,
            "body": {"data": {REVOKED_FILE: add_revocations(data.get(REVOKED_FILE), identities=[identity])}}}


def exec_request(pod: str, namespace: str, argv: list[str], *, container: str = "agent") -> dict:
    """The keyword arguments of ``kubernetes.stream.stream(CoreV1Api.connect_get_namespaced_pod_exec, ...)``."""
    if not argv:
        raise ConfigError("exec needs a command", code="config.invalid")
    return {"name": pod, "namespace": namespace, "container": container, "command": list(argv), "stdin": False,
            "stdout": True, "stderr": True, "tty": False, "_preload_content": False}


class Cluster:
    def __init__(self, custom=None, core=None) -> None:
        if custom is None or core is None:
            try:
                from kubernetes import client, config
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise AgentVMError("the kubernetes client is not installed", code="k8s.unavailable") from exc
            try:
                if os.environ.get("KUBERNETES_SERVICE_HOST"):
                    config.load_incluster_config()
                else:
                    config.load_kube_config()
            except Exception as exc:  # noqa: BLE001 - no configuration is one clear error
                raise AgentVMError(f"no Kubernetes cluster is configured: {exc}", code="k8s.unavailable",
                                   hint="set KUBECONFIG to a kubeconfig file") from None
            custom, core = client.CustomObjectsApi(), client.CoreV1Api()
        self.custom, self.core = custom, core

    def _call(self, fn, **kw):
        try:
            return fn(**kw)
        except Exception as exc:  # noqa: BLE001 - the client's ApiException, translated at the boundary
            status = getattr(exc, "status", None)
            if status == 404:
                raise AgentVMError(f"not found: {kw.get('name') or kw.get('plural')}", code="k8s.not-found") from exc
            raise AgentVMError(f"the Kubernetes API failed: {status or type(exc).__name__}: "
                               f"{getattr(exc, 'reason', exc)}", code="k8s.error") from exc

    def claim(self, name: str, namespace: str, pool: str, *, annotations: dict | None = None) -> dict:
        return self._call(self.custom.create_namespaced_custom_object,
                          **claim_request(claim_body(name, namespace, pool, annotations=annotations)))

    def rm(self, name: str, namespace: str) -> dict:
        return self._call(self.custom.delete_namespaced_custom_object, **delete_request(name, namespace))

    def revoke(self, identity: str, namespace: str, *, config_map: str = "agentvm-gateway-config") -> dict:
        """Add ``identity`` to ``revoked.yaml`` of the gateway's ConfigMap (a merge patch of that
        one key: the render never writes it, so a later ``kubectl apply`` of the render keeps it).
        Every replica refuses the identity's next request once the kubelet has synced the volume."""
        cm = self._call(self.core.read_namespaced_config_map, name=config_map, namespace=namespace)
        data = (getattr(cm, "data", None) if not isinstance(cm, dict) else cm.get("data")) or {}
        return self._call(self.core.patch_namespaced_config_map, **revoke_request(identity, namespace, data, config_map))

    def pod_of(self, name: str, namespace: str) -> str:
        """The pod behind a claim: claim.status.sandbox.name -> Sandbox.status.selector -> pod."""
        claim = self._call(self.custom.get_namespaced_custom_object, group=GROUP, version=VERSION,
                           namespace=namespace, plural="sandboxclaims", name=name)
        sb = ((claim.get("status") or {}).get("sandbox") or {}).get("name")
        if not sb:
            raise AgentVMError(f"claim {name} has no sandbox yet", code="k8s.not-found", hint="retry in a moment")
        sandbox = self._call(self.custom.get_namespaced_custom_object, group=SANDBOX_GROUP, version=VERSION,
                             namespace=namespace, plural="sandboxes", name=sb)
        selector = (sandbox.get("status") or {}).get("selector")
        if not selector:
            raise AgentVMError(f"sandbox {sb} has no pod yet", code="k8s.not-found", hint="retry in a moment")
        pods = self._call(self.core.list_namespaced_pod, namespace=namespace, label_selector=selector)
        items = getattr(pods, "items", None) or []
        if not items:
            raise AgentVMError(f"no pod for sandbox {sb}", code="k8s.not-found")
        return items[0].metadata.name

    def exec(self, name: str, namespace: str, argv: list[str], *, timeout: float = 300.0) -> tuple[int, str, str]:
        from kubernetes.stream import stream

        pod = self.pod_of(name, namespace)
        resp = stream(self.core.connect_get_namespaced_pod_exec, **exec_request(pod, namespace, argv))
        out, err = [], []
        resp.run_forever(timeout=timeout)
        out.append(resp.read_stdout() or "")
        err.append(resp.read_stderr() or "")
        code = resp.returncode if resp.returncode is not None else 124
        resp.close()
        return code, "".join(out), "".join(err)

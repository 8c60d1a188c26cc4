"""``agentvm k8s render|claim|exec|rm``: agents on Kubernetes (agent-sandbox v1beta1) behind
the shared egress gateway (docs/k8s.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.group()
def k8s() -> None:
    """Agents on Kubernetes (agent-sandbox v1beta1) behind the shared gateway (docs/k8s.md)."""


@k8s.command("render")
@click.option("-f", "--file", "files", required=True, multiple=True, type=click.Path(exists=True, path_type=Path),
              help="An agent file (repeat: several agents share one gateway).")
@click.option("--namespace", "-n", default="default", show_default=True)
@click.option("--warm-pool", type=int, default=None, help="Also render a SandboxWarmPool of N sandboxes.")
@click.option("--image", default=None, help="The agent's image in a registry (agentvm image export --oci, pushed).")
@click.option("--gateway-image", default=None, help="The agentvm image for the gateway and the proxy bridge.")
@click.option("--runtime-class", default=None, help="RuntimeClass (default by risk tier: gvisor, kata from L4).")
@click.option("--gateway-replicas", type=int, default=2, show_default=True)
@click.option("--ca", "ca_dir", type=click.Path(path_type=Path), default=None,
              help="The gateway's CA: mint each agent's identity into its Secret (else left empty to fill).")
@click.option("--identity", "identity_mode", type=click.Choice(["claim", "template"]), default="claim", show_default=True,
              help="claim: each claim enrols its own short-lived certificate at the gateway; template: one "
                   "Secret shared by every pod of the template.")
@click.option("--identity-ttl", type=float, default=86400.0, show_default=True,
              help="Lifetime of the certificate minted into the template's Secret (--identity template), s.")
@click.option("--trust", "trust_file", type=click.Path(exists=True, path_type=Path), default=None,
              help="The gate's interception CA certificate (PEM) sandboxes trust.")
def render_cmd(files, namespace, warm_pool, image, gateway_image, runtime_class, gateway_replicas, ca_dir,
               identity_mode, identity_ttl, trust_file) -> None:
    """Print the objects for the agent(s) as one multi-document YAML stream (kubectl apply -f -)."""
    from agentvm.k8s.render import render_all, to_yaml

    gateway_ca_pem = None
    if ca_dir is not None and identity_mode == "claim":
        from agentvm.gateway.ca import GatewayCA

        gateway_ca_pem = GatewayCA.load(ca_dir).cert_pem.decode()
    objs = render_all(files, namespace=namespace, warm_pool=warm_pool, image=image, gateway_image=gateway_image,
                      runtime_class=runtime_class, gateway_replicas=gateway_replicas,
                      trust_pem=trust_file.read_text() if trust_file else None, identity_mode=identity_mode,
                      gateway_ca_pem=gateway_ca_pem)
    if ca_dir is not None and identity_mode == "template":
        import base64

        from agentvm.gateway.ca import GatewayCA
        from agentvm.gateway.identity import Identity

        ca = GatewayCA.load(ca_dir)
        for o in objs:
            uri = (o["metadata"].get("annotations") or {}).get("agentvm.dev/identity")
            if o["kind"] == "Secret" and uri:
                m = ca.mint(Identity.parse(uri), lifetime=identity_ttl)
                o["data"] = {k: base64.b64encode(v).decode() for k, v in
                             (("tls.crt", m.cert_pem), ("tls.key", m.key_pem), ("ca.crt", ca.cert_pem))}
    sys.stdout.write(to_yaml(objs))


@k8s.command("claim")
@click.argument("name")
@click.option("--pool", required=True, help="The SandboxWarmPool (the agent's name).")
@click.option("--namespace", "-n", default="default", show_default=True)
@click.option("--enroll-key", type=click.Path(exists=True, path_type=Path), default=None,
              envvar="AGENTVM_ENROLL_KEY", help="enroll.key (agentvm gateway issuer): give the claim its own identity.")
@click.option("--token-ttl", type=float, default=1800.0, show_default=True,
              help="Seconds the claim's bootstrap token is good for (until its bridge enrols).")
def claim(name, pool, namespace, enroll_key, token_ttl) -> None:
    """Claim a sandbox NAME from an agent's warm pool (with --enroll-key: identity agentvm://NS/NAME)."""
    from agentvm.k8s.cluster import Cluster, enrolment_annotations

    ann = enrolment_annotations(name, namespace, pool, enroll_key, ttl=token_ttl) if enroll_key else None
    meta = Cluster().claim(name, namespace, pool, annotations=ann).get("metadata", {})
    click.echo(json.dumps({"name": meta.get("name"), "namespace": meta.get("namespace"),
                           "identity": (ann or {}).get("agentvm.dev/identity")}, default=str))


@k8s.command("exec")
@click.argument("name")
@click.argument("argv", nargs=-1, required=True)
@click.option("--namespace", "-n", default="default", show_default=True)
@click.option("--timeout", type=float, default=300.0, show_default=True)
def exec_cmd(name, argv, namespace, timeout) -> None:
    """Run ARGV in the agent container of the claimed sandbox NAME."""
    from agentvm.k8s.cluster import Cluster

    code, out, err = Cluster().exec(name, namespace, list(argv), timeout=timeout)
    sys.stdout.write(out)
    sys.stderr.write(err)
    raise SystemExit(code)


@k8s.command("rm")
@click.argument("name")
@click.option("--namespace", "-n", default="default", show_default=True)
@click.option("--revoke", is_flag=True,
              help="Also revoke its identity agentvm://NS/NAME at the gateway (revoked.yaml of its ConfigMap).")
def rm(name, namespace, revoke) -> None:
    """Delete the claim NAME (its sandbox goes with it, and the only copy of its key)."""
    from agentvm.gateway.identity import Identity
    from agentvm.k8s.cluster import Cluster

    c = Cluster()
    if revoke:  # first: the identity is refused even if deleting the claim fails
        c.revoke(Identity(namespace, name).uri, namespace)
        click.echo(f"revoked agentvm://{namespace}/{name}")
    c.rm(name, namespace)
    click.echo(f"deleted claim {namespace}/{name}")

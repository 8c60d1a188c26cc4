"""``agentvm gateway init|mint|issuer|token|serve|revoke|verify|bridge``: the gate as a shared egress gateway
(docs/scale-out.md)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import click


@click.group()
def gateway() -> None:
    """The gate as a shared egress gateway: many sandboxes over mTLS (docs/scale-out.md)."""


@gateway.command("init")
@click.option("--dir", "ca_dir", required=True, type=click.Path(path_type=Path), help="Where the CA is made.")
@click.option("--name", "names", multiple=True, help="A DNS name or IP of the gateway (repeat; default localhost, 127.0.0.1).")
def init(ca_dir: Path, names: tuple[str, ...]) -> None:
    """Make the gateway's CA and its server certificate."""
    from agentvm.gateway.ca import GatewayCA

    ca = GatewayCA.create(ca_dir, server_names=names or ("localhost", "127.0.0.1"))
    click.echo(f"gateway CA in {ca.directory} (ca.pem, server.pem; keys 0600)")


@gateway.command("mint")
@click.argument("identity")
@click.option("--dir", "ca_dir", required=True, type=click.Path(path_type=Path), help="The gateway's CA directory.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Writes tls.crt, tls.key, ca.crt here.")
@click.option("--ttl", default=3600.0, show_default=True, type=float, help="Lifetime in seconds.")
def mint(identity: str, ca_dir: Path, out: Path, ttl: float) -> None:
    """Mint a client certificate for IDENTITY (agentvm://NAMESPACE/SANDBOX or NAMESPACE/SANDBOX)."""
    from agentvm.gateway.ca import GatewayCA
    from agentvm.gateway.identity import Identity

    ca = GatewayCA.load(ca_dir)
    m = ca.mint(Identity.parse(identity), lifetime=ttl)
    ca.write_client(m, out)
    click.echo(json.dumps({"identity": m.identity.uri, "serial": m.serial_hex, "not_after": m.not_after.isoformat(),
                           "dir": str(out)}))


@gateway.command("issuer")
@click.option("--dir", "ca_dir", required=True, type=click.Path(path_type=Path), help="The gateway's CA directory.")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Writes issuer.pem, issuer.key, ca.pem and enroll.key here (the gateway's Secret).")
@click.option("--namespace", "-n", "namespaces", multiple=True,
              help="Constrain the issuer to identities of this namespace (repeat; recommended).")
@click.option("--ttl", default=30 * 86400.0, show_default=True, type=float, help="The issuer's lifetime in seconds.")
def issuer_cmd(ca_dir: Path, out: Path, namespaces: tuple[str, ...], ttl: float) -> None:
    """Make the intermediate the gateway mints per-claim certificates with (the root key stays here)."""
    from agentvm.gateway.ca import GatewayCA

    files = GatewayCA.load(ca_dir).make_issuer(out, namespaces=namespaces, lifetime=ttl)
    click.echo(json.dumps({k: str(v) for k, v in files.items()}))


@gateway.command("token")
@click.argument("identity")
@click.option("--enroll-key", required=True, type=click.Path(exists=True, path_type=Path), help="enroll.key.")
@click.option("--ttl", default=1800.0, show_default=True, type=float, help="Seconds the token is good for.")
def token_cmd(identity: str, enroll_key: Path, ttl: float) -> None:
    """Print a bootstrap token for IDENTITY (what `agentvm k8s claim` puts on the claim)."""
    from agentvm.gateway.enroll import load_key, make_token
    from agentvm.gateway.identity import Identity

    click.echo(make_token(load_key(enroll_key), Identity.parse(identity), ttl=ttl))


@gateway.command("serve")
@click.option("--config", "config_dir", required=True, type=click.Path(path_type=Path),
              help="The configuration source (gateway.yaml and agent files).")
@click.option("--ca", "ca_dir", required=True, type=click.Path(path_type=Path), help="The gateway's CA directory.")
@click.option("--listen", default="127.0.0.1:8443", show_default=True, help="HOST:PORT to listen on.")
@click.option("--state", "state_dir", default=None, type=click.Path(path_type=Path),
              help="This replica's own state (decision logs, the interception CA); default $AGENTVM_HOME/gateway.")
@click.option("--audit", "audit_dir", default=None, type=click.Path(path_type=Path), help="The shared audit sink.")
@click.option("--replica", default=None, help="This replica's name in the audit sink (default: the host name).")
@click.option("--vault", "vault_dir", default=None, type=click.Path(path_type=Path), help="A vault for vault: references.")
@click.option("--issuer", "issuer_dir", default=None, type=click.Path(path_type=Path),
              help="The issuer (agentvm gateway issuer): serve per-claim enrolment.")
@click.option("--enroll-key", default=None, type=click.Path(path_type=Path), help="enroll.key, with --issuer.")
@click.option("--enroll-port", default=8444, show_default=True, type=int, help="The enrolment port, with --issuer.")
@click.option("--cert-ttl", default=3600.0, show_default=True, type=float, help="Lifetime of enrolled certificates, s.")
def serve(config_dir: Path, ca_dir: Path, listen: str, state_dir: Path | None, audit_dir: Path | None,
          replica: str | None, vault_dir: Path | None, issuer_dir: Path | None, enroll_key: Path | None,
          enroll_port: int, cert_ttl: float) -> None:
    """Serve sandboxes identified by their client certificates until stopped."""
    from agentvm.errors import ConfigError
    from agentvm.gate.server import run
    from agentvm.gateway.server import serve as serve_gateway

    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--listen {listen!r} is not HOST:PORT")
    if state_dir is None:
        state_dir = Path(os.environ.get("AGENTVM_HOME", Path.home() / ".agentvm")) / "gateway"

    def ready(addr, _gate) -> None:
        click.echo(f"gateway listening on {addr[0]}:{addr[1]}", err=True)

    run(serve_gateway(config_dir, ca_dir, host.strip("[]") or "0.0.0.0", int(port), state_dir=state_dir,
                      audit_dir=audit_dir, replica=replica or socket.gethostname(), vault_dir=vault_dir, ready=ready,
                      issuer_dir=issuer_dir, enroll_key=enroll_key, enroll_port=enroll_port, cert_lifetime=cert_ttl))


@gateway.command("revoke")
@click.option("--config", "config_dir", required=True, type=click.Path(path_type=Path))
@click.option("--identity", "identities", multiple=True, help="agentvm://NAMESPACE/SANDBOX (repeat).")
@click.option("--serial", "serials", multiple=True, help="A certificate serial number, hex (repeat).")
@click.option("--credential", "credentials", multiple=True, help="A credential name, for every sandbox (repeat).")
def revoke(config_dir: Path, identities, serials, credentials) -> None:
    """Revoke in the configuration source: every replica refuses on the next request."""
    from agentvm.errors import ConfigError
    from agentvm.gateway.config import edit_revocations

    if not (identities or serials or credentials):
        raise ConfigError("nothing to revoke", hint="--identity, --serial or --credential")
    click.echo(json.dumps(edit_revocations(config_dir, identities=identities, serials=serials,
                                           credentials=credentials)))


@gateway.command("verify")
@click.option("--audit", "audit_dir", required=True, type=click.Path(path_type=Path))
@click.argument("identity")
def verify(audit_dir: Path, identity: str) -> None:
    """Verify a sandbox's chains in the audit sink (every replica's) and print the merged head."""
    from agentvm.errors import AgentVMError
    from agentvm.gateway.audit import verify as verify_chain
    from agentvm.gateway.identity import Identity

    v = verify_chain(audit_dir, Identity.parse(identity).key)
    click.echo(json.dumps(v.__dict__))
    if not v.ok:
        raise AgentVMError(f"the audit chain of {identity} does not verify", code="audit.broken-chain")


@gateway.command("bridge")
@click.option("--listen", default="127.0.0.1:3128", show_default=True, help="HOST:PORT the agent's proxy variables name.")
@click.option("--gateway", "gateway_addr", default=None,
              help="HOST:PORT of the gateway (default: $AGENTVM_GATEWAY_SERVICE_HOST/PORT, the Service's variables).")
@click.option("--server-name", default="agentvm-gateway", show_default=True, help="The name the gateway's certificate carries.")
@click.option("--identity", "identity_dir", required=True, type=click.Path(path_type=Path),
              help="tls.crt, tls.key and ca.crt of this sandbox (its Secret, or with --enroll-token-file where "
                   "the bridge keeps what it enrols: a volume of its own).")
@click.option("--enroll-token-file", default=None, type=click.Path(path_type=Path),
              help="Per-claim identity: the downwardAPI annotations file carrying the claim's bootstrap token.")
@click.option("--gateway-ca", default=None, type=click.Path(path_type=Path),
              help="The gateway CA certificate (with --enroll-token-file).")
@click.option("--enroll-port", default=8444, show_default=True, type=int)
def bridge_cmd(listen: str, gateway_addr: str | None, server_name: str, identity_dir: Path,
               enroll_token_file: Path | None, gateway_ca: Path | None, enroll_port: int) -> None:
    """The sandbox's end of the gateway: a local proxy port carried to the gateway over mTLS."""
    import asyncio

    from agentvm.gateway.bridge import bridge, gateway_address

    host, _, port = listen.rpartition(":")
    gw = gateway_address(gateway_addr)
    if enroll_token_file is None:
        asyncio.run(bridge((host, int(port)), gw, server_name, identity_dir))
        return
    from agentvm.errors import ConfigError
    from agentvm.gateway.enroll import keep_enrolled

    if gateway_ca is None:
        raise ConfigError("--enroll-token-file needs --gateway-ca", code="config.invalid")

    async def both() -> None:
        await asyncio.gather(bridge((host, int(port)), gw, server_name, identity_dir),
                             keep_enrolled((gw[0], enroll_port), server_name, gateway_ca, enroll_token_file,
                                           identity_dir, log=lambda m: click.echo(m, err=True)))

    asyncio.run(both())

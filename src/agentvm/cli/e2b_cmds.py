"""``agentvm e2b serve | env | key``: the E2B-compatible API (docs/e2b.md).

The daemon serves the API itself with ``agentvm up --e2b-listen HOST:PORT`` (over its
ControlPlane, its sandboxes kept across restarts); ``serve`` runs it in a process of its own
over the running daemon's API instead (state in memory); ``env`` prints the ``export`` lines
that point the ``e2b`` SDKs at whichever serves it (``<runtime>/e2b.json`` says which).
"""

from __future__ import annotations

import ipaddress
import json
import os

import click


def _runtime_file():
    from agentvm.paths import default_paths

    return default_paths().runtime / "e2b.json"


def _served():
    """What ``<runtime>/e2b.json`` says serves the API (``url``, ``pid``, ``domain``, ``by``),
    or None when nothing does (no file, or its process is gone)."""
    try:
        served = json.loads(_runtime_file().read_text())
        url, pid = str(served["url"]), int(served["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return {**served, "url": url}


@click.group()
def e2b():
    """The E2B-compatible API: existing E2B code runs on agent-vm sandboxes."""


@e2b.command()
@click.option("--listen", default="127.0.0.1:49983", show_default=True, metavar="HOST:PORT",
              help="Loopback address to serve the API on (plain HTTP: loopback only).")
@click.option("--max-per-tenant", default=20, show_default=True, help="Sandboxes one API key may hold.")
@click.option("--max-creating", default=4, show_default=True, help="Creates in progress at once (more: 429).")
@click.option("--domain", default=None, metavar="DOMAIN",
              help="The sandboxes' domain: get_host(port) is PORT-ID.DOMAIN, routed by Host "
                   "[default: localhost:PORT, *.localhost being loopback].")
def serve(listen, max_per_tenant, max_creating, domain):
    """Serve the E2B API over the running daemon (foreground)."""
    from agentvm import e2b as pkg
    from agentvm.daemon.client import Client
    from agentvm.errors import ConfigError

    host, _, port = listen.rpartition(":")
    try:
        if not ipaddress.ip_address(host.strip("[]")).is_loopback:
            raise ValueError
        port = int(port)
    except ValueError:
        raise ConfigError(f"--listen {listen!r}: a loopback HOST:PORT is required",
                          hint="the E2B API is plain HTTP: serve it on 127.0.0.1 (a TLS front is yours to add)") from None
    client = Client()
    client.request("GET", "/v1/sandboxes")  # DaemonUnavailable (with its hint) when it is not up
    other = _served()
    if other is not None and other.get("pid") != os.getpid():
        from agentvm.errors import AgentVMError

        who = "the daemon (`agentvm up --e2b-listen`)" if other.get("by") == "daemon" else f"pid {other.get('pid')}"
        raise AgentVMError(f"the E2B API is already served at {other['url']} by {who}", code="e2b.bad-request",
                           hint="use that one (`agentvm e2b env`), or stop it first")
    import uvicorn

    from agentvm.e2b.app import make_app
    from agentvm.e2b.backend import DaemonBackend

    pkg.api_keys()  # the first key exists before anyone asks for it
    import logging

    # the adapter's records (e2b.create, e2b.kill, e2b.port...: never a token) on stderr
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    for lname in ("agentvm.e2b", "agentvm.e2b.ports"):
        lg = logging.getLogger(lname)
        lg.setLevel(logging.INFO)
        if lname == "agentvm.e2b":
            lg.addHandler(handler)
    domain = domain or f"localhost:{port}"
    app = make_app(DaemonBackend(client), lambda: pkg.api_keys(create=False), max_per_tenant=max_per_tenant,
                   max_concurrent_creates=max_creating, domain=domain)
    f = _runtime_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{host}:{port}"
    f.write_text(json.dumps({"url": url, "pid": os.getpid(), "domain": domain}))
    click.echo(f"E2B API on {url} (`agentvm e2b env` prints the environment)", err=True)
    try:
        from agentvm.e2b.listener import guarded_protocol

        uvicorn.run(app, host=host.strip("[]"), port=port, log_level="warning", lifespan="on",
                    http=guarded_protocol(),  # connections capped, heads due in time (docs/e2b.md)
                    ws_max_size=16 << 20, ws_max_queue=1)  # a WebSocket message, and messages held: bounded
    finally:
        try:
            if json.loads(f.read_text()).get("pid") == os.getpid():
                f.unlink()
        except (OSError, ValueError):
            pass


@e2b.command()
@click.option("--tenant", default="default", show_default=True, help="Whose API key to print.")
def env(tenant):
    """Print the export lines for the e2b SDKs (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)."""
    import http.client

    from agentvm import e2b as pkg
    from agentvm.errors import AgentVMError

    served = _served()
    if served is None:
        from agentvm.daemon.client import Client

        if not Client().available():
            raise AgentVMError("the E2B API is not being served: the daemon is not running", code="e2b.not-serving",
                               hint="start it with the API: `agentvm up --e2b-listen 127.0.0.1:49983`")
        raise AgentVMError("the E2B API is not being served: the daemon runs without --e2b-listen",
                           code="e2b.not-serving",
                           hint="restart it with the API (`agentvm down && agentvm up --e2b-listen 127.0.0.1:49983`), "
                                "or serve it beside the daemon with `agentvm e2b serve`")
    url = served["url"]
    by_daemon = served.get("by") == "daemon"
    keys = [k for k, t in pkg.api_keys().items() if t == tenant]
    if not keys:
        raise AgentVMError(f"no API key for tenant {tenant!r}", code="e2b.not-serving",
                           hint=f"`agentvm e2b key --tenant {tenant}` makes one")
    host, _, port = url.removeprefix("http://").rpartition(":")
    try:
        c = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=5)
        c.request("GET", "/sandboxes", headers={"X-API-Key": keys[0]})
        status = c.getresponse().status
        c.close()
    except OSError:
        status = 0
    if status != 200:
        raise AgentVMError(f"the E2B API at {url} does not answer (HTTP {status or 'none'})", code="e2b.not-serving",
                           hint="is the daemon up (`agentvm status`; its log: <home>/daemon.log)?" if by_daemon else
                           "is `agentvm e2b serve` still running? is the daemon up (`agentvm up`)?")
    click.echo(f"export E2B_API_URL={url}")
    click.echo(f"export E2B_SANDBOX_URL={url}")
    click.echo(f"export E2B_API_KEY={keys[0]}")
    if served.get("domain"):  # get_host(port) -> PORT-ID.DOMAIN (the create answer says so too)
        click.echo(f"export E2B_DOMAIN={served['domain']}")
    click.echo("export E2B_DEBUG=false")


@e2b.command()
@click.option("--tenant", required=True, help="A tenant name: its sandboxes are invisible to other keys.")
def key(tenant):
    """Make an API key for a tenant (printed once)."""
    from agentvm import e2b as pkg

    click.echo(pkg.add_tenant(tenant))

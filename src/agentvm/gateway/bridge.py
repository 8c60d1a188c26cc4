"""The proxy bridge: the sandbox's end of the gateway, in its own container of the pod.

It listens on 127.0.0.1 inside the pod (the agent's HTTP(S)_PROXY) and carries each
connection, byte for byte, to the gateway over TLS with the sandbox's client certificate -
which only this container mounts. The agent never holds the key; it holds an address. The
gateway's address comes from the Service's environment variables (no DNS in the pod)."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path


def client_context(identity_dir: Path) -> ssl.SSLContext:
    d = Path(identity_dir)
    if (d / "current").is_dir():  # what the bridge enrolled itself (agentvm.gateway.enroll), swapped whole
        d = d / "current"
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    ctx.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
    return ctx


def gateway_address(explicit: str | None) -> tuple[str, int]:
    if explicit:
        host, _, port = explicit.rpartition(":")
        return host.strip("[]"), int(port)
    return os.environ["AGENTVM_GATEWAY_SERVICE_HOST"], int(os.environ.get("AGENTVM_GATEWAY_SERVICE_PORT", "8443"))


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await r.read(65536)
            if not data:
                break
            w.write(data)
            await w.drain()
    except (ConnectionError, asyncio.CancelledError, ssl.SSLError):
        pass
    finally:
        try:
            if w.can_write_eof():
                w.write_eof()
            else:
                w.close()
        except (OSError, RuntimeError):
            pass


async def bridge(listen: tuple[str, int], gateway: tuple[str, int], server_name: str, identity_dir: Path,
                 *, ready=None, stop: asyncio.Event | None = None) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            # the context is read per connection: a renewed certificate (the Secret updated) is used at once
            ur, uw = await asyncio.wait_for(asyncio.open_connection(*gateway, ssl=client_context(identity_dir),
                                                                    server_hostname=server_name), 10)
        except (OSError, ssl.SSLError, asyncio.TimeoutError):
            cw.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            cw.close()
            return
        await asyncio.gather(_pipe(cr, uw), _pipe(ur, cw))
        for w in (cw, uw):
            w.close()

    server = await asyncio.start_server(handle, *listen)
    if ready is not None:
        ready(server.sockets[0].getsockname()[:2])
    async with server:
        await (stop.wait() if stop is not None else asyncio.Event().wait())

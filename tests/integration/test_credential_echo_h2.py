"""Echoes as classes over HTTP/2 (issue 35 item 3): the gate in this process, a real HTTP/2
client over TLS through its socket, and an HTTP/2 upstream on loopback that echoes the
Authorization header it received - compressed without declaring it, in HTML escapes, or
split across server-sent events. Names map to 127.0.0.1 through the gate's static hosts."""

from __future__ import annotations

import asyncio
import gzip
import json
import ssl

import h2.config
import h2.connection
import h2.events

from tests.integration.test_gate_h2 import REAL, H2Client, _bearer_creds, _gate, _gate_ca, _records, ca, run  # noqa: F401


def _echo_upstream(cert, key):
    """An HTTP/2 upstream answering ``/gz`` (gzip, no Content-Encoding), ``/html`` (entities)
    and ``/sse`` (the token in 5 deltas) with the Authorization header it got."""

    async def serve(r, w):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        w.write(conn.data_to_send())
        heads: dict[int, dict] = {}
        while data := await r.read(65536):
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    heads[ev.stream_id] = {bytes(k): bytes(v) for k, v in ev.headers}
                if isinstance(ev, h2.events.StreamEnded) and ev.stream_id in heads:
                    hd = heads.pop(ev.stream_id)
                    auth = hd.get(b"authorization", b"").decode()
                    path = hd[b":path"]
                    if path == b"/v1/gz":
                        head = [(b":status", b"200"), (b"content-type", b"application/json")]
                        body = gzip.compress(json.dumps({"auth": auth}).encode())
                    elif path == b"/v1/html":
                        head = [(b":status", b"200"), (b"content-type", b"text/html")]
                        body = ("<p>token " + "".join(f"&#{ord(c)};" for c in auth) + "</p>").encode()
                    else:
                        head = [(b":status", b"200"), (b"content-type", b"text/event-stream")]
                        cuts = [len(auth) * i // 5 for i in range(6)]
                        body = b"".join(b"data: " + json.dumps({"choices": [{"delta": {"content": auth[a:b]}}]}).encode()
                                        + b"\n\n" for a, b in zip(cuts, cuts[1:]))
                    conn.send_headers(ev.stream_id, head)
                    for i in range(0, len(body), 7):  # small DATA frames
                        conn.send_data(ev.stream_id, body[i:i + 7])
                    conn.end_stream(ev.stream_id)
            w.write(conn.data_to_send())
            await w.drain()

    return serve


def test_echoes_over_http2_are_refused_scrubbed_or_cut(tmp_path, ca):
    creds, ph = _bearer_creds()

    async def go():
        sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        sctx.load_cert_chain(str(ca[1]), str(ca[2]))
        sctx.set_alpn_protocols(["h2"])
        srv = await asyncio.start_server(_echo_upstream(ca[1], ca[2]), "127.0.0.1", 0, ssl=sctx)
        port = srv.sockets[0].getsockname()[1]
        gate, ep, sock = await _gate(tmp_path, ca, port, creds=creds)
        c = await H2Client.open(sock, "h2.test", port, _gate_ca(tmp_path))
        assert c.alpn == "h2"
        auth = {"authorization": f"Bearer {ph}"}
        res = await c.requests([("GET", "/v1/gz", auth, b""), ("GET", "/v1/html", auth, b""),
                                ("GET", "/v1/sse", auth, b"")], authority=f"h2.test:{port}")
        c.close()
        await gate.close_endpoint("sbx-h2")
        srv.close()
        return res, _records(ep)

    (gz, page, sse), recs = run(go())
    # compressed without a Content-Encoding: refused before its head went out - a 502
    assert gz["status"] == 502 and gz["headers"].get("x-agentvm-denied") == "credential:uninspectable-body", gz
    # the value in HTML entities: replaced, the page intact
    assert page["status"] == 200 and page["ended"], page
    import html

    text = html.unescape(page["body"].decode())
    assert REAL not in text and text.startswith("<p>token Bearer sk-") and text.endswith("</p>"), text
    # the value in 5 deltas: the stream is cut before it is whole
    deltas = "".join(json.loads(ln[6:])["choices"][0]["delta"]["content"]
                     for ln in sse["body"].decode().split("\n") if ln.startswith("data: {"))
    assert REAL[3:] not in deltas and sse["reset"] is not None, sse
    for r in (gz, page, sse):
        assert REAL.encode() not in r["body"] and REAL[4:-4].encode() not in r["body"]
    rules = {r.get("rule") for r in recs}
    assert {"credential:uninspectable-body", "credential:echo-split"} <= rules, rules

"""Local stand-ins for the services a brokered credential talks to, on loopback - the same
peers agent-vm's tests use (tests/unit/test_brokers_peers.py): an OAuth 2 authorization server
built with Authlib, moto's server as AWS STS/S3, and a GitHub-shaped app-token endpoint.

    python3 peers.py KIND WORKDIR      (KIND: oauth2-refresh | aws-sts | github-app)

writes WORKDIR/ca/test-ca.pem (the upstream CA the gate trusts), WORKDIR/port (the HTTPS port the
sandbox talks to), WORKDIR/entry.json (0600: the vault entry - the long-lived secret) and, on
SIGTERM, WORKDIR/seen.txt: what the upstream saw, one line. Obviously fake values only."""

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.gate_upstreams import make_test_ca  # noqa: E402
from tests.unit.test_brokers_peers import (Moto, TlsFront, _Thread, github_entry, github_server,  # noqa: E402
                                           oauth_entry, oauth_server)


def main(kind: str, work: Path) -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (no access log on the terminal)
    ca, cert, key = make_test_ca(work / "ca")
    os.chmod(work / "ca", 0o755)
    stops, seen = [], []
    if kind == "oauth2-refresh":
        st, srv = oauth_server()
        tls = _Thread(srv.app, tls=(cert, key))
        stops += [srv.stop, tls.stop]
        entry, port = oauth_entry(st, srv.port), tls.port

        def report():
            minted = [a[7:] for a in st.seen_by_resource if a.startswith("Bearer ")]
            ok = minted and all(t in st.access_tokens for t in minted)
            rts = set(st.refresh_tokens)
            leaked = sum(t in a for a in st.seen_by_resource for t in rts)
            return (f"upstream saw: {len(minted)} request(s) with access token(s) minted by the gate's refresh grant"
                    f" ({'valid' if ok else 'INVALID'}), " + ("never the refresh token" if not leaked else "THE REFRESH TOKEN"))
    elif kind == "github-app":
        st, srv = github_server()
        tls = _Thread(srv.app, tls=(cert, key))
        stops += [srv.stop, tls.stop]
        entry, port = github_entry(st, srv.port), tls.port

        def report():
            toks = [a.split(" ", 1)[-1] for a in st.seen_by_api]
            scopes = sorted({json.dumps(st.issued[t]["repositories"]) for t in toks if t in st.issued})
            return (f"upstream saw: {len(toks)} request(s) with installation token(s) limited to {', '.join(scopes)}; "
                    f"the app's private key never (it signed a JWT in the gate)")
    elif kind == "aws-sts":
        moto = Moto(Moto.SETUP_ACTIONS)
        stops.append(moto.stop)
        setup = moto.setup()
        entry = {k: setup[k] for k in ("accessKeyId", "secretAccessKey", "region", "endpoint")}
        (work / "role").write_text(setup["roleArn"])

        class Front(TlsFront):  # records the access key id each signed request names
            def _serve(self, c):
                import socket as s_

                try:
                    t = self.ctx.wrap_socket(c, server_side=True)
                    u = s_.create_connection(("127.0.0.1", self.back))
                except OSError:
                    c.close()
                    return

                def up():
                    try:
                        while (d := t.recv(65536)):
                            seen.extend(re.findall(rb"Credential=([A-Z0-9]+)/", d))
                            u.sendall(d)
                    except OSError:
                        pass
                    finally:
                        u.close()

                threading.Thread(target=up, daemon=True).start()
                try:
                    while (d := u.recv(65536)):
                        t.sendall(d)
                except OSError:
                    pass
                finally:
                    t.close()

        front = Front(cert, key, moto.port)
        stops.append(front.stop)
        port = front.port

        def report():
            ids = sorted({x.decode() for x in seen})
            stored = setup["accessKeyId"] in ids
            kinds = "session credentials (ASIA...)" if ids and all(i.startswith("ASIA") for i in ids) else "OTHER keys"
            return (f"upstream saw: {len(seen)} signed request(s) with {kinds}, "
                    f"{'THE STORED KEY' if stored else 'never the stored key'} {setup['accessKeyId'][:4]}...")
    else:
        raise SystemExit(f"unknown kind {kind}")
    fd = os.open(work / "entry.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, json.dumps(entry).encode())
    os.close(fd)
    (work / "port").write_text(str(port))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: done.set())
    done.wait()
    (work / "seen.txt").write_text(report() + "\n")
    for stop in stops:
        stop()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))

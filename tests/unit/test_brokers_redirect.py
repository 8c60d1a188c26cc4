"""A broker never follows a redirect from its token endpoint: the request carries credentials
(Basic auth of the client, an app's JWT) that urllib would re-send to the Location's host.
Real loopback HTTP servers; the 3xx is a BrokerError with a clear reason."""

from __future__ import annotations

import http.server
import threading

import pytest

from agentvm.gate import brokers


@pytest.fixture
def servers():
    got: dict = {}

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            got["auth"] = self.headers.get("Authorization")
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"access_token": "fake-token"}')

        do_POST = do_GET  # noqa: N815

        def log_message(self, *a):
            pass

    collector = http.server.HTTPServer(("127.0.0.1", 0), Collector)

    class Issuer(http.server.BaseHTTPRequestHandler):
        code = 302

        def do_POST(self):  # noqa: N802
            self.send_response(Issuer.code)
            self.send_header("Location", f"http://127.0.0.1:{collector.server_port}/collect")
            self.end_headers()

        def log_message(self, *a):
            pass

    issuer = http.server.HTTPServer(("127.0.0.1", 0), Issuer)
    ts = [threading.Thread(target=s.serve_forever, daemon=True) for s in (collector, issuer)]
    for t in ts:
        t.start()
    try:
        yield issuer, Issuer, collector, got
    finally:
        for s in (collector, issuer):
            s.shutdown()
            s.server_close()


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_failure_and_the_credentials_go_nowhere_else(servers, code):
    issuer, handler, _collector, got = servers
    handler.code = code
    with pytest.raises(brokers.BrokerError) as ei:
        brokers._http("cred", "POST", f"http://127.0.0.1:{issuer.server_port}/token", data=b"grant_type=x",
                      headers={"Authorization": "Basic ZmFrZTpmYWtl"})
    assert f"redirect (HTTP {code})" in str(ei.value) and "never follows" in str(ei.value)
    assert "auth" not in got, "the redirect target received the request"


def test_a_direct_answer_still_works(servers):
    _issuer, _handler, collector, got = servers
    st, doc = brokers._http("cred", "POST", f"http://127.0.0.1:{collector.server_port}/token", data=b"x",
                            headers={"Authorization": "Basic ZmFrZTpmYWtl"})
    assert st == 200 and doc == {"access_token": "fake-token"} and got["auth"] == "Basic ZmFrZTpmYWtl"

"""Review 8, findings 1 and 4: deeply nested request bodies sent to the E2B API by a tenant.

* 1: a Connect request (envd) nested ~20,000 levels deep reached protobuf's native JSON parser,
  which recursed until the process died of SIGSEGV - the root daemon with every sandbox. Here the
  real ASGI app (``make_app`` over a fake backend) gets such bodies on every Connect method,
  unary and enveloped (streaming), JSON and binary (a Connect GET is refused with 405 before any
  decoding: no envd method is marked side-effect free); it runs in a child process so
  that a crash is a failed test (rc -11), not a dead pytest. Each must be a typed
  ``invalid_argument`` and the app must go on answering.
* 4: the REST routes' ``body_of`` answered deep JSON with a 500 (RecursionError): a typed 400.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentvm.e2b import envd

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "src" / "agentvm" / "e2b" / "_gen"


def _routes() -> list[tuple[str, str]]:
    """(path, kind) of every Connect method the generated services declare."""
    out = []
    for f in sorted(GEN.glob("*_connect.py")):
        out += re.findall(r'"(/[a-z]+\.[A-Za-z]+/[A-Za-z]+)": Endpoint\.([a-z_]+)', f.read_text())
    return out


CHILD = textwrap.dedent(r'''
    import json, struct, sys
    from starlette.testclient import TestClient
    from agentvm.e2b import app as e2bapp

    class Fake:
        async def create(self, name, spec_text, ttl): pass
        async def kill(self, name): pass

    routes = json.loads(sys.argv[1]); depth = int(sys.argv[2]); home = sys.argv[3]
    c = TestClient(e2bapp.make_app(Fake(), {"key-a": "a"}, home=home))
    r = c.post("/sandboxes", json={}, headers={"X-API-Key": "key-a"})
    assert r.status_code == 201, r.text
    sb = r.json()
    hdrs = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"],
            "Connect-Protocol-Version": "1"}
    deep_json = b"[" * depth + b"]" * depth
    deep_obj = b'{"a":' * depth + b"1" + b"}" * depth
    deep_group = bytes([15 << 3 | 3]) * depth + bytes([15 << 3 | 4]) * depth  # nested groups, field 15

    def stream_error(body):
        """The error of a Connect streaming answer (its end-of-stream envelope), or None."""
        i = 0
        while i + 5 <= len(body):
            flags, n = body[i], struct.unpack(">I", body[i + 1:i + 5])[0]
            msg = body[i + 5:i + 5 + n]
            i += 5 + n
            if flags & 2:
                return (json.loads(msg).get("error") or {}).get("code")
        return None

    out = []
    for path, kind in routes:
        for codec, payload in (("json", deep_json), ("json", deep_obj), ("proto", deep_group)):
            if kind == "unary":
                r = c.post(path, content=payload, headers={**hdrs, "Content-Type": f"application/{codec}"})
                try:
                    code = r.json().get("code")
                except ValueError:
                    code = None
                out.append([path, kind, codec, "POST", r.status_code, code])
            else:
                env = b"\0" + struct.pack(">I", len(payload)) + payload
                r = c.post(path, content=env, headers={**hdrs, "Content-Type": f"application/connect+{codec}"})
                out.append([path, kind, codec, "POST", r.status_code, stream_error(r.content)])
    # still answering afterwards
    r = c.post("/filesystem.Filesystem/RemoveWatcher", content=b'{"watcherId": "x"}',
               headers={**hdrs, "Content-Type": "application/json"})
    out.append(["after", "unary", "json", "POST", r.status_code, None])
    print(json.dumps(out))
''')


def _run_child(tmp_path, routes, depth: int) -> list:
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(routes), str(depth), str(tmp_path)],
                       capture_output=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, (f"the app's process ended with {p.returncode} (-11: SIGSEGV in the native parser)\n"
                               f"{p.stderr.decode()[-3000:]}")
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


def test_every_connect_method_refuses_deep_json_and_survives(tmp_path):
    routes = _routes()
    assert len(routes) >= 17 and {k for _, k in routes} >= {"unary", "server_stream", "client_stream"}
    results = _run_child(tmp_path, routes, 30000)
    *answers, after = results
    assert after[4] == 200, after  # the app goes on answering
    # every method, each codec and method of sending it, got a typed invalid_argument
    assert len(answers) == 3 * len(routes)
    # StreamInput is not implemented: it answers so before reading (so decoding) any message
    expected = {p: "unimplemented" if p == "/process.Process/StreamInput" else "invalid_argument" for p, _ in routes}
    wrong = [a for a in answers if a[5] != expected[a[0]] or (a[1] == "unary" and a[4] != 400)]
    assert not wrong, wrong


def test_nesting_within_the_limit_is_still_decoded(tmp_path):
    """The bound refuses only what nests past MAX_JSON_DEPTH: an E2B SDK's messages pass."""
    from agentvm.e2b._gen import filesystem_pb as fpb
    from agentvm.e2b._gen import process_pb as ppb

    codec = envd.BoundedJSONCodec()
    m = codec.decode(b'{"path": "/a[{\\"b\\"", "unknown": [[[[{"x": "]]]]"}]]]]}', fpb.StatRequest)
    assert m.path == '/a[{"b"'
    req = ppb.StartRequest(process=ppb.ProcessConfig(cmd="/bin/sh", args=["-c", "echo [{"], envs={"A": "}]"}))
    assert codec.decode(codec.encode(req), ppb.StartRequest) == req
    d = envd.MAX_JSON_DEPTH
    ok = b'{"path": "x", "u": ' + b"[" * (d - 1) + b"]" * (d - 1) + b"}"
    assert envd.json_depth(ok) == d
    assert codec.decode(ok, fpb.StatRequest).path == "x"
    over = b'{"path": "x", "u": ' + b"[" * d + b"]" * d + b"}"
    with pytest.raises(Exception) as ei:
        codec.decode(over, fpb.StatRequest)
    assert getattr(ei.value, "code", None) is not None and ei.value.code.value == "invalid_argument"
    assert str(d) in str(ei.value)


@pytest.mark.parametrize("text,depth", [
    (b"", 0), (b"1", 0), (b"[]", 1), (b'{"a": [1, {"b": []}]}', 4), (b'"[[[["', 0),
    (b'["\\"[", "\\\\", [{}]]', 3), (b'[' * 65 + b']' * 65, 65), (b'[{' * 40 + b'}]' * 40, 80),
])
def test_json_depth_skips_strings(text, depth):
    assert min(envd.json_depth(text), envd.MAX_JSON_DEPTH + 1) == min(depth, envd.MAX_JSON_DEPTH + 1)


def test_binary_messages_bounded_and_typed():
    from agentvm.e2b._gen import filesystem_pb as fpb

    codec = envd.BoundedProtoCodec()
    deep = bytes([15 << 3 | 3]) * 100000 + bytes([15 << 3 | 4]) * 100000
    with pytest.raises(Exception) as ei:
        codec.decode(deep, fpb.StatRequest)
    assert ei.value.code.value == "invalid_argument"
    assert codec.decode(fpb.StatRequest(path="/x").to_binary(), fpb.StatRequest).path == "/x"


def test_rest_deep_json_is_a_typed_400(tmp_path):
    """Finding 4: every REST route with a body answers deep JSON with 400 e2b.bad-request."""
    from starlette.testclient import TestClient

    from agentvm.e2b import app as e2bapp

    class Fake:
        async def create(self, name, spec_text, ttl):
            pass

        async def kill(self, name):
            pass

        async def resume(self, name):
            pass

    c = TestClient(e2bapp.make_app(Fake(), {"key-a": "a"}, home=tmp_path), raise_server_exceptions=False)
    h = {"X-API-Key": "key-a", "Content-Type": "application/json"}
    sid = c.post("/sandboxes", json={}, headers=h).json()["sandboxID"]
    deep = b"[" * 100000 + b"]" * 100000
    for path in ("/sandboxes", "/v2/sandboxes", f"/sandboxes/{sid}/timeout", f"/sandboxes/{sid}/refreshes",
                 f"/sandboxes/{sid}/connect", f"/v2/sandboxes/{sid}/connect", f"/sandboxes/{sid}/resume"):
        r = c.post(path, content=deep, headers=h)
        assert r.status_code == 400, (path, r.status_code, r.text[:300])
        assert "e2b.bad-request" in r.json()["message"] and "nest" in r.json()["message"], r.text
    assert c.get(f"/sandboxes/{sid}", headers=h).status_code == 200

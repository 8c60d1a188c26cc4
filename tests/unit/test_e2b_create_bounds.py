"""Review 8, findings 3 and 6: what one E2B create may make the daemon do, bounded first.

* 3: ``allowOut`` with 20,000 hosts (a 300 KB body) held the daemon's event loop 2.5 s compiling
  a spec that was then refused, before any quota was counted. Now the create's lists and maps
  have caps (400 naming the cap, before any work), a tenant past its quota is refused before
  its spec is compiled, and the compilation runs in a thread, off the loop.
* 6: an ``envVars`` value over 128 KiB was accepted and the sandbox's start failed with E2BIG
  for ever (restarted with back-off). Now it is a 400 naming the kernel's limit - the limit
  itself checked against a real ``execve`` here.

On the adapter's real code (``make_app``) over a fake backend.
"""

from __future__ import annotations

import subprocess
import threading

import pytest

from agentvm.e2b import app as e2bapp
from agentvm.e2b import templates as tpls

WILD = """\
apiVersion: agentvm/v1
kind: Agent
metadata: {name: wild}
spec:
  egress:
    allow:
      - {host: "*.x.test"}
"""


class Fake:
    def __init__(self):
        self.created = []

    async def create(self, name, spec_text, ttl):
        self.created.append(spec_text)

    async def kill(self, name):
        pass


def _client(tmp_path, **kw):
    from starlette.testclient import TestClient

    backend = Fake()
    records = []
    app = e2bapp.make_app(backend, {"key-a": "a", "key-b": "b"}, home=tmp_path,
                          audit=lambda kind, **d: records.append((kind, d)), **kw)
    (tmp_path / "wild.yaml").write_text(WILD)
    tpls.add(tmp_path / "wild.yaml", "wild", home=tmp_path, tenant="a")
    return TestClient(app), backend, records


def _create(c, body, key="key-a"):
    return c.post("/sandboxes", json=body, headers={"X-API-Key": key})


def _refused(r, *words):
    assert r.status_code == 400, (r.status_code, r.text[:300])
    msg = r.json()["message"]
    assert "e2b.bad-request" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_network_lists_are_capped_before_any_work(tmp_path, monkeypatch):
    c, backend, _ = _client(tmp_path)
    compiled = []
    real = tpls.sandbox_spec
    monkeypatch.setattr(tpls, "sandbox_spec", lambda *a: compiled.append(1) or real(*a))
    n = e2bapp.MAX_NETWORK_ENTRIES
    ok = [f"h{i}.x.test" for i in range(n)]
    assert _create(c, {"templateID": "wild", "network": {"allowOut": ok}}).status_code == 201
    assert len(compiled) == 1
    for field in ("allowOut", "denyOut"):
        r = _create(c, {"templateID": "wild", "network": {field: ok + ["one.more.x.test"]}})
        _refused(r, f"network.{field}", str(n + 1), f"at most {n}")
    _refused(_create(c, {"templateID": "wild", "network": {"allowOut": ["a" * 300 + ".x.test"]}}),
             "at most 255")
    # the review's body: 20,000 hosts under the template's wildcard
    r = _create(c, {"templateID": "wild", "network": {"allowOut": [f"h{i}.x.test" for i in range(20000)]}})
    _refused(r, "20000 entries")
    assert len(compiled) == 1 and len(backend.created) == 1  # none of the refused ones was compiled


def test_metadata_and_env_counts_are_capped(tmp_path):
    c, backend, _ = _client(tmp_path)
    md = {f"k{i}": "v" for i in range(e2bapp.MAX_METADATA_ENTRIES + 1)}
    _refused(_create(c, {"metadata": md}), "metadata", f"at most {e2bapp.MAX_METADATA_ENTRIES}")
    _refused(_create(c, {"metadata": {"k": "v" * (e2bapp.MAX_METADATA_VALUE + 1)}}), "metadata")
    _refused(_create(c, {"metadata": {"k" * (e2bapp.MAX_METADATA_KEY + 1): "v"}}), "metadata")
    envs = {f"V{i}": "x" for i in range(e2bapp.MAX_ENV_VARS + 1)}
    _refused(_create(c, {"envVars": envs}), "envVars", f"at most {e2bapp.MAX_ENV_VARS}")
    assert backend.created == []
    ok = {"metadata": {f"k{i}": "v" * 100 for i in range(e2bapp.MAX_METADATA_ENTRIES)},
          "envVars": {f"V{i}": "x" * 100 for i in range(e2bapp.MAX_ENV_VARS)}}
    assert _create(c, ok).status_code == 201


def _execs(env_string: bytes) -> bool:
    """Whether the kernel execs /bin/true with ``env_string`` (NAME=value) as its environment."""
    name, _, value = env_string.partition(b"=")
    try:
        subprocess.run(["/bin/true"], env={name: value}, check=True, timeout=30)
        return True
    except OSError as exc:
        assert exc.errno == 7, exc  # E2BIG
        return False


def test_env_strings_the_kernel_cannot_exec_are_refused(tmp_path):
    c, backend, _ = _client(tmp_path)
    most = e2bapp.MAX_ENV_STRING - 1  # bytes of NAME=value (its NUL makes MAX_ENV_STRING)
    largest = {"X": "y" * (most - 2)}
    # the limit is the kernel's: the largest string accepted execs, one byte more does not
    assert _execs(b"X=" + b"y" * (most - 2))
    assert not _execs(b"X=" + b"y" * (most - 1))
    assert _create(c, {"envVars": largest}).status_code == 201
    r = _create(c, {"envVars": {"X": "y" * (most - 1)}})
    _refused(r, "128 KiB", str(most))
    _refused(_create(c, {"envVars": {"X": "y" * 900000}}), "128 KiB")  # the review's value
    # multi-byte characters count as their UTF-8 bytes
    _refused(_create(c, {"envVars": {"X": "\u00e9" * (most // 2)}}), "128 KiB")
    # the whole environment: under 1 MiB (each string within its own limit); the body itself
    # is at most 1 MiB, so the total is checked directly
    big = {f"V{i}": "z" * 100000 for i in range(11)}
    with pytest.raises(Exception) as ei:
        e2bapp._create_request({"envVars": big})
    assert "1 MiB" in str(ei.value) and getattr(ei.value, "code", "") == "e2b.bad-request"
    assert len(backend.created) == 1


def test_quota_is_counted_before_the_spec_is_compiled_and_compiling_is_off_the_loop(tmp_path, monkeypatch):
    c, backend, _ = _client(tmp_path, max_per_tenant=2)
    threads = []
    real = tpls.sandbox_spec

    def spy(*a):
        import asyncio

        try:  # on the thread running the app's event loop there is a running loop
            asyncio.get_running_loop()
            threads.append("on the loop")
        except RuntimeError:
            threads.append(threading.current_thread())
        return real(*a)

    monkeypatch.setattr(tpls, "sandbox_spec", spy)
    assert _create(c, {}).status_code == 201
    assert _create(c, {}).status_code == 201
    assert len(threads) == 2
    # compiled in a worker thread, not on the thread running the app's event loop
    assert all(isinstance(t, threading.Thread) and t is not threading.main_thread() for t in threads), threads
    r = _create(c, {"templateID": "wild", "network": {"allowOut": ["a.x.test"]}})
    assert r.status_code == 429 and r.headers.get("Should-Retry") == "false"
    assert len(threads) == 2  # refused by the quota without compiling anything
    assert _create(c, {}, key="key-b").status_code == 201  # another tenant's quota is its own


def test_the_create_record_says_how_the_network_was_narrowed(tmp_path):
    c, _, records = _client(tmp_path)
    assert _create(c, {"templateID": "wild", "network": {"allowOut": ["a.x.test"], "denyOut": ["b.x.test"]}}
                   ).status_code == 201
    kind, data = [r for r in records if r[0] == "e2b.create"][-1]
    assert data["allow_out"] == ["a.x.test"] and data["deny_out"] == ["b.x.test"]

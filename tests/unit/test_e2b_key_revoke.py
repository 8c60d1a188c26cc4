"""Review 8, finding 7: an API key removed from ``<home>/e2b/api-keys.json`` stopped working
only at the daemon's next start (the keys were cached; the file was read again only for an
unknown key). The adapter now reads the file again whenever it changed (inode, mtime, size),
so a removed key is refused from the next request on - the daemon's own key source
(``agentvm.e2b.api_keys(home, create=False)``), the real file, the real app."""

from __future__ import annotations

import json
import os

from agentvm import e2b as pkg
from agentvm.e2b import app as e2bapp


class Fake:
    async def create(self, name, spec_text, ttl):
        pass

    async def kill(self, name):
        pass


def test_a_removed_key_is_refused_without_a_restart(tmp_path):
    from starlette.testclient import TestClient

    alice = pkg.api_keys(tmp_path)  # the default tenant's key, made on first use
    bob = pkg.add_tenant("bob", tmp_path)
    app = e2bapp.make_app(Fake(), lambda: pkg.api_keys(tmp_path, create=False), home=tmp_path)
    c = TestClient(app)
    (key_a,) = alice
    assert c.get("/v2/sandboxes", headers={"X-API-Key": bob}).status_code == 200
    assert c.get("/v2/sandboxes", headers={"X-API-Key": key_a}).status_code == 200
    # the operator removes bob's key (as the reviewer did: the file rewritten without it)
    f = pkg.state_dir(tmp_path) / "api-keys.json"
    keys = json.loads(f.read_text())
    del keys[bob]
    pkg._write_keys(f, keys)
    assert c.get("/v2/sandboxes", headers={"X-API-Key": bob}).status_code == 401
    assert c.post("/sandboxes", json={}, headers={"X-API-Key": bob}).status_code == 401
    assert c.get("/v2/sandboxes", headers={"X-API-Key": key_a}).status_code == 200
    # edited in place (same inode): seen too
    with open(f, "r+") as fh:
        fh.seek(0)
        fh.write(json.dumps({}))
        fh.truncate()
    os.utime(f, ns=(1, 1))
    assert c.get("/v2/sandboxes", headers={"X-API-Key": key_a}).status_code == 401
    # a file that does not parse: every key refused (not a 500)
    f.write_text("{not json")
    assert c.get("/v2/sandboxes", headers={"X-API-Key": key_a}).status_code == 401
    # and a key added later still works at once
    f.unlink()
    new = pkg.add_tenant("carol", tmp_path)
    assert c.get("/v2/sandboxes", headers={"X-API-Key": new}).status_code == 200

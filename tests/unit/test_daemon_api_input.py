"""The daemon's API input is typed (``agentvm.daemon.api``): a wrong JSON type, an unknown
field or a string where a list is expected is a 400 ``config.invalid`` naming the field
(exit 78 on the CLI), never a 500 with a traceback, and never a string run as a list of
characters. The API is published as OpenAPI, generated from the same models."""

from __future__ import annotations

import json
import logging

import pytest

from agentvm.daemon import api
from agentvm.daemon.client import ApiFailure
from tests.unit.test_daemon_fake import d, spec  # noqa: F401 (d: the fake-backend daemon fixture)


def fail(d, method, path, doc) -> ApiFailure:
    with pytest.raises(ApiFailure) as e:
        d.client.request(method, path, doc)
    return e.value


# the inputs the review found answered with 500s (or run wrongly), and their neighbours
BAD = [
    ("POST", "/v1/fleet/plan", {"commit": 5}, {"repo", "commit"}),
    ("POST", "/v1/fleet/plan", {"repo": "/x", "replay": [1]}, {"replay"}),
    ("POST", "/v1/fleet/apply", {"repo": "/x", "commit": ["a"]}, {"commit"}),
    ("POST", "/v1/run", {"argv": 5, "mounts": "x"}, {"argv", "mounts"}),
    ("POST", "/v1/run", {"command": ["true"], "timeout": "abc", "memory": [1]}, {"timeout", "memory"}),
    ("POST", "/v1/run", {"command": "true"}, {"command"}),
    ("POST", "/v1/run", {"command": ["true"], "mounts": [{"host": "/tmp"}]}, {"mounts.0.path"}),
    ("POST", "/v1/run", {"command": ["true"], "stdin": "not base64!"}, {"stdin"}),
    ("POST", "/v1/run", {"command": ["true"], "cli": {"timeout": 5}}, {"cli.timeout"}),
    ("POST", "/v1/run", {"command": ["true"], "timeout": float("inf")}, {"timeout"}),
    ("POST", "/v1/sandboxes", {"spec": 5}, {"spec"}),
    ("POST", "/v1/sandboxes", {"spec": "x", "ttl": "1h"}, {"ttl"}),
    ("POST", "/v1/sandboxes", {"spec": "x", "ttl": True}, {"ttl"}),
    ("POST", "/v1/sandboxes/w/exec", {"argv": "ls"}, {"argv"}),
    ("POST", "/v1/sandboxes/w/exec", {"argv": []}, {"argv"}),
    ("POST", "/v1/sandboxes/w/policy", {"op": "allow", "rule": 5}, {"rule"}),
    ("POST", "/v1/sandboxes/w/policy", {"op": "budget", "tokens": 1.5}, {"tokens"}),
    ("POST", "/v1/sandboxes/w/policy", {"op": "budget", "tokens": "9"}, {"tokens"}),
    ("POST", "/v1/sandboxes/w/policy", {"op": "tools", "action": "allow", "tool": ["x"]}, {"tool"}),
    ("POST", "/v1/sandboxes/w/policy", {"op": "limits", "pids": -1}, {"pids"}),
    ("POST", "/v1/sandboxes/w/start", {"force": True}, {"force"}),
    ("POST", "/v1/approvals/x/approve", {"note": 7}, {"note"}),
]


@pytest.mark.parametrize("method,path,doc,fields", BAD, ids=[f"{b[1]} {json.dumps(b[2])[:40]}" for b in BAD])
def test_wrong_types_are_a_400_naming_the_field(d, method, path, doc, fields, caplog):
    caplog.set_level(logging.ERROR)
    e = fail(d, method, path, doc)
    assert (e.status, e.code, e.exit_code) == (400, "config.invalid", 78), e.message
    for f in fields:
        assert f"  {f}: " in e.message, e.message
    assert "Traceback" not in caplog.text and "internal error" not in caplog.text


def test_an_unknown_op_lists_the_ops(d):
    d.client.create(spec("w"), "w.yaml")
    e = fail(d, "POST", "/v1/sandboxes/w/policy", {"op": "nope"})
    assert e.status == 400 and "'show', 'allow'" in e.message


def test_the_wire_error_carries_every_problem(d):
    c, r = d.client._send("POST", "/v1/run", json.dumps({"command": "x", "bogus": 1}).encode(), "application/json")
    doc = json.loads(r.read())
    c.close()
    assert r.status == 400 and doc["error"] == "config.invalid" and doc["exit_code"] == 78
    assert {p["field"] for p in doc["problems"]} == {"command", "bogus"}
    assert "openapi.json" in doc["hint"]


def test_valid_requests_still_work_and_defaults_hold(d):
    c = d.client
    row = c.create(spec("w"), "w.yaml", ttl=60)
    assert row["name"] == "w"
    assert c.action("w", "start")["state"] == "running"
    assert c.policy("w", "allow", rule="example.org")["applied"]
    assert c.policy("w", "show")["paused"] is False


def test_bad_query_values_are_a_400(d):
    d.client.create(spec("w"), "w.yaml")
    e = fail(d, "GET", "/v1/sandboxes/w/logs?tail=lots", None)
    assert e.status == 400 and "tail" in e.message
    e = fail(d, "GET", "/v1/approvals?all=maybe", None)
    assert e.status == 400 and "all" in e.message


def test_openapi_is_served_and_generated_from_the_models(d):
    doc = d.client.request("GET", "/v1/openapi.json")
    assert doc["openapi"].startswith("3.1")
    run = doc["paths"]["/v1/run"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert run == {"$ref": "#/components/schemas/Run"}
    props = doc["components"]["schemas"]["Run"]["properties"]
    assert props["command"]["anyOf"][0]["type"] == "array"
    assert doc["components"]["schemas"]["Run"]["additionalProperties"] is False
    assert "PolicyChange" in doc["components"]["schemas"]
    # every route the daemon serves is described (and nothing it does not serve)
    assert set(doc["paths"]) == {r[1] for r in api.ROUTES}


def test_routes_table_and_dispatch_agree():
    from agentvm.daemon.router import body_model as _body_model
    from agentvm.daemon.router import query_model as _query_model

    for method, path, body, query, _answers, _summary in api.ROUTES:
        p = [x if not x.startswith("{") else "n" for x in path.split("/")[2:]]
        if path == "/metrics":
            continue
        want_body = body if body not in (None, "bytes") else None
        assert _body_model(method, p) is want_body, (method, path)
        assert _query_model(method, p) is query, (method, path)


def test_a_huge_body_of_wrong_values_is_one_short_answer():
    # a dict per wrong value would cost the daemon memory in proportion to what a client sent
    doc = {"command": ["x"], "env": {f"k{i}": i for i in range(20_000)}}
    with pytest.raises(api.ApiInputError) as e:
        api.parse(api.Run, doc)
    assert len(e.value.problems) == 1 and "20000 values are wrong" in e.value.message
    with pytest.raises(api.ApiInputError) as e:
        api.parse(api.Run, {"command": ["x"], "env": {f"k{i}": "v" for i in range(5000)}})
    assert "at most 4096 items" in e.value.message


def test_an_api_approval_can_be_bound_to_the_digest_it_was_shown(d, tmp_path):
    from agentvm.approvals import open_store

    store = open_store(d.paths)
    req = store.submit(kind="tool", sandbox="w", agent="w", target="gh__delete_repo", summary={"keys": ["repo"]},
                       arg_digest="sha256:" + "1" * 64, policy="sha256:p", timeout=60)
    e = fail(d, "POST", f"/v1/approvals/{req.id}/approve", {"digest": "sha256:" + "0" * 64})
    assert e.status == 409 and e.code == "approvals.digest-mismatch"
    assert d.client.request("GET", f"/v1/approvals/{req.id}")["state"] == "pending"
    ok = d.client.request("POST", f"/v1/approvals/{req.id}/approve", {"digest": req.digest, "note": "seen"})
    assert ok["state"] == "approved"

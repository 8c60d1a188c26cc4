"""quick_init: the hot path's frozen dataclasses keep their signature, defaults and frozen-ness."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from agentvm.gate.frozen import evolve, quick_init
from agentvm.gate.h1 import ProxyRequest
from agentvm.gate.exchange import Forward
from agentvm.gate.policy import Decision, RequestMeta

QUICK = [ProxyRequest, RequestMeta, Decision, Forward]


@pytest.mark.parametrize("cls", QUICK)
def test_the_quick_init_takes_the_same_arguments_and_gives_the_same_object(cls):
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
                                           for f in fields]
    values = {f.name: f"v{i}" for i, f in enumerate(fields)}
    obj = cls(**values)
    assert dataclasses.asdict(obj) == values and obj == cls(*values.values()) and hash(obj) == hash(cls(**values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, fields[0].name, "other")
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(obj, fields[0].name)
    for how in (dataclasses.replace, evolve):
        changed = how(obj, **{fields[-1].name: "new"})
        assert type(changed) is cls and getattr(changed, fields[-1].name) == "new"
        assert getattr(obj, fields[-1].name) == values[fields[-1].name]
        assert dataclasses.asdict(changed) == {**values, fields[-1].name: "new"}
    with pytest.raises(TypeError):
        evolve(obj, no_such_field=1)


def test_quick_init_refuses_what_it_would_get_wrong():
    @dataclasses.dataclass
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slots:
        a: int

    @dataclasses.dataclass(frozen=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Post:
        a: int

        def __post_init__(self):
            pass

    @dataclasses.dataclass(frozen=True)
    class Clash:
        _quick_init_fields: int

    @dataclasses.dataclass(frozen=True)
    class D:  # "d" was the local name once: a field called d held the instance's own dict
        a: int
        d: int

    assert quick_init(D)(1, 7).d == 7
    for cls in (NotFrozen, Slots, Factory, Post, Clash):
        with pytest.raises(TypeError):
            quick_init(cls)


@pytest.mark.parametrize("cls", QUICK)
def test_make_takes_every_field_in_order_and_gives_the_object_the_class_call_gives(cls):
    """``cls.make`` (the hot path's positional builder) is the class call without its cost: the
    same parameters and defaults, and an instance equal to, and as frozen as, ``cls(...)``."""
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.make).parameters.values())
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
                                           for f in fields]
    values = {f.name: f"v{i}" for i, f in enumerate(fields)}
    made, called = cls.make(*values.values()), cls(**values)
    assert type(made) is cls and made == called and vars(made) == vars(called) == values
    assert list(vars(made)) == [f.name for f in fields]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, fields[0].name, "other")
    required = [f for f in fields if f.default is dataclasses.MISSING]
    assert cls.make(*[values[f.name] for f in required]) == cls(**{f.name: values[f.name] for f in required})
    with pytest.raises(TypeError):
        cls.make(*values.values(), "one too many")


def test_the_hot_paths_build_what_the_class_call_builds():
    """The places that build per request with ``make``: a parsed head, its RequestMeta (when the
    policy's memo misses) and its Forward equal what the keyword class calls give."""
    from agentvm.gate import exchange, h1
    from agentvm.gate.policy import compile_egress, normalize_host
    from types import SimpleNamespace

    req, _ = h1.parse_head(b"POST http://x.test:8080/a?b HTTP/1.1\r\nHost: x.test:8080\r\nContent-Length: 3\r\n"
                           b"Upgrade: websocket\r\n\r\n")
    assert req == ProxyRequest(method="POST", target="http://x.test:8080/a?b", scheme="http", host="x.test", port=8080,
                               path="/a?b", headers=req.headers, content_length=3, chunked=False,
                               upgrade_websocket=True, http_version="1.1", explicit_port=True)
    pol = compile_egress(SimpleNamespace(allow=[SimpleNamespace(host="x.test", ports=[8080], websocket=True)], deny=[],
                                         hosts={"x.test": "127.0.0.1"}))
    from agentvm.gate import policy as gp

    seen = []
    real_decide = gp._decide
    ep = SimpleNamespace(paused=False, bucket=SimpleNamespace(take=lambda: True), tools=None, policy=pol, creds=None,
                         budget=None)
    try:  # (the RequestMeta is built where the policy's memo misses: a new policy's first request)
        gp._decide = lambda meta, policy: seen.append(meta) or real_decide(meta, policy)
        flow = exchange.request(ep, req, scheme="http")
        fwd = next(flow)
        assert next(exchange.request(ep, req, scheme="http")) == fwd and len(seen) == 1  # (the second: remembered)
    finally:
        gp._decide = real_decide
    assert seen == [RequestMeta(host="x.test", port=8080, scheme="http", method="POST", path="/a?b", body_size=3,
                                sni=None, websocket=True, phase="request")]
    assert fwd == Forward(req=req, decision=fwd.decision, addr="127.0.0.1", scheme="http", sni=None, swap=None,
                          max_body=fwd.decision.max_body, shown=None, budget=None)
    assert fwd.decision.allowed and normalize_host(fwd.req.host) == "x.test"

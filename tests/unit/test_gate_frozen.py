"""quick_init: the hot path's frozen dataclasses keep their signature, defaults and frozen-ness."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from agentvm.gate.frozen import evolve, quick_init
from agentvm.gate.h1 import ProxyRequest
from agentvm.gate.policy import Decision, RequestMeta


@pytest.mark.parametrize("cls", [ProxyRequest, RequestMeta, Decision])
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

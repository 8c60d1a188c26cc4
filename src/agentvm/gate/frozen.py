"""A quicker ``__init__`` for the frozen dataclasses built once per request on the gate's
hot path (``ProxyRequest``, ``RequestMeta``, ``Decision``).

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__``:
about 0.1 us a field, several microseconds a request. The one built here stores the fields
straight into the instance's ``__dict__`` - same signature, same defaults - and the instance
stays exactly as frozen (assigning or deleting a field still raises ``FrozenInstanceError``;
``dataclasses.replace`` goes through this ``__init__``). ``cls.make(*fields)`` builds the same
instance from all its fields given positionally, without the class call: for the one or two
places per class that build one per request."""

from __future__ import annotations

import dataclasses


_LOCAL = "_quick_init_fields"  # the generated __init__'s one local name (no field may take it)
_RESERVED = ("self", _LOCAL, "_quick_cls", "_quick_new")  # names the generated functions use


def quick_init(cls):
    """Class decorator, applied above ``@dataclass(frozen=True)``: replaces its ``__init__``."""
    params, body, defaults = [], [], {}
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen or hasattr(cls, "__slots__") \
            or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init is for frozen dataclasses with a __dict__ and no __post_init__")
    for f in dataclasses.fields(cls):
        if f.name in _RESERVED:
            raise TypeError(f"{cls.__name__}.{f.name}: a field name the generated __init__ uses itself")
        if not f.init or f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes plain fields and plain defaults only")
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        body.append(f"    {_LOCAL}[{f.name!r}] = {f.name}")
    src = f"def __init__(self, {', '.join(params)}):\n    {_LOCAL} = self.__dict__\n" + "\n".join(body) + "\n"
    # make: the same instance from every field, positionally, in declaration order, without the
    # class call (type call -> __init__ lookup -> keyword matching: most of an instance's cost)
    src += (f"def make({', '.join(params)}):\n    self = _quick_new(_quick_cls)\n    {_LOCAL} = self.__dict__\n"
            + "\n".join(body) + "\n    return self\n")
    ns: dict = {}
    exec(src, {**defaults, "_quick_new": object.__new__, "_quick_cls": cls}, ns)  # noqa: S102 - field
    # names of our own dataclasses, as dataclasses itself does
    init = ns["__init__"]
    make = ns["make"]
    make.__qualname__ = f"{cls.__qualname__}.make"
    make.__module__ = cls.__module__
    cls.make = staticmethod(make)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.quick_init = True  # (evolve relies on it: the instance dict holds exactly the fields)
    cls.__init__ = init
    return cls


def evolve(obj, **changes):
    """``dataclasses.replace`` for an instance of a :func:`quick_init` class, without the
    field introspection replace does on every call (its ``__dict__`` holds exactly its fields)."""
    cls = type(obj)
    if not getattr(cls.__init__, "quick_init", False):  # not one of ours: the general way
        return dataclasses.replace(obj, **changes)
    return cls(**{**obj.__dict__, **changes})

"""`agentvm run`'s command-line overrides, parsed the same way wherever the run happens.

The CLI sends the raw strings to the daemon when one is up (the thin client imports nothing
it does not need); the embedded path and the daemon both turn them into the keyword
arguments of ``policy.with_overrides`` here.
"""

from __future__ import annotations

from agentvm.errors import ConfigError

FIELDS = ("mounts", "env", "timeout", "memory", "allow", "add_host", "network", "substrate", "image")


def parse_env(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise ConfigError(f"invalid --env {v!r}", hint="use --env NAME=VALUE")
        out[k] = val
    return out


def parse_hosts(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, ip = v.partition("=")
        if not sep or not name or not ip:
            raise ConfigError(f"invalid --add-host {v!r}", hint="use --add-host NAME=IP")
        out[name] = ip
    return out


def from_cli(raw: dict, command: list[str] | None) -> dict:
    """``raw``: the option strings as typed (``FIELDS``); returns ``with_overrides`` kwargs."""
    from agentvm.policy import parse_mount_arg
    from agentvm.units import parse_duration, parse_size

    def strings(key: str) -> list[str]:
        v = raw.get(key) or []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ConfigError(f"--{key.replace('_', '-')} values must be strings")
        return v

    def one(key: str) -> str | None:
        v = raw.get(key)
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"--{key} must be a string")
        return v

    try:
        t = parse_duration(one("timeout")) if one("timeout") is not None else None
        m = parse_size(one("memory")) if one("memory") is not None else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if command is not None and (not isinstance(command, list) or not all(isinstance(a, str) for a in command)):
        raise ConfigError("the command must be a list of strings")
    return dict(
        command=tuple(command or ()) or None,
        mounts=tuple(parse_mount_arg(x) for x in strings("mounts")),
        env=parse_env(strings("env")),
        timeout=t,
        memory=m,
        allow=tuple(strings("allow")),
        hosts=parse_hosts(strings("add_host")),
        network=one("network"),
        substrate=one("substrate"),
        image=one("image"),
    )

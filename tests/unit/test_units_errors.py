import pytest

from agentvm import errors
from agentvm.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("256M", 256 * 1024**2), ("2G", 2 * 1024**3), ("1k", 1024), ("512", 512), (4096, 4096), ("1.5G", int(1.5 * 1024**3)),
     ("64MiB", 64 * 1024**2), ("10 M", 10 * 1024**2)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "-1M", "1X", "M", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize(
    "text,expected",
    [("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), ("2", 2.0), (1.5, 1.5), ("1d", 86400.0)],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "5x", "m5", "1h 30m", "-3s", "s", False])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_roundtrip():
    assert format_size(256 * 1024**2) == "256M"
    assert format_size(1000) == "1000"
    assert format_duration(300) == "5m"
    assert format_duration(1.5) == "1.5s"


def test_error_tree_exit_codes_and_codes_are_stable():
    assert errors.SpecError("x").exit_code == errors.EXIT_CONFIG == 78
    assert errors.PrimitiveMissing("x").exit_code == errors.EXIT_POLICY == 77
    assert errors.PolicyDenied("x").exit_code == 77
    assert errors.LaunchError("cgroup", "boom").exit_code == errors.EXIT_BACKEND == 125
    assert errors.EXIT_TIMEOUT == 124
    e = errors.LaunchError("cgroup", "boom", hint="h")
    d = e.to_dict()
    assert d["step"] == "cgroup" and d["error"] == "backend.launch-failed" and d["hint"] == "h"
    assert "cgroup" in e.message
    assert isinstance(errors.PrimitiveMissing("x"), errors.HostEnvironmentError)
    assert isinstance(errors.SpecError("x"), errors.ConfigError)


def test_spec_error_lists_located_problems():
    p = errors.SpecProblem("a.yaml", 7, "spec.limits.memory", "bad size")
    e = errors.SpecError("invalid agent", problems=[p])
    assert "a.yaml:7: spec.limits.memory: bad size" in e.message
    assert e.to_dict()["problems"][0]["line"] == 7


def test_cli_durations_and_times_use_the_one_parser():
    import time

    import click

    from agentvm.cli.daemon_cmds import _duration, _since
    from agentvm.units import parse_since

    assert _duration().convert("5m", None, None) == 300.0 and _duration().convert("90", None, None) == 90.0
    with pytest.raises(click.BadParameter):
        _duration().convert("soon", None, None)
    assert abs(_since().convert("1m", None, None) - (time.time() - 60)) < 5
    assert parse_since("1763740000") == 1763740000.0
    assert parse_since("2026-11-23T00:00:00+00:00") == 1795392000.0
    with pytest.raises(ValueError):
        parse_since("nan")

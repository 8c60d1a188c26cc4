"""The workspace pool's rules as data (agentvm.wspool): the admission arithmetic (what running
agents may still write, the overcommit factor, growth before refusal), the operator's settings,
and which backend new workspaces get. The pool for real is tests/integration/test_wspool.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentvm import workspace, wspool
from agentvm.errors import ConfigError, PolicyDenied

M = 1 << 20


class FakePool(wspool.Pool):
    """The admission rule over made-up numbers: entries, free space, host room; growth adds."""

    def __init__(self, entries: dict[str, tuple[int, int]], size: int, free: int, room: int, exists: bool = True):
        super().__init__(Path("/nonexistent/ws"), Path("/nonexistent/run"))
        self._e, self._size, self._free, self._room, self._exists = entries, size, free, room, exists
        self.grown: list[int] = []
        self.made = self.torn = False

    def exists(self):
        return self._exists

    def _create(self, size=wspool.INITIAL):
        self._exists, self.made, self._size, self._free = True, True, size, size - 12 * M

    def ensure(self, *, create):
        return True

    def names(self):
        return sorted(self._e)

    def entry(self, name):
        if name not in self._e:
            return None
        lim, used = self._e[name]
        return wspool.Entry(name, lim, used, 0.0, 256)

    def space(self):
        return self._size, self._free

    def host_room(self):
        return self._room, self._room + 10 * M, 10 * M

    def grow(self, by):
        self.grown.append(by)
        self._room -= by
        self._size += by
        self._free += by

    def teardown(self):
        self.torn = True


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in ("AGENTVM_WORKSPACE_OVERCOMMIT", "AGENTVM_WORKSPACE_POOL", "AGENTVM_WORKSPACE_BACKEND"):
        monkeypatch.delenv(k, raising=False)


def test_running_agents_count_for_what_they_may_still_write():
    # two running: 100M limit with 60M used (40M left), 50M with nothing (50M left); the new one 30M
    p = FakePool({"a": (100 * M, 60 * M), "b": (50 * M, 0), "stopped": (900 * M, 10 * M)},
                 size=1024 * M, free=200 * M, room=0)
    got = p.admit("new", 30 * M, {"a", "b"})
    assert got["headroom"] == (40 + 50 + 30) * M and got["running"] == 3 and got["grown"] == 0
    # 120M + 16M slack fits in 200M; a stopped agent's 900M limit does not count, its 10M is in "free"


def test_the_pool_grows_before_it_refuses_and_refuses_with_the_numbers():
    p = FakePool({"a": (200 * M, 0)}, size=256 * M, free=150 * M, room=1024 * M)
    got = p.admit("new", 100 * M, {"a"})
    assert p.grown and got["grown"] == p.grown[0] and got["pool_free"] >= 300 * M + wspool.SLACK
    assert p.grown[0] % wspool.STEP == 0
    q = FakePool({"a": (200 * M, 0)}, size=256 * M, free=150 * M, room=64 * M)
    with pytest.raises(PolicyDenied) as ei:
        q.admit("new", 100 * M, {"a"})
    e = ei.value
    assert e.code == "workspace.overcommit" and e.exit_code == 125
    for part in ("'new' (it needs 100M)", "2 running agent(s)", "may still write 300.0M", "overcommit factor 1",
                 "needs 316.0M free", "150.0M free of 256.0M", "can grow by 64.0M"):
        assert part in e.message, (part, e.message)
    assert not q.grown, "a growth that would not be enough is not made"


def test_the_overcommit_factor_divides_what_must_be_free(monkeypatch):
    p = FakePool({"a": (200 * M, 0)}, size=256 * M, free=150 * M, room=0)
    with pytest.raises(PolicyDenied):
        p.admit("new", 100 * M, {"a"})
    monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", "2")
    with pytest.raises(PolicyDenied, match="overcommit factor 2 that needs 166.0M"):  # 300M / 2 + 16M > 150M
        p.admit("new", 100 * M, {"a"})
    monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", "3")
    assert p.admit("new", 100 * M, {"a"})["factor"] == 3.0  # 300M / 3 + 16M = 116M <= 150M


def test_the_overcommit_factor_divides_what_must_be_free_exactly(monkeypatch):
    monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", "3")
    p = FakePool({"a": (200 * M, 0)}, size=256 * M, free=116 * M, room=0)
    assert p.admit("new", 100 * M, {"a"})["headroom"] == 300 * M  # 300M / 3 + 16M = 116M: just fits
    p._free = 116 * M - 1
    with pytest.raises(PolicyDenied):
        p.admit("new", 100 * M, {"a"})


def test_no_pool_is_made_when_the_host_cannot_hold_its_first_size():
    p = FakePool({}, size=0, free=0, room=wspool.MIN_POOL - 1, exists=False)
    with pytest.raises(PolicyDenied) as ei:
        p.admit("first", 16 * M, set())
    assert not p.made and "it needs 16M" in ei.value.message and "no pool yet" in ei.value.message
    # a host with less room than a pool's usual first size gets a smaller one, when it is enough -
    # counting less than a small pool's statfs free (btrfs under 256M over-allocates metadata)
    p = FakePool({}, size=0, free=0, room=60 * M, exists=False)
    r = p.admit("first", 16 * M, set())
    assert r["pool_size"] == 60 * M and p.made and r["pool_free"] == wspool.usable(60 * M, 48 * M) < 40 * M, r
    # ...and not when statfs's free would seem enough (28M + 16M <= 48M) but what it can hold is not
    p = FakePool({}, size=0, free=0, room=60 * M, exists=False)
    with pytest.raises(PolicyDenied, match="free of 60.0M"):
        p.admit("first", 28 * M, set())
    assert p.made and p.torn, "the pool made for nothing is removed again"
    # made, then refused: the pool it made for nothing is removed again
    p = FakePool({}, size=0, free=0, room=wspool.INITIAL, exists=False)
    with pytest.raises(PolicyDenied):
        p.admit("first", 512 * M, set())
    assert p.made and p.torn


@pytest.mark.parametrize("raw", ["0.5", "0", "-1", "nan", "lots"])
def test_an_overcommit_below_one_or_not_a_number_is_a_config_error(monkeypatch, raw):
    monkeypatch.setenv("AGENTVM_WORKSPACE_OVERCOMMIT", raw)
    with pytest.raises(ConfigError, match="AGENTVM_WORKSPACE_OVERCOMMIT"):
        wspool.overcommit()


def test_the_pool_cap_is_a_size_of_at_least_256m(monkeypatch):
    assert wspool.max_size() is None
    monkeypatch.setenv("AGENTVM_WORKSPACE_POOL", "64G")
    assert wspool.max_size() == 64 << 30
    for raw in ("100M", "big"):
        monkeypatch.setenv("AGENTVM_WORKSPACE_POOL", raw)
        with pytest.raises(ConfigError, match="at least 256M"):
            wspool.max_size()


def test_which_backend_new_workspaces_get(monkeypatch):
    monkeypatch.setattr(wspool, "supported", lambda: (True, "pool ok"))
    monkeypatch.setattr(workspace, "_image_supported", lambda: (True, "image ok"))
    assert workspace.backend()[0] == "pool"
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", "image")
    assert workspace.backend() == ("image", "image ok (AGENTVM_WORKSPACE_BACKEND=image)")
    monkeypatch.setattr(wspool, "supported", lambda: (False, "no btrfs"))
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", "auto")
    name, why = workspace.backend()
    assert name == "image" and "no btrfs" in why  # auto falls back, and says why
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", "pool")
    name, why = workspace.backend()
    assert name == "none" and "no btrfs" in why  # an explicit choice does not fall back
    ok, detail = workspace.quota_supported()
    assert not ok and "no btrfs" in detail
    monkeypatch.setenv("AGENTVM_WORKSPACE_BACKEND", "zfs")
    with pytest.raises(ConfigError, match="AGENTVM_WORKSPACE_BACKEND"):
        workspace.backend()


def test_simple_quotas_are_required(monkeypatch):
    monkeypatch.setattr(wspool, "_kernel", lambda: (6, 6))
    monkeypatch.setattr(wspool.os, "geteuid", lambda: 0)
    monkeypatch.setattr(wspool, "_filesystems", lambda: "nodev\tproc\n\tbtrfs\n")
    monkeypatch.setattr(wspool, "mkfs", lambda: "/sbin/mkfs.btrfs")
    monkeypatch.setattr(wspool.os.path, "exists", lambda p: True)
    ok, why = wspool.supported()
    assert not ok and "6.7" in why


def test_statfs_free_counts_in_full_from_256m_and_less_below():
    assert wspool.usable(wspool.MIN_RESIZE, 200 * M) == 200 * M
    # a new 64M pool: 52M by statfs; 29.7M of fsync'd data went in (measured) - with the 16M
    # every admission keeps, what it admits (usable - 16M) stays under that
    assert wspool.usable(wspool.INITIAL, 52 * M) - wspool.SLACK <= 29 * M
    assert wspool.usable(wspool.MIN_POOL, 40 * M) < 40 * M  # (the smallest first pool: less still)

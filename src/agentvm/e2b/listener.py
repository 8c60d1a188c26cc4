"""The E2B listener's guard against local peers holding its connections (docs/e2b.md
"Connections").

The E2B API is uvicorn on a loopback port that every local account can reach before any key is
checked. Plain uvicorn keeps a connection whose request head never completes for ever and
accepts as many as the process has descriptors: a local user holding 20 000 half-sent heads
took every fd of the (root) daemon, and with them its owner's unix-socket API. This wraps
uvicorn's HTTP protocol (``uvicorn.Config(http=guarded_protocol())``) so that:

* at most ``limit`` connections are open at once (HTTP and upgraded WebSockets together), well
  below RLIMIT_NOFILE: the rest of the descriptors stay the daemon's (its unix socket, its
  sandboxes, the port proxy's upstream sockets, staging files);
* a connection that is not inside a request (no head yet, a partial head, idle between
  requests) is aborted once it has spent ``head_timeout`` seconds without a whole head;
* past ``limit`` a new connection takes the place of the oldest one that is not inside a
  request (an SDK client sends its head at once, so half-open connections cannot keep it
  out); when every connection is inside a request, the new one is accepted and closed at once
  (as the daemon's own TCP listener does, daemon/http.py TCP_CONNECTIONS).
"""

from __future__ import annotations

import logging
import resource
import time

log = logging.getLogger("agentvm.e2b")

MAX_CONNECTIONS = 512  # connections open at once (each may hold a second fd: the port proxy's upstream)
HEAD_TIMEOUT = 10.0  # seconds a connection has for a whole request head (none is authenticated before)


def connection_limit(limit: int = MAX_CONNECTIONS) -> int:
    """``limit``, or less on a process with few descriptors: at most an eighth of RLIMIT_NOFILE
    (two fds per proxied connection leave three quarters for everything else)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, max(8, soft // 8))
    return limit


def _live(connections) -> int:
    """Connections not already being closed (an evicted one stays in uvicorn's set until its
    connection_lost runs, later in the same loop pass as a burst of accepts)."""
    n = 0
    for c in connections:
        t = getattr(c, "transport", None)
        n += t is None or not t.is_closing()
    return n


def _base():
    try:  # what uvicorn's http="auto" would choose
        import httptools  # noqa: F401

        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - httptools is a dependency here
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return base


def guarded_protocol(limit: int | None = None, head_timeout: float = HEAD_TIMEOUT, base=None):
    """A uvicorn HTTP protocol class with the guard (pass it as ``uvicorn.Config(http=...)``)."""
    limit = connection_limit() if limit is None else limit
    base = base or _base()
    stats = {"refused": 0, "evicted": 0, "timed_out": 0}

    class Guarded(base):  # type: ignore[misc, valid-type]
        _head_timer = None
        _waiting_since = 0.0

        def _waiting(self) -> bool:  # outside any request (uvicorn's own test, as in shutdown())
            return self.cycle is None or self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._waiting_since = time.monotonic()
            if len(self.connections) > limit and _live(self.connections) > limit and not self._evict_one():
                stats["refused"] += 1
                transport.abort()  # connection_lost follows and forgets it
                return
            self._arm()

        def _evict_one(self) -> bool:
            oldest = None
            for c in self.connections:
                if c is not self and isinstance(c, Guarded) and c._waiting() and not c.transport.is_closing() and \
                        (oldest is None or c._waiting_since < oldest._waiting_since):
                    oldest = c
            if oldest is None:
                return False
            stats["evicted"] += 1
            oldest._disarm()
            oldest.transport.abort()
            return True

        def _arm(self) -> None:
            if self._head_timer is None:
                self._waiting_since = time.monotonic()
                self._head_timer = self.loop.call_later(head_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            # (a connection upgraded to a WebSocket has left self.connections: not ours any more)
            if self in self.connections and self._waiting() and not self.transport.is_closing():
                stats["timed_out"] += 1
                self.transport.abort()

        def data_received(self, data: bytes) -> None:
            if self._waiting():
                self._arm()  # the first bytes of a head: its deadline runs from now (or from connect)
            super().data_received(data)
            if not self._waiting() or self not in self.connections:  # in a request, or a WebSocket now
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._waiting_since = time.monotonic()  # idle: uvicorn's keep-alive timeout closes it

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    Guarded.stats = stats  # type: ignore[attr-defined]
    Guarded.limit = limit  # type: ignore[attr-defined]
    return Guarded

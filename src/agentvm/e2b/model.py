"""The E2B adapter's own records: a sandbox (``Box``), a process of it (``Proc``), and how an
E2B path becomes the sandbox's path. Below both app.py (the service, the REST API) and
envd.py (the in-sandbox API), which share them."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import posixpath
import secrets
from dataclasses import dataclass, field
from typing import Any

from agentvm.e2b.backend import WORKSPACE, BackendFailure, EventChannel


def digest(token: str) -> str:
    """What is kept of an access token (sha256, hex): enough to check it, not to use it."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(digests, token: str | None) -> bool:
    if not token:
        return False
    d = digest(token)
    ok = False
    for want in digests:  # every one compared: no early answer tells which matched
        ok |= hmac.compare_digest(want, d)
    return ok


@dataclass
class Proc:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    handle: Any
    subscribers: list[EventChannel] = field(default_factory=list)  # the clients following it (envd._subscribe)
    done: bool = False
    task: asyncio.Task | None = None
    expiry: asyncio.TimerHandle | None = None  # ended with clients still following: when they are dropped (envd._retire)


@dataclass
class Box:
    id: str
    tenant: str
    template: str
    name: str  # the daemon's sandbox name
    metadata: dict[str, str]
    envs: dict[str, str]
    started_at: float
    end_at: float
    token: str  # envd's X-Access-Token as last handed out (after a restart: a new one, minted at connect)
    auto_pause: bool = False
    state: str = "running"  # running | paused
    procs: dict[int, Proc] = field(default_factory=dict)
    watchers: dict[str, dict] = field(default_factory=dict)
    starting: int = 0  # Starts between their check of MAX_PROCS and their process's entry in procs
    watch_streams: int = 0  # watch_dir streams open (envd.MAX_WATCH_STREAMS)
    held: dict[str, int] = field(default_factory=dict)  # watcher/stream -> bytes its snapshot holds (envd.WATCH_BUDGET)
    ports: tuple[int, ...] = ()  # the template's ports: the only ones get_host(port) reaches (ports.py)
    traffic_token: str = ""  # E2B-Traffic-Access-Token for those ports
    running_since: float = 0.0
    # sha256 of every access token handed out for this sandbox: what is persisted and checked
    token_digests: list[str] = field(default_factory=list)
    traffic_digests: list[str] = field(default_factory=list)
    known_tokens: bool = True  # False after a restart: the tokens' text was never stored

    def __post_init__(self) -> None:
        if self.token and not self.token_digests:
            self.token_digests.append(digest(self.token))
        if self.traffic_token and not self.traffic_digests:
            self.traffic_digests.append(digest(self.traffic_token))

    def access_ok(self, token: str | None) -> bool:
        return token_matches(self.token_digests, token)

    def traffic_ok(self, token: str | None) -> bool:
        return token_matches(self.traffic_digests, token)

    def mint_tokens(self) -> None:
        """New access tokens, valid beside the old ones (a client holding an old token keeps
        working): used when the old ones' text is not known (after a daemon restart)."""
        self.token = secrets.token_urlsafe(24)
        self.token_digests.append(digest(self.token))
        if self.ports:
            self.traffic_token = secrets.token_urlsafe(24)
            self.traffic_digests.append(digest(self.traffic_token))
        del self.token_digests[:-8], self.traffic_digests[:-8]  # bounded: a connect loop cannot grow them
        self.known_tokens = True


def resolve_path(path: str) -> str:
    """An E2B path as the sandbox sees it: relative paths (and ``~``) start at the workspace,
    the sandbox's home. Nothing else is done on the host side: the sandbox's own view decides."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise BackendFailure("invalid", "a path is required")
    if path == "~" or path.startswith("~/"):
        path = WORKSPACE + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(WORKSPACE, path)
    return posixpath.normpath(path)

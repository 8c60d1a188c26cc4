"""The E2B-compatible API as one ASGI app: ``make_app(backend, api_keys)``.

Two surfaces on one listener (``E2B_API_URL`` = ``E2B_SANDBOX_URL``):

* the REST API of E2B's control plane (``/sandboxes``, ``/v2/sandboxes``...), authenticated by
  ``X-API-Key``; each key is a tenant, and a sandbox of another tenant is answered exactly as a
  sandbox that does not exist (404, same body);
* the in-sandbox API ("envd"): ``/health``, ``/files`` (download, multipart or octet-stream
  upload) and the Connect services ``process.Process`` and ``filesystem.Filesystem`` (served by
  ``connectrpc`` with the generated code of ``_gen``), routed by the ``E2b-Sandbox-Id`` header
  and authenticated by the sandbox's own ``X-Access-Token`` (returned once, at create). An
  unknown id and a wrong token get the same 502 "sandbox ... was not found".

Everything is done through an :class:`agentvm.e2b.backend.E2BBackend`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import json
import logging
import os
import posixpath
import secrets
import time
from typing import Mapping
from urllib.parse import parse_qsl

from agentvm.e2b import templates as tpls
from agentvm.e2b.backend import BackendFailure, E2BBackend
from agentvm.e2b.model import Box, Proc, resolve_path  # noqa: F401 (re-exported)
from agentvm.errors import AgentVMError

log = logging.getLogger("agentvm.e2b")

ENVD_VERSION = "0.5.7"
DEFAULT_TIMEOUT = 300  # seconds, as E2B
MAX_TIMEOUT = 24 * 3600
KILL_GRACE_TTL = MAX_TIMEOUT + 600  # the daemon's own TTL: a backstop if this adapter dies


# Request bodies (docs/e2b.md "Back-pressure"): refused on their Content-Length before a byte is
# read (413), and read as a bounded stream (a chunked body stops at the limit): a REST body of at
# most MAX_JSON_BODY in memory; an upload staged in a temporary file as it arrives, never whole
# in memory, at most MAX_UPLOAD (the daemon's copy limit) plus a multipart envelope.
MAX_JSON_BODY = 1 << 20
MAX_UPLOAD = 64 * 1024 * 1024  # = daemon.files.MAX_FILE
MULTIPART_SLACK = 1 << 20  # multipart boundaries and headers around the files
# files read or uploaded at once by one tenant (each read holds up to backend.MAX_READ bytes)
MAX_TRANSFERS_PER_TENANT = 4

# A create's options, bounded before any work is done on them (review 8, finding 3: 20,000
# allowOut hosts held the daemon's loop 2.5 s compiling a spec that was then refused):
MAX_NETWORK_ENTRIES = 64  # network.allowOut and network.denyOut, each
MAX_HOST_CHARS = 255  # one allowOut/denyOut entry (a DNS name is at most 253, "*." more)
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 256  # characters
MAX_METADATA_VALUE = 4096  # characters
MAX_ENV_VARS = 256
# what execve takes (review 8, finding 6: a larger envVars string made the sandbox's start fail
# with E2BIG for ever): one "NAME=value" string at most MAX_ARG_STRLEN (32 pages = 128 KiB) with
# its NUL; all of them well under ARG_MAX (a quarter of the 8 MiB stack), which the template's own
# environment, the gate's variables and the command's arguments share
MAX_ENV_STRING = 128 * 1024  # bytes of NAME=value plus its NUL
MAX_ENV_TOTAL = 1024 * 1024  # bytes of every NAME=value plus NULs


class _TooLarge(Exception):
    pass


def _declared_length(headers) -> int | None:
    raw = headers.get("content-length")
    if raw is None:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise _TooLarge("an invalid Content-Length") from None
    if n < 0:
        raise _TooLarge("an invalid Content-Length")
    return n


def _bounded_receive(receive, limit: int):
    """``receive`` that ends the request (``_TooLarge``) once its body passes ``limit`` bytes."""
    seen = [0]

    async def wrapped():
        msg = await receive()
        if msg["type"] == "http.request":
            seen[0] += len(msg.get("body", b""))
            if seen[0] > limit:
                raise _TooLarge(f"the body is larger than {limit} bytes")
        return msg

    return wrapped


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


class E2BService:
    """The state of the E2B adapter: tenants' sandboxes, their processes, timeouts, limits."""

    def __init__(self, backend: E2BBackend, api_keys: Mapping[str, str], *, home=None, max_per_tenant: int = 20,
                 max_concurrent_creates: int = 4, audit=None, domain: str | None = None, store=None):
        self.backend = backend
        # agentvm.e2b.store.E2BStore: the sandboxes survive a restart of whoever serves this
        # (the daemon); None: kept in memory and removed when the service closes (`e2b serve`)
        self.store = store
        self.domain = domain  # answered as the sandboxes' domain: get_host(port) is PORT-ID.DOMAIN
        # key -> tenant; or a callable giving it (re-read when a key is not known: keys added later)
        self._keys_source = api_keys if callable(api_keys) else None
        self.home = home
        self._keys_seen = self._keys_file_state()
        self.api_keys = dict(api_keys() if callable(api_keys) else api_keys)
        self.max_per_tenant = max_per_tenant
        self.max_concurrent_creates = max_concurrent_creates
        self.creating = 0
        self.transfers: dict[str, int] = {}  # tenant -> files being read or uploaded (MAX_TRANSFERS_PER_TENANT)
        self.boxes: dict[str, Box] = {}
        self.listing_gates: dict[str, asyncio.Semaphore] = {}  # tenant -> its listings at once (envd)
        self.record = audit or (lambda kind, **data: log.info("%s %s", kind, data))
        self._reaper: asyncio.Task | None = None

    # -- auth --------------------------------------------------------------------------------
    def _keys_file_state(self) -> tuple | None:
        """(inode, mtime, size) of the API-key file the key source reads, None when it has none."""
        if self._keys_source is None:
            return None
        from agentvm.e2b import state_dir

        try:
            st = os.stat(state_dir(self.home) / "api-keys.json")
        except OSError:
            return ("missing",)
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def _reload_keys(self) -> None:
        try:
            self.api_keys = dict(self._keys_source())
        except (OSError, ValueError) as exc:  # a hand-edited file that does not parse: no key works
            log.warning("e2b: the API-key file cannot be read (%s); every key is refused until it can", exc)
            self.api_keys = {}

    def tenant_of(self, key: str | None) -> str | None:
        if not key:
            return None
        # a key removed from the file is refused from the next request on (review 8, finding 7):
        # the file is read again whenever it changed (a stat per request; `e2b key` replaces it)
        state = self._keys_file_state()
        if state != self._keys_seen:
            self._keys_seen = state
            self._reload_keys()
        for attempt in (0, 1):
            for k, tenant in self.api_keys.items():
                if hmac.compare_digest(k.encode(), key.encode()):
                    return tenant
            if attempt or self._keys_source is None:
                return None
            self._reload_keys()
        return None

    def box_for(self, tenant: str, sandbox_id: str) -> Box | None:
        b = self.boxes.get(sandbox_id)
        return b if b is not None and b.tenant == tenant else None

    def envd_box(self, sandbox_id: str | None, token: str | None) -> Box | None:
        b = self.boxes.get(sandbox_id or "")
        if b is None or not b.access_ok(token):
            return None
        return b

    def save(self, box: Box) -> None:
        if self.store is not None and box.id in self.boxes:
            self.store.save(box)

    def handed_out(self, box: Box) -> Box:
        """``box`` with access tokens whose text can be answered (new ones after a restart)."""
        if not box.known_tokens:
            box.mint_tokens()
            self.save(box)
        return box

    async def load(self) -> None:
        """The sandboxes the store kept (a restart): those the control plane still has come
        back with their deadlines (the reaper times out any that passed meanwhile)."""
        if self.store is None:
            return
        for box in self.store.load():
            try:
                alive = await self.backend.info(box.name)
            except BackendFailure:
                log.exception("e2b: looking up %s failed; kept", box.name)
                alive = True
            if alive is None:
                self.store.delete(box.id)
                self.record("e2b.kill", tenant=box.tenant, sandbox=box.name, reason="gone at restart")
                continue
            self.boxes[box.id] = box
            tpl = tpls.get(box.template, self.home)
            if tpl is None or not tpl.usable_by(box.tenant):  # made before templates had tenants
                log.warning("e2b: sandbox %s of tenant %s was made from template %s, which is not that tenant's "
                            "(kept; `agentvm template set` or `agentvm rm`)", box.name, box.tenant, box.template)
                self.record("e2b.template-not-owned", tenant=box.tenant, sandbox=box.name, template=box.template)
            if box.state == "running" and getattr(alive, "state", "running") != "running":
                try:  # the daemon left it stopped (`up --no-resume`): E2B's running sandbox runs
                    await self.backend.resume(box.name)
                except BackendFailure:
                    log.exception("e2b: starting %s again failed", box.name)
        log.info("e2b: %d sandboxes kept from before", len(self.boxes))
    # -- lifecycle ---------------------------------------------------------------------------
    async def create(self, tenant: str, body: dict) -> Box:
        req = _create_request(body)  # wrong types: 400 before anything else
        template = req["template"]
        tpl = tpls.get(template, self.home)
        # another tenant's template is answered as one that does not exist (as its sandboxes are)
        if tpl is None or not tpl.usable_by(tenant):
            raise AgentVMError(f"template {template!r} not found", hint="`agentvm template ls` lists them",
                               code="e2b.template-not-found")
        timeout, metadata, envs = req["timeout"], req["metadata"], req["envs"]
        opts = tpls.CreateOptions(template=template, allow_internet_access=req["allow_internet_access"],
                                  allow_out=req["allow_out"], deny_out=req["deny_out"], envs=envs)
        sid = "i" + secrets.token_hex(10)
        name = f"e2b-{sid}"
        # the quotas first (review 8, finding 3): a tenant past them costs no spec compilation
        self._check_quota(tenant)
        self.creating += 1
        try:
            # refusals raise here, before anything exists; compiled off the daemon's loop
            spec_text = await asyncio.to_thread(tpls.sandbox_spec, tpl, name, opts)
            mine = sum(1 for b in self.boxes.values() if b.tenant == tenant)
            if mine >= self.max_per_tenant:  # the tenant's other creates that finished meanwhile
                raise _TooMany(f"tenant has {mine} sandboxes (the limit is {self.max_per_tenant})", retry=False)
            now = time.time()
            from agentvm.e2b.ports import allowed_ports

            box = Box(sid, tenant, template, name, dict(metadata), {}, now, now + timeout,
                      secrets.token_urlsafe(24), auto_pause=req["auto_pause"],
                      ports=allowed_ports(tpl.ports), traffic_token=secrets.token_urlsafe(24), running_since=now)
            self.boxes[sid] = box  # counted against the tenant while it starts
            try:
                await self.backend.create(name, spec_text, KILL_GRACE_TTL)
                self.save(box)
            except BaseException:
                self.boxes.pop(sid, None)
                raise
        finally:
            self.creating -= 1
        net = {k: req[k] for k in ("allow_out", "deny_out") if req[k]}  # what narrowed it (bounded above)
        self.record("e2b.create", tenant=tenant, sandbox=name, template=template, timeout=timeout, **net)
        return box

    def _check_quota(self, tenant: str) -> None:
        mine = sum(1 for b in self.boxes.values() if b.tenant == tenant)
        if mine >= self.max_per_tenant:
            raise _TooMany(f"tenant has {mine} sandboxes (the limit is {self.max_per_tenant})", retry=False)
        if self.creating >= self.max_concurrent_creates:
            raise _TooMany(f"{self.creating} creates in progress (the limit is {self.max_concurrent_creates})",
                           retry=True)

    async def kill(self, box: Box, why: str = "kill") -> None:
        self.boxes.pop(box.id, None)
        for p in box.procs.values():
            if p.task is not None:
                p.task.cancel()
        try:
            await self.backend.kill(box.name)
        except BaseException:
            self.boxes.setdefault(box.id, box)  # still there: the reaper (or the client) tries again
            raise
        if self.store is not None:
            self.store.delete(box.id)
        self.record("e2b.kill", tenant=box.tenant, sandbox=box.name, reason=why)

    async def pause(self, box: Box) -> None:
        await self.backend.pause(box.name)
        box.state = "paused"
        box.procs.clear()
        self.save(box)
        self.record("e2b.pause", tenant=box.tenant, sandbox=box.name)

    async def resume(self, box: Box, timeout: int | None) -> None:
        if box.state == "paused":
            await self.backend.resume(box.name)
            box.state = "running"
            box.running_since = time.time()
            self.record("e2b.resume", tenant=box.tenant, sandbox=box.name)
        if timeout is not None:
            box.end_at = time.time() + timeout
        self.save(box)

    def set_deadline(self, box: Box, end_at: float) -> None:
        box.end_at = end_at
        self.save(box)

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for box in list(self.boxes.values()):
                if box.end_at <= now:
                    try:
                        if box.auto_pause and box.state == "running":
                            await self.pause(box)
                            self.set_deadline(box, now + MAX_TIMEOUT)
                        else:
                            await self.kill(box, "timeout")
                    except Exception:  # noqa: BLE001 - logged; retried on the next pass
                        log.exception("e2b: timing out %s failed", box.name)

    async def close(self) -> None:
        if self.store is not None:  # kept for the next start (the deadlines too)
            self.store.close()
            return
        for box in list(self.boxes.values()):
            try:
                await self.kill(box, "shutdown")
            except Exception:  # noqa: BLE001
                log.exception("e2b: removing %s failed", box.name)


def _seconds(v) -> bool:
    """A whole number of seconds as JSON gives it (``true`` is not 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _create_request(body: dict) -> dict:
    """E2B's create body (NewSandbox), its types checked: a wrong one is a 400 naming the field
    (never a 500, never ``true`` taken as 1 s). Fields agent-vm does not read are ignored."""
    def bad(msg: str) -> AgentVMError:
        return AgentVMError(msg, code="e2b.bad-request")

    def str_map(field: str, most: int) -> dict[str, str]:
        v = body.get(field)
        if v is None:
            return {}
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
            raise bad(f"{field} must be an object mapping strings to strings")
        if len(v) > most:
            raise bad(f"{field} has {len(v)} entries; agent-vm takes at most {most}")
        return dict(v)

    def str_list(doc: dict, field: str) -> list[str]:
        v = doc.get(field)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise bad(f"network.{field} must be a list of strings")
        if len(v) > MAX_NETWORK_ENTRIES:
            raise bad(f"network.{field} has {len(v)} entries; agent-vm takes at most {MAX_NETWORK_ENTRIES} (name a "
                      "'*.suffix' the template allows instead of many hosts under it)")
        for x in v:
            if len(x) > MAX_HOST_CHARS:
                raise bad(f"network.{field} entry {x[:40]!r}... is {len(x)} characters; a host is at most "
                          f"{MAX_HOST_CHARS}")
        return list(v)

    def env_map() -> dict[str, str]:
        envs = str_map("envVars", MAX_ENV_VARS)
        total = 0
        for k, x in envs.items():
            n = len(k.encode("utf-8", "surrogatepass")) + 1 + len(x.encode("utf-8", "surrogatepass")) + 1
            if n > MAX_ENV_STRING:
                raise bad(f"envVars {k[:40]!r}: NAME=value is {n - 1} bytes; the kernel execs at most "
                          f"{MAX_ENV_STRING - 1} bytes (128 KiB with its NUL) per variable (put large values in "
                          "a file: files.write, then read it from the sandbox)")
            total += n
        if total > MAX_ENV_TOTAL:
            raise bad(f"envVars take {total} bytes; agent-vm passes at most {MAX_ENV_TOTAL} bytes (1 MiB) of "
                      "variables to a sandbox (put large values in files instead)")
        return envs

    def metadata_map() -> dict[str, str]:
        md = str_map("metadata", MAX_METADATA_ENTRIES)
        for k, x in md.items():
            if len(k) > MAX_METADATA_KEY or len(x) > MAX_METADATA_VALUE:
                raise bad(f"metadata {k[:40]!r}: keys are at most {MAX_METADATA_KEY} characters and values at "
                          f"most {MAX_METADATA_VALUE}")
        return md

    template = body.get("templateID")
    if template is None or template == "":
        template = "base"
    if not isinstance(template, str):
        raise bad("templateID must be a string")
    timeout = body.get("timeout", DEFAULT_TIMEOUT)
    if not _seconds(timeout) or not 0 < timeout <= MAX_TIMEOUT:
        raise bad(f"timeout must be a whole number of seconds, 1..{MAX_TIMEOUT}")
    for flag in ("autoPause", "allow_internet_access", "secure"):
        if body.get(flag) is not None and not isinstance(body.get(flag), bool):
            raise bad(f"{flag} must be true or false")
    net = body.get("network")
    if net is None:
        net = {}
    if not isinstance(net, dict):
        raise bad("network must be an object ({allowOut: [...], denyOut: [...]})")
    for unsupported in ("volumeMounts", "iam", "mcp"):
        if body.get(unsupported):
            raise AgentVMError(f"{unsupported} is not supported by agent-vm's E2B API",
                               hint="see docs/e2b.md (not compatible)", code="e2b.bad-request")
    return {"template": template, "timeout": timeout, "metadata": metadata_map(), "envs": env_map(),
            "allow_internet_access": body.get("allow_internet_access"), "auto_pause": body.get("autoPause") is True,
            "allow_out": str_list(net, "allowOut"), "deny_out": str_list(net, "denyOut")}


class _TooMany(Exception):
    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


# -- REST --------------------------------------------------------------------------------------

def _sandbox_doc(box: Box, domain: str | None = None) -> dict:
    return {"templateID": box.template, "sandboxID": box.id, "clientID": "agentvm", "alias": box.template,
            "envdVersion": ENVD_VERSION, "envdAccessToken": box.token, "trafficAccessToken": box.traffic_token or None,
            "domain": domain}


def _detail_doc(box: Box, *, token: bool) -> dict:
    d = {"templateID": box.template, "sandboxID": box.id, "clientID": "agentvm", "alias": box.template,
         "startedAt": _iso(box.started_at), "endAt": _iso(box.end_at), "envdVersion": ENVD_VERSION,
         "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 64, "state": box.state, "metadata": box.metadata}
    if token:
        d["envdAccessToken"] = box.token
    return d


def _rest_routes(svc: E2BService):
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def err(status: int, message: str, **headers) -> JSONResponse:
        return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers or None)

    def not_found(sid: str) -> JSONResponse:
        return err(404, f"sandbox \"{sid}\" doesn't exist or you don't have access to it")

    def authed(fn):
        async def handler(request):
            tenant = svc.tenant_of(request.headers.get("x-api-key"))
            if tenant is None:
                return err(401, "Invalid API key (agent-vm: `agentvm e2b env` prints E2B_API_KEY)")
            try:
                return await fn(request, tenant)
            except AgentVMError as exc:
                msg = str(exc) + (f" ({exc.hint})" if exc.hint else "")
                return err(exc.status if exc.status >= 400 else 400, f"{msg} [{exc.code}]")
            except _TooLarge as exc:
                return err(413, str(exc))
            except _TooMany as exc:
                hdr = {"Retry-After": "2"} if exc.retry else {"Should-Retry": "false"}
                return err(429, str(exc), **hdr)
            except BackendFailure as exc:
                return err(404 if exc.kind == "not-found" else 500, str(exc))

        return handler

    async def body_of(request) -> dict:
        too_big = _TooLarge(f"the request body is larger than {MAX_JSON_BODY} bytes")
        try:
            n = _declared_length(request.headers)
        except _TooLarge as exc:
            raise AgentVMError(str(exc), code="e2b.bad-request") from None
        if n is not None and n > MAX_JSON_BODY:
            raise too_big  # refused before a byte is read
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > MAX_JSON_BODY:  # a chunked body (or a short Content-Length) stops here
                raise too_big
        raw = bytes(buf)
        from agentvm.e2b.envd import MAX_JSON_DEPTH, json_depth

        if json_depth(raw) > MAX_JSON_DEPTH:  # review 8 finding 4: refused before the parser recurses
            raise AgentVMError(f"the body's JSON nests deeper than {MAX_JSON_DEPTH} levels",
                               hint="send the body as the E2B SDKs build it", code="e2b.bad-request")
        try:
            doc = json.loads(raw or b"{}")
        except (ValueError, RecursionError):
            raise AgentVMError("the body is not JSON", code="e2b.bad-request") from None
        if not isinstance(doc, dict):
            raise AgentVMError("the body must be a JSON object", code="e2b.bad-request")
        return doc

    @authed
    async def create(request, tenant):
        box = await svc.create(tenant, await body_of(request))
        return JSONResponse(_sandbox_doc(svc.handed_out(box), svc.domain), status_code=201)

    def _listed(tenant, query) -> list[Box]:
        boxes = [b for b in svc.boxes.values() if b.tenant == tenant]
        md = query.get("metadata")
        if md:
            want = dict(parse_qsl(md))
            boxes = [b for b in boxes if all(b.metadata.get(k) == v for k, v in want.items())]
        states = [s for s in (query.get("state") or "").split(",") if s]
        if states:
            boxes = [b for b in boxes if b.state in states]
        return sorted(boxes, key=lambda b: b.started_at)

    @authed
    async def list_v1(request, tenant):
        return JSONResponse([_detail_doc(b, token=False) for b in _listed(tenant, request.query_params)
                             if b.state == "running"])

    @authed
    async def list_v2(request, tenant):
        boxes = _listed(tenant, request.query_params)
        if request.query_params.get("order") == "desc":
            boxes.reverse()
        try:
            start = int(request.query_params.get("nextToken") or 0)
            limit = min(max(int(request.query_params.get("limit") or 100), 1), 100)
        except ValueError:
            return err(400, "limit and nextToken are integers")
        page = boxes[start:start + limit]
        headers = {"X-Next-Token": str(start + limit)} if start + limit < len(boxes) else None
        return JSONResponse([_detail_doc(b, token=False) for b in page], headers=headers)

    def one(fn):
        @authed
        async def handler(request, tenant):
            sid = request.path_params["sid"]
            box = svc.box_for(tenant, sid)
            if box is None:
                return not_found(sid)
            return await fn(request, box)

        return handler

    @one
    async def get_one(request, box):
        return JSONResponse(_detail_doc(svc.handed_out(box), token=True))

    @one
    async def kill(request, box):
        await svc.kill(box)
        return Response(status_code=204)

    @one
    async def set_timeout(request, box):
        t = (await body_of(request)).get("timeout")
        if not _seconds(t) or not 0 < t <= MAX_TIMEOUT:
            return err(400, f"timeout must be 1..{MAX_TIMEOUT} seconds")
        svc.set_deadline(box, time.time() + t)
        svc.record("e2b.timeout", tenant=box.tenant, sandbox=box.name, timeout=t)
        return Response(status_code=204)

    @one
    async def refresh(request, box):
        d = (await body_of(request)).get("duration", DEFAULT_TIMEOUT)
        if not _seconds(d) or not 0 <= d <= 3600:
            return err(400, "duration must be 0..3600 seconds")
        svc.set_deadline(box, max(box.end_at, time.time() + d))
        return Response(status_code=204)

    @one
    async def pause(request, box):
        if box.state == "paused":
            return err(409, f"sandbox {box.id} is already paused")
        await svc.pause(box)
        return Response(status_code=204)

    @one
    async def resume(request, box):
        t = (await body_of(request)).get("timeout")
        if box.state != "paused":
            return err(409, f"sandbox {box.id} is not paused")
        await svc.resume(box, t if _seconds(t) and 0 < t <= MAX_TIMEOUT else DEFAULT_TIMEOUT)
        return JSONResponse(_sandbox_doc(svc.handed_out(box), svc.domain), status_code=201)

    @one
    async def connect(request, box):
        t = (await body_of(request)).get("timeout")
        was = box.state
        t = t if _seconds(t) and 0 < t <= MAX_TIMEOUT else None
        await svc.resume(box, t)
        if t is not None:  # connect only ever extends
            svc.set_deadline(box, max(box.end_at, time.time() + t))
        return JSONResponse(_sandbox_doc(svc.handed_out(box), svc.domain), status_code=201 if was == "paused" else 200)

    @one
    async def metrics(request, box):
        return JSONResponse([])

    @one
    async def logs(request, box):
        return JSONResponse({"logs": [], "logEntries": []})

    @one
    async def network(request, box):
        return err(400, "changing a running sandbox's network through the E2B API is not supported: "
                        "use `agentvm policy` (docs/e2b.md)")

    return [
        Route("/sandboxes", create, methods=["POST"]),
        Route("/v2/sandboxes", create, methods=["POST"]),
        Route("/sandboxes", list_v1, methods=["GET"]),
        Route("/v2/sandboxes", list_v2, methods=["GET"]),
        Route("/sandboxes/{sid}", get_one, methods=["GET"]),
        Route("/sandboxes/{sid}", kill, methods=["DELETE"]),
        Route("/sandboxes/{sid}/timeout", set_timeout, methods=["POST"]),
        Route("/sandboxes/{sid}/refreshes", refresh, methods=["POST"]),
        Route("/sandboxes/{sid}/pause", pause, methods=["POST"]),
        Route("/sandboxes/{sid}/resume", resume, methods=["POST"]),
        Route("/sandboxes/{sid}/connect", connect, methods=["POST"]),
        Route("/v2/sandboxes/{sid}/connect", connect, methods=["POST"]),
        Route("/sandboxes/{sid}/metrics", metrics, methods=["GET"]),
        Route("/sandboxes/{sid}/logs", logs, methods=["GET"]),
        Route("/v2/sandboxes/{sid}/logs", logs, methods=["GET"]),
        Route("/sandboxes/{sid}/network", network, methods=["PUT"]),
    ]


# -- envd --------------------------------------------------------------------------------------

_HTTP_STATUS = {"not-found": 404, "exists": 409, "permission": 403, "not-dir": 400, "is-dir": 400, "invalid": 400,
                "unsupported": 501, "gone": 502, "internal": 500}


def _envd_routes(svc: E2BService):
    import contextlib

    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def err(status: int, message: str) -> JSONResponse:
        return JSONResponse({"code": status, "message": message}, status_code=status)

    async def health(request):
        return Response(status_code=204)

    def transfer(box: Box):
        """One of the tenant's MAX_TRANSFERS_PER_TENANT file transfers, or None (answer 429)."""
        import contextlib

        if svc.transfers.get(box.tenant, 0) >= MAX_TRANSFERS_PER_TENANT:
            return None

        @contextlib.contextmanager
        def held():
            svc.transfers[box.tenant] = svc.transfers.get(box.tenant, 0) + 1
            try:
                yield
            finally:
                svc.transfers[box.tenant] -= 1
                if not svc.transfers[box.tenant]:
                    del svc.transfers[box.tenant]

        return held()

    def busy(box: Box) -> JSONResponse:
        r = err(429, f"at most {MAX_TRANSFERS_PER_TENANT} files are read or uploaded at once per tenant; "
                     "retry when one has finished")
        r.headers["Retry-After"] = "1"
        return r

    async def files_get(request):
        box = request.scope["e2b.box"]
        slot = transfer(box)
        if slot is None:
            return busy(box)
        with slot:
            try:
                path = resolve_path(request.query_params.get("path", ""))
                data = await svc.backend.read_file(box.name, path)
            except BackendFailure as exc:
                return err(_HTTP_STATUS.get(exc.kind, 500), str(exc))
        svc.record("e2b.files.read", tenant=box.tenant, sandbox=box.name, path=path, bytes=len(data))
        return Response(data, media_type="application/octet-stream")

    async def files_post(request):
        box = request.scope["e2b.box"]
        ctype = request.headers.get("content-type", "")
        multipart = ctype.startswith("multipart/form-data")
        limit = MAX_UPLOAD + (MULTIPART_SLACK if multipart else 0)
        try:
            n = _declared_length(request.headers)
        except _TooLarge as exc:
            return err(400, str(exc))
        if n is not None and n > limit:  # refused before a byte is read
            return err(413, f"the upload is {n} bytes; at most {MAX_UPLOAD} bytes per file")
        if not multipart and request.headers.get("content-encoding", "identity") not in ("identity", ""):
            return err(400, "compressed uploads are not supported")
        slot = transfer(box)
        if slot is None:
            return busy(box)
        from starlette.requests import Request

        request = Request(request.scope, _bounded_receive(request.receive, limit))
        with slot, contextlib.ExitStack() as files:
            try:
                items = await _staged(request, multipart, files)
                out = []
                for p, up in items:
                    path = resolve_path(p)
                    await svc.backend.write_file(box.name, path, up)
                    svc.record("e2b.files.write", tenant=box.tenant, sandbox=box.name, path=path, bytes=up.length)
                    out.append({"name": posixpath.basename(path), "type": "file", "path": path})
            except _TooLarge:
                return err(413, f"the upload is larger than {MAX_UPLOAD} bytes per file (its reading stopped "
                                "there)")
            except BackendFailure as exc:
                return err(_HTTP_STATUS.get(exc.kind, 500), str(exc))
        return JSONResponse(out)

    async def _staged(request, multipart: bool, files) -> list:
        """The upload's files, each an :class:`Upload` in a temporary file (never whole in memory)."""
        import tempfile

        from agentvm.e2b.backend import Upload

        items = []
        if multipart:
            form = await request.form(max_files=1000, max_fields=1000)  # files spooled to disk past 1 MiB
            files.callback(_close_form, form)
            for _, v in form.multi_items():
                if hasattr(v, "read"):
                    size = v.size if v.size is not None else 0
                    if size > MAX_UPLOAD:
                        raise _TooLarge()
                    items.append((v.filename or request.query_params.get("path", ""), Upload(v.file, size)))
            if len(items) == 1 and request.query_params.get("path"):
                items = [(request.query_params["path"], items[0][1])]
            return items
        f = files.enter_context(tempfile.TemporaryFile(prefix="agentvm-e2b-upload-"))
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_UPLOAD:
                raise _TooLarge()
            await asyncio.to_thread(f.write, chunk)
        return [(request.query_params.get("path", ""), Upload(f, size))]

    def _close_form(form) -> None:
        for _, v in form.multi_items():
            if hasattr(v, "file"):
                v.file.close()

    return [Route("/health", health, methods=["GET"]), Route("/files", files_get, methods=["GET"]),
            Route("/files", files_post, methods=["POST"])]


# -- the whole app -----------------------------------------------------------------------------

ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_PATHS = ("/health", "/files")


def make_app(backend: E2BBackend, api_keys, *, home=None, max_per_tenant: int = 20,
             max_concurrent_creates: int = 4, audit=None, domain: str | None = None, store=None):
    """The ASGI app. ``api_keys`` maps each API key to its tenant (or is a callable returning
    that map, called again when an unknown key arrives). ``domain`` is answered as the
    sandboxes' domain (``get_host(port)`` = ``PORT-ID.DOMAIN``, routed by ``Host``). ``store``
    (agentvm.e2b.store.E2BStore) keeps the sandboxes across restarts; without it they live
    as long as the app. ``audit(kind, **data)`` gets the adapter's records (``tenant`` in data)."""
    from starlette.applications import Starlette

    from agentvm.e2b.envd import connect_apps

    svc = E2BService(backend, api_keys, home=home, max_per_tenant=max_per_tenant,
                     max_concurrent_creates=max_concurrent_creates, audit=audit, domain=domain, store=store)

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await svc.load()
        svc._reaper = asyncio.create_task(svc.reap())
        try:
            yield
        finally:
            svc._reaper.cancel()
            await svc.close()

    from starlette.responses import JSONResponse

    async def unsupported(request, exc):
        status = getattr(exc, "status_code", 404)
        return JSONResponse({"code": status, "message": f"{request.method} {request.url.path} is not part of "
                             "agent-vm's E2B API (docs/e2b.md lists what is)"}, status_code=status)

    rest = Starlette(routes=_rest_routes(svc), lifespan=lifespan,
                     exception_handlers={404: unsupported, 405: unsupported})
    envd = Starlette(routes=_envd_routes(svc))
    connect = connect_apps(svc)
    from agentvm.e2b.ports import PortProxy, route_of

    port_proxy = PortProxy(svc)

    async def unknown_sandbox(scope, send, sid):
        body = json.dumps({"code": 502, "message": f"The sandbox {sid!r} was not found"}).encode()
        await send({"type": "http.response.start", "status": 502,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await rest(scope, receive, send)
        path = scope.get("path", "")
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        route = route_of(hdrs)  # a sandbox's port (get_host), by E2b-Sandbox-Port or PORT-ID.DOMAIN
        if route is not None:
            return await port_proxy(scope, receive, send, route, hdrs)
        if scope["type"] == "websocket":
            await receive()
            return await send({"type": "websocket.close", "code": 1008})
        sid = hdrs.get("e2b-sandbox-id")
        if sid is not None or path.startswith(ENVD_PREFIXES) or path in ENVD_PATHS:
            box = svc.envd_box(sid, hdrs.get("x-access-token"))
            if box is None or box.state != "running":
                return await unknown_sandbox(scope, send, sid or "")
            scope = dict(scope)
            scope["e2b.box"] = box
            for prefix, capp in connect.items():
                if path.startswith(prefix):
                    return await capp(scope, receive, send)
            return await envd(scope, receive, send)
        return await rest(scope, receive, send)

    app.service = svc  # type: ignore[attr-defined]
    return app

"""The web console: the daemon's own view of its sandboxes, decisions, audit trail and
approvals, served at ``/`` of the daemon's API (a Starlette app called in-process).

Who may use it
    The API's unix socket is owner-only and browsers cannot open it; a browser reaches the
    console on the daemon's TCP listener (``agentvm up --listen 127.0.0.1:PORT``). There a
    request is the operator's when it carries the API's bearer token, or the cookie of a
    console session. A session starts from a one-time login link (``agentvm console``: a
    code minted over the unix socket, single use, valid ``CODE_TTL`` seconds), so the
    long-lived token never sits in a URL, a browser history or a screenshot.

What it defends against
    * CSRF: every form carries the session's CSRF token (compared in constant time); the
      cookie is ``SameSite=Strict`` and ``HttpOnly``; a POST whose ``Origin`` is not the
      console's own is refused.
    * DNS rebinding: on TCP the ``Host`` header must name the listener (or localhost at
      its port), else 421.
    * XSS: Jinja2 autoescaping, and a Content-Security-Policy that allows only the
      console's own script and style files (no inline code, no other origin, no framing).
      The live stream's rows are built with ``textContent``, never HTML.
    * Nothing from a sandbox is trusted: hosts, paths and reasons are data, escaped.

Every live action goes through the daemon's own handlers (the ones the API calls) with the
actor ``console``, so it is validated, applied and recorded on the audit chain exactly as
``agentvm stop`` or ``agentvm policy`` would be.
"""

from __future__ import annotations

import asyncio
import hmac

import jinja2
import json
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlencode

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from agentvm.errors import AgentVMError
from agentvm.policy_patch import AddRules, BudgetChange, SetCredential, SetPaused

if TYPE_CHECKING:  # pragma: no cover
    from agentvm.daemon.control import ControlPlane

HERE = Path(__file__).parent
COOKIE = "agentvm_console"
CODE_TTL = 60.0
SESSION_TTL = 12 * 3600.0
SESSION_IDLE = 3600.0  # a session unused this long ends (cookies reach every port of the host)
MAX_SESSIONS = 64
MAX_FORM = 16 * 1024
HEARTBEAT = 15.0
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
ACTOR = "console"


class Sessions:
    """One-time login codes and the sessions they start (in the daemon's memory: a daemon
    restart logs every browser out)."""

    def __init__(self) -> None:
        self.codes: dict[str, float] = {}
        self.sessions: dict[str, dict] = {}

    def mint_code(self) -> str:
        now = time.monotonic()
        self.codes = {c: t for c, t in self.codes.items() if t > now}
        if len(self.codes) >= 32:
            self.codes.pop(next(iter(self.codes)))
        code = secrets.token_urlsafe(24)
        self.codes[code] = now + CODE_TTL
        return code

    def redeem(self, code: str) -> tuple[str, dict] | None:
        now = time.monotonic()
        match = next((c for c in list(self.codes) if hmac.compare_digest(c.encode(), code.encode())), None)
        if match is None:
            return None
        expires = self.codes.pop(match)
        if expires <= now:
            return None
        self.sessions = {s: v for s, v in self.sessions.items() if v["expires"] > now}
        while len(self.sessions) >= MAX_SESSIONS:
            self.sessions.pop(next(iter(self.sessions)))
        sid = secrets.token_urlsafe(32)
        sess = {"csrf": secrets.token_urlsafe(24), "expires": now + SESSION_TTL, "seen": now}
        self.sessions[sid] = sess
        return sid, sess

    def get(self, sid: str | None) -> dict | None:
        if not sid:
            return None
        sess = self.sessions.get(sid)
        now = time.monotonic()
        if sess is None or sess["expires"] <= now or now - sess.get("seen", now) > SESSION_IDLE:
            if sess is not None:
                self.sessions.pop(sid, None)
            return None
        sess["seen"] = now
        return sess


class Console:
    def __init__(self, control: "ControlPlane", *, token: str | None = None, listen: str | None = None) -> None:
        self.d = control  # public ControlPlane methods only (agentvm.daemon.control)
        self.token, self.listen = token, listen
        self.sessions = Sessions()
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE / "templates")), autoescape=True)
        self.templates = Jinja2Templates(env=env)
        env.filters["ts"] = _ts
        env.filters["size"] = _size
        env.filters["dur"] = _dur
        env.filters["data"] = lambda v: json.dumps(v, sort_keys=True, ensure_ascii=False, default=str)  # escaped by autoescape
        self.app = Starlette(routes=[
            Route("/", self.index),
            Route("/login", self.login),
            Route("/favicon.ico", lambda request: RedirectResponse("/static/favicon.svg", status_code=301)),
            Route("/sandboxes/{name}", self.sandbox),
            Route("/sandboxes/{name}/action", self.sandbox_action, methods=["POST"]),
            Route("/decisions", self.decisions),
            Route("/decisions/stream", self.stream),
            Route("/audit", self.audit),
            Route("/approvals", self.approvals),
            Route("/approvals/{rid}/{answer}", self.approval_answer, methods=["POST"]),
            Mount("/static", app=StaticFiles(directory=str(HERE / "static")), name="static"),
        ])

    # ------------------------------------------------------------------ the ASGI entry
    async def __call__(self, scope, receive, send) -> None:
        """Authentication, host and origin checks, and the security headers, around the app."""
        request = Request(scope, receive)
        transport = scope.get("agentvm.transport")  # "unix" | "tcp", set by the daemon
        path = scope.get("path", "/")
        if transport == "tcp" and not self._host_ok(request):
            return await self._send(PlainTextResponse("misdirected request: this console answers only to the address "
                                                      "it listens on", status_code=421), scope, receive, send)
        scope["agentvm.session"] = None
        if not (path.startswith("/static/") or path in ("/login", "/favicon.ico")):
            who = self._who(request, transport)
            if who is None:
                return await self._send(self._page(request, "login.html", {"reason": "no session"}, status=401),
                                        scope, receive, send)
            scope["agentvm.session"] = who
        if request.method == "POST":
            origin = request.headers.get("origin")
            if origin is not None and origin != "null" and not self._same_origin(request, origin):
                return await self._send(PlainTextResponse("cross-origin request refused", status_code=403), scope,
                                        receive, send)
        await self.app(scope, receive, _with_headers(send))

    async def _send(self, response: Response, scope, receive, send) -> None:
        await response(scope, receive, _with_headers(send))

    def _who(self, request: Request, transport) -> dict | None:
        if transport == "unix":  # the owner-only socket: the operator (no browser can get here)
            return {"csrf": None, "via": "unix"}
        auth = request.headers.get("authorization", "")
        tok = self.token
        if tok and auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].encode(), tok.encode()):
            return {"csrf": None, "via": "token"}
        sess = self.sessions.get(request.cookies.get(COOKIE))
        return sess and {**sess, "via": "session"}

    def _host_ok(self, request: Request) -> bool:
        host = request.headers.get("host", "")
        listen = self.listen or ""
        port = listen.rpartition(":")[2]
        allowed = {listen, f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"}
        return host in allowed

    def _same_origin(self, request: Request, origin: str) -> bool:
        return origin == f"http://{request.headers.get('host', '')}"

    def _page(self, request: Request, name: str, ctx: dict, status: int = 200) -> Response:
        who = request.scope.get("agentvm.session") or {}
        base = {"request": request, "csrf": who.get("csrf") or "", "nav": name.split(".")[0]}
        return self.templates.TemplateResponse(request, name, {**base, **ctx}, status_code=status)

    async def _form(self, request: Request) -> dict[str, str]:
        """The posted form (urlencoded, bounded), its CSRF token checked for cookie sessions."""
        body = b""
        async for piece in request.stream():
            body += piece
            if len(body) > MAX_FORM:
                raise _Refused(413, "form too large")
        try:
            form = {k: v[-1] for k, v in parse_qs(body.decode("utf-8"), keep_blank_values=True).items()}
        except UnicodeDecodeError:
            raise _Refused(400, "the form is not UTF-8") from None
        who = request.scope.get("agentvm.session") or {}
        if who.get("via") == "session":
            sent = form.get("csrf", "")
            if not (who.get("csrf") and hmac.compare_digest(sent.encode(), who["csrf"].encode())):
                raise _Refused(403, "the form's CSRF token is missing or wrong: reload the page and try again")
        return form

    # ------------------------------------------------------------------ pages
    async def login(self, request: Request) -> Response:
        code = request.query_params.get("code", "")
        got = self.sessions.redeem(code) if code else None
        if got is None:
            return self._page(request, "login.html", {"reason": "expired" if code else "no session"}, status=401)
        sid, _sess = got
        self.d.record("console.login", actor=ACTOR, via=request.headers.get("host", ""))
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(COOKIE, sid, max_age=int(SESSION_TTL), httponly=True, samesite="strict", path="/")
        return resp

    async def index(self, request: Request) -> Response:
        rows = []
        for d in self.d.sandboxes():
            d["usage"] = self.d.usage(d["name"])
            d["syscalls"] = self._syscalls(d["name"])
            s = self.d.observer.summary.get(d["name"], {})
            d["denied"] = sum(v[1] for v in s.values())
            d["allowed"] = sum(v[0] for v in s.values())
            rows.append(d)
        pending = self._pending()
        return self._page(request, "index.html", {"rows": rows, "pending": len(pending) if pending is not None else None})

    async def sandbox(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            row = self.d.sandbox(name)
        except AgentVMError:
            return self._page(request, "error.html", {"message": f"no sandbox named {name!r}"}, status=404)
        view = self.d.policy_view(name)
        creds = self._credentials(name)
        recent = [r for r in reversed(self.d.observer.recent) if r.get("agent") == name][:100]
        return self._page(request, "sandbox.html", {
            "row": row, "usage": self.d.usage(name), "policy": view, "credentials": creds,
            # the DoH deny rules every sandbox gets are counted, not listed one by one
            "rules": [r for r in view["rules"] if not r["id"].startswith("doh:")],
            "doh": sum(1 for r in view["rules"] if r["id"].startswith("doh:")),
            "summary": self.d.observer.egress_summary(name), "recent": recent,
            "syscalls": self._syscalls(name),
            "flash": request.query_params.get("done", "")})

    def _syscalls(self, name: str) -> dict | None:
        """The sandbox's escape probes (agentvm.sysaudit): ``{denied, watched, suppressed, action,
        detached, on_probe}``, or None where its substrate does not audit syscalls (gVisor) or it
        is not running under this daemon."""
        m = getattr(self.d, "managed", {}).get(name)
        if m is None or m.handle is None:
            return None
        audit = getattr(m.backend, "syscall_audit", None)
        try:
            a = audit(m.handle) if audit is not None else None
            return a.summary() if a is not None else None
        except Exception:  # noqa: BLE001 - a sandbox between states: no column, not an error
            return None

    async def sandbox_action(self, request: Request) -> Response:
        name = request.path_params["name"]
        try:
            form = await self._form(request)
            action = form.get("action", "")
            if action in ("stop", "start"):
                if action == "stop":
                    await self.d.stop(name, actor=ACTOR)
                else:
                    self.d.row(name)
                    await self.d.start(name, actor=ACTOR)
            elif action in ("pause", "resume"):
                await self.d.change_policy(name, SetPaused(action == "pause"), actor=ACTOR)
            elif action in ("revoke", "restore"):
                await self.d.change_policy(name, SetCredential(form.get("credential", ""), action == "revoke"),
                                           actor=ACTOR)
            elif action == "budget":
                change = {}
                for k in ("tokens", "requests", "cost"):
                    v = form.get(k, "").strip()
                    if v:
                        try:
                            change[k] = float(v) if k == "cost" else int(v)
                        except ValueError:
                            raise _Refused(400, f"budget {k} is a number, not {v[:40]!r}") from None
                if not change:
                    raise _Refused(400, "give a new tokens, requests or cost limit")
                await self.d.change_policy(name, BudgetChange(**change), actor=ACTOR)
            elif action in ("allow", "deny"):
                rule = form.get("rule", "").strip()
                if not rule:
                    raise _Refused(400, "name a host (HOST or HOST:PORT)")
                await self.d.change_policy(name, AddRules(action, (rule,)), actor=ACTOR)
            else:
                raise _Refused(400, f"unknown action {action[:40]!r}")
        except _Refused as exc:
            return self._page(request, "error.html", {"message": exc.message}, status=exc.status)
        except Exception as exc:  # noqa: BLE001 - the API's own errors, shown as the CLI would
            return self._page(request, "error.html", {"message": _error_text(exc)}, status=getattr(exc, "status", 409))
        return RedirectResponse(f"/sandboxes/{_q(name)}?{urlencode({'done': action})}", status_code=303)

    async def decisions(self, request: Request) -> Response:
        f = _filters(request)
        rows = [r for r in reversed(self.d.observer.recent) if _match(r, f)][:300]
        names = sorted(set(self.d.names()) | {r.get("agent") for r in self.d.observer.recent
                                                                if r.get("agent")})
        return self._page(request, "decisions.html", {"rows": rows, "f": f, "names": names,
                                                       "query": urlencode({k: v for k, v in f.items() if v})})

    async def stream(self, request: Request) -> Response:
        """Server-sent events: each new decision that matches the filters, as JSON."""
        f = _filters(request)
        q = self.d.subscribe()  # unbounded: the daemon cuts a lagging reader off

        async def events():
            try:
                yield b"retry: 2000\n\n"
                while True:
                    try:
                        rec = await asyncio.wait_for(q.get(), HEARTBEAT)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    if rec is None:
                        return
                    if rec.get("kind") == "stream.lagged":  # the browser reconnects and reloads
                        yield b"event: lagged\ndata: " + json.dumps({"reason": rec["reason"]}).encode() + b"\n\n"
                        return
                    if rec.get("kind") != "egress" or not _match(rec, f):
                        continue
                    light = {k: rec.get(k) for k in ("time", "agent", "host", "port", "method", "path", "rule",
                                                      "verdict", "reason", "bytes_out", "bytes_in", "tool")}
                    yield b"data: " + json.dumps(light, default=str).encode() + b"\n\n"
            finally:
                self.d.unsubscribe(q)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-accel-buffering": "no"})

    async def audit(self, request: Request) -> Response:
        sandbox = request.query_params.get("sandbox") or None
        recs = self.d.audit_records(sandbox=sandbox, limit=200, newest=True)
        recs.reverse()
        verify = await asyncio.to_thread(self._verify)
        return self._page(request, "audit.html", {"records": recs, "verify": verify, "sandbox": sandbox or ""})

    async def approvals(self, request: Request) -> Response:
        try:
            items = self.d.approvals(all=True)
        except AgentVMError:  # (approvals.unavailable)
            return self._page(request, "approvals.html", {"available": False, "pending": [], "answered": []})
        pending = [r for r in items if r["state"] == "pending"]
        answered = sorted((r for r in items if r["state"] != "pending"), key=lambda r: -(r.get("answered") or 0))[:50]
        return self._page(request, "approvals.html", {"available": True, "pending": pending, "answered": answered,
                                                       "flash": request.query_params.get("done", "")})

    async def approval_answer(self, request: Request) -> Response:
        rid, answer = request.path_params["rid"], request.path_params["answer"]
        try:
            form = await self._form(request)
            if answer not in ("approve", "deny"):
                raise _Refused(404, "approve or deny")
            note = (form.get("note") or "")[:1000] or None
            digest = form.get("digest") or ""
            if answer == "approve" and not digest:
                # the page sends the digest of what it showed: an approval without one approves
                # something nobody was shown (a forged or stale form) - refused, never assumed
                raise _Refused(409, f"{rid}: an approval must name the digest of the request it was shown "
                               "(reload the approvals page and approve from there)")
            try:
                self.d.answer_approval(rid, answer == "approve", by=f"console:{ACTOR}", note=note, digest=digest or None)
            except AgentVMError as exc:
                if exc.code == "approvals.unavailable":
                    raise _Refused(503, "the approvals queue cannot be opened") from None
                raise _Refused(409, exc.message) from None
        except _Refused as exc:
            return self._page(request, "error.html", {"message": exc.message}, status=exc.status)
        return RedirectResponse(f"/approvals?{urlencode({'done': answer})}", status_code=303)

    # ------------------------------------------------------------------ helpers
    def _credentials(self, name: str) -> list[dict]:
        try:
            return self.d.credentials(name)
        except Exception:  # noqa: BLE001
            return []

    def _pending(self):
        try:
            return self.d.approvals()
        except AgentVMError:
            return None

    def _verify(self) -> dict:
        try:
            return self.d.audit_verify_readonly()
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "records": 0, "problem": _error_text(exc), "at_seq": None}


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _with_headers(send):
    async def wrapped(msg):
        if msg.get("type") == "http.response.start":
            headers = [(k, v) for k, v in msg.get("headers", []) if k.decode().lower() not in SECURITY_HEADERS]
            headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
            msg = {**msg, "headers": headers}
        await send(msg)
    return wrapped


def _filters(request: Request) -> dict[str, str]:
    qp = request.query_params
    verdict = qp.get("verdict", "")
    return {"sandbox": qp.get("sandbox", "")[:128], "verdict": verdict if verdict in ("allow", "deny", "ask") else "",
            "q": qp.get("q", "")[:200]}


def _match(rec: dict, f: dict) -> bool:
    if f["sandbox"] and rec.get("agent") != f["sandbox"]:
        return False
    if f["verdict"] and rec.get("verdict") != f["verdict"]:
        return False
    if f["q"]:
        hay = " ".join(str(rec.get(k) or "") for k in ("host", "path", "rule", "reason", "tool")).lower()
        if f["q"].lower() not in hay:
            return False
    return True


def _q(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


def _error_text(exc: BaseException) -> str:
    msg = getattr(exc, "message", None) or str(exc)
    hint = getattr(exc, "hint", "")
    return f"{msg} (hint: {hint})" if hint else msg


def _ts(t) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError):
        return "-"


def _size(n) -> str:
    if n is None or isinstance(n, jinja2.Undefined):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _dur(s) -> str:
    if s is None or isinstance(s, jinja2.Undefined):
        return "-"
    s = float(s)
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"

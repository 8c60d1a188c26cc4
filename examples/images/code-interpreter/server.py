"""A small code-interpreter server, compatible with what ``e2b-code-interpreter`` asks of E2B's.

It runs INSIDE the sandbox (the example image's start command), listens on the sandbox's own
loopback (127.0.0.1:49999, the port the SDK names), and agent-vm's E2B API proxies the SDK's
requests to it (``get_host``/``E2b-Sandbox-Port: 49999``). Code runs in real IPython kernels
(``ipykernel``) driven with ``jupyter_client``; only the Python standard library and those two
are used (Debian: python3-ipykernel, python3-jupyter-client).

The subset of E2B's code-interpreter server that ``e2b-code-interpreter`` 2.11.5 calls:

* ``POST /execute`` ``{code, context_id, language, env_vars}`` -> NDJSON lines, as they come:
  ``{"type": "stdout"|"stderr", "text", "timestamp"}`` (ns since the epoch), ``{"type": "result", "text", "html",
  "png", ..., "is_main_result"}``, ``{"type": "error", "name", "value", "traceback"}``,
  ``{"type": "number_of_executions", "execution_count"}``, ``{"type": "end_of_execution"}``;
* ``POST /contexts`` ``{language, cwd}``, ``GET /contexts``, ``DELETE /contexts/ID``,
  ``POST /contexts/ID/restart``: one kernel per context;
* ``GET /health``.

Python is the only language (a context of another language is refused with 400). Nothing here
authenticates: the sandbox's loopback is reached only through agent-vm's proxy, which does.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))
HOME = os.environ.get("CODE_INTERPRETER_CWD") or os.environ.get("HOME") or "/tmp"
RUNTIME = os.environ.get("JUPYTER_RUNTIME_DIR") or "/tmp/code-interpreter-runtime"
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript"}


class Context:
    def __init__(self, cid: str, language: str, cwd: str):
        self.id, self.language, self.cwd = cid, language, cwd
        self.lock = threading.Lock()
        self.km: KernelManager | None = None
        self.kc = None
        self.start()

    def start(self) -> None:
        os.makedirs(RUNTIME, mode=0o700, exist_ok=True)
        # unix sockets in the sandbox's /tmp, not TCP ports, between the server and its kernel
        self.km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(RUNTIME, f"k-{self.id}"))
        self.km.start_kernel(cwd=self.cwd if os.path.isdir(self.cwd) else None)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def stop(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:  # noqa: BLE001 - a kernel already gone
            pass

    def restart(self) -> None:
        with self.lock:
            self.stop()
            self.start()

    def doc(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def _silent(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        while True:
            m = self.kc.get_iopub_msg(timeout=60)
            if m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status" \
                    and m["content"]["execution_state"] == "idle":
                return

    def execute(self, code: str, env: dict[str, str] | None, out: "queue.Queue[dict | None]") -> None:
        """Run ``code``; put each output line's document on ``out``, then None."""
        with self.lock:
            try:
                if env:
                    self._silent("import os as __e2b_os\n__e2b_saved = {k: __e2b_os.environ.get(k) for k in %r}\n"
                                 "__e2b_os.environ.update(%r)" % (list(env), env))
                msg_id = self.kc.execute(code, store_history=True)
                while True:
                    m = self.kc.get_iopub_msg(timeout=None)
                    if m["parent_header"].get("msg_id") != msg_id:
                        continue
                    t, c = m["msg_type"], m["content"]
                    if t == "stream":
                        out.put({"type": "stdout" if c["name"] == "stdout" else "stderr", "text": c["text"],
                                 "timestamp": time.time_ns()})
                    elif t in ("execute_result", "display_data"):
                        doc = {"type": "result", "is_main_result": t == "execute_result"}
                        extra = {}
                        for mime, value in c.get("data", {}).items():
                            if mime in MIME:
                                doc[MIME[mime]] = value
                            else:
                                extra[mime] = value
                        if extra:
                            doc["extra"] = extra
                        out.put(doc)
                    elif t == "error":
                        out.put({"type": "error", "name": c["ename"], "value": c["evalue"],
                                 "traceback": "\n".join(c["traceback"])})
                    elif t == "execute_input":
                        out.put({"type": "number_of_executions", "execution_count": c["execution_count"]})
                    elif t == "status" and c["execution_state"] == "idle":
                        break
                if env:
                    self._silent("for __k, __v in __e2b_saved.items():\n"
                                 "    (__e2b_os.environ.pop(__k, None) if __v is None else "
                                 "__e2b_os.environ.__setitem__(__k, __v))")
                out.put({"type": "end_of_execution"})
            except Exception as exc:  # noqa: BLE001 - reported to the client as the execution's error
                out.put({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": ""})
            finally:
                out.put(None)


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id: dict[str, Context] = {}
        self.default: Context | None = None

    def get_default(self) -> Context:
        with self.lock:
            if self.default is None:
                self.default = Context("default", "python", HOME)
                self.by_id[self.default.id] = self.default
            return self.default

    def create(self, language: str, cwd: str) -> Context:
        ctx = Context(uuid.uuid4().hex, language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx


CONTEXTS = Contexts()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "agentvm-code-interpreter/1"

    def log_message(self, fmt, *args):
        sys.stderr.write("code-interpreter: " + (fmt % args) + "\n")

    def _json(self, status: int, doc) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > 16 << 20:
            raise ValueError("request too large")
        raw = self.rfile.read(n) if n else b""
        doc = json.loads(raw or b"{}")
        if not isinstance(doc, dict):
            raise ValueError("a JSON object is required")
        return doc

    def do_GET(self):
        if self.path == "/health":
            return self._json(200, "OK")
        if self.path == "/contexts":
            with CONTEXTS.lock:
                return self._json(200, [c.doc() for c in CONTEXTS.by_id.values()])
        self._json(404, {"error": f"no route {self.path}"})

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            with CONTEXTS.lock:
                ctx = CONTEXTS.by_id.pop(parts[1], None)
                if ctx is CONTEXTS.default:
                    CONTEXTS.default = None
            if ctx is None:
                return self._json(404, {"error": f"context {parts[1]} not found"})
            ctx.stop()
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._json(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        try:
            body = self._body()
        except ValueError as exc:
            return self._json(400, {"error": str(exc)})
        parts = self.path.strip("/").split("/")
        if parts == ["contexts"]:
            lang = (body.get("language") or "python").lower()
            if lang != "python":
                return self._json(400, {"error": f"language {lang!r} is not available in this image (python only)"})
            return self._json(200, CONTEXTS.create(lang, body.get("cwd") or HOME).doc())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            ctx = CONTEXTS.by_id.get(parts[1])
            if ctx is None:
                return self._json(404, {"error": f"context {parts[1]} not found"})
            ctx.restart()
            return self._json(200, ctx.doc())
        if parts == ["execute"]:
            return self._execute(body)
        self._json(404, {"error": f"no route {self.path}"})

    def _execute(self, body: dict) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            return self._json(400, {"error": "code is required"})
        cid, lang = body.get("context_id"), (body.get("language") or "python").lower()
        if cid:
            ctx = CONTEXTS.by_id.get(cid)
            if ctx is None:
                return self._json(404, {"error": f"context {cid} not found"})
        elif lang != "python":
            return self._json(400, {"error": f"language {lang!r} is not available in this image (python only)"})
        else:
            ctx = CONTEXTS.get_default()
        env = body.get("env_vars") or None
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in env.items())):
            return self._json(400, {"error": "env_vars maps strings to strings"})
        out: queue.Queue = queue.Queue()
        threading.Thread(target=ctx.execute, args=(code, env, out), daemon=True).start()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                doc = out.get()
                if doc is None:
                    break
                line = json.dumps(doc).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the client went away: stop the cell
            try:
                ctx.km.interrupt_kernel()
            except Exception:  # noqa: BLE001
                pass


def main() -> None:
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # the kernel's debugger: no warning per start
    t0 = time.monotonic()
    CONTEXTS.get_default()  # the first run_code does not wait for a kernel
    srv = ThreadingHTTPServer(("127.0.0.1", PORT), Handler)
    srv.daemon_threads = True
    print(f"code-interpreter: listening on 127.0.0.1:{PORT} (kernel ready in {time.monotonic() - t0:.1f}s)",
          flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()

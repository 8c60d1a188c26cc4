"""`agentvm run` through a daemon that is up: the thin client.

Everything a run needs happens in the daemon (policy, sandbox, gate, audit); the client sends
the command line as typed and relays the output stream.

Two ways in:

- :func:`fast_run` - ``agentvm run [--] CMD...`` with no options, no terminal and no stdin to
  send: it imports nothing beyond the interpreter's own start-up set (the C ``_socket`` and
  ``_json`` modules; no ``json``, ``socket``, ``argparse`` or ``re``, which cost more than the
  rest of the client on a small machine). The daemon answers in frames (output bytes as they
  come, then the exit code and the report already rendered by :mod:`agentvm.runreport`), so
  the client parses no JSON either. Anything else returns None and takes the full path;
- :func:`connect` and :func:`run_stream` - the full path's client (one HTTP/1.1 request, a
  chunked NDJSON response), used with every option;
- :func:`attach` - an interactive session (stdin relayed, a terminal, signals): an upgraded
  connection of frames both ways (docs/daemon.md "Interactive sessions"), for ``run`` with a
  pipe or a terminal on stdin and for ``exec -i`` / ``exec -it``.
"""

from __future__ import annotations

import os
import sys

DEFAULT_TIMEOUT = 60.0
MAX_PIECE = 16 << 20  # bytes of one chunk or one frame (the daemon's are at most 64 KiB)
FRAMES_PATH = "/v1/run/frames"  # the daemon's framed run (a daemon without it answers 404, having run nothing)
FRAMES_TYPE = "application/x-agentvm-frames"

# every option of `agentvm run` at its default: what the full path would send for `run -- CMD`
_NO_OPTIONS = ('"cli":{"mounts":[],"env":[],"timeout":null,"memory":null,"allow":[],"add_host":[],'
               '"network":null,"substrate":null,"image":null}')


def socket_path() -> str:
    """The daemon's socket, by the rules of ``agentvm.locations`` (as the library's paths)."""
    from agentvm.locations import default_dirs

    return os.path.join(default_dirs()[1], "agentvm.sock")


def _timeout() -> float:
    """AGENTVM_CLIENT_TIMEOUT, seconds: a positive finite number, else the default."""
    try:
        t = float(os.environ.get("AGENTVM_CLIENT_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT
    return t if 0 < t < 1e9 else DEFAULT_TIMEOUT


def stdin_kind() -> str:
    """What is on stdin, for the daemon: "stream" (a pipe, a socket, a terminal or another
    character device but /dev/null: it could stream forever - relayed in an interactive
    session), "file" (a regular file), else "none"."""
    import stat

    try:
        st = os.fstat(0)
    except OSError:
        return "none"  # closed: nothing to send
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        return "stream"
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISCHR(st.st_mode):
        try:
            dn = os.stat(os.devnull)
        except OSError:
            return "stream"
        return "none" if (st.st_rdev, st.st_ino) == (dn.st_rdev, dn.st_ino) else "stream"
    return "none"


def fast_run(argv: list[str]) -> int | None:
    """Run ``argv`` (what follows ``run``) through the daemon if it is the plain form and a
    daemon is listening; its exit code, or None for the full path."""
    if not argv:
        return None
    if argv[0] == "--":
        command = argv[1:]
    elif argv[0].startswith("-"):
        return None  # an option: the full path parses it
    else:
        command = argv
    if not command or os.environ.get("AGENTVM_NO_DAEMON") == "1":
        return None
    if os.isatty(0) and os.isatty(1):
        return None  # a terminal: the full path decides whether the sandbox gets one
    if stdin_kind() != "none":
        # a pipe (or a file, a terminal that is not also stdout) to relay: an interactive
        # session, still without argparse or the full client
        from agentvm.errors import AgentVMError

        try:
            from _json import encode_basestring_ascii as q
        except ImportError:
            from json.encoder import encode_basestring_ascii as q
        body = ('{"command":[' + ",".join(q(a) for a in command) + "]," + _NO_OPTIONS + "}").encode("ascii")
        try:
            return attach_run(command, body)
        except AgentVMError as err:
            from agentvm.cli.report import report_error

            return report_error(err)
    try:
        import _socket
    except ImportError:  # not CPython: the full path
        return None
    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:
        from json.encoder import encode_basestring_ascii as quote
    sock = _connect(_socket)
    if sock is None:
        return None  # no daemon listening: the run is embedded
    body = ('{"command":[' + ",".join(quote(a) for a in command) + "]," + _NO_OPTIONS + "}").encode("ascii")
    timeout = _timeout()
    sock.settimeout(timeout)
    try:
        sock.sendall(_post_run(body, FRAMES_PATH))
        r = _Reader(sock, timeout)
        status, headers = r.head()
        r.deadline = None
    except (TimeoutError, OSError) as exc:
        sock.close()
        return _say(_unavailable(timeout, exc))
    if status == 404:
        sock.close()
        return None  # a daemon from before frames: nothing ran; the full path asks it its way
    if status >= 300:  # a refusal before the run: said as the full path says it
        from agentvm.errors import AgentVMError

        try:
            for _ in _events(r, status, headers):
                pass
        except AgentVMError as err:
            from agentvm.cli.report import report_error

            return report_error(err)
        except (TimeoutError, OSError, ValueError) as exc:
            return _say(_unavailable(timeout, exc))
        finally:
            sock.close()
    if headers.get("content-type") != FRAMES_TYPE:
        sock.close()  # the run may have started: never asked for a second time
        return _say("agentvm: the daemon answered the run in a form this client does not read; nothing was "
                    "shown of it (see `agentvm runs`)\n", 125)
    sock.settimeout(None)  # the stream is as long as the run; the answer came in time
    out, err = sys.stdout.buffer, sys.stderr.buffer
    fo, fe = output_filters()
    try:
        frames = _Frames(r, headers)
        while True:
            kind, payload = frames.next()
            if kind == b"o":
                out.write(fo.feed(payload) if fo else payload)
                out.flush()
            elif kind == b"e":
                err.write(fe.feed(payload) if fe else payload)
                err.flush()
            elif kind == b"x":  # the end: "CODE\n" and what to print on stderr
                code, nl, text = payload.partition(b"\n")
                if not nl or not 0 < len(code) <= 3 or not code.isdigit() or not code.isascii() or int(code) > 255:
                    raise ConnectionError("a malformed end frame")
                if text:
                    out.flush()
                    err.write(report_text(fe, text))
                    err.flush()
                return int(code)
            else:
                raise ConnectionError(f"unknown frame {kind!r}")
    except BrokenPipeError:
        # our reader went away (`| head`): dropping the connection makes the daemon stop the run
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130
    except (ConnectionError, ValueError, OSError) as exc:
        return _say(f"agentvm: the daemon ended the run without a result ({exc})\n", 125)
    finally:
        sock.close()


def output_filters(raw: bool = False) -> tuple:
    """(stdout's, stderr's) filter of the sandbox's output (agentvm.termfilter): one for each
    that is a terminal, None where bytes pass exact (a pipe, a file; ``--raw-output``,
    AGENTVM_RAW_OUTPUT=1). The filter's module is imported only for a terminal."""
    if raw or os.environ.get("AGENTVM_RAW_OUTPUT") == "1":
        return None, None
    t1, t2 = os.isatty(1), os.isatty(2)
    if not (t1 or t2):
        return None, None
    from agentvm.termfilter import TermFilter

    return (TermFilter() if t1 else None), (TermFilter() if t2 else None)


def report_text(f, text: bytes) -> bytes:
    """The report the daemon rendered, written after the run's output through ``f``: what the
    sandbox left incomplete is dropped first (it does not swallow the report)."""
    if f is None:
        return text
    f.finish()
    shown = f.feed(text)
    f.finish()
    return shown


def _say(text_or_err, code: int = 0) -> int:
    if isinstance(text_or_err, tuple):
        text_or_err, code = text_or_err
    sys.stderr.write(text_or_err)
    return code


def daemon_log() -> str:
    """The daemon's log, where ``agentvm up`` writes it (``<home>/daemon.log``)."""
    from agentvm.locations import default_dirs

    return os.path.join(default_dirs()[0], "daemon.log")


def _timed_out(timeout: float) -> tuple[str, str]:
    """(message, hint) of a daemon that did not answer in time, for both clients."""
    from agentvm.cli.report import daemon_timeout_hint

    return f"the agent-vm daemon did not answer within {timeout:g}s ({socket_path()})", daemon_timeout_hint()


def _unavailable(timeout: float, exc: BaseException) -> tuple[str, int]:
    from agentvm.runreport import error_text

    if isinstance(exc, TimeoutError):
        return error_text("daemon.timeout", *_timed_out(timeout)), 125
    return error_text("daemon.unavailable", f"the agent-vm daemon broke off the connection ({exc})",
                      f"see the daemon's log: {daemon_log()}"), 125


def _chunk_size(line: bytes) -> int:
    """A chunk-size line: hex digits only (no sign, no 0x, no spaces), at most MAX_PIECE."""
    size = line.split(b";")[0]
    if not 0 < len(size) <= 8 or size.strip(b"0123456789abcdefABCDEF"):
        raise ConnectionError("a malformed chunk")
    n = int(size, 16)
    if n > MAX_PIECE:
        raise ConnectionError("a chunk over the size limit")
    return n


class _Frames:
    """The run's frames, across the HTTP chunks: ``KIND LENGTH\\n PAYLOAD``."""

    def __init__(self, r: "_Reader", headers: dict) -> None:
        self.r = r
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self.buf = b""

    def _more(self) -> None:
        if not self.chunked:
            data = self.r.some()
            if not data:
                raise ConnectionError("the daemon closed the connection mid-answer")
            self.buf += data
            return
        n = _chunk_size(self.r.line())
        if n == 0:
            raise ConnectionError("the daemon's answer ended before the run's result")
        self.buf += self.r.exactly(n)
        if self.r.exactly(2) != b"\r\n":
            raise ConnectionError("a malformed chunk")

    def next(self) -> tuple[bytes, bytes]:
        while b"\n" not in self.buf:
            if len(self.buf) > 10:  # a kind and 9 digits at most
                raise ConnectionError("a malformed frame")
            self._more()
        head, _, self.buf = self.buf.partition(b"\n")
        kind, digits = head[:1], head[1:]
        if not 0 < len(digits) <= 9 or not digits.isdigit() or not digits.isascii():
            raise ConnectionError("a malformed frame")
        n = int(digits)
        if n > MAX_PIECE:
            raise ConnectionError("a frame over the size limit")
        while len(self.buf) < n:
            self._more()
        payload, self.buf = self.buf[:n], self.buf[n:]
        return kind, payload


class _Reader:
    def __init__(self, sock, timeout: float | None = None) -> None:
        import time

        self.sock = sock
        self.buf = b""
        self._clock = time.monotonic
        self.deadline = self._clock() + timeout if timeout else None  # the whole head, not each read

    def _fill(self) -> bool:
        if self.deadline is not None:
            left = self.deadline - self._clock()
            if left <= 0:
                raise TimeoutError("the head did not arrive in time")
            self.sock.settimeout(left)
        data = self.sock.recv(65536)
        if not data:
            return False
        self.buf += data
        return True

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if len(self.buf) > 65536:  # no daemon's line is this long
                raise ConnectionError("a line over 64 KiB")
            if not self._fill():
                raise ConnectionError("the daemon closed the connection mid-answer")
        ln, _, self.buf = self.buf.partition(b"\r\n")
        return ln

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("the daemon closed the connection mid-answer")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def some(self) -> bytes:
        if not self.buf:
            self._fill()
        out, self.buf = self.buf, b""
        return out

    def head(self) -> tuple[int, dict]:
        """The status code and the headers (names lower-cased)."""
        status_line = self.line().decode("latin-1")
        try:
            status = int(status_line.split()[1])
        except (IndexError, ValueError):
            raise ConnectionError(f"not an HTTP answer: {status_line[:80]!r}") from None
        headers = {}
        while True:
            ln = self.line()
            if not ln:
                return status, headers
            k, _, v = ln.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()

    def rest(self) -> bytes:
        while self._fill():
            if len(self.buf) > MAX_PIECE:
                raise ConnectionError("an answer over the size limit")
        out, self.buf = self.buf, b""
        return out


def connect():
    """A connection to the daemon, or None when none is listening (then the run is embedded)."""
    import socket

    return _connect(socket)


def _connect(module):
    """A unix-socket connection to the daemon made with ``module`` (``socket``, or the thin
    client's ``_socket``), or None when none is listening."""
    s = module.socket(module.AF_UNIX, module.SOCK_STREAM)
    try:
        s.connect(socket_path())
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError, PermissionError):
        s.close()
        return None
    return s


def _post_run(body: bytes, path: str = "/v1/run") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), len(body))) + body


def run_stream(sock, doc: dict):
    """POST /v1/run on ``sock``; yields the events (``data`` decoded). A refusal - before the
    stream or inside it - raises the same error the embedded path raises."""
    import json

    timeout = _timeout()
    sock.settimeout(timeout)
    try:
        sock.sendall(_post_run(json.dumps(doc).encode()))
        r = _Reader(sock, timeout)
        status, headers = r.head()
        r.deadline = None
    except TimeoutError:
        sock.close()
        from agentvm.daemon.apierror import DaemonUnavailable

        message, hint = _timed_out(timeout)
        raise DaemonUnavailable(message, hint=hint, code="daemon.timeout") from None
    try:
        if status < 300:
            sock.settimeout(None)  # the stream is as long as the run; the answer came in time
        yield from _events(r, status, headers)
    finally:
        sock.close()


def _events(r: _Reader, status: int, headers: dict):
    """The NDJSON events of an answer whose head was read; an error answer, or an error event
    in the stream, raises the same error the embedded path raises."""
    import binascii
    import json

    chunked = headers.get("transfer-encoding", "").lower() == "chunked"

    def chunks():
        if chunked:
            while True:
                size = _chunk_size(r.line())
                if size == 0:
                    return
                yield r.exactly(size)
                if r.exactly(2) != b"\r\n":
                    raise ConnectionError("a malformed chunk")
        elif "content-length" in headers:
            n = headers["content-length"]
            if not n.isdigit() or int(n) > MAX_PIECE:
                raise ConnectionError("a malformed Content-Length")
            yield r.exactly(int(n))
        else:
            data = r.rest()
            if len(data) > MAX_PIECE:
                raise ConnectionError("an answer over the size limit")
            yield data

    if status >= 300:
        data = b"".join(chunks())
        try:
            doc_ = json.loads(data or b"{}")
        except ValueError:
            doc_ = {}
        from agentvm.daemon.apierror import error_from

        raise error_from(doc_ if isinstance(doc_, dict) else {}, status)
    pending = b""
    for chunk in chunks():
        pending += chunk
        while b"\n" in pending:
            ln, _, pending = pending.partition(b"\n")
            if not ln.strip():
                continue
            ev = json.loads(ln)
            if isinstance(ev, dict) and isinstance(ev.get("error"), dict):
                from agentvm.daemon.apierror import error_from

                raise error_from(ev["error"])
            if "data" in ev:
                ev["data"] = binascii.a2b_base64(ev["data"])
            yield ev


# ---------------------------------------------------------------- interactive sessions
ATTACH_PATH = "/v1/run/attach"
ATTACH_PROTOCOL = "agentvm-frames/1"
IN_FRAME = 65536  # bytes of stdin per frame (the daemon's limit)
OUT_PENDING = 256 * 1024  # bytes queued for the daemon before stdin is no longer read (back-pressure)
_SIGNAL_NAMES = {2: b"INT", 15: b"TERM", 1: b"HUP", 3: b"QUIT"}


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + str(len(payload)).encode() + b"\n" + payload


def _term_size(fd: int) -> tuple[int, int] | None:
    import fcntl
    import struct
    import termios

    try:
        rows, cols = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))[:2]
    except OSError:
        return None
    return (rows or 24, cols or 80)


def attach_body(doc_json: bytes, tty: bool) -> bytes:
    """The request body of an interactive session: the run's (or exec's) JSON object, with the
    terminal's size when it has one (``doc_json`` ends in ``}``)."""
    if not tty:
        return doc_json
    rows, cols = _term_size(0) or _term_size(1) or (24, 80)
    return doc_json[:-1] + b',"tty":{"rows":%d,"cols":%d}}' % (rows, cols)


def attach(sock, path: str, body: bytes, *, tty: bool = False, report_to_stdout: bool = False,
           headers: bytes = b"", raw_output: bool = False) -> int | None:
    """An interactive session on ``sock`` (docs/daemon.md "Interactive sessions"): POST ``path``
    with ``body`` asking for the upgrade, then frames both ways - this process's stdin as ``i``
    frames (``c`` at its end), the terminal's size changes (SIGWINCH) as ``w``, SIGINT /
    SIGTERM / SIGHUP / SIGQUIT as ``s``; ``o``/``e`` to stdout/stderr until ``x``. With
    ``tty`` a terminal on stdin is put in raw mode (restored after). Returns the exit code;
    None when the daemon has no such route (404: nothing ran); a refusal raises the error the
    embedded path raises. Bounded: at most OUT_PENDING bytes wait for the daemon (then stdin
    is not read), output is written before more is read (the daemon waits on us). Output to a
    terminal goes through agentvm.termfilter unless ``raw_output`` (or AGENTVM_RAW_OUTPUT=1)."""
    import select
    import signal

    timeout = _timeout()
    sock.settimeout(timeout)
    head = (b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: Upgrade\r\nUpgrade: %s\r\n%s\r\n" % (path.encode(), len(body), ATTACH_PROTOCOL.encode(),
                                                              headers))
    try:
        sock.sendall(head + body)
        r = _Reader(sock, timeout)
        status, headers = r.head()
        r.deadline = None
    except TimeoutError:
        sock.close()
        from agentvm.daemon.apierror import DaemonUnavailable

        message, hint = _timed_out(timeout)
        raise DaemonUnavailable(message, hint=hint, code="daemon.timeout") from None
    if status == 404:
        sock.close()
        return None
    if status != 101:
        try:
            for _ in _events(r, status if status >= 300 else 502, headers):
                pass
        finally:
            sock.close()
        raise ConnectionError(f"the daemon answered {status} to an interactive session")
    sock.settimeout(None)
    sock.setblocking(False)
    fo, fe = output_filters(raw_output)
    inbuf = bytearray(r.buf)
    out = bytearray()
    stdin_open = True
    raw_saved = None
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_handlers: dict = {}
    old_wakeup = None

    def on_signal(signum, _frame_):
        if signum == signal.SIGWINCH:
            size = _term_size(0)
            if size:
                out.extend(_frame(b"w", b"%d %d" % size))
        elif signum in _SIGNAL_NAMES:
            out.extend(_frame(b"s", _SIGNAL_NAMES[signum]))

    try:
        if tty and os.isatty(0):
            import termios
            import tty as tty_

            raw_saved = termios.tcgetattr(0)
            tty_.setraw(0, termios.TCSADRAIN)  # what was typed ahead is kept, not flushed
        for sig in ([signal.SIGWINCH] if tty else []) + [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT]:
            old_handlers[sig] = signal.signal(sig, on_signal)
        old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        poller = select.poll()
        sfd = sock.fileno()
        while True:
            poller.register(sfd, select.POLLIN | (select.POLLOUT if out else 0))
            if stdin_open and len(out) < OUT_PENDING:
                poller.register(0, select.POLLIN)
            else:
                try:
                    poller.unregister(0)
                except KeyError:
                    pass
            poller.register(wake_r, select.POLLIN)
            ready = dict(poller.poll())
            if wake_r in ready:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
            if stdin_open and 0 in ready:
                try:
                    data = os.read(0, IN_FRAME)
                except OSError:
                    data = b""  # a terminal that hung up: its end
                if data:
                    out.extend(_frame(b"i", data))
                else:
                    out.extend(_frame(b"c"))
                    stdin_open = False
            if out and ready.get(sfd, 0) & select.POLLOUT:
                try:
                    out[:sock.send(out)] = b""
                except BlockingIOError:
                    pass
            if ready.get(sfd, 0) & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                if not data:
                    raise ConnectionError("the daemon closed the connection mid-session")
                inbuf += data
                while True:
                    nl = inbuf.find(b"\n", 0, 11)
                    if nl < 0:
                        if len(inbuf) > 10:
                            raise ConnectionError("a malformed frame")
                        break
                    digits = bytes(inbuf[1:nl])
                    if not 0 < len(digits) <= 9 or not digits.isdigit() or not digits.isascii():
                        raise ConnectionError("a malformed frame")
                    n = int(digits)
                    if n > MAX_PIECE:
                        raise ConnectionError("a frame over the size limit")
                    if len(inbuf) < nl + 1 + n:
                        break
                    kind, payload = inbuf[:1], bytes(inbuf[nl + 1:nl + 1 + n])
                    del inbuf[:nl + 1 + n]
                    if kind == b"o":
                        _write_all(1, fo.feed(payload) if fo else payload)
                    elif kind == b"e":
                        _write_all(2, fe.feed(payload) if fe else payload)
                    elif kind == b"x":
                        code, nl2, text = payload.partition(b"\n")
                        if not nl2 or not 0 < len(code) <= 3 or not code.isdigit() or int(code) > 255:
                            raise ConnectionError("a malformed end frame")
                        if raw_saved is not None:
                            import termios

                            termios.tcsetattr(0, termios.TCSADRAIN, raw_saved)
                            raw_saved = None
                        if text:
                            _write_all(1 if report_to_stdout else 2,
                                       report_text(fo if report_to_stdout else fe, text))
                        return int(code)
                    else:
                        raise ConnectionError(f"unknown frame {bytes(kind)!r}")
    finally:
        if raw_saved is not None:
            import termios

            termios.tcsetattr(0, termios.TCSADRAIN, raw_saved)
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        os.close(wake_r)
        os.close(wake_w)
        sock.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def attach_run(command: list[str], body: bytes | None = None, *, tty: bool = False) -> int | None:
    """``agentvm run`` of ``command`` (or of the JSON ``body``) as an interactive session when a
    daemon is listening; the exit code, or None (no daemon, or one without the route)."""
    sock = connect()
    if sock is None:
        return None
    if body is None:
        from json import dumps

        body = ('{"command":' + dumps(command) + "," + _NO_OPTIONS + "}").encode()
    try:
        return attach(sock, ATTACH_PATH, attach_body(body, tty), tty=tty)
    except BrokenPipeError:
        # our reader went away (`| head`): dropping the connection makes the daemon stop the run
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ConnectionError, OSError, ValueError) as exc:
        return _say(f"agentvm: the daemon ended the run without a result ({exc})\n", 125)

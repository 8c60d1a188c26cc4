"""Interactive sessions: the sandbox gets a pseudo-terminal of its own; agent-vm relays
between it and the operator's terminal (raw mode, window size, timeout).

The sandbox never holds the operator's real terminal, so a TIOCSTI-style injection could
only ever reach its own pty (and seccomp refuses TIOCSTI anyway).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import sys
import termios
import time
import tty

from agentvm.backends.base import ExitStatus


def _copy_winsize(src_fd: int, dst_fd: int) -> None:
    try:
        ws = fcntl.ioctl(src_fd, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(dst_fd, termios.TIOCSWINSZ, ws)
    except OSError:
        pass


class PtySession:
    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        os.set_blocking(self.master, False)
        self.stdin = sys.stdin.fileno()
        self.stdout = sys.stdout.fileno()
        self._saved = None
        self._old_winch = None

    def __enter__(self) -> "PtySession":
        _copy_winsize(self.stdin, self.slave)
        if os.isatty(self.stdin):
            self._saved = termios.tcgetattr(self.stdin)
            tty.setraw(self.stdin)
        self._old_winch = signal.signal(signal.SIGWINCH, lambda *_: _copy_winsize(self.stdin, self.master))
        return self

    def close_slave(self) -> None:
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            termios.tcsetattr(self.stdin, termios.TCSADRAIN, self._saved)
        if self._old_winch is not None:
            signal.signal(signal.SIGWINCH, self._old_winch)
        self.close_slave()
        os.close(self.master)

    def relay(self, backend, handle, timeout: float) -> ExitStatus:
        deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
        stdin_open = True
        while True:
            if deadline is not None and time.monotonic() > deadline:
                return backend.wait(handle, timeout=0.001)
            poller = select.poll()  # poll, not select: descriptor numbers above 1024 are fine
            for fd in [self.master] + ([self.stdin] if stdin_open else []):
                poller.register(fd, select.POLLIN)
            try:
                # a hang-up is readable too: the read below sees the EOF / EIO
                r = [fd for fd, _ in poller.poll(50)]
            except InterruptedError:
                continue
            if self.master in r:
                try:
                    data = os.read(self.master, 65536)
                except OSError as exc:
                    if exc.errno == errno.EIO:  # every slave closed: the session is over
                        data = b""
                    elif exc.errno == errno.EAGAIN:
                        data = None
                    else:
                        raise
                if data == b"":
                    break
                if data:
                    os.write(self.stdout, data)
            if stdin_open and self.stdin in r:
                data = os.read(self.stdin, 65536)
                if not data:
                    stdin_open = False
                else:
                    os.write(self.master, data)
            if backend.poll(handle):
                # drain what is left
                try:
                    while True:
                        data = os.read(self.master, 65536)
                        if not data:
                            break
                        os.write(self.stdout, data)
                except OSError:
                    pass
                break
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        return backend.wait(handle, timeout=remaining)

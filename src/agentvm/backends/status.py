"""Reading status streams from a pipe without mistaking a partial read for an answer.

bwrap reports on ``--json-status-fd`` as a stream of JSON objects (``{ "child-pid": N ... }``
when the sandbox exists, ``{ "exit-code": N }`` when it ends). A pipe delivers them in
whatever pieces the kernel likes, so nothing here ever tests a substring of a partial
buffer: :class:`JsonStatusParser` is sans-IO (bytes in, complete documents out), and
:func:`read_until` is the one loop that feeds it from a file descriptor until the caller's
question is answered, the writer closes, or a deadline passes.

``poll`` rather than ``select``: the daemon can hold more than 1,024 descriptors.
"""

from __future__ import annotations

import codecs
import json
import os
import select
import time
from collections.abc import Callable


class JsonStatusParser:
    """Incremental parser of a stream of JSON objects (whitespace between them optional).

    ``feed`` returns the documents completed by that piece; a document is only ever returned
    whole. Text that cannot be the start of a JSON object makes the stream ``broken`` (the
    rest is ignored): bwrap never writes that, so a caller treats it as a failed launch.
    """

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._json = json.JSONDecoder()
        self._text = ""
        self.docs: list[dict] = []
        self.eof = False
        self.broken = False

    def feed(self, data: bytes) -> list[dict]:
        if self.eof or self.broken:
            return []
        self._text += self._dec.decode(data)
        return self._parse(final=False)

    def close(self) -> list[dict]:
        """The writer is gone: whatever is left is either complete or never will be."""
        if self.eof:
            return []
        self._text += self._dec.decode(b"", final=True)
        new = [] if self.broken else self._parse(final=True)
        self.eof = True
        if self._text.strip():
            self.broken = True  # a truncated document
        return new

    def _parse(self, *, final: bool) -> list[dict]:
        new: list[dict] = []
        text = self._text.lstrip()
        while text:
            if text[0] != "{":
                self.broken = True
                break
            try:
                doc, end = self._json.raw_decode(text)
            except ValueError:
                # incomplete so far (an object only parses once its closing brace is in);
                # at the end of the stream the caller sees the leftover as ``broken``
                break
            if isinstance(doc, dict):
                new.append(doc)
            text = text[end:].lstrip()
        self._text = text
        self.docs += new
        return new

    def first(self, key: str):
        """The value of ``key`` in the first complete document that has it, else None."""
        return next((d[key] for d in self.docs if key in d), None)


def read_until(fd: int, parser: JsonStatusParser, done: Callable[[], bool], deadline: float) -> bool:
    """Feed ``parser`` from ``fd`` until ``done()`` is true, the writer closes, or ``deadline``
    (a ``time.monotonic()`` value) passes. Returns ``done()``. Never blocks past the deadline."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while not done() and not parser.eof and not parser.broken:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            ready = poller.poll(max(1, int(min(remaining, 0.25) * 1000)))
        except InterruptedError:
            continue
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if data:
            parser.feed(data)
        else:
            parser.close()
    return done()


def drain(fd: int | None) -> bytes:
    """Everything readable on ``fd`` right now, without waiting (for a pipe whose writer has
    exited, that is all of it)."""
    if fd is None:
        return b""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    chunks = []
    while poller.poll(0):
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)

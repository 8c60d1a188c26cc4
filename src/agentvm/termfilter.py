"""What a sandboxed program writes, made safe for the operator's terminal.

A terminal acts on some of the bytes it is given: it can write the operator's clipboard
(OSC 52), report on itself by typing its answer into its own input (DSR ``CSI 6n``, DA
``CSI c``, DECRQSS ``DCS $ q``, XTGETTCAP ``DCS + q``, colour queries ``OSC 11;?``, window
reports ``CSI 21 t``, ENQ's answerback...; the answer lands in the operator's shell once the
client exits), set its window title, define keys. When the client's stdout (or stderr, each on
its own) is a terminal, the sandbox's output goes through :class:`TermFilter`, a streaming state
machine that keeps what interactive programs need (text, SGR colours, cursor movement, erasing,
scrolling regions, modes such as the alternate screen, bracketed paste and the mouse, OSC 8
hyperlinks) and removes the rest:

* every answer-back query: CSI ``n`` (DSR), ``c`` (DA1/2/3), ``t`` (window operations and
  reports), ``x`` (DECREQTPARM), ``$ p`` (DECRQM), ``> q`` (XTVERSION), ``? u`` (keyboard
  protocol query), ``? S`` (XTSMGRAPHICS), ``? m`` (XTQMODKEYS), ``* y`` (DECRQCRA), ``' w``,
  ``$ w``, ``$ u``, ``& u``, ``" v``, ``# |``, ``' |``; ``ESC Z`` (DECID); ENQ (0x05);
* every DCS, SOS, PM and APC string (DECRQSS, XTGETTCAP, DECUDK, sixel, tmux pass-through,
  kitty graphics);
* every OSC but an allow-list: 8 (hyperlink), 133 (prompt marks), and the colour settings 4,
  10-19, 104, 110-119 unless an item is ``?`` (a query). So OSC 52, the titles (OSC 0/1/2: a
  program in the sandbox does not name the operator's window) and OSC 7 (the working directory:
  many terminals open new tabs there, so the sandbox could steer the operator into a folder it
  prepared, where a git-aware prompt runs its hooks) go;
* the C1 controls in their UTF-8 form (U+0080-U+009F, ``c2 80``-``c2 9f``), which some
  terminals act on as 8-bit CSI/OSC/DCS, and every byte above ASCII that is not part of a
  well-formed UTF-8 sequence (a stray continuation byte such as a raw 8-bit ``9b``/``9d``,
  overlong forms, surrogates, ``c0``/``c1``/``f5``-``ff``): the output is valid UTF-8 whatever
  mode the terminal is in. A sequence is written only whole, so no dropped sequence between
  its bytes can join a lead with a later ``9b`` into U+009B;
* ``ESC %`` but ``ESC % G`` (the others take the terminal out of UTF-8, after which raw C1
  bytes would act), screen's title string ``ESC k ... ESC \\``, DECRQLP ``CSI ' |``.

A sequence is held only until its end: one longer than ``limit`` bytes is dropped (its
introducer never reaches the terminal, the rest is plain text), never buffered without bound.
A sequence is also cut short where a terminal would end or cancel it (CAN, SUB, a new ESC, a
control byte inside it): nothing kept ever spans a byte the terminal might read differently.
``finish()`` drops a sequence left incomplete (the next writer must not complete it).

Not covered (docs/daemon.md): modes the terminal reports input in (mouse, focus, bracketed paste) pass, as full-screen programs need
them.

The C client (agentvm/native/agentvm-client.c, ``tf_feed``) implements the same machine; the
two are tested with one table (tests/unit/test_termfilter.py).
"""

from __future__ import annotations

import os
import re

LIMIT = 4096  # bytes of one held sequence (an OSC 8 link's URI fits)

_GROUND, _ESC, _ESC_I, _CSI, _OSC, _OSC_ESC, _STR, _STR_ESC, _LEAD = range(9)
# in ground: the next byte that starts something, or a whole short CSI in one piece (most of
# them: decided at once, the answer cached); anything else (split across writes, long, cut
# short) goes through the state machine byte by byte
_NEXT = re.compile(rb"\x1b\[[\x20-\x3f]{0,64}[\x40-\x7e]|[\x05\x1b\x80-\xff]")
# a run of well-formed UTF-8 sequences (Unicode table 3-7) of two or more bytes, without the
# C1 controls (c2 80-9f): written as it is
_UTF8_RUN = re.compile(rb"(?:\xc2[\xa0-\xbf]|[\xc3-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]"
                       rb"|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]"
                       rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2})+")


def _utf8_lead(b: int) -> "tuple[int, int, int] | None":
    """A UTF-8 lead byte's sequence length and the range of its second byte; None if ``b``
    starts no well-formed sequence (a continuation byte, c0, c1, f5-ff)."""
    if 0xC2 <= b <= 0xDF:
        return 2, 0x80, 0xBF
    if b == 0xE0:
        return 3, 0xA0, 0xBF
    if 0xE1 <= b <= 0xEF:
        return 3, 0x80, 0x9F if b == 0xED else 0xBF
    if b == 0xF0:
        return 4, 0x90, 0xBF
    if 0xF1 <= b <= 0xF3:
        return 4, 0x80, 0xBF
    if b == 0xF4:
        return 4, 0x80, 0x8F
    return None


_CSI_SEEN: dict = {}
_OSC_KEEP = {8, 133, 4, 104, 105} | set(range(10, 20)) | set(range(110, 120))
_OSC_COLOR = {4} | set(range(10, 20))


def raw_output_env() -> bool:
    return os.environ.get("AGENTVM_RAW_OUTPUT") == "1"


def for_fd(fd: int, raw: bool = False) -> "TermFilter | None":
    """A filter for output written to ``fd``; None when it is not a terminal (a pipe, a file:
    bytes pass exact) or raw output was asked for (``--raw-output``, AGENTVM_RAW_OUTPUT=1)."""
    if raw or raw_output_env():
        return None
    try:
        if not os.isatty(fd):
            return None
    except OSError:
        return None
    return TermFilter()


def _csi_keep(seq: bytes) -> bool:
    """``seq`` is ESC [ PARAMS INTERMEDIATES FINAL (bytes 0x20-0x7e)."""
    body = seq[2:-1]
    final = seq[-1:]
    i = len(body)
    while i and 0x20 <= body[i - 1] <= 0x2F:
        i -= 1
    params, inter = body[:i], body[i:]
    if any(0x20 <= b <= 0x2F for b in params):
        return False  # malformed (an intermediate before a parameter): terminals differ, dropped
    if final in (b"n", b"c", b"t"):
        return False
    if not inter:
        if final == b"x":
            return False
        if final == b"q" and params.startswith(b">"):
            return False
        if final in (b"u", b"S", b"m") and params.startswith(b"?"):
            return False
        return True
    if (inter, final) in ((b"$", b"p"), (b"$", b"w"), (b"$", b"u"), (b"*", b"y"), (b"'", b"w"), (b"&", b"u"),
                          (b'"', b"v"), (b"#", b"|"), (b"'", b"|")):
        return False
    return True


def _osc_keep(payload: bytes) -> bool:
    """``payload`` is what comes between ESC ] and the terminator."""
    num, _, rest = payload.partition(b";")
    if not num.isdigit() or len(num) > 5 or int(num) not in _OSC_KEEP:
        return False
    if any(b < 0x20 or b > 0x7E for b in payload):
        return False  # a control or a byte above ASCII inside: dropped (no terminal may end it early)
    if int(num) in _OSC_COLOR or int(num) in (104, 105) or 110 <= int(num) < 120:
        if any(item.strip() == b"?" for item in rest.split(b";")):
            return False
    return True


class TermFilter:
    """Feed it output (any split); it returns what may reach the terminal."""

    __slots__ = ("state", "held", "limit")

    def __init__(self, limit: int = LIMIT) -> None:
        self.state = _GROUND
        self.held = bytearray()
        self.limit = limit

    def finish(self) -> bytes:
        """The end of the stream: a sequence left incomplete is dropped."""
        self.state = _GROUND
        self.held.clear()
        return b""

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        held = self.held
        st = self.state
        n = len(data)
        i = 0
        while i < n:
            if st == _GROUND:
                start = i  # data[start:i] is to be written as it is
                while True:
                    m = _NEXT.search(data, i)
                    if m is None:
                        i = n
                        break
                    seq = m.group()
                    if 1 < len(seq) <= self.limit:  # a whole CSI (no longer than the machine would hold)
                        keep = _CSI_SEEN.get(seq)
                        if keep is None:
                            keep = _csi_keep(seq)
                            if len(_CSI_SEEN) < 1024:
                                _CSI_SEEN[seq] = keep
                        if not keep:
                            out += data[start:m.start()]
                            start = m.end()
                        i = m.end()
                        continue
                    b = seq[0]
                    if b >= 0x80:
                        u = _UTF8_RUN.match(data, m.start())
                        if u is not None:  # well-formed UTF-8: written as it is
                            i = u.end()
                            continue
                    out += data[start:m.start()]
                    start = i = m.start() + 1  # (a CSI too long for a small limit: byte by byte)
                    if b == 0x1B:
                        held.clear()
                        held.append(b)
                        st = _ESC
                        break
                    if b >= 0x80 and _utf8_lead(b) is not None:
                        held.clear()  # a sequence split across writes, a C1 control or malformed:
                        held.append(b)  # decided byte by byte
                        st = _LEAD
                        break
                    # ENQ (0x05), a byte that starts no UTF-8 sequence: dropped
                out += data[start:i]
                continue
            b = data[i]
            i += 1
            if st == _LEAD:
                need, lo, hi = _utf8_lead(held[0])  # type: ignore[misc]
                if len(held) > 1:
                    lo, hi = 0x80, 0xBF
                if lo <= b <= hi:
                    held.append(b)
                    if len(held) == need:  # written only whole: nothing dropped later joins its bytes
                        if not (held[0] == 0xC2 and held[1] <= 0x9F):  # else a C1 control, UTF-8 encoded
                            out += held
                        held.clear()
                        st = _GROUND
                else:  # malformed: what was held is dropped, the byte after it is in ground
                    held.clear()
                    st = _GROUND
                    i -= 1
                continue
            if b in (0x18, 0x1A):  # CAN, SUB: a terminal cancels the sequence
                held.clear()
                st = _GROUND
                continue
            if st == _ESC:
                if b == 0x5B:  # [
                    held.append(b)
                    st = _CSI
                elif b == 0x5D:  # ]
                    held.append(b)
                    st = _OSC
                elif b in (0x50, 0x58, 0x5E, 0x5F, 0x6B):  # P X ^ _: DCS SOS PM APC; k: screen's title
                    held.clear()
                    st = _STR
                elif 0x20 <= b <= 0x2F:
                    held.append(b)
                    st = _ESC_I
                elif 0x30 <= b <= 0x7E:
                    if b != 0x5A:  # ESC Z: DECID, an answer-back
                        held.append(b)
                        out += held
                    held.clear()
                    st = _GROUND
                else:  # a control, ESC again, or a byte above ASCII: the ESC is dropped
                    held.clear()
                    st = _GROUND
                    i -= 1
                continue
            if st == _ESC_I:
                if 0x20 <= b <= 0x2F:
                    held.append(b)
                elif 0x30 <= b <= 0x7E:
                    held.append(b)
                    if held[1] != 0x25 or bytes(held) == b"\x1b%G":  # ESC % (other than G: to UTF-8)
                        out += held  # would take the terminal out of UTF-8, where 8-bit C1 act
                    held.clear()
                    st = _GROUND
                else:
                    held.clear()
                    st = _GROUND
                    i -= 1
                    continue
            elif st == _CSI:
                if 0x20 <= b <= 0x3F:
                    held.append(b)
                elif 0x40 <= b <= 0x7E:
                    held.append(b)
                    if _csi_keep(bytes(held)):
                        out += held
                    held.clear()
                    st = _GROUND
                else:
                    held.clear()
                    st = _GROUND
                    i -= 1
                    continue
            elif st == _OSC:
                if b == 0x07:
                    if _osc_keep(bytes(held[2:])):
                        out += held
                        out.append(b)
                    held.clear()
                    st = _GROUND
                elif b == 0x1B:
                    st = _OSC_ESC
                else:
                    held.append(b)
            elif st == _OSC_ESC:
                if b == 0x5C:  # ESC \ : ST
                    if _osc_keep(bytes(held[2:])):
                        out += held
                        out += b"\x1b\\"
                    held.clear()
                    st = _GROUND
                else:  # a new sequence: this one is dropped
                    held.clear()
                    held.append(0x1B)
                    st = _ESC
                    i -= 1
                continue
            elif st == _STR:
                if b == 0x1B:
                    st = _STR_ESC
                elif b == 0x07:
                    st = _GROUND
                continue  # nothing held: a dropped string costs no memory
            elif st == _STR_ESC:
                if b == 0x5C:
                    st = _GROUND
                else:
                    held.clear()
                    held.append(0x1B)
                    st = _ESC
                    i -= 1
                continue
            if len(held) > self.limit:  # too long to hold: dropped, the rest is text
                held.clear()
                st = _GROUND
        self.state = st
        return bytes(out)


def _pump(r: int, term: int, f: TermFilter) -> None:
    try:
        while True:
            try:
                data = os.read(r, 65536)
            except InterruptedError:
                continue
            if not data:
                break
            shown = memoryview(f.feed(data))
            while shown:
                shown = shown[os.write(term, shown):]
    except OSError:
        pass  # the terminal went away: what is left is not shown
    finally:
        f.finish()
        os.close(r)


class filtered_fds:
    """For an embedded run, whose sandbox inherits this process's fds 1 and 2: each of them that
    is a terminal becomes, for the run, a pipe whose bytes a thread writes onto the terminal
    through a :class:`TermFilter`; restored on exit (the pump drains what is left first). A
    no-op when neither is a terminal or raw output was asked for."""

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw
        self.saved: list[tuple[int, int]] = []
        self.threads: list = []

    def __enter__(self) -> "filtered_fds":
        import sys
        import threading

        sys.stdout.flush()
        sys.stderr.flush()
        try:
            for fd in (1, 2):
                f = for_fd(fd, self.raw)
                if f is None:
                    continue
                term = os.dup(fd)  # not inherited by the sandbox
                r, w = os.pipe()
                os.dup2(w, fd)
                os.close(w)
                self.saved.append((fd, term))
                t = threading.Thread(target=_pump, args=(r, term, f), name=f"termfilter-{fd}", daemon=True)
                t.start()
                self.threads.append(t)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import sys

        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        for fd, term in self.saved:
            os.dup2(term, fd)  # our write end closes: the pump sees the end once the sandbox's have
        for t in self.threads:
            t.join(timeout=5)
        for (fd, term), t in zip(self.saved, self.threads):
            if not t.is_alive():  # a pump still writing keeps its descriptor (never reused under it)
                os.close(term)
        self.saved, self.threads = [], []

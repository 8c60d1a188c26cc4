"""bwrap's status stream arrives in whatever pieces a pipe delivers: a partial document must
never be taken for an answer (it once was: a running sandbox was reported as not running)."""

from __future__ import annotations

import os
import resource
import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from agentvm.backends.status import JsonStatusParser, drain, read_until

STREAM = (b'{ "child-pid": 32252, "cgroup-namespace": 4026532836, "ipc-namespace": 4026532834,'
          b' "mnt-namespace": 4026532832, "net-namespace": 4026532837 }\n{ "exit-code": 3 }\n')


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points + [len(data)]:
        pieces.append(data[last:p])
        last = p
    return pieces


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_any_split_yields_the_same_documents_and_never_a_partial_one(cuts):
    parser = JsonStatusParser()
    seen: list[dict] = []
    fed = b""
    for piece in _split(STREAM, cuts):
        fed += piece
        seen += parser.feed(piece)
        # a child pid is only ever reported once its document is complete
        if parser.first("child-pid") is not None:
            assert b"4026532837 }" in fed
    seen += parser.close()
    assert seen == [
        {"child-pid": 32252, "cgroup-namespace": 4026532836, "ipc-namespace": 4026532834,
         "mnt-namespace": 4026532832, "net-namespace": 4026532837},
        {"exit-code": 3},
    ]
    assert parser.first("exit-code") == 3 and not parser.broken


@given(st.integers(min_value=1, max_value=len(STREAM) - 1))
def test_a_truncated_stream_is_broken_not_answered(n):
    parser = JsonStatusParser()
    parser.feed(STREAM[:n])
    parser.close()
    complete = STREAM[:n].count(b"}")
    assert len(parser.docs) == complete
    ends_whole = STREAM[:n].rstrip().endswith(b"}")
    assert parser.broken == (not ends_whole)


def test_garbage_marks_the_stream_broken():
    parser = JsonStatusParser()
    parser.feed(b"bwrap: oops\n")
    assert parser.broken and parser.docs == [] and parser.first("child-pid") is None


def test_multibyte_text_split_inside_a_character():
    doc = '{ "note": "é€" }'.encode()
    parser = JsonStatusParser()
    for i in range(len(doc)):
        parser.feed(doc[i:i + 1])
    assert parser.docs == [{"note": "é€"}]


def test_read_until_waits_for_the_complete_document_across_slow_writes():
    r, w = os.pipe()

    def writer():
        for piece in (b'{ "child-pid"', b": 32252", b' }\n'):
            os.write(w, piece)
            time.sleep(0.05)
        time.sleep(0.2)
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    parser = JsonStatusParser()
    try:
        assert read_until(r, parser, lambda: parser.first("child-pid") is not None, time.monotonic() + 5)
        assert parser.first("child-pid") == 32252
    finally:
        t.join()
        os.close(r)


def test_read_until_returns_at_the_deadline_and_at_eof():
    r, w = os.pipe()
    parser = JsonStatusParser()
    t0 = time.monotonic()
    assert not read_until(r, parser, lambda: parser.first("child-pid") is not None, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 2
    os.write(w, b'{ "child-pid": 1')
    os.close(w)
    assert not read_until(r, parser, lambda: parser.first("child-pid") is not None, time.monotonic() + 5)
    assert parser.eof and parser.broken
    os.close(r)


def test_drain_works_on_descriptors_above_1024():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    r, w = os.pipe()
    hi_r = os.dup2(r, 1500)
    os.close(r)
    try:
        os.write(w, b"abc")
        os.close(w)
        assert drain(hi_r) == b"abc"
    finally:
        os.close(hi_r)

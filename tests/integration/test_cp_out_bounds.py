"""Folder cp-out through the real daemon is bounded as a tar (security review 2026-11-28,
finding 5) and survives deep folders (finding 7).

An agent fills a folder with tens of thousands of hard links with long names: 0 content bytes,
~1.5 KiB of pax+ustar headers each. Before, the daemon counted only content, so the in-memory
JSON cp-out (capped "at MAX_FILE") answered a tar of several times MAX_FILE and grew the root
daemon by as much, and the streamed one staged a tar far past the room it had checked. Now the
tar itself is bounded, members are capped (MAX_MEMBERS, as on the way in), and a folder nested
1 200 deep is a clear `files.too-deep` instead of `internal: RecursionError`.

A real bubblewrap sandbox, the real daemon, the real CLI and the daemon's HTTP API on its socket.
"""

from __future__ import annotations

import pytest

from tests.integration.test_cp_streaming import MIB, _agent, _av, _raw, home  # noqa: F401 (fixture)
from tests.helpers import needs_root

pytestmark = [pytest.mark.integration, needs_root]

# python3 -c LINKS DIR COUNT NAMELEN: COUNT hard links (a new source file every 5 000: btrfs
# caps the links of one inode in one folder) named to NAMELEN characters, in /workspace/DIR
LINKS = r"""
import os, sys
d, n, width = "/workspace/" + sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d, exist_ok=True)
for i in range(n):
    if i % 5000 == 0:
        src = f"{d}/src{i // 5000:03d}"
        open(src, "w").close()
    os.link(src, f"{d}/{i:07d}".ljust(len(d) + 1 + width, "x"))
print("made", n)
"""

DEEP = r"""
import os
fd = os.open("/workspace", os.O_RDONLY | os.O_DIRECTORY)
os.mkdir("deep", dir_fd=fd)
fd = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
for _ in range(1200):
    os.mkdir("d", dir_fd=fd)
    fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
os.close(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
print("deep")
"""


@pytest.mark.timeout(900)
def test_folder_cp_out_counts_tar_headers_members_and_depth(home, tmp_path):
    _agent(home, tmp_path, "hl", "256M")
    # 48 000 names of ~200 characters, 0 content bytes: a tar of ~72 MiB (MAX_FILE is 64 MiB)
    r = _av(home, "exec", "hl", "--", "python3", "-c", LINKS, "h", "48000", "200")
    assert r.returncode == 0 and b"made 48000" in r.stdout, r.stderr
    status, doc = _raw(home, b"GET /v1/sandboxes/hl/files?path=h&tar=1 HTTP/1.1\r\nHost: x\r\n\r\n", timeout=300)
    assert status == 403 and doc.get("error") == "files.too-large", \
        (status, {k: v for k, v in doc.items() if k != "data"}, "the in-memory tar passed MAX_FILE")

    # over MAX_MEMBERS entries: refused (was staged and sent whole), nothing written locally
    r = _av(home, "exec", "hl", "--", "python3", "-c", LINKS, "m", "100005", "8")
    assert r.returncode == 0 and b"made 100005" in r.stdout, r.stderr
    out = tmp_path / "m-out"
    r = _av(home, "cp", "hl:m", str(out))
    assert r.returncode != 0 and b"files.too-large" in r.stderr and b"100000 entries" in r.stderr, \
        (r.returncode, r.stdout[-300:], r.stderr[-600:])
    assert not out.exists() or not any(out.iterdir())

    # 1 200 nested folders: a clear refusal, not `internal`
    r = _av(home, "exec", "hl", "--", "python3", "-c", DEEP)
    assert r.returncode == 0 and b"deep" in r.stdout, r.stderr
    r = _av(home, "cp", "hl:deep", str(tmp_path / "deep-out"))
    assert r.returncode == 77 and b"files.too-deep" in r.stderr and b"internal" not in r.stderr, \
        (r.returncode, r.stderr[-600:])
    # the snapshot walk too: a clear snapshot.too-deep (was internal: RecursionError)
    r = _av(home, "snapshot", "hl")
    assert r.returncode == 78 and b"snapshot.too-deep" in r.stderr and b"internal" not in r.stderr, \
        (r.returncode, r.stderr[-600:])
    # a folder's shallower part is still copied out whole, through the same walk
    r = _av(home, "exec", "hl", "--", "python3", "-c",
            "import os; os.makedirs('/workspace/ok/a/b/c'); open('/workspace/ok/a/b/c/f', 'w').write('x')")
    assert r.returncode == 0, r.stderr
    r = _av(home, "cp", "hl:ok", str(tmp_path / "ok-out"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ok-out" / "a" / "b" / "c" / "f").read_text() == "x"

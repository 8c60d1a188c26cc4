"""`agentvm cp` streams through the real daemon: an upload is staged on the daemon's state disk
as it arrives (a nameless file in a root-only folder), bounded by what the workspace can take
(refused before its body is read when its length cannot fit, cut off as soon as a body without
a length passes it), then written beneath the workspace with the same path checks; a download
is sent from the file as the socket drains. The daemon's memory does not grow with the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import agentvm_cmd, needs_root, release_workspaces

pytestmark = [pytest.mark.integration, needs_root]

MIB = 1 << 20


def _env(home: Path) -> dict:
    return {**os.environ, "AGENTVM_HOME": str(home), "AGENTVM_UID_BASE": os.environ["AGENTVM_UID_BASE"]}


def _av(home: Path, *args: str, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run(agentvm_cmd() + list(args), capture_output=True, env={**_env(home), **env}, timeout=timeout,
                          stdin=subprocess.DEVNULL)


_MEASURED = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:], capture_output=True, stdin=subprocess.DEVNULL)\n"
    "sys.stdout.buffer.write(r.stdout); sys.stderr.buffer.write(r.stderr)\n"
    "sys.stderr.write('\\nmaxrss=%d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(r.returncode)\n"
)


def _av_rss(home: Path, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI run as the only child of a small wrapper: its result and its peak RSS in bytes."""
    r = subprocess.run([agentvm_cmd()[0], "-c", _MEASURED, *agentvm_cmd(), *args], capture_output=True,
                       env=_env(home), timeout=300, stdin=subprocess.DEVNULL)
    body, _, tail = r.stderr.rpartition(b"\nmaxrss=")
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout, body), int(tail.split()[0]) * 1024


@pytest.fixture
def home(avm_home):
    """A home of its own (its own daemon), sharing the session's uid range; workspaces removed."""
    h = Path(f"/tmp/agentvm-test-cpstream-{secrets.token_hex(3)}")
    h.mkdir(mode=0o711)
    assert _av(h, "up").returncode == 0
    yield h
    _av(h, "down", timeout=60)
    release_workspaces(h)
    subprocess.run(["rm", "-rf", str(h)])


def _agent(home: Path, tmp_path: Path, name: str, disk: str) -> None:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
                 f"  lifecycle: persistent\n  command: [/bin/sleep, '600']\n  limits: {{disk: {disk}}}\n")
    r = _av(home, "create", "-f", str(f), "--start")
    assert r.returncode == 0, r.stderr


def _daemon_pid(home: Path) -> int:
    return int((home / "run" / "daemon.pid").read_text())


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _random_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        left = size
        while left:
            b = os.urandom(min(4 * MIB, left))
            h.update(b)
            fh.write(b)
            left -= len(b)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while b := fh.read(4 * MIB):
            h.update(b)
    return h.hexdigest()


def _raw(home: Path, head: bytes, body: bytes = b"", *, timeout: float = 60) -> tuple[int, dict]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(home / "run" / "agentvm.sock"))
    try:
        s.sendall(head + body)
        data = b""
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            data += b
    finally:
        s.close()
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


@pytest.mark.timeout(600)
def test_a_200_mib_file_goes_in_and_out_streamed_and_the_daemon_does_not_grow(home, tmp_path):
    _agent(home, tmp_path, "big", "512M")
    pid = _daemon_pid(home)
    warm = tmp_path / "warm"
    warm.write_bytes(b"w" * (2 * MIB))
    # one small copy each way first: what a copy imports is loaded before the baseline (and the
    # client's own peak RSS for a small file, its baseline)
    r, client_small_in = _av_rss(home, "cp", str(warm), "big:warm")
    assert r.returncode == 0, r.stderr
    r, client_small_out = _av_rss(home, "cp", "big:warm", str(tmp_path / "warm.back"))
    assert r.returncode == 0, r.stderr

    src = tmp_path / "src.bin"
    digest = _random_file(src, 200 * MIB)

    base = _status(pid, "VmRSS")
    _reset_peak(pid)
    r, client_in = _av_rss(home, "cp", str(src), "big:data/blob.bin")
    peak_in = _status(pid, "VmHWM")
    assert r.returncode == 0, r.stderr
    assert f"{200 * MIB} bytes -> big:data/blob.bin".encode() in r.stdout, r.stdout
    inside = _av(home, "exec", "big", "--", "sha256sum", "/workspace/data/blob.bin")
    assert inside.stdout.split()[:1] == [digest.encode()], (inside.stdout, inside.stderr)

    base_out = _status(pid, "VmRSS")
    _reset_peak(pid)
    back = tmp_path / "back.bin"
    r, client_out = _av_rss(home, "cp", "big:data/blob.bin", str(back))
    peak_out = _status(pid, "VmHWM")
    assert r.returncode == 0, r.stderr
    assert _sha256(back) == digest
    print(f"daemon RSS {base >> 20} MiB; upload peak +{(peak_in - base) / MIB:.1f} MiB, "
          f"download peak +{(peak_out - base_out) / MIB:.1f} MiB (200 MiB each way)")
    print(f"client (the CLI) peak RSS: upload {client_in >> 20} MiB vs {client_small_in >> 20} MiB for 2 MiB, "
          f"download {client_out >> 20} MiB vs {client_small_out >> 20} MiB")
    assert peak_in - base < 32 * MIB, (base, peak_in)
    assert peak_out - base_out < 32 * MIB, (base_out, peak_out)
    assert client_in - client_small_in < 32 * MIB and client_out - client_small_out < 32 * MIB, \
        (client_small_in, client_in, client_small_out, client_out)
    # the staging folder: root-only, and nothing left in it (the staged file had no name)
    st = os.lstat(home / ".staging")
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
    assert os.listdir(home / ".staging") == []
    # no partial or temporary file was left in the workspace either
    ls = _av(home, "exec", "big", "--", "ls", "-A", "/workspace/data")
    assert ls.stdout.split() == [b"blob.bin"], ls.stdout


@pytest.mark.timeout(300)
def test_a_folder_over_the_old_64_mib_cap_goes_both_ways(home, tmp_path):
    _agent(home, tmp_path, "tree", "256M")
    src = tmp_path / "proj"
    (src / "a").mkdir(parents=True)
    d1 = _random_file(src / "a" / "one.bin", 40 * MIB)
    d2 = _random_file(src / "two.bin", 40 * MIB)
    os.symlink("/etc/passwd", src / "link")  # left out, named
    r = _av(home, "cp", str(src), "tree:proj")
    assert r.returncode == 0 and b"2 files, 1 folders" in r.stdout and b"link" in r.stdout, (r.stdout, r.stderr)
    out = tmp_path / "out"
    out.mkdir()
    r = _av(home, "cp", "tree:proj", str(out))
    assert r.returncode == 0, r.stderr
    assert _sha256(out / "proj" / "a" / "one.bin") == d1 and _sha256(out / "proj" / "two.bin") == d2
    assert not (out / "proj" / "link").exists()


@pytest.mark.timeout(300)
def test_an_upload_over_the_workspace_room_is_refused_up_front_with_the_numbers(home, tmp_path):
    _agent(home, tmp_path, "small", "16M")
    pid = _daemon_pid(home)
    src = tmp_path / "big.bin"
    _random_file(src, 64 * MIB)
    base = _status(pid, "VmRSS")
    _reset_peak(pid)
    r = _av(home, "cp", str(src), "small:big.bin")
    assert r.returncode == 125, (r.returncode, r.stderr)  # files.no-space: the backend's exit code
    err = r.stderr.decode()
    assert "files.no-space" in err or "cannot take" in err, err
    assert f"cannot take {64 * MIB} bytes" in err and "room for" in err, err
    assert "Traceback" not in err
    assert _status(pid, "VmHWM") - base < 32 * MIB
    ls = _av(home, "exec", "small", "--", "ls", "-A", "/workspace")
    assert b"big.bin" not in ls.stdout and b".agentvm-cp" not in ls.stdout, ls.stdout

    # a body without a length (chunked): read only until it passes the room, then refused
    head = (b"PUT /v1/sandboxes/small/files?path=chunked.bin HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = os.urandom(MIB)
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(str(home / "run" / "agentvm.sock"))
    sent = 0
    try:
        s.sendall(head)
        try:
            for _ in range(64):
                s.sendall(chunk)
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while b := s.recv(65536):
                data += b
        except ConnectionResetError:
            pass
    finally:
        s.close()
    assert b" 507 " in data.split(b"\r\n", 1)[0], data[:300]
    doc = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert doc["error"] == "files.no-space" and "reading stopped" in doc["message"], doc
    # it stopped staging just past the room (16M less what the workspace holds), not at 64 MiB;
    # the rest of what the client sent was read and dropped, so it could read the answer
    import re

    took = int(re.search(r"cannot take (\d+) bytes or more", doc["message"]).group(1))
    assert took <= 17 * MIB, doc["message"]
    ls = _av(home, "exec", "small", "--", "ls", "-A", "/workspace")
    assert b"chunked.bin" not in ls.stdout and b".agentvm-cp" not in ls.stdout, ls.stdout


def test_other_routes_keep_their_body_limit_and_a_staged_upload_has_no_name(home, tmp_path):
    # a JSON route still refuses a body over MAX_BODY before reading it
    status, doc = _raw(home, b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (100 * MIB))
    assert status == 413 and doc["error"] == "api.too-large", doc
    # an upload to a sandbox that does not exist: not found, before its body is read
    status, doc = _raw(home, b"PUT /v1/sandboxes/nosuch/files?path=f HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: %d\r\n\r\n" % (100 * MIB))
    assert status == 404 and doc["error"] == "sandbox.not-found", doc

    _agent(home, tmp_path, "stage", "64M")
    pid = _daemon_pid(home)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(home / "run" / "agentvm.sock"))
    try:  # an upload half sent: staged, under no name, where no sandbox reaches
        s.sendall(b"PUT /v1/sandboxes/stage/files?path=half.bin HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Length: %d\r\n\r\n" % (8 * MIB) + b"x" * (4 * MIB))
        deadline = time.monotonic() + 20
        staged = []
        while time.monotonic() < deadline and not staged:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(str(home / ".staging")):
                    staged.append(target)
            time.sleep(0.1)
        assert staged, "the upload is staged in the daemon's staging folder"
        assert all("(deleted)" in t or "/#" in t for t in staged), staged  # O_TMPFILE or unlinked
        assert os.listdir(home / ".staging") == []
        ls = _av(home, "exec", "stage", "--", "ls", "-A", "/workspace")
        assert b"half" not in ls.stdout and b".agentvm-cp" not in ls.stdout, ls.stdout
    finally:
        s.close()


@pytest.fixture
def small_home(avm_home):
    """A home on a 96 MiB tmpfs: a small state disk (the workspace's image or pool on it too)."""
    h = Path(f"/tmp/agentvm-test-cpstream-{secrets.token_hex(3)}")
    h.mkdir(mode=0o711)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0711", "tmpfs", str(h)], check=True)
    yield h
    _av(h, "down", timeout=60)
    release_workspaces(h)
    subprocess.run(["umount", "-l", str(h)], capture_output=True)
    subprocess.run(["rm", "-rf", str(h)])


@pytest.mark.timeout(300)
def test_an_upload_the_state_disk_cannot_stage_is_refused_and_the_reserve_kept(small_home, tmp_path):
    home = small_home
    # overcommit: the workspace's limit may be more than the host keeps free, so it is the state
    # disk (less the daemon's reserve), not the workspace, that bounds the copy
    assert _av(home, "up", AGENTVM_WORKSPACE_OVERCOMMIT="2").returncode == 0
    r = _av(home, "create", "-f", str(_write_agent(tmp_path, "tiny", "48M")), "--start",
            AGENTVM_WORKSPACE_OVERCOMMIT="2")
    if r.returncode != 0:
        pytest.skip(f"a 48M workspace does not fit a 96 MiB tmpfs home here: {r.stderr.decode()[-300:]}")
    v = os.statvfs(home)
    free = v.f_bavail * v.f_frsize
    room = _av(home, "exec", "tiny", "--", "df", "-B1", "--output=avail", "/workspace")
    ws_free = int(room.stdout.split()[-1])
    size = min(ws_free - MIB, free - 2 * MIB)  # the workspace could take it; the state disk, less its reserve, not
    if size <= free - (8 * MIB + (96 * MIB) // 20):
        pytest.skip(f"the workspace ({ws_free}) is not larger than the state disk's room here ({free})")
    src = tmp_path / "mid.bin"
    _random_file(src, size)
    r = _av(home, "cp", str(src), "tiny:mid.bin")
    err = r.stderr.decode()
    assert r.returncode == 75 and "cannot be staged" in err and "room for" in err, (r.returncode, err)
    assert (home / ".reserve").exists() and (home / ".reserve").stat().st_size == 8 * MIB  # never touched
    assert _av(home, "audit", "verify").returncode == 0
    ls = _av(home, "exec", "tiny", "--", "ls", "-A", "/workspace")
    assert b"mid.bin" not in ls.stdout, ls.stdout
    _av(home, "rm", "tiny")


def _write_agent(tmp_path: Path, name: str, disk: str) -> Path:
    f = tmp_path / f"{name}.yaml"
    f.write_text(f"apiVersion: agentvm/v1\nkind: Agent\nmetadata: {{name: {name}}}\nspec:\n"
                 f"  lifecycle: persistent\n  command: [/bin/sleep, '600']\n  limits: {{disk: {disk}}}\n")
    return f

"""Attacks on the seccomp deny list itself, against the real sandbox (bubblewrap, the default
policy - the syscall audit on - and the plain deny list of ``--degrade syscall-audit``).

* A listener of the agent's own: flood the syscall audit (more than FLOOD_PER_SEC distinct
  denied calls in a second), then load a filter with ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` whose
  USER_NOTIF rules win the tie with agent-vm's (the newest filter's) and answer them with
  CONTINUE. Before the fix the flood closed agent-vm's listener, the kernel forgot it, the new
  listener was accepted and io_uring/keyctl/AF_VSOCK/NETLINK_AUDIT/unshare all ran.
* Bits 32-63 of an int argument: ``socket(AF_VSOCK | 1 << 32, ...)`` is AF_VSOCK to the
  kernel (it reads an int); a 64-bit "eq" in the filter did not match it.
"""

from __future__ import annotations

import json

import pytest

from _attacklib import dump, needs_root

pytestmark = [pytest.mark.attack, needs_root]

# Runs inside the sandbox. Prints one JSON line: what each step got.
OWN_LISTENER = r'''
import ctypes, errno, json, os, struct, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
SYS_seccomp, SYS_unshare, SYS_io_uring_setup, SYS_keyctl, SYS_socket = 317, 272, 425, 250, 41
def sc(nr, *a):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) for x in a]); e = ctypes.get_errno()
    if r >= 0 and nr != SYS_keyctl:
        os.close(r)
    return "OK" if r >= 0 else errno.errorcode.get(e, str(e))
def probes():
    params = ctypes.create_string_buffer(120)
    return {"io_uring": sc(SYS_io_uring_setup, 4, ctypes.addressof(params)), "keyctl": sc(SYS_keyctl, 0, -3, 1),
            "vsock": sc(SYS_socket, 40, 1, 0), "netlink_audit": sc(SYS_socket, 16, 3, 9)}
out = {"before": probes()}
FLOOD = int(sys.argv[1]) if len(sys.argv) > 1 else 0
if FLOOD:
    # distinct calls (a new protocol each: no folding), 4 threads, for FLOOD seconds
    stop = time.monotonic() + FLOOD
    counts = []
    def flood(base):
        i = 0
        while time.monotonic() < stop:
            libc.syscall(ctypes.c_long(SYS_socket), ctypes.c_long(16), ctypes.c_long(3), ctypes.c_long(1000 + base + i))
            i += 1
        counts.append(i)
    ts = [threading.Thread(target=flood, args=(k * 10_000_000,)) for k in range(4)]
    [t.start() for t in ts]; [t.join() for t in ts]
    out["flood_calls"] = sum(counts)
    out["after_flood"] = probes()
NOTIFY = (SYS_unshare, SYS_io_uring_setup, SYS_keyctl, SYS_socket, 165)
ins = [struct.pack("HBBI", 0x20, 0, 0, 0)]
for i, nr in enumerate(NOTIFY):
    ins.append(struct.pack("HBBI", 0x15, len(NOTIFY) - i, 0, nr))
ins.append(struct.pack("HBBI", 0x06, 0, 0, 0x7fff0000))
ins.append(struct.pack("HBBI", 0x06, 0, 0, 0x7fc00000))
buf = ctypes.create_string_buffer(b"".join(ins))
pbuf = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(ins), ctypes.addressof(buf)))
listener = libc.syscall(ctypes.c_long(SYS_seccomp), ctypes.c_long(1), ctypes.c_long(8), ctypes.c_long(ctypes.addressof(pbuf)))
out["own_listener"] = "OK" if listener >= 0 else errno.errorcode.get(ctypes.get_errno())
if listener >= 0:
    RECV, SEND = 0xc0502100, 0xc0182101
    def answer():
        while True:
            n = ctypes.create_string_buffer(80)
            if libc.ioctl(listener, ctypes.c_ulong(RECV), n) < 0:
                return
            nid = struct.unpack_from("Q", n, 0)[0]
            libc.ioctl(listener, ctypes.c_ulong(SEND), ctypes.create_string_buffer(struct.pack("QqiI", nid, 0, 0, 1)))
    threading.Thread(target=answer, daemon=True).start()
out["after"] = probes()
# an ordinary filter (no listener), as Chromium's sandbox loads one, is still allowed
allow = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7fff0000))
p2 = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", 1, ctypes.addressof(allow)))
r = libc.syscall(ctypes.c_long(SYS_seccomp), ctypes.c_long(1), ctypes.c_long(0), ctypes.c_long(ctypes.addressof(p2)))
out["ordinary_filter"] = "OK" if r == 0 else errno.errorcode.get(ctypes.get_errno())
print(json.dumps(out), flush=True)
'''


def _result(r) -> dict:
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('{"before"')]
    assert lines, dump(r)
    return json.loads(lines[-1])


def _all_refused(d: dict) -> bool:
    return all(v != "OK" for v in d.values())


@pytest.mark.parametrize("flood", [0, 4])
def test_no_listener_of_the_agents_own_even_after_flooding_the_audit(py_json, flood):
    r, _res = py_json(OWN_LISTENER.replace("int(sys.argv[1]) if len(sys.argv) > 1 else 0", str(flood)), timeout=120)
    assert r.returncode == 0, dump(r)
    out = _result(r)
    assert _all_refused(out["before"]), out
    assert out["own_listener"] != "OK", f"the agent got a seccomp listener of its own: {out}"
    assert out["own_listener"] == "EBUSY", out
    assert _all_refused(out["after"]), f"a denied call ran: {out}"
    assert out["after"] == out["before"], "refused exactly as before (EPERM, not the no-listener ENOSYS)"
    assert out["ordinary_filter"] == "OK", "an ordinary filter (no listener) stays allowed"
    if flood:
        assert out["flood_calls"] > 0
        assert out["after_flood"] == out["before"], f"the flood changed the answers (listener closed?): {out}"


def test_no_listener_of_the_agents_own_under_the_plain_deny_list(py_json):
    r, _res = py_json(OWN_LISTENER.replace("int(sys.argv[1]) if len(sys.argv) > 1 else 0", "0"),
                      "--degrade", "syscall-audit", timeout=120)
    assert r.returncode == 0, dump(r)
    out = _result(r)
    assert out["own_listener"] == "EBUSY" and _all_refused(out["after"]), out
    assert out["ordinary_filter"] == "OK", out


HIGH_BITS = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True); libc.syscall.restype = ctypes.c_long
def sock(fam, typ, proto):
    r = libc.syscall(ctypes.c_long(41), ctypes.c_long(fam), ctypes.c_long(typ), ctypes.c_long(proto))
    e = ctypes.get_errno()
    if r >= 0:
        os.close(r)
        return "OPENED"
    return errno.errorcode.get(e, str(e))
HI = 1 << 32
cases = {"netlink_audit": (16, 3, 9), "netlink_uevent": (16, 2, 15), "netlink_netfilter": (16, 3, 12),
         "netlink_xfrm": (16, 3, 6), "af_key": (15, 3, 2), "af_vsock": (40, 1, 0), "af_packet": (17, 3, 0),
         "inet_raw": (2, 3, 1), "inet6_raw": (10, 3, 58)}
out = {}
for name, (f, t, p) in cases.items():
    out[name] = [sock(f, t, p), sock(f | HI, t, p), sock(f | HI, t | HI, p | HI), sock(f | (0xFFFF << 32), t, p)]
out["route"] = [sock(16, 3, 0), sock(16 | HI, 3, 0)]
print("HB " + json.dumps(out), flush=True)
'''


@pytest.mark.parametrize("mode", ["audit", "plain"])
def test_socket_families_refused_whatever_the_high_bits(py_json, mode):
    args = ("--degrade", "syscall-audit") if mode == "plain" else ()
    r, _res = py_json(HIGH_BITS, *args, timeout=60)
    assert r.returncode == 0, dump(r)
    [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("HB ")]
    out = json.loads(line[3:])
    route = out.pop("route")
    opened = {k: v for k, v in out.items() if "OPENED" in v}
    assert not opened, f"denied socket families opened with bits 32-63 set: {opened}"
    assert all(v[0] == "EPERM" for v in out.values()), out
    assert route[0] == "OPENED" and route[1] == "OPENED", f"NETLINK_ROUTE stays allowed: {route}"

"""The chown rule of the bwrap substrate's seccomp filter (seccomp.chown_prefix): a chown to an
id the sandbox does not map is refused with EPERM (what fakeroot, tar, cp -p expect), a chown to
the mapped ids or -1 (no change) goes on to libseccomp's program unchanged. Checked by running
the classic BPF on seccomp_data built here (tests/compat/test_host_parity.py runs the real thing)."""

from __future__ import annotations

import errno
import os
import struct

import pytest

from agentvm import seccomp as sc

ARCH = {"x86_64": sc.AUDIT_ARCH_X86_64, "aarch64": sc.AUDIT_ARCH_AARCH64}.get(os.uname().machine)
pytestmark = pytest.mark.skipif(ARCH is None, reason="the chown rule exists for x86_64 and aarch64 only")
FALL_THROUGH = "fall-through"


def run(prog: bytes, nr: int, args=(0,) * 6, arch: int | None = None):
    """Run classic BPF ``prog`` on a seccomp_data; the return value, or FALL_THROUGH when it
    jumps past its end (into libseccomp's program)."""
    data = struct.pack("<iIQ6Q", nr, ARCH if arch is None else arch, 0, *[a & 0xFFFFFFFFFFFFFFFF for a in args])
    insns = [struct.unpack("<HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while pc < len(insns):
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld w abs
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x15:  # jeq k
            pc += jt if acc == k else jf
        elif code == 0x05:  # ja
            pc += k
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1
    return FALL_THROUGH


EPERM = sc.SECCOMP_RET_ERRNO | errno.EPERM
ME = 1000
CALLS = dict(dict(sc.CHOWN_SYSCALLS)[ARCH]) if ARCH else {}


@pytest.mark.parametrize("nr,first", sorted(CALLS.items()))
@pytest.mark.parametrize("uid,gid,refused", [
    (ME, ME, False), (-1, -1, False), (ME, -1, False), (-1, ME, False),
    (0xFFFFFFFF, 0xFFFFFFFF, False),  # -1 as a 32-bit value (glibc)
    (0, 0, True), (0, -1, True), (-1, 0, True), (ME, 0, True), (12345, ME, True), (65534, 65534, True),
    (0xFFFFFFFE, -1, True), (1001, 999, True),
])
def test_chown_to_an_unmapped_id_is_eperm(nr, first, uid, gid, refused):
    prog = sc.chown_prefix(ME, ME)
    args = [0] * 6
    args[first], args[first + 1] = uid, gid
    assert run(prog, nr, args) == (EPERM if refused else FALL_THROUGH)


def test_other_syscalls_and_architectures_fall_through():
    prog = sc.chown_prefix(ME, ME)
    nr, first = next(iter(CALLS.items()))
    args = [0] * 6  # root:root - would be refused natively
    assert run(prog, nr, args) == EPERM
    assert run(prog, nr, args, arch=0x40000003) == FALL_THROUGH, "i386: libseccomp's program kills it"
    assert run(prog, nr | 0x40000000, args) == FALL_THROUGH, "x32 numbers: libseccomp's program kills them"
    assert run(prog, 0, args) == FALL_THROUGH and run(prog, 90, args) == FALL_THROUGH  # read, chmod


def test_the_filter_carries_the_rule_only_when_asked():
    plain = sc.SeccompOptions()
    mapped = sc.SeccompOptions(chown_mapped=(ME, ME))
    assert plain.key() != mapped.key(), "cached separately"
    assert sc._build(mapped) == sc.chown_prefix(ME, ME) + sc._build(plain)


def test_the_bwrap_substrate_asks_for_its_mapping():
    from agentvm.backends.bwrap import SANDBOX_UID, seccomp_options

    assert seccomp_options(False).chown_mapped == (SANDBOX_UID, SANDBOX_UID)
    assert seccomp_options(True).allow_ptrace

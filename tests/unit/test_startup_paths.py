"""What `agentvm run -- CMD` does on every start without the costs it used to pay
(docs/architecture.md "Start-up budget"), and that none of it loosens a check:

- libseccomp is asked directly (no pyseccomp import: it ran `ldconfig -p` twice): the same
  numbers pyseccomp gives, and the classifier gets them without pyseccomp in the process;
- the compiled filter's disk cache is keyed by every input of the program and is read only
  from a regular file of this user (or root) that no one else may write: anything else is
  compiled again;
- the cgroup warm-up (bwrap.MigrationWarmup) moves no task anywhere new: this process stays
  in its cgroups, the warm-up thread ends, one thread serves every run prepared at once;
- the plain form `run -- CMD` is read as argparse reads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentvm import seccomp as sc

OPTS = sc.SeccompOptions(notify=True, watch=sc.DEFAULT_WATCH, chown_mapped=(1000, 1000))


def test_libseccomp_numbers_are_pyseccomps():
    import pyseccomp

    names = {r.syscall for o in (OPTS, sc.SeccompOptions(), sc.SeccompOptions(allow_ptrace=True, statx_fallback=True))
             for r in sc.rules(o)} | {"definitely_not_a_syscall"}
    for n in sorted(names):
        assert sc.syscall_number(n) == pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n), n
    assert sc.syscall_number("definitely_not_a_syscall") < 0


def test_the_classifier_needs_no_pyseccomp():
    code = ("import sys\nfrom agentvm import seccomp as sc, sysaudit\n"
            "o = sc.SeccompOptions(notify=True, watch=sc.DEFAULT_WATCH, chown_mapped=(1000, 1000))\n"
            "c = sysaudit.Classifier(o)\n"
            "v = c.classify(sc.syscall_number('unshare'), [0x10000000, 0, 0, 0, 0, 0])\n"
            "print(v.rule, 'pyseccomp' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["seccomp:namespaces", "False"]


def test_the_cache_key_names_the_rules_and_the_library(monkeypatch):
    key = sc.cache_key.__wrapped__  # (the process's memo aside)
    k = key(OPTS)
    assert k == sc.cache_key(OPTS) and k.startswith(OPTS.key() + "-")
    assert key(sc.SeccompOptions()) != k
    monkeypatch.setattr(sc, "libseccomp_version", lambda: "9.9.9")
    assert key(OPTS) != k
    monkeypatch.undo()
    real = sc.rules
    monkeypatch.setattr(sc, "rules", lambda o: real(o)[:-1])  # a rule changed, FILTER_VERSION not bumped
    assert key(OPTS) != k
    r = real(OPTS)
    monkeypatch.setattr(sc, "rules", lambda o: r[:-1] + [sc.Rule(r[-1].id, r[-1].syscall, r[-1].conds, 1)])
    assert key(OPTS) != k  # one errno changed


@pytest.mark.parametrize("spoil", ["group-writable", "symlink", "truncated"])
def test_a_cache_file_not_beyond_doubt_is_compiled_again(tmp_path, spoil):
    good = sc._build(OPTS)
    path = tmp_path / f"seccomp-{sc.cache_key(OPTS)}.bpf"
    bogus = b"\x06\x00\x00\x00\x00\x00\xff\x7f" * 4  # "allow everything"
    if spoil == "symlink":
        target = tmp_path / "elsewhere.bpf"
        target.write_bytes(bogus)
        path.symlink_to(target)
    else:
        path.write_bytes(bogus if spoil == "group-writable" else bogus[:-3])
        os.chmod(path, 0o664 if spoil == "group-writable" else 0o644)
    sc.compiled_filter.cache_clear()
    try:
        assert sc.compiled_filter(OPTS, tmp_path) == good
    finally:
        sc.compiled_filter.cache_clear()


def test_a_sound_cache_file_is_used(tmp_path):
    path = tmp_path / f"seccomp-{sc.cache_key(OPTS)}.bpf"
    marker = b"\x06\x00\x00\x00\x00\x00\xff\x7f" * 2
    path.write_bytes(marker)
    os.chmod(path, 0o644)
    sc.compiled_filter.cache_clear()
    try:
        assert sc.compiled_filter(OPTS, tmp_path) == marker  # (what makes the check above meaningful)
    finally:
        sc.compiled_filter.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0, reason="moving a task between cgroups needs root")
def test_the_cgroup_warmup_moves_nothing():
    from agentvm.backends import bwrap

    before = Path("/proc/self/cgroup").read_text()
    d = bwrap._own_cgroup_dir()
    assert d is not None, "this machine has cgroups (HOST-FACTS): the warm-up must find ours"
    assert str(os.getpid()).encode() in Path(d, "cgroup.procs").read_bytes().split()
    tasks = set(os.listdir("/proc/self/task"))
    release = bwrap.warm_launch()
    w = bwrap._WARM[0]
    time.sleep(0.05)  # several rounds of the no-op move
    for t in os.listdir("/proc/self/task"):  # every thread of ours (the warm-up's too), where the process is
        try:
            assert Path(f"/proc/self/task/{t}/cgroup").read_text() == before
        except FileNotFoundError:
            pass
    release()
    assert w.done.wait(5)
    assert Path("/proc/self/cgroup").read_text() == before
    deadline = time.monotonic() + 5
    while set(os.listdir("/proc/self/task")) - tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(os.listdir("/proc/self/task")) <= tasks  # the warm-up thread is gone


@pytest.mark.skipif(os.geteuid() != 0, reason="moving a task between cgroups needs root")
def test_runs_prepared_at_once_share_one_warmup_until_the_last_lets_go():
    from agentvm.backends import bwrap

    tasks = set(os.listdir("/proc/self/task"))
    releases = [bwrap.warm_launch() for _ in range(20)]  # a daemon preparing 20 runs at once
    w = bwrap._WARM[0]
    time.sleep(0.02)
    assert len(set(os.listdir("/proc/self/task")) - tasks) == 1  # one thread, not 20
    for r in releases[:-1]:
        r()
        r()  # (idempotent: a second call lets go of nothing more)
    assert not w.done.wait(0.05)  # one holder left: still warm
    releases[-1]()
    assert w.done.wait(5)
    r = bwrap.warm_launch()  # the next run starts a new one
    assert bwrap._WARM[0] is not w
    r()
    assert bwrap._WARM[0].done.wait(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="moving a task between cgroups needs root")
def test_a_warmup_never_let_go_ends_by_itself(monkeypatch):
    from agentvm.backends import bwrap

    monkeypatch.setattr(bwrap, "WARM_MAX", 0.05)
    bwrap.warm_launch()  # never released (its run failed before launch and before teardown)
    assert bwrap._WARM[0].done.wait(5)


@pytest.mark.parametrize("argv", [["--", "echo", "--json", "-x"], ["--"], ["--", "--"], ["--", "-f", "a.yaml"]])
def test_the_plain_form_reads_as_argparse_reads_it(argv):
    from agentvm.cli import run_cmd

    assert vars(run_cmd._plain(argv)) == vars(run_cmd.build_parser().parse_args(argv))


def test_options_still_go_through_argparse():
    from agentvm.cli import run_cmd

    assert run_cmd._plain(["--network", "none", "--", "true"]) is None
    assert run_cmd._plain(["true"]) is None

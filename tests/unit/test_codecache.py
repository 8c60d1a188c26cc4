"""agentvm.codecache: the code dataclasses generate, kept between runs. The classes must be the
same with it as without it, and a file anyone else could have written is never run."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentvm import codecache

PY = sys.executable


def _run(code: str, env: dict | None = None) -> str:
    r = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _build(path: Path) -> int:
    return int(_run(f"""
        from agentvm import codecache
        print(codecache.build({str(path)!r}))
        """, {"AGENTVM_NO_CODECACHE": "1"}))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("codecache")
    os.chmod(d, 0o755)
    path = d / "kept.marshal"
    assert _build(path) > 300  # every module of the package was imported (about 1,300 methods)
    return path


def _methods(path: Path | None) -> str:
    """Every generated method of the classes a start imports, as marshalled code (hex), with
    the kept code from ``path`` (None: compiled as usual)."""
    env = {"AGENTVM_NO_CODECACHE": "1"}
    install = ""
    if path is not None:
        install = f"""
        from agentvm import codecache
        codecache._packed.update(codecache.load({str(path)!r}))
        assert codecache._packed, "nothing loaded"
        import dataclasses
        dataclasses.exec = codecache._exec
        """
    return _run(install + """
        import hashlib, marshal, dataclasses
        import agentvm.runtime, agentvm.backends.bwrap, agentvm.policy, agentvm.gate.policy, agentvm.audit
        h = hashlib.sha256()
        n = 0
        for mod in (agentvm.runtime, agentvm.backends.bwrap, agentvm.policy, agentvm.gate.policy, agentvm.audit,
                    agentvm.backends.base, agentvm.lifecycle):
            for name, cls in sorted(vars(mod).items()):
                if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == mod.__name__:
                    for meth in ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__"):
                        f = cls.__dict__.get(meth)
                        if f is not None and hasattr(f, "__code__"):
                            h.update(marshal.dumps(f.__code__)); n += 1
        print(n, h.hexdigest())
        """, env)


def test_the_classes_are_the_same_with_the_kept_code(built):
    plain, kept = _methods(None), _methods(built)
    n = int(plain.split()[0])
    assert n > 50, plain
    assert kept == plain


def test_every_kept_entry_is_what_compile_makes_of_its_source(built):
    tables = codecache.load(str(built))
    assert len(tables) > 50
    checked = 0
    for raw in tables.values():
        for source, code in marshal.loads(raw).items():
            assert marshal.dumps(compile(source, "<string>", "exec", dont_inherit=True)) == marshal.dumps(code)
            checked += 1
    assert checked > 300


def test_a_start_uses_it_and_says_so(built, monkeypatch):
    out = _run(f"""
        from agentvm import codecache
        codecache.FILE = {str(built)!r}
        codecache._installed = False
        assert codecache.install()
        import agentvm.runtime
        st = codecache.status()
        print(st["installed"], sum(1 for t in codecache._code.values() if t))
        """)
    installed, used = out.split()
    assert installed == "True" and int(used) > 5


@pytest.mark.parametrize("spoil", ["group-writable", "world-writable-folder", "other-owner", "symlink", "magic", "index"])
def test_a_file_anyone_else_could_have_written_is_never_run(built, tmp_path, spoil):
    d = tmp_path / "cc"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    path = d / "kept.marshal"
    data = built.read_bytes()
    if spoil == "magic":
        data = b"\0\0\0\0" + data[4:]
    elif spoil == "index":
        data = data[:8] + b"\xff" * 16 + data[24:]
    if spoil == "symlink":
        (d / "real").write_bytes(data)
        os.chmod(d / "real", 0o644)
        path.symlink_to(d / "real")
    else:
        path.write_bytes(data)
        os.chmod(path, 0o644)
    if spoil == "group-writable":
        os.chmod(path, 0o664)
    elif spoil == "world-writable-folder":
        os.chmod(d, 0o777)
    elif spoil == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another uid")
        os.chown(path, 4242, 4242)
    assert codecache.load(str(path)) == {}
    if spoil not in ("magic", "index"):
        assert codecache.untrusted(str(path))


def test_a_damaged_table_falls_back_to_compiling(built):
    # one module's table cut short: that module's classes compile as usual, and are the same
    out = _run(f"""
        from agentvm import codecache
        t = codecache.load({str(built)!r})
        t["agentvm.policy"] = memoryview(bytes(t["agentvm.policy"])[:10])
        codecache._packed.update(t)
        import dataclasses
        dataclasses.exec = codecache._exec
        import agentvm.policy
        p = agentvm.policy.Limits()
        print(codecache._code.get("agentvm.policy"), type(p).__name__)
        """, {"AGENTVM_NO_CODECACHE": "1"})
    assert out == "{} Limits"

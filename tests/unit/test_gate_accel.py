"""The gate's compiled request path (agentvm.gate.accel): loaded only for the source it was
built from, never from a file others could have written, and the same behaviour either way."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentvm.gate import accel

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """accel pointed at a package folder of our own with one module, ``tiny``."""
    here = tmp_path / "gate"
    here.mkdir(mode=0o755)
    os.chmod(here, 0o755)
    (here / "tiny.py").write_text("def f():\n    return 'tiny'\n")
    monkeypatch.setattr(accel, "HERE", here)
    monkeypatch.setattr(accel, "OUT", here / "_accel")
    monkeypatch.setattr(accel, "COMPILED", ("tiny",))
    monkeypatch.delenv("AGENTVM_GATE_PURE", raising=False)
    return here


def _place(here: Path) -> Path:
    """A file where tiny.py's build would be (its content does not matter to the finder)."""
    out = here / "_accel"
    out.mkdir(mode=0o755, exist_ok=True)
    os.chmod(out, 0o755)
    content = b"not really a library"
    p = out / f"{accel._prefix('tiny', (here / 'tiny.py').read_bytes())}{len(content)}{accel.SUFFIX}"
    p.write_bytes(content)
    os.chmod(p, 0o644)
    return p


def test_the_installed_gate_runs_its_request_path_compiled():
    # scripts/install.sh (run by scripts/test.sh) builds it; a gate source edited since then
    # fails here until `python -m agentvm.gate build` - a stale build is never loaded instead
    code = ("import json, agentvm.gate.server, agentvm.gate.relay, agentvm.gate.h1 as h1\n"
            "from agentvm.gate import accel\n"
            "print(json.dumps({'status': accel.status(), 'file': h1.__file__,\n"
            "                  'kind': type(h1.parse_head).__name__}))")
    env = {k: v for k, v in os.environ.items() if k != "AGENTVM_GATE_PURE"}
    out = json.loads(subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True, env=env).stdout)
    assert {m: s for m, s in out["status"].items() if not s.startswith("compiled (")} == {}
    assert out["file"].endswith(accel.SUFFIX) and "/_accel/" in out["file"]
    assert out["kind"] != "function"  # a compiled function, not a Python one


def test_AGENTVM_GATE_PURE_runs_the_python_source():
    code = ("import json, agentvm.gate.h1 as h1\nfrom agentvm.gate import accel\n"
            "print(json.dumps([h1.__file__, accel.summary()]))")
    f, (ok, line) = json.loads(subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                                              env=dict(os.environ, AGENTVM_GATE_PURE="1")).stdout)
    assert f.endswith("/gate/h1.py") and not ok and "AGENTVM_GATE_PURE" in line


def test_a_build_stands_in_only_for_the_exact_source_it_was_built_from(fake):
    assert accel.compiled_for("tiny") == (None, "pure Python: no build of this source (python -m agentvm.gate build)")
    p = _place(fake)
    assert accel.compiled_for("tiny")[0] == p
    spec = accel.Finder().find_spec(f"{accel.PACKAGE}.tiny")
    assert spec is not None and spec.origin == str(p)
    assert accel.Finder().find_spec(f"{accel.PACKAGE}.other") is None  # not one of COMPILED
    assert accel.Finder().find_spec("tiny") is None
    (fake / "tiny.py").write_text("def f():\n    return 'edited'\n")  # one byte differs: a new key
    assert accel.compiled_for("tiny")[0] is None and accel.Finder().find_spec(f"{accel.PACKAGE}.tiny") is None
    assert accel.unbuilt() == ["tiny"]


@pytest.mark.parametrize("how", ["file-world-writable", "file-group-writable", "dir-world-writable",
                                 "file-owned-by-another-uid", "dir-owned-by-another-uid", "symlink"])
def test_a_build_someone_else_could_have_written_is_never_loaded(fake, tmp_path, how):
    p = _place(fake)
    if how == "file-world-writable":
        os.chmod(p, 0o646)
    elif how == "file-group-writable":
        os.chmod(p, 0o664)
    elif how == "dir-world-writable":
        os.chmod(p.parent, 0o777)
    elif how == "file-owned-by-another-uid":
        os.chown(p, 4242, -1)
    elif how == "dir-owned-by-another-uid":
        os.chown(p.parent, 4242, -1)
    else:  # a link to a library elsewhere: whoever can write there chooses the code
        real = tmp_path / "elsewhere.so"
        p.rename(real)
        p.symlink_to(real)
    path, why = accel.compiled_for("tiny")
    assert path is None and why.startswith("pure Python: not loading"), why
    assert accel.Finder().find_spec(f"{accel.PACKAGE}.tiny") is None


def test_the_pure_switch_wins_over_a_good_build(fake, monkeypatch):
    _place(fake)
    monkeypatch.setenv("AGENTVM_GATE_PURE", "1")
    assert accel.compiled_for("tiny") == (None, "pure Python: AGENTVM_GATE_PURE is set")
    monkeypatch.setenv("AGENTVM_GATE_PURE", "0")
    assert accel.compiled_for("tiny")[0] is not None


def test_build_compiles_loads_and_replaces_a_stale_build(fake, monkeypatch):
    pytest.importorskip("Cython", reason="the accel extra (cython) is not installed")
    name = f"{accel.PACKAGE}.tiny"
    assert accel.build() == []
    first = accel.compiled_for("tiny")[0]
    assert first is not None and first.stat().st_mode & 0o777 == 0o644
    assert os.stat(accel.OUT).st_mode & 0o777 == 0o755
    monkeypatch.setattr(sys, "meta_path", [accel.Finder(), *sys.meta_path])
    try:
        mod = importlib.import_module(name)
        assert mod.__file__ == str(first) and mod.f() == "tiny" and type(mod.f).__name__ != "function"
    finally:
        sys.modules.pop(name, None)
    assert accel.build() == []  # nothing to do: the same file stays
    assert accel.compiled_for("tiny")[0] == first and first.exists()
    (fake / "tiny.py").write_text("def f():\n    return 'edited'\n")
    assert accel.build() == []
    second = accel.compiled_for("tiny")[0]
    assert second is not None and second != first and not first.exists()  # the old build is gone
    assert sorted(f.name for f in accel.OUT.iterdir()) == [second.name]


def test_a_source_that_does_not_compile_is_reported_and_nothing_is_left(fake):
    pytest.importorskip("Cython", reason="the accel extra (cython) is not installed")
    (fake / "tiny.py").write_text("def f(:\n")
    errors = accel.build()
    assert len(errors) == 1 and errors[0].startswith("tiny: cython failed")
    assert accel.compiled_for("tiny")[0] is None and list(accel.OUT.iterdir()) == []


def test_the_gate_unit_tests_pass_as_plain_python():
    # the suite runs the compiled modules; their source, as plain Python, must pass the same tests
    tests = sorted(str(p) for p in (ROOT / "tests" / "unit").glob("test_gate_*.py") if p.name != "test_gate_accel.py")
    r = subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, AGENTVM_GATE_PURE="1"), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1] and "failed" not in r.stdout.splitlines()[-1]


def test_a_build_that_does_not_load_falls_back_to_the_source_and_says_so(fake, monkeypatch):
    # a file cut short by a crash, say: the name matches, the library does not load
    p = _place(fake)
    name = f"{accel.PACKAGE}.tiny"
    monkeypatch.setattr(sys, "meta_path", [accel.Finder(), *sys.meta_path])
    monkeypatch.setattr(accel, "FAILED", {})
    monkeypatch.setitem(sys.modules, accel.PACKAGE, sys.modules[accel.PACKAGE])
    try:
        import importlib.util

        spec = accel.Finder().find_spec(name)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        assert mod.f() == "tiny" and mod.__file__ == str(fake / "tiny.py")
        st = accel.status()["tiny"]
        assert st.startswith(f"pure Python: {p.name} did not load"), st
    finally:
        sys.modules.pop(name, None)


def test_build_refuses_an_output_folder_that_is_a_symbolic_link(fake, tmp_path):
    pytest.importorskip("Cython", reason="the accel extra (cython) is not installed")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "important.txt").write_text("keep me")
    (fake / "_accel").symlink_to(private)
    errors = accel.build()
    assert len(errors) == 1 and "not a folder of this user's" in errors[0]
    assert (private / "important.txt").read_text() == "keep me" and oct(private.stat().st_mode & 0o777) == "0o700"
    assert accel.compiled_for("tiny")[0] is None


def test_a_build_cut_short_is_never_loaded_and_is_built_again(fake):
    # a shared library cut short can kill the process that maps it (SIGBUS), past any fallback
    pytest.importorskip("Cython", reason="the accel extra (cython) is not installed")
    assert accel.build() == []
    p = accel.compiled_for("tiny")[0]
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size // 2)
    path, why = accel.compiled_for("tiny")
    assert path is None and "cut short" in why, why
    assert accel.Finder().find_spec(f"{accel.PACKAGE}.tiny") is None
    assert accel.unbuilt() == ["tiny"]
    assert accel.build() == []  # built again: the same name (the same size), whole this time
    assert accel.compiled_for("tiny")[0] == p and p.stat().st_size == size and accel.unbuilt() == []


def test_a_stray_file_with_a_strange_size_in_its_name_is_ignored(fake):
    src = (fake / "tiny.py").read_bytes()
    out = fake / "_accel"
    out.mkdir(mode=0o755)
    os.chmod(out, 0o755)
    (out / f"{accel._prefix('tiny', src)}\u00b2{accel.SUFFIX}").write_bytes(b"x")  # not an ASCII number
    assert accel.compiled_for("tiny")[0] is None and accel.Finder().find_spec(f"{accel.PACKAGE}.tiny") is None
    whole = _place(fake)  # beside one cut short, the whole build is the one found
    (out / f"{accel._prefix('tiny', src)}999{accel.SUFFIX}").write_bytes(b"y")
    assert accel.compiled_for("tiny")[0] == whole


def test_a_pxd_lays_out_a_class_in_c_and_is_part_of_the_build_key(fake, monkeypatch):
    """An augmenting .pxd makes a class an extension type (attributes in the object), keeps
    Python's semantics (an undeclared attribute still works through __dict__), and editing it
    makes the old build stale - it is compiled into the module as much as the .py is."""
    pytest.importorskip("Cython", reason="the accel extra (cython) is not installed")
    (fake / "tiny.py").write_text("class C:\n    def __init__(self):\n        self.a = 1\n"
                                  "def f():\n    return 'tiny'\n")
    (fake / "tiny.pxd").write_text("cdef class C:\n    cdef dict __dict__\n    cdef object __weakref__\n"
                                   "    cdef public object a\n")
    name = f"{accel.PACKAGE}.tiny"
    assert accel.build() == []
    first = accel.compiled_for("tiny")[0]
    monkeypatch.setattr(sys, "meta_path", [accel.Finder(), *sys.meta_path])
    try:
        mod = importlib.import_module(name)
        c = mod.C()
        assert type(mod.C.__dict__["a"]).__name__ == "getset_descriptor"  # a C slot, not a dict entry
        c.b = 2  # not declared: the instance's __dict__
        assert (c.a, c.b, c.__dict__) == (1, 2, {"b": 2})
        import weakref

        assert weakref.ref(c)() is c
    finally:
        sys.modules.pop(name, None)
    (fake / "tiny.pxd").write_text("cdef class C:\n    cdef public object a\n")
    assert accel.compiled_for("tiny")[0] is None  # the build of the old .pxd no longer stands in
    assert accel.build() == [] and accel.compiled_for("tiny")[0] not in (None, first)


def test_every_attribute_a_compiled_class_sets_is_declared_in_its_pxd():
    """An attribute missing from the .pxd still works (in __dict__) but is slow again - and for a
    class with __slots__ it would fail compiled only. Each .pxd covers every ``self.x = ``."""
    import ast
    import re

    gate = ROOT / "src" / "agentvm" / "gate"
    pxds = sorted(gate.glob("*.pxd"))
    assert {p.stem for p in pxds} <= set(accel.COMPILED) and len(pxds) >= 7
    for pxd in pxds:
        declared: dict[str, set[str]] = {}
        cls = None
        for line in pxd.read_text().splitlines():
            m = re.match(r"cdef class (\w+)", line)
            if m:
                cls = declared.setdefault(m.group(1), set())
            m = re.match(r"\s+cdef public object (.*)", line)
            if m:
                cls.update(a.strip() for a in m.group(1).split(","))
        tree = ast.parse((gate / f"{pxd.stem}.py").read_text())
        classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
        for name, attrs in declared.items():
            c = classes[name]
            inherited = set().union(*(declared.get(ast.unparse(b), set()) for b in c.bases))
            sets = {n.attr for n in ast.walk(c) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
            assert sets - attrs - inherited == set(), f"{pxd.name}: {name} sets undeclared attributes"
            slots = [ast.literal_eval(n.value) for n in c.body if isinstance(n, ast.Assign)
                     and any(getattr(t, "id", "") == "__slots__" for t in n.targets)]
            if slots:  # no __dict__ to fall back on, compiled or not: exactly the same attributes
                assert set(slots[0]) == attrs, f"{pxd.name}: {name}'s __slots__ and its declaration differ"

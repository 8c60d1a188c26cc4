"""The benchmarks run on the interpreter agentvm is installed in.

``python3 bench/X.py`` as the README writes it: when this Python cannot import agentvm and
the gate's dependencies (a fresh Debian's python3 has none of them), the script starts again
on the venv that ``scripts/install.sh`` made (``$AGENTVM_VENV``, default /opt/agentvm/venv),
so its child processes (``sys.executable``) have them too; without that venv it says what to
run instead of failing in a child process later.
"""

from __future__ import annotations

import os
import sys

_MARK = "AGENTVM_BENCH_REEXEC"  # set across the re-exec: never a loop


def agentvm_python() -> None:
    try:
        import agentvm  # noqa: F401
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
        return
    except ImportError as exc:
        missing = exc.name or str(exc)
    venv = os.environ.get("AGENTVM_VENV", "/opt/agentvm/venv")
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and not os.environ.get(_MARK):
        os.environ[_MARK] = "1"
        os.execv(py, [py, *sys.argv])
    sys.exit(f"{os.path.basename(sys.argv[0])}: this Python ({sys.executable}) cannot import {missing}: "
             f"run scripts/install.sh first (it makes {venv}), or run the benchmark with that venv's python")

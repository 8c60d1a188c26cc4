"""Where an installation lives, by the environment: the one definition of the rules, without
imports (``agentvm run``'s thin client needs the daemon's socket before anything else).

As root the defaults are system paths; otherwise per user. ``AGENTVM_HOME`` (state) and
``AGENTVM_RUNTIME_DIR`` (runtime) override both.
"""

from __future__ import annotations

import os


def default_dirs() -> tuple[str, str]:
    """(home, runtime) directories of the installation this environment names."""
    home = os.environ.get("AGENTVM_HOME")
    runtime = os.environ.get("AGENTVM_RUNTIME_DIR")
    if os.geteuid() == 0:
        h = home or "/var/lib/agentvm"
        r = runtime or (os.path.join(h, "run") if home else "/run/agentvm")
    else:
        xdg_data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        h = home or os.path.join(xdg_data, "agentvm")
        xdg_run = os.environ.get("XDG_RUNTIME_DIR")
        r = runtime or (os.path.join(xdg_run, "agentvm") if xdg_run and not home else os.path.join(h, "run"))
    return h, r

"""Where agent-vm keeps its state, runtime files and private binaries.

Everything lives outside every sandbox. As root the defaults are system paths; otherwise per
user. ``AGENTVM_HOME`` (state) and ``AGENTVM_RUNTIME_DIR`` (runtime) override both; tests use
them to get a private installation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    """Where agent-vm keeps durable state (home) and per-boot state (runtime)."""
    home: Path  # durable state: db, workspaces, CA keys later
    runtime: Path  # per-boot state: sandbox run dirs, sockets

    @property
    def libexec(self) -> Path:
        return self.home / "libexec"

    @property
    def workspaces(self) -> Path:
        return self.home / "workspaces"

    @property
    def state_db(self) -> Path:
        return self.home / "state.db"

    @property
    def audit_dir(self) -> Path:
        return self.home / "audit"

    @property
    def sandboxes(self) -> Path:
        return self.runtime / "sandboxes"

    def check_traversable(self) -> None:
        """The sandbox is started as an unprivileged uid that must reach bwrap, the helper and
        the run dir by path: every ancestor needs the search (x) bit for others."""
        from agentvm.errors import ConfigError

        for top in (self.libexec, self.sandboxes):
            for d in [top, *top.parents]:
                try:
                    mode = d.stat().st_mode
                except OSError:
                    continue
                if not mode & 0o001:
                    raise ConfigError(
                        f"{d} is not traversable by other users (mode {oct(mode & 0o777)}), so the sandbox's "
                        f"unprivileged uid cannot reach {top}",
                        hint="set AGENTVM_HOME/AGENTVM_RUNTIME_DIR to a path whose parents are mode 0711 or 0755",
                    )

    def ensure(self) -> "Paths":
        # 0711: an agent uid may traverse to its own workspace but list nothing.
        for d, mode in (
            (self.home, 0o711),
            (self.libexec, 0o755),
            (self.workspaces, 0o711),
            (self.audit_dir, 0o700),
            (self.runtime, 0o711),
            (self.sandboxes, 0o711),
        ):
            d.mkdir(parents=True, exist_ok=True)
            if d.stat().st_uid == os.geteuid():
                os.chmod(d, mode)
        return self


def default_paths() -> Paths:
    from agentvm.locations import default_dirs

    home, runtime = default_dirs()
    return Paths(home=Path(home), runtime=Path(runtime))


def default_preset_dirs() -> list[Path]:
    """User preset directories from the environment, highest priority first:
    ``$AGENTVM_PRESET_PATH`` (``:``-separated), then ``$AGENTVM_HOME/presets``."""
    dirs = [Path(p) for p in os.environ.get("AGENTVM_PRESET_PATH", "").split(":") if p]
    home = os.environ.get("AGENTVM_HOME")
    if home:
        dirs.append(Path(home) / "presets")
    return dirs

"""agent-vm: host AI agents in isolated, persistent sandboxes."""

__version__ = "0.1.0"

"""The control-plane daemon (``agentvm up``) and its client (used by the CLI and the SDK)."""

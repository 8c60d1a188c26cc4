"""``agentvm selftest``: a shipped red-team suite that proves containment on this host."""

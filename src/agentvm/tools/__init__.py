"""Tools: the MCP tool gateway, its policy, and the tool servers' sandboxes."""

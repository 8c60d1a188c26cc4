"""The egress gate: the L7 forward proxy that is every sandbox's only route out."""

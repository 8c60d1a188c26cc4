"""The egress gate: the L7 forward proxy that is every sandbox's only route out."""

from agentvm.gate import accel as _accel

_accel.install()  # the request path's modules load from their compiled build when it matches

"""The gate as a shared egress gateway: many sandboxes over TCP, each identified by an mTLS
client certificate the gateway's own CA minted for it (docs/scale-out.md).

* ``identity`` - ``agentvm://NAMESPACE/SANDBOX``: the one name a sandbox has at the gateway;
* ``ca`` - the gateway's CA: client certificates per sandbox (short-lived), its server certificate;
* ``config`` - the configuration source (a directory: ``gateway.yaml`` and agent files),
  reloaded when it changes, compiled into one policy, credential set and budget per identity;
* ``audit`` - the audit sink: one hash chain per (sandbox, replica), merged and verified per sandbox;
* ``server`` - the gate's exchange core (``agentvm.gate``) behind an mTLS listener.
"""

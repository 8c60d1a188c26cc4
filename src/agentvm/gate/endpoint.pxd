# C layout for endpoint.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class TokenBucket:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object rate, capacity, tokens, stamp

cdef class Endpoint:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object budget, gate, sandbox_id, agent, policy, sock_path, log_path, _log_pending
    cdef public object _log_pending_len, _log_torn, _relayed_fmt, server, active, bucket, bytes_out
    cdef public object bytes_in, denials, denial_reasons, deny_log_bucket, deny_suppressed, alert_log_bucket
    cdef public object alerts_suppressed
    cdef public object resign_buffered, allowed, _paused, conns, splices, cut, creds, tools
    cdef public object approval_timeout, approval_webhook, policy_digest, alerts, pool, _pool_idle
    cdef public object decoders, decoder_waiters, _pool_timer, _log_fd, closing, creds_ready, bridge_key

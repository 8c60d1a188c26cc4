# C layout for relay.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class ResponseScrub:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object scrubber, decoder, decoded_from, swapped, strict, sniff, guard, released, uninspected

cdef class Relay:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object cred, pooled, splice, host_value, ws, budget, scanner, scrubber, sent
    cdef public object _watching, t0, client_keep, llm_counted, _out, _out_len, _frame, meter, ep
    cdef public object client, body, upstream, fwd, req, d

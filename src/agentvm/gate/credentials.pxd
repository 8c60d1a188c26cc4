# C layout for credentials.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class CredentialSet:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object bindings, placeholders, _by_ph, value, revoked, local_revoked, max_len
    cdef public object _header_work, scrub_encoded, _scrub_table, _header_forms, _raw_value, brokers, _seen_values, _derived, _derived_match, check_real

cdef class BodyScanner:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object hold, tail, creds, host

cdef class ScrubTable:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object encoded, table, owner, regex, maxlen, hold_raw, hold_esc, newline_free, split_regex, stream_window, split_ws

cdef class Scrubber:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _t, _d, tail, hits

cdef class StreamGuard:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _t, buf, base, parsed, long_line, streams

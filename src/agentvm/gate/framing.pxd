# C layout for framing.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class RequestBody:  # __slots__ in the .py: no __dict__ either way
    cdef public object _buf, _eof, chunked, _trailer_bytes, _state, _left

cdef class Head:  # __slots__ in the .py: no __dict__ either way
    cdef public object status, reason, headers, version

cdef class Upgraded:  # __slots__ in the .py: no __dict__ either way
    cdef public object head, rest

cdef class ResponseReader:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _head_only, _parser, _events, _headers, _reason, _final, _complete
    cdef public object _until_close, _extra, _eof, _keep_alive, _bad, _in_head, _head_fields
    cdef public object _head_bytes, _fed_idle

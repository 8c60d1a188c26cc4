# C layout for streams.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class PlainStream:  # __slots__ in the .py: no __dict__ either way
    cdef public object transport, _chunks, _size, _limit, _eof, _exc, _lost, _waiter
    cdef public object _reading_paused, _writing_paused, _drains, _on_connect, _over_ssl, task
    cdef public object on_gone, _loop, _poll

cdef class TLSStream:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object raw, tls

# C layout for tls.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class ClientHelloParser:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _buf, _pos, _hs, _hs_total, _result, _error

cdef class _TLSSide:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _ssl, _incoming, _outgoing, _obj, handshake_done, eof, closed, _pending_error

cdef class TLSServerSide(_TLSSide):
    pass

cdef class TLSClientSide(_TLSSide):
    cdef public object server_hostname

cdef class _HostContexts:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _ca, _size, _ttl, _clock, _lock, _cache

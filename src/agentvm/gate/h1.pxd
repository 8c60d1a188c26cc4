# C layout for h1.py's classes when Cython compiles it (agentvm.gate.accel): their
# attributes live in the object, not in a dict. The .py alone is what runs pure. An attribute
# not declared here still works where the class keeps a __dict__ (all but those with __slots__
# in the .py), only slower: declare each one a class sets (tests/unit/test_gate_accel.py).
cdef class HeadReader:
    cdef dict __dict__  # anything else set on an instance (Python's semantics)
    cdef object __weakref__  # weak references, as to any Python object with a __dict__
    cdef public object _buf, limit, head, rest

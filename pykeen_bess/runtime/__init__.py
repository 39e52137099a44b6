"""The host process a run uses: CPU threads, the C library's allocator and the memory probes of the size searches.

* :mod:`~pykeen_bess.runtime.threads`: intra-op threads, measured (``num_threads="auto"``) or given;
* :mod:`~pykeen_bess.runtime.allocator`: glibc's allocator setting for the steps' CPU tensors;
* :mod:`~pykeen_bess.runtime.memory`: whether a probe fits, and the largest size that does.
"""

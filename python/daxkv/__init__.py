"""daxkv: a KV-cache store for LLM inference caches in CXL / DAX memory.

``daxkv.DaxConnector`` is LMCache's ``native_plugin`` connector over the
Rust engine; ``daxkv.lmcache`` (imported lazily, needs LMCache) holds the
``plugin``-path adapter; ``daxkv.cuda`` (imported lazily, torch optional)
stores and loads GPU tensors straight into leased slots. See python/README.md.
"""

from ._daxkv import DaxConfigError, DaxConnector, LeaseError, ReadLease, StoreLease

__all__ = [
    "DaxConfigError",
    "DaxConnector",
    "LeaseError",
    "ReadLease",
    "StoreLease",
]

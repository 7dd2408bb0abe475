"""daxkv's LMCache faces that subclass LMCache's own classes.

Each name is imported on first use (PEP 562 ``__getattr__``), so
``import daxkv.lmcache`` needs LMCache only for the face you touch:

- ``DaxL2Adapter`` (and its config class): the MP ``plugin`` path, in
  ``daxkv.lmcache._l2_adapter``;
- ``DaxBackend``: the non-MP storage plugin, in ``daxkv.lmcache._backend``.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DaxL2Adapter": "._l2_adapter",
    "DaxL2AdapterConfig": "._l2_adapter",
    "DaxBackend": "._backend",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

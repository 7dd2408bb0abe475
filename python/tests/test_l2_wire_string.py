"""python/src/l2.rs `wire_string` against LMCache's own
`_object_key_to_string` (native_connector_l2_adapter.py) for ObjectKeys
LMCache's `ObjectKey.__post_init__` accepts whose fields are subclasses of
str / bytes / int. Upstream builds the string with an f-string (each field's
`__format__`, `chunk_hash.hex()`); the core read the raw str / bytes / int
value, so the same ObjectKey was digested from a different string on the
`plugin` path than on the `native_plugin` path (README: one key names one
entry on both paths). Python 3.11 formats a `(str, Enum)` member as
`Class.NAME`. Found by a hostile review (the fifth); each case failed
before the fix (plain types keep the fast path, anything else goes
through Python's `format`)."""

from __future__ import annotations

import enum

import pytest

pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (  # noqa: E402
    _object_key_to_string,
)

from daxkv._daxkv import DaxL2Core  # noqa: E402


class Model(str, enum.Enum):
    LLAMA = "llama-3-8b"


class Salt(str, enum.Enum):
    TENANT = "tenant-a"


class Rank(int):
    def __format__(self, spec: str) -> str:
        return "r" + int.__format__(self, spec)


class Hash(bytes):
    def hex(self, *a) -> str:  # type: ignore[override]
        return "h" + bytes.hex(self, *a)


CASES = {
    "str_enum_model_name": ObjectKey(chunk_hash=b"\x01\x02", model_name=Model.LLAMA, kv_rank=0),
    "str_enum_cache_salt": ObjectKey(chunk_hash=b"\x01\x02", model_name="m", kv_rank=0,
                                     cache_salt=Salt.TENANT),
    "int_subclass_kv_rank": ObjectKey(chunk_hash=b"\x01", model_name="m", kv_rank=Rank(3)),
    "bytes_subclass_chunk_hash": ObjectKey(chunk_hash=Hash(b"\x01"), model_name="m", kv_rank=0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_wire_string_equals_lmcaches_for_field_subclasses(name: str) -> None:
    k = CASES[name]
    assert DaxL2Core.key_string(k) == _object_key_to_string(k)

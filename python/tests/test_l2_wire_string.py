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
through Python's `format`). A sixth review found `hex()`'s result taken
raw (the f-string formats it too) and an interrupt in a field's
`__format__` turned into "not an ObjectKey": both cases below failed
before their fix."""

from __future__ import annotations

import enum

import pytest

pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (  # noqa: E402
    _object_key_to_string,
)

from daxkv._daxkv import DaxL2Core  # noqa: E402

from test_l2_adapter import made, params  # noqa: E402,F401


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


class Tagged(str):
    """A `str` subclass formatting itself with a prefix (as a `(str, Enum)`
    member formats itself as `Class.NAME` on Python 3.11)."""

    def __format__(self, spec: str) -> str:
        return "t" + str.__format__(self, spec)


class HashTaggedHex(bytes):
    """`{key.chunk_hash.hex()}`: the f-string formats `hex()`'s result too."""

    def hex(self, *a) -> str:  # type: ignore[override]
        return Tagged(bytes.hex(self, *a))


class HashIntHex:
    def hex(self) -> int:
        return 0xAB


CASES = {
    "hex_returns_str_subclass_with_format": ObjectKey(
        chunk_hash=HashTaggedHex(b"\x01\x02"), model_name="m", kv_rank=0
    ),
    "hex_returns_int": ObjectKey(chunk_hash=HashIntHex(), model_name="m", kv_rank=0),
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


class Interrupted(int):
    def __format__(self, spec: str) -> str:
        raise KeyboardInterrupt


def test_an_interrupt_in_a_fields_format_is_not_a_type_error(made) -> None:
    """A Ctrl-C landing in a key field's `__format__` goes through as
    itself, as from LMCache's own `_object_key_to_string` (LMCache's
    controllers catch `Exception` around submits: a TypeError would have
    swallowed the interrupt); an ordinary error still names the key."""
    a = made.adapter(params("plugin", made.file()))
    k = ObjectKey(chunk_hash=b"\x01", model_name="m", kv_rank=Interrupted(1))
    with pytest.raises(KeyboardInterrupt):
        _object_key_to_string(k)
    with pytest.raises(KeyboardInterrupt):
        a._core.exists([k])
    bad = ObjectKey(chunk_hash=b"\x01", model_name="m", kv_rank=1.5)
    with pytest.raises(TypeError, match="key 0: not an ObjectKey") as e:
        a._core.exists([bad])
    assert isinstance(e.value.__cause__, ValueError), e.value.__cause__
    assert a.pending_tasks() == 0

"""``daxkv._daxkv.DaxStore`` (the non-MP backend's Rust store): lock / GIL
interplay of the put path with ``cached_positions``.

Plain ``DaxStore`` on a memfd; no LMCache needed. Every wait has a hang
guard; a hung call is left on a daemon thread (blocked in Rust with the GIL
released, so the rest of the run goes on).
"""

from __future__ import annotations

import threading

import pytest

from daxkv._daxkv import DaxStore

SLOT = 4096
HANG_S = 5.0


def _store() -> DaxStore:
    return DaxStore("memfd", 8 * SLOT, SLOT)


def _run(f):
    out: list = []

    def body() -> None:
        try:
            out.append(("ok", f()))
        except BaseException as e:  # noqa: BLE001
            out.append(("err", e))

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(HANG_S)
    return t, out


@pytest.mark.parametrize("call", ["status", "remove", "restore"])
def test_a_put_with_positions_does_not_hang_when_its_hook_uses_the_store(call: str) -> None:
    """A put with ``cached_positions`` holds the ``positions`` mutex from
    before its reservation until its tensor is in the map, and runs the
    write hook (with the GIL) inside that. A hook that calls back into the
    store on the same thread -- ``status()``, ``remove()`` (``forget_positions``)
    or ``restore()`` -- would take the same non-reentrant mutex and the put
    thread would deadlock with itself (python/src/store.rs put_batch
    positions path vs ``status`` / ``forget_positions`` / ``restore``); the
    call is refused from inside the hook instead."""
    s = _store()
    s.put_batch(["other"], [bytes(100)], [0], [object()])
    calls = {
        "status": lambda: s.status(),
        "remove": lambda: s.remove("other"),
        "restore": lambda: s.restore(["other"], False, lambda hits: [bytearray(100)]),
    }
    s._set_write_hook(lambda: calls[call]())
    t, out = _run(lambda: s.put_batch(["k"], [bytes(100)], [0], [object()]))
    hung = t.is_alive()
    if not hung:
        s._set_write_hook(None)
        s.close()
    assert not hung, f"put_batch with positions hung: its hook's {call}() waits on the positions lock"
    assert out and out[0][0] == "ok"

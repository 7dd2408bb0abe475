"""`commit_leases` batches: mixed connectors, a lease listed twice, one
already committed (in the parent); a child's batch mixing its own lease
with a parent's is refused whole, and its own lease commits alone after.
From a hostile review of the per-lease fork check."""

from __future__ import annotations

import daxkv

from conftest import SLOT, drain_until
from test_edges import in_child


def _c() -> daxkv.DaxConnector:
    return daxkv.DaxConnector(slot_bytes=SLOT, device_path="memfd",
                              max_dax_size_gb=64 * SLOT / 2**30, num_load_workers=1)


def _get(c, k, n):
    dst = bytearray(n)
    fid = c.submit_batch_get([k], [dst])
    ok = drain_until(c, {fid})[fid]
    return ok, bytes(dst)


def test_mixed_batch_in_the_parent_and_child() -> None:
    c1, c2 = _c(), _c()
    try:
        (a,) = c1.lease_store(["a"], [100])
        (b,) = c2.lease_store(["b"], [100])
        (d,) = c1.lease_store(["d"], [100])
        a.write(b"A" * 100); b.write(b"B" * 100); d.write(b"D" * 100)
        box = [d]

        def child() -> str:
            mine = _c()
            (x,) = mine.lease_store(["x"], [100])
            x.write(b"X" * 100)
            try:
                mine.commit_leases([x, box[0]])
                return "mixed batch accepted"
            except RuntimeError as e:
                if "fork" not in str(e):
                    return f"RuntimeError {e}"
            if not x.is_open:
                return "own lease taken by the refused batch"
            r = mine.commit_leases([x])
            ok, data = _get(mine, "x", 100)
            return f"ok {r} {ok[0]} {data == b'X' * 100}"

        assert in_child(child) == (0, "ok [True] True True")
        # The parent: a batch of two connectors' leases, one twice, one already committed.
        assert c1.commit_leases([a, b, a]) == [True, True, False]
        assert c1.commit_leases([a, d]) == [False, True]
        for c, k, ch in ((c1, "a", b"A"), (c2, "b", b"B"), (c1, "d", b"D")):
            ok, data = _get(c, k, 100)
            assert ok[0] and data == ch * 100, (k, ok)
    finally:
        c1.close()
        c2.close()

"""A forked child whose parent had a thread inside the plugin adapter,
holding its store lock, at the fork: the child's calls raise the fork
RuntimeError and never wait for that lock (its owner does not exist in
the child). From a hostile review: `reconfigure()` hung there once its
delete report took the lock before checking for a fork."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("lmcache")
pytest.importorskip("torch")

from test_edges import in_child  # noqa: E402
from test_l2_adapter import made, plugin, store  # noqa: E402,F401
from test_lmcache import key, obj  # noqa: E402


@pytest.mark.parametrize("call", ["reconfigure_status_op", "delete"])
def test_a_forked_child_raises_though_a_parent_thread_held_the_store_lock(plugin, call):
    """LMCache's store controller thread is inside pop_completed_store_tasks
    (telling a slow "stored" listener, so holding _store_lock) when the
    main thread forks. In the child, reconfigure() must raise the fork
    RuntimeError, not wait for _store_lock (held for ever there by a
    thread that does not exist)."""
    a = plugin(hotplug_enabled=True)
    entered, release = threading.Event(), threading.Event()

    class Slow:
        def on_l2_keys_stored(self, keys, sizes):
            entered.set()
            release.wait(30)

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            pass

    a.register_listener(Slow())
    a.submit_store_task([key(1)], [obj(b"x" * 1000)])

    def controller():
        while not entered.is_set():
            a.pop_completed_store_tasks()

    t = threading.Thread(target=controller, daemon=True)
    t.start()
    assert entered.wait(30)

    def child() -> str:
        try:
            if call == "delete":
                a.delete([key(1)])
            else:
                a.reconfigure("status", {})
        except RuntimeError as e:
            return "refused" if "fork" in str(e) else f"RuntimeError {e}"
        return "no error"

    try:
        code, out = in_child(child, timeout_s=10)
    finally:
        release.set()
        t.join(30)
    assert (code, out) == (0, "refused"), f"child exit {code}: {out!r} (-14 = SIGALRM: hung)"

"""The exit handshake and the fork check against a caller whose Python
code (a key's ``to_string()``, a keys generator, a listener, an ``alloc``
callback) runs inside a daxkv call — real processes, real ``os.fork``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A key whose to_string() forks: the child goes on inside the daxkv call the
# parent made, under `gil::held` (the exit handshake's window).
_FORK_IN_KEY = """
import os, sys, time
from daxkv._daxkv import DaxStore, _window_count
s = DaxStore("memfd", 64 * 4096, 4096)

class Key:
    child = False
    def to_string(self):
        pid = os.fork()
        Key.child = pid == 0
        if pid:
            self.pid = pid
        return "k"
"""


def _run(script: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, cwd="/")


def test_fork_inside_a_held_stretch_leaves_the_child_window_at_0() -> None:
    """The child of a fork made inside a daxkv call's Python stretch starts
    with the window at 0. A reset to 0 followed by the stretch's end taking
    one would leave it one below zero (usize::MAX), and the child's exit
    hook would wait its whole 5 s bound."""
    p = _run(_FORK_IN_KEY + """
k = Key()
try:
    s.contains(k)
except RuntimeError:
    pass
if Key.child:
    os.write(1, f"child window {_window_count()}\\n".encode())
    sys.exit(0)  # a normal exit: the atexit hook runs
t = time.monotonic()
_, st = os.waitpid(k.pid, 0)
print("child exit took", round(time.monotonic() - t, 2), "s, status", st, flush=True)
print("parent window", _window_count())
""")
    assert "child window 0" in p.stdout, (p.stdout, p.stderr[-2000:])
    took = float(p.stdout.split("child exit took ")[1].split()[0])
    assert took < 2.0, (p.stdout, p.stderr[-2000:])
    assert "parent window 0" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_a_call_that_forks_midway_does_not_go_on_in_the_child() -> None:
    """A child forked inside the call's own Python code (here a key's
    ``to_string()``; also a keys generator), after the fork check at the
    call's start, must raise instead of going on with the parent's call:
    going on, it would write into the parent's slots (the device mapping
    is MAP_SHARED), and the parent's stored payload would read back as the
    child's bytes."""
    p = _run(_FORK_IN_KEY + """
n = 100
buf = bytearray(b"P" * n)
class Forking(Key):
    def to_string(self):
        r = super().to_string()
        if Key.child:
            buf[:] = b"C" * n   # the child's copy of the caller's buffer
            time.sleep(0.5)     # the parent has stored by now
        return r
k = Forking()
try:
    out = s.put_batch([k], [buf], [0])
    where = "child" if Key.child else "parent"
    os.write(1, f"{where} put_batch returned {out}\\n".encode())
except RuntimeError as e:
    os.write(1, f"{'child' if Key.child else 'parent'} raised {e}\\n".encode())
if Key.child:
    os._exit(0)
os.waitpid(k.pid, 0)
got = []
def alloc(hits):
    got.extend(bytearray(nb) for _, _, nb in hits)
    return got
s.restore(["k"], False, alloc)
print("parent reads", bytes(got[0][:4]) if got else None, flush=True)
""")
    assert "child raised" in p.stdout, (p.stdout, p.stderr[-2000:])
    assert "parent reads b'PPPP'" in p.stdout, (p.stdout, p.stderr[-2000:])


def test_a_keys_generator_that_forks_does_not_go_on_in_the_child() -> None:
    """The connector's keys may be any iterable: a generator is Python code
    run after the fork check. Its child must get the fork RuntimeError,
    not submit to workers that do not exist in it."""
    p = _run("""
import os
import daxkv
c = daxkv.DaxConnector(slot_bytes=4096, device_path="memfd",
                       max_dax_size_gb=64 * 4096 / 2**30, num_load_workers=1)
child = False
def keys():
    global child
    child = os.fork() == 0
    yield "k"
try:
    fid = c.submit_batch_exists(keys())
    os.write(1, f"{'child' if child else 'parent'} got future {fid}\\n".encode())
except RuntimeError as e:
    os.write(1, f"{'child' if child else 'parent'} raised {e}\\n".encode())
if child:
    os._exit(0)
os.wait()
c.close()
""")
    assert "child raised" in p.stdout and "parent got future" in p.stdout, (p.stdout, p.stderr[-2000:])


# -- exit with daemon threads iterating keys generators inside daxkv --------------

import os  # noqa: E402

import pytest  # noqa: E402
from test_edges import PYTHONS, _run_exit  # noqa: E402

# A keys / buffers generator is Python code that daxkv's Rust frame runs
# (the iteration), with the GIL held: it may hand the GIL over and take it
# back while the interpreter exits — the door `gil::held` closes for a
# key's to_string(), left open for the iteration itself.
_GEN = """
def keys():
    for i in range(4):
        out = ""
        for c in "model@1@0@":
            out += c
        yield out + str(i)
"""

GEN_EXIT_SCRIPTS = {
    "backend_store": _GEN + """
from daxkv._daxkv import DaxStore
s = DaxStore("memfd", 64 * 4096, 4096)

def body():
    s.batched_contains(keys())
    s.batched_contains(keys())

start(body)
""",
    "connector": _GEN + """
import daxkv
c = daxkv.DaxConnector(slot_bytes=4096, device_path="memfd",
                       max_dax_size_gb=256 * 4096 / 2**30, num_load_workers=1, spin_us=0)
def gen_bufs():
    for _ in range(4):
        b = bytearray(64)
        x = 0
        for i in range(10):
            x += i
        yield b

def body():
    c.submit_batch_exists(keys())
    c.submit_batch_delete(keys())
    c.submit_batch_get(["a", "b", "c", "d"], gen_bufs())
    c.drain_completions()

start(body)
""",
}


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p))) or p)
@pytest.mark.parametrize("face", sorted(GEN_EXIT_SCRIPTS))
def test_exit_with_daemon_threads_iterating_a_generator_inside_daxkv_exits_0(python: str, face: str) -> None:
    """Daemon threads passing generators (keys, buffers) to daxkv when the
    script exits: exit 0 on every run, not SIGABRT ("FATAL: exception not
    rethrown"), which a generator handing the GIL over at exit hits on
    most runs on 3.11, 3.12 and 3.13 for the backend store."""
    for run in range(5):
        p = _run_exit(python, GEN_EXIT_SCRIPTS[face])
        assert "exiting with daemon threads" in p.stdout, p.stderr[-2000:]
        assert p.returncode == 0 and "FATAL" not in p.stderr, (
            f"run {run}: exit status {p.returncode}; stderr: {p.stderr[-2000:]}"
        )


# -- a listener that calls back into the adapter ----------------------------------


def test_a_listener_querying_its_load_again_does_not_break_the_callers_query() -> None:
    """``on_l2_keys_accessed`` is told inside ``query_load_result``; a
    listener that asks for the same task's result there (re-entrant: the
    adapter's lock is an RLock) must not take the kept bitmap from the
    outer call — LMCache's prefetch controller — which would then raise
    ``KeyError`` (its ``del self._loads_kept[task_id]``) instead of
    returning the bitmap."""
    pytest.importorskip("lmcache")
    from test_l2_adapter import SLOTS, build, dax_file, drain_stores, lookup, params, wait_result
    from test_lmcache import bits, key, obj

    from conftest import SLOT

    path = dax_file(SLOTS * SLOT)
    a = build(params("plugin", path))
    try:
        keys = [key(i) for i in range(4)]
        inner: list = []
        tid: list[int] = []

        class Listener:
            def on_l2_keys_stored(self, ks, sizes):
                pass

            def on_l2_keys_accessed(self, ks):
                inner.append(a.query_load_result(tid[0]))

            def on_l2_keys_deleted(self, ks):
                pass

        a.register_listener(Listener())
        s = a.submit_store_task(keys, [obj(b"x" * 100) for _ in keys])
        assert drain_stores(a, {s})[s].is_successful()
        assert lookup(a, keys) == [True] * 4
        dst = [obj(b"\0" * 100) for _ in keys]
        tid.append(a.submit_load_task(keys, dst))
        bm = wait_result(a, a.query_load_result, a.get_load_event_fd(), tid[0])
        assert bits(bm, 4) == [True] * 4
        assert [bytes(d.byte_array)[:100] for d in dst] == [b"x" * 100] * 4
        assert len(inner) == 1
        a.submit_unlock(keys)
    finally:
        a.close()
        os.unlink(path)


# -- the control plane's listening socket in a forked child -----------------------


def test_close_frees_the_control_port_while_a_forked_child_lives() -> None:
    """The child of a fork (a worker started with ``fork`` after the
    connector opened) must not keep the control plane's listening socket:
    if it did, after the parent's ``close()`` the port would stay bound
    while the child lives — a reopen on it failing with EADDRINUSE and a
    client connecting hanging (accepted by the kernel, served by no one)."""
    p = _run("""
import os, socket, time
import daxkv
c = daxkv.DaxConnector(slot_bytes=4096, device_path="memfd", max_dax_size_gb=64 * 4096 / 2**30,
                       num_load_workers=1, http={"port": 0})
port = int(c.http_address.rsplit(":", 1)[1])
pid = os.fork()
if pid == 0:
    time.sleep(5)
    os._exit(0)
c.close()
s = socket.socket()
try:
    s.bind(("127.0.0.1", port))
    print("rebind ok", flush=True)
except OSError as e:
    print("rebind failed:", e, flush=True)
s.close()
k = socket.socket()
k.settimeout(2)
try:
    k.connect(("127.0.0.1", port))
    print("connect accepted", flush=True)
except ConnectionRefusedError:
    print("connect refused", flush=True)
os.kill(pid, 9)
os.waitpid(pid, 0)
""")
    assert "rebind ok" in p.stdout and "connect refused" in p.stdout, (p.stdout, p.stderr[-2000:])


# -- a callback that calls back into daxkv while the interpreter exits ------------

_RESTORE_CALLBACK = """
from daxkv._daxkv import DaxStore
s = DaxStore("memfd", 64 * 4096, 4096)
s.put_batch(["a", "b"], [b"x" * 100, b"y" * 100], [0, 0])

def alloc(hits):
    x = 0
    for i in range(200):
        x += i
    s.lock_count("a")
    s.status()
    return [bytearray(nb) for _, _, nb in hits]

def body():
    s.restore(["a", "b"], False, alloc)

start(body)
"""


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p))) or p)
def test_exit_with_a_callback_calling_back_into_daxkv_is_prompt(python: str) -> None:
    """Daemon threads restoring, their ``alloc`` callback (run by daxkv
    under ``gil::with_gil``, counted in the exit window) calling daxkv
    again. A thread already in the window must run on to its end: an inner
    call that parked at exit while the outer entry stayed counted would
    make every exit wait the hook's whole 5 s bound."""
    import time

    for run in range(3):
        t = time.monotonic()
        p = _run_exit(python, _RESTORE_CALLBACK)
        took = time.monotonic() - t
        assert p.returncode == 0 and "FATAL" not in p.stderr, p.stderr[-2000:]
        assert took < 4.0, f"run {run}: the exit took {took:.1f} s (the hook's 5 s bound)"

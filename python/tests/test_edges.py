"""The Python faces at their edges: interpreter exit with daemon threads
inside daxkv calls, fork() after open, bad worker counts, caller-fault open
errors. Each runs real processes (subprocess scripts, os.fork) over real
mappings. The LMCache-specific ones (the plugin adapter, the non-MP backend,
listeners that raise, str keys on the plugin path) are in
test_edges_lmcache.py."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Callable

import pytest

import daxkv
from conftest import SLOT, drain_until

# -- interpreter exit ------------------------------------------------------------

#: Interpreters to run the exit scripts on: this one, and CPython 3.12 /
#: 3.13 where pyenv has them (the extension is abi3: one build loads in
#: every 3.11+). Extra ones: DAXKV_EXIT_PYTHONS (paths, ':'-separated).
def _pythons() -> list[str]:
    found = [sys.executable]
    for minor in ("3.12", "3.13"):
        paths = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python3")))
        if paths:
            found.append(paths[-1])
        else:
            print(f"test_edges: no CPython {minor} found under ~/.pyenv; not tested there")
    extra = os.environ.get("DAXKV_EXIT_PYTHONS", "")
    found += [p for p in extra.split(":") if p]
    return found


PYTHONS = _pythons()

#: Daemon threads loop on calls that release the GIL; the main thread
#: returns once each thread has looped a while, without closing anything.
_PRELUDE = """
import sys, threading, time
N_THREADS = 4
ready = threading.Barrier(N_THREADS + 1, timeout=60)

def spin(body):
    def run():
        n = 0
        while True:
            body()
            n += 1
            if n == 30:
                ready.wait()
    return run

def start(body):
    for _ in range(N_THREADS):
        threading.Thread(target=spin(body), daemon=True).start()
    ready.wait()
    print("exiting with daemon threads inside daxkv", flush=True)
"""

EXIT_SCRIPTS = {
    "connector": """
import daxkv
c = daxkv.DaxConnector(slot_bytes=4096, device_path="memfd",
                       max_dax_size_gb=256 * 4096 / 2**30, num_load_workers=1, spin_us=0)
c.submit_batch_set(["k"], [bytearray(b"v" * 100)])

def body():
    c.submit_batch_exists(["k", "x"])
    c.submit_batch_delete(["x"])
    c.drain_completions()
    c.status()

start(body)
""",
    "l2_core": """
from daxkv._daxkv import DaxL2Core

class Key:  # the fields of LMCache's ObjectKey
    def __init__(self, i):
        self.model_name, self.kv_rank, self.object_group_id = "m", 0, 0
        self.chunk_hash, self.cache_salt = i.to_bytes(8, "big"), ""

core = DaxL2Core(slot_bytes=4096, device_path="memfd",
                 max_dax_size_gb=256 * 4096 / 2**30, num_load_workers=1, spin_us=0)
ks = [Key(1), Key(2)]

def body():
    core.delete(ks)
    core.usage()
    core.exists(ks)
    core.closed
    t = core.submit_lookup(ks)
    core.query_lookup(t)
    core.submit_unlock(ks)
    core.pop_completed_stores()

start(body)
""",
    "backend_store": """
from daxkv._daxkv import DaxStore
s = DaxStore("memfd", 64 * 4096, 4096)

def body():
    s.put_batch(["a", "b"], [b"x" * 100, b"y" * 100], [0, 0])
    s.remove_many(["a", "b"])
    s.status()
    try:
        s.check_invariants()
    except RuntimeError:
        pass  # meaningful only with nothing in flight; other threads put here

start(body)
""",
    # Keys whose to_string() is Python code, run under daxkv's Rust frame
    # with the GIL held (LMCache's CacheEngineKey): that code may hand the
    # GIL over and take it back while the interpreter exits.
    "backend_store_py_keys": """
from daxkv._daxkv import DaxStore
s = DaxStore("memfd", 64 * 4096, 4096)

class Key:
    def __init__(self, i):
        self.i = i
    def to_string(self):
        out = ""
        for c in "model@1@0@":
            out += c
        return out + str(self.i)

ks = [Key(i) for i in range(4)]

def body():
    for k in ks:
        s.contains(k)
        s.lock_count(k)
    s.batched_contains(ks)

start(body)
""",
}


def _run_exit(python: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-c", _PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
        # Not the source folder (python/), whose daxkv has no extension.
        cwd="/",
    )


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p))) or p)
@pytest.mark.parametrize("face", sorted(EXIT_SCRIPTS))
def test_exit_with_daemon_threads_inside_daxkv_exits_0(python: str, face: str) -> None:
    """A script whose daemon threads are inside daxkv calls (GIL released)
    when the interpreter exits, with nothing closed, exits 0 without a core
    (not SIGABRT, "FATAL: exception not rethrown", exit 134). Three runs
    each: without the exit handshake the race is hit on most runs."""
    for run in range(3):
        p = _run_exit(python, EXIT_SCRIPTS[face])
        assert "exiting with daemon threads" in p.stdout, p.stderr[-2000:]
        assert p.returncode == 0, (
            f"run {run}: exit status {p.returncode} "
            f"({'SIGABRT' if p.returncode in (134, -6) else 'not 0'}); stderr: {p.stderr[-2000:]}"
        )
        assert "FATAL" not in p.stderr, p.stderr[-2000:]


def test_the_exit_hook_is_registered_at_import() -> None:
    """The handshake's hook runs from atexit: not set while running."""
    from daxkv import _daxkv

    assert _daxkv._finalizing() is False
    p = subprocess.run(
        [sys.executable, "-c",
         "import atexit, daxkv._daxkv as d\n"
         "atexit.register(lambda: print('after', d._finalizing(), flush=True))\n"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )
    # atexit runs last-registered first: ours (registered at import) runs
    # after the lambda, so the lambda still sees False.
    assert p.returncode == 0 and "after False" in p.stdout, (p.stdout, p.stderr)


def test_a_fork_child_does_not_inherit_threads_in_the_window() -> None:
    """Threads of the parent waiting for the GIL inside daxkv (the forking
    thread holds it) are counted in the exit handshake's window; they do
    not exist in a forked child, whose count starts at 0 — else its exit
    hook would wait its whole bound for them."""
    script = _PRELUDE + textwrap.dedent("""
        import os
        import daxkv, daxkv._daxkv as d
        c = daxkv.DaxConnector(slot_bytes=4096, device_path="memfd",
                               max_dax_size_gb=64 * 4096 / 2**30, num_load_workers=1)

        def body():
            c.submit_batch_exists(["k"])
            c.drain_completions()

        start(body)
        bad = 0
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                os._exit(0 if d._window_count() == 0 else 1)
            _, status = os.waitpid(pid, 0)
            bad += os.waitstatus_to_exitcode(status) != 0
        print("children with a stale window:", bad, flush=True)
        c.close()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert "children with a stale window: 0" in p.stdout, (p.stdout, p.stderr[-2000:])
    assert p.returncode == 0, p.stderr[-2000:]


# -- fork after open -------------------------------------------------------------


def in_child(fn: Callable[[], str], timeout_s: int = 30,
             fork: Callable[[], int] = os.fork) -> tuple[int, str]:
    """Run `fn` in a forked child; returns (exit code, what it reported).
    The child exits 0 only if `fn` returned; a hang is ended by SIGALRM."""
    r, w = os.pipe()
    pid = fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            signal.alarm(timeout_s)
            os.write(w, fn().encode())
            code = 0
        except BaseException as e:  # noqa: BLE001 - report anything, PanicException too
            try:
                os.write(w, f"{type(e).__name__}: {e}".encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def refused_in_child(calls: dict[str, Callable[[], object]]) -> str:
    """Each call must raise RuntimeError naming the fork; the problems found."""
    bad = []
    for name, call in calls.items():
        try:
            call()
            bad.append(f"{name}: no error")
        except RuntimeError as e:
            if "fork" not in str(e):
                bad.append(f"{name}: {e}")
        except BaseException as e:  # noqa: BLE001
            bad.append(f"{name}: {type(e).__name__}: {e}")
    return "\n".join(bad)


def _small_connector() -> daxkv.DaxConnector:
    return daxkv.DaxConnector(slot_bytes=SLOT, device_path="memfd",
                              max_dax_size_gb=64 * SLOT / 2**30, num_load_workers=1)


def _c_fork(how: str) -> Callable[[], int]:
    """A fork that is not Python's `os.fork` (as a C extension makes one),
    so none of Python's at-fork hooks run: the C library's `fork()`, its
    `_Fork()` (glibc 2.34, POSIX.1-2024: no `pthread_atfork` handlers
    either), or the raw system call. PyDLL: the GIL is kept over the
    call, so the child starts holding it."""
    import ctypes

    libc = ctypes.PyDLL(None)
    if how == "syscall":
        libc.syscall.restype = ctypes.c_long
        return lambda: libc.syscall(ctypes.c_long(57))  # SYS_fork, x86_64
    f = getattr(libc, how)
    f.restype = ctypes.c_int
    return f


@pytest.mark.parametrize("how", ["fork", "_Fork", "syscall"])
def test_fork_by_the_c_library_is_seen(how: str) -> None:
    """A child made without Python's `os.fork` is refused too, whichever
    way it was made: the check reads a word the kernel clears in every
    child (MADV_WIPEONFORK, python/src/fork.rs). A `pthread_atfork`
    handler missed `_Fork()` and the raw system call."""
    if how == "_Fork" and not hasattr(__import__("ctypes").CDLL(None), "_Fork"):
        pytest.skip("no _Fork in this C library")
    c = _small_connector()
    try:
        def child() -> str:
            return refused_in_child({
                "submit_batch_exists": lambda: c.submit_batch_exists(["k"]),
                "submit_batch_set": lambda: c.submit_batch_set(["k"], [bytearray(b"c" * 100)]),
                "status": c.status,
            }) or "ok"

        assert in_child(child, fork=_c_fork(how)) == (0, "ok")
        fid = c.submit_batch_exists(["k"])
        assert drain_until(c, {fid})[fid][2] == [False], "the child reached the parent's slots"
    finally:
        c.close()


def test_first_face_opened_while_another_thread_forks() -> None:
    """The process's first face, opened by one thread while another is
    inside a C-level `fork()` (held in its prepare stage by a slow
    `pthread_atfork` handler): the child, which has the face in its
    memory, is refused it. (A handler daxkv registered at that moment
    would not have run in that child.) A fresh interpreter, so the face
    is the first."""
    script = textwrap.dedent(f"""
        import ctypes, os, threading, daxkv
        libc = ctypes.PyDLL(None)
        libc.fork.restype = ctypes.c_int
        go, opened, box = threading.Event(), threading.Event(), []
        forker = threading.get_ident()
        def prepare():
            if threading.get_ident() == forker:
                go.set(); opened.wait(30)
        PREP = ctypes.CFUNCTYPE(None)(prepare)
        # pthread_atfork is a libc_nonshared.a wrapper of this:
        assert libc.__register_atfork(PREP, None, None, None) == 0
        def opener():
            go.wait(30)
            box.append(daxkv.DaxConnector(slot_bytes={SLOT}, device_path="memfd",
                                          max_dax_size_gb={64 * SLOT / 2**30}, num_load_workers=1))
            opened.set()
        threading.Thread(target=opener).start()
        pid = libc.fork()
        if pid == 0:
            try:
                box[0].submit_batch_exists(["k"])
                os.write(1, b"the child used the parent's connector\\n")
                os._exit(3)
            except RuntimeError:
                os._exit(0)
        _, st = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(st), flush=True)
        box[0].close()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert "child exit 0" in r.stdout, r.stdout + r.stderr


def test_leases_in_a_forked_child_are_refused_and_left_alone() -> None:
    """Leases open at fork(): in the child every call raises, and abort,
    release and drop do nothing (the slot and its pin are the parent's);
    the parent commits, reads and releases them afterwards as if no child
    had been. Before, a child's write landed in the parent's slot."""
    c = _small_connector()
    try:
        fid = c.submit_batch_set(["r"], [bytearray(b"r" * 1000)])
        assert drain_until(c, {fid})[fid][0]
        (sl,) = c.lease_store(["s"], [1000])
        sl.write(b"p" * 1000)
        (rl,) = c.lease_load(["r"])
        box = [sl, rl]

        def child() -> str:
            s, r = box
            bad = refused_in_child({
                "StoreLease.write": lambda: s.write(b"c" * 1000),
                "StoreLease.commit": s.commit,
                "ReadLease.read": lambda: r.read(bytearray(1000)),
            })
            s.abort()
            r.release()
            with s:
                pass
            box.clear()
            del s, r
            import gc

            gc.collect()
            return bad or "ok"

        assert in_child(child) == (0, "ok")
        assert sl.is_open and rl.is_open
        # Both slots are still held for the parent: "r" deleted under its
        # read lease and every free slot filled, neither is reused (a
        # child's release or abort would have let one go).
        fid = c.submit_batch_delete(["r"])
        assert drain_until(c, {fid})[fid][0]
        fill = [f"f{i}" for i in range(64)]
        fid = c.submit_batch_set(fill, [bytearray(b"f" * 1000) for _ in fill])
        drain_until(c, {fid})
        got = bytearray(1000)
        assert rl.read(got) == 1000 and bytes(got) == b"r" * 1000
        rl.release()
        assert c.commit_leases([sl]) == [True]
        dst = bytearray(1000)
        fid = c.submit_batch_get(["s"], [dst])
        assert drain_until(c, {fid})[fid][0] and bytes(dst) == b"p" * 1000
    finally:
        c.close()


def test_a_childs_own_connector_cannot_commit_a_parents_lease() -> None:
    """A child opens a connector of its own (whose own check passes) and
    hands it the parent's open StoreLease: `commit_leases` refuses it,
    naming the fork, before taking any lease; the parent then commits it
    as if there were no child. (Before, the child's connector committed
    its copy of the lease, as another engine's, into the parent's slot.)"""
    c = _small_connector()
    try:
        (sl,) = c.lease_store(["s"], [1000])
        sl.write(b"p" * 1000)
        box = [sl]

        def child() -> str:
            mine = _small_connector()
            try:
                r = mine.commit_leases(box)
            except RuntimeError as e:
                return "refused" if "fork" in str(e) else f"RuntimeError {e}"
            return f"no error: commit_leases -> {r}, lease is_open={box[0].is_open}"

        code, out = in_child(child)
        assert sl.is_open, "the parent's lease object was emptied"
        parent_commit = c.commit_leases([sl])
        dst = bytearray(1000)
        fid = c.submit_batch_get(["s"], [dst])
        got = drain_until(c, {fid})[fid]
        assert parent_commit == [True] and got[0] and bytes(dst) == b"p" * 1000
        assert (code, out) == (0, "refused"), (
            f"child: {out!r}; parent afterwards: commit_leases -> {parent_commit}, "
            f"get ok={got[0]}, data ok={bytes(dst) == b'p' * 1000}")
    finally:
        c.close()


_SHIM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/types.h>
/* getrandom refused (a seccomp filter answering ENOSYS, as container
   runtimes did for new syscalls), and a wall clock that does not move
   between the parent's open and the child's (CLOCK_REALTIME only). */
ssize_t getrandom(void *buf, size_t n, unsigned flags) {
    (void)buf; (void)n; (void)flags; errno = ENOSYS; return -1;
}
int clock_gettime(clockid_t id, struct timespec *ts) {
    if (id == CLOCK_REALTIME) { ts->tv_sec = 1700000000; ts->tv_nsec = 0; return 0; }
    return (int)syscall(SYS_clock_gettime, id, ts);
}
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)")
@pytest.mark.parametrize("getrandom", ["works", "refused"])
def test_a_child_with_its_parents_pid_is_refused(getrandom: str, tmp_path) -> None:
    """A child in a new PID namespace has its parent's pid (both 1 here),
    as can a child that got a dead parent's pid number. Once it opens a
    face of its own, the parent's connector must still be refused there:
    the fork word holds a token per process, not the pid. `refused`:
    `getrandom` fails (a seccomp filter) and the wall clock is frozen, so
    the child has its parent's pid, addresses and time; its token still
    differs (the parent's is mixed in and never repeated). (With the pid
    in the word, and then with a fallback of pid, clock and address, the
    child leased and committed into the parent's slots.)"""
    env = dict(os.environ)
    if getrandom == "refused":
        if shutil.which("cc") is None:
            pytest.skip("no cc for the getrandom shim")
        (tmp_path / "shim.c").write_text(_SHIM)
        so = tmp_path / "libshim.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(so), str(tmp_path / "shim.c")],
                       check=True)
        env["LD_PRELOAD"] = str(so)
    script = textwrap.dedent(f"""
        import ctypes, os, sys, daxkv
        assert os.getpid() == 1, os.getpid()
        def conn():
            return daxkv.DaxConnector(slot_bytes={SLOT}, device_path="memfd",
                                      max_dax_size_gb={64 * SLOT / 2**30}, num_load_workers=1)
        def drain(c, ids):
            got = {{}}
            while not ids <= set(got):
                for t in c.drain_completions():
                    got[t[0]] = t
            return got
        c = conn()
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWPID = 0x20000000
        # Children go into a new PID namespace (this process stays pid 1;
        # after this it can start no thread, so the connector is opened first).
        assert libc.unshare(CLONE_NEWPID) == 0, ctypes.get_errno()
        fid = c.submit_batch_set(["a"], [bytearray(b"a" * 1000)])
        drain(c, {{fid}})
        pid = os.fork()
        if pid == 0:
            assert os.getpid() == 1
            out = []
            try:
                c.submit_batch_exists(["a"])
                out.append("before: accepted")
            except RuntimeError:
                out.append("before: refused")
            mine = conn()
            try:
                c.submit_batch_exists(["a"])  # no worker of c's runs here: not drained
                (sl,) = c.lease_store(["x"], [1000])  # synchronous: the parent's slots
                sl.write(b"C" * 1000)
                out.append(f"after own open: accepted (lease_store+write+commit -> {{c.commit_leases([sl])}})")
            except RuntimeError:
                out.append("after own open: refused")
            os.write(1, (", ".join(out) + "\\n").encode())
            os._exit(0)
        os.waitpid(pid, 0)
        dst = bytearray(1000)
        fid = c.submit_batch_get(["a"], [dst])
        drain(c, {{fid}})
        print("parent reads a:", bytes(dst[:4]), flush=True)
        c.close()
    """)
    r = subprocess.run(["unshare", "-Urpf", sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=120, cwd="/", env=env)
    if r.returncode != 0 and r.stderr.startswith("unshare:"):
        pytest.skip(f"no user and pid namespaces here ({r.stderr.strip()})")
    assert "before: refused, after own open: refused" in r.stdout, r.stdout + r.stderr[-3000:]


def test_fork_after_open_connector() -> None:
    """In a forked child every call raises RuntimeError, close() and drop
    are silent no-ops, nothing reaches the parent's slots; the parent goes
    on as before."""
    box = [daxkv.DaxConnector(slot_bytes=SLOT, device_path="memfd",
                              max_dax_size_gb=64 * SLOT / 2**30, num_load_workers=2)]
    c = box[0]
    fid = c.submit_batch_set(["parent"], [bytearray(b"p" * 1000)])
    assert drain_until(c, {fid})[fid][0]
    del c

    def child() -> str:
        c = box[0]
        bad = refused_in_child({
            "submit_batch_set": lambda: c.submit_batch_set(["child"], [bytearray(b"c" * 1000)]),
            "submit_batch_get": lambda: c.submit_batch_get(["parent"], [bytearray(1000)]),
            "submit_batch_exists": lambda: c.submit_batch_exists(["parent"]),
            "submit_batch_delete": lambda: c.submit_batch_delete(["parent"]),
            "drain_completions": c.drain_completions,
            "status": c.status,
            "event_fd": c.event_fd,
            "pending": c.pending,
        })
        c.close()
        c.close()
        del c
        box.clear()  # drop: the last reference in the child
        import gc

        gc.collect()
        return bad or "ok"

    code, out = in_child(child)
    assert (code, out) == (0, "ok")
    c = box[0]
    fid = c.submit_batch_exists(["parent", "child"])
    assert drain_until(c, {fid})[fid][2] == [True, False], "the child reached the parent's slots"
    dst = bytearray(1000)
    fid = c.submit_batch_get(["parent"], [dst])
    assert drain_until(c, {fid})[fid][0] and dst == b"p" * 1000
    c.close()


def test_fork_after_open_l2_core() -> None:
    """The plugin path's Rust half (the adapter's own test, over LMCache,
    is in test_edges_lmcache.py)."""
    from daxkv._daxkv import DaxL2Core

    class Key:
        def __init__(self, i: int) -> None:
            self.model_name, self.kv_rank, self.object_group_id = "m", 0, 0
            self.chunk_hash, self.cache_salt = i.to_bytes(8, "big"), ""

    box = [DaxL2Core(slot_bytes=SLOT, device_path="memfd", max_dax_size_gb=64 * SLOT / 2**30)]

    def child() -> str:
        core = box[0]
        bad = refused_in_child({
            "submit_store": lambda: core.submit_store([Key(9)], [bytearray(100)]),
            "submit_lookup": lambda: core.submit_lookup([Key(9)]),
            "delete": lambda: core.delete([Key(9)]),
            "usage": core.usage,
            "closed": lambda: core.closed,
            "pop_completed_stores": core.pop_completed_stores,
            "event_fds": core.event_fds,
        })
        core.close()
        del core
        box.clear()
        return bad or "ok"

    assert in_child(child) == (0, "ok")
    core = box[0]
    assert core.usage()[1] > 0 and core.closed is False
    core.close()
    assert core.closed is True


def test_fork_after_open_backend_store(dax_file: str) -> None:
    """The non-MP backend's Rust half over a /dev/shm file (the backend
    class itself, over LMCache, is in test_edges_lmcache.py)."""
    from daxkv._daxkv import DaxStore

    with open(dax_file, "wb") as f:
        f.truncate(64 * SLOT)
    box = [DaxStore(dax_file, 64 * SLOT, SLOT)]
    codes, full_at = box[0].put_batch(["parent"], [b"p" * 500], [0])
    assert (list(codes), full_at) == ([0], -1)

    def child() -> str:
        s = box[0]
        bad = refused_in_child({
            "put_batch": lambda: s.put_batch(["child"], [b"c" * 500], [0]),
            "contains": lambda: s.contains("parent"),
            "remove_many": lambda: s.remove_many(["parent"]),
            "status": s.status,
            "closed": lambda: s.closed,
            "restore": lambda: s.restore(["parent"], False, lambda hits: [bytearray(500)]),
        })
        s.close()
        del s
        box.clear()
        return bad or "ok"

    assert in_child(child) == (0, "ok")
    s = box[0]
    assert s.contains("parent") and not s.contains("child")
    got: list[bytearray] = []

    def alloc(hits):
        got.extend(bytearray(n) for _, _, n in hits)
        return got

    s.restore(["parent"], False, alloc)
    assert got == [bytearray(b"p" * 500)]
    s.close()


# -- worker counts and caller-fault open errors -------------------------------------


@pytest.mark.parametrize("field", ["num_store_workers", "num_lookup_workers", "num_load_workers"])
@pytest.mark.parametrize("count", [10**8, 2**32, 1025])
def test_huge_worker_counts_are_value_errors(field: str, count: int) -> None:
    """A worker count over the fixed limit is refused before anything is
    allocated or spawned (unchecked, it ends in "memory allocation failed",
    an abort; 1025 opens 1025 threads), naming the field and the limit."""
    params = {"slot_bytes": SLOT, "device_path": "memfd", "max_dax_size_gb": 16 * SLOT / 2**30}
    with pytest.raises(ValueError, match=rf"{field}: must be at most 1024 workers per pool \(got {count}\)"):
        daxkv.DaxConnector(**params, **{field: count})
    from daxkv._daxkv import DaxL2Core

    with pytest.raises(ValueError, match=rf"{field}: must be at most 1024"):
        DaxL2Core.check_config(**params, **{field: count})
    with pytest.raises(ValueError, match=rf"{field}: must be at most 1024"):
        DaxL2Core(**params, **{field: count})
    DaxL2Core.check_config(**params, **{field: 1024})  # the limit itself is valid


def test_duplicate_device_is_a_value_error(dax_file: str) -> None:
    """A device listed twice: ValueError ("already mapped"), as LMCache's
    own dax adapter raises and its test suite expects; still a
    RuntimeError too (daxkv.DaxConfigError), as before."""
    with open(dax_file, "wb") as f:
        f.truncate(16 * SLOT)
    dev = {"device_path": dax_file, "max_dax_size_gb": 8 * SLOT / 2**30}
    params = {"slot_bytes": SLOT, "devices": [dev, dict(dev)]}
    from daxkv._daxkv import DaxL2Core

    for face in (daxkv.DaxConnector, DaxL2Core):
        with pytest.raises(ValueError, match="already mapped") as e:
            face(**params)
        assert isinstance(e.value, RuntimeError) and type(e.value).__name__ == "DaxConfigError"
    # A missing device and one too small are the caller's too.
    for bad, what in [({"device_path": dax_file + ".missing"}, "no such file"),
                      ({"max_dax_size_gb": 64 * SLOT / 2**30}, "smaller|exceeds|too small")]:
        with pytest.raises(ValueError, match=what):
            daxkv.DaxConnector(slot_bytes=SLOT, devices=[dict(dev, **bad)])


def test_backend_store_open_errors_are_value_errors(dax_file: str) -> None:
    """The non-MP store: a missing device and one smaller than asked are
    ValueErrors that keep upstream's RuntimeError and wording."""
    from daxkv._daxkv import DaxStore

    with open(dax_file, "wb") as f:
        f.truncate(8 * SLOT)
    with pytest.raises(ValueError, match="Failed to open dax device") as e:
        DaxStore(dax_file + ".missing", 8 * SLOT, SLOT)
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(ValueError, match="exceeds device capacity") as e:
        DaxStore(dax_file, 16 * SLOT, SLOT)
    assert isinstance(e.value, RuntimeError)


def test_backend_store_refuses_a_path_with_control_characters(dax_file: str) -> None:
    """The non-MP store checks its path as the config and hotplug do: a
    newline or bidirectional-formatting character (a path that prints as
    another in the logs) is refused, naming the field, before anything is
    opened."""
    from daxkv._daxkv import DaxStore

    with open(dax_file, "wb") as f:
        f.truncate(8 * SLOT)
    for bad in (dax_file + "\n", dax_file + "\u202e"):
        with pytest.raises(ValueError, match="device_path must not contain control"):
            DaxStore(bad, 8 * SLOT, SLOT)
    DaxStore(dax_file, 8 * SLOT, SLOT).close()

"""Races between DaxConnector.close() and drain_completions().

`Engine::close()` closes the engine's three completion eventfds (it drops
the worker pools) and only then closes the devices, under the pool's
`admin` mutex. `close()` (python/src/lib.rs) takes the engine out of the
state (`engine = None`) *before* it calls `Engine::close()`. Were it the
other way round, a `drain_completions()` that takes the state mutex in
that window would still see `engine` set and call `reset_fd` (an 8-byte
`read`) on the three raw fd numbers it saved at construction: numbers the
engine has closed and the process may have reused for anything else.

The window is normally microseconds wide. Here it is held open on purpose,
the way a control-plane operation can hold it in production: a hotplug
`add` posted to the connector's own HTTP control plane holds the engine's
`admin` mutex while the device probe reads sysfs; the test's fake sysfs
tree makes that read a FIFO, so the probe blocks until the test lets it
go. `close()` closes the engine's fds, then blocks on `admin` in
`close_all` -- with the state mutex free, so a drain runs inside the
window.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
import urllib.request

import pytest


def _epoll_targets(epfd: int) -> list[int]:
    with open(f"/proc/self/fdinfo/{epfd}") as f:
        return [int(line.split()[1]) for line in f if line.startswith("tfd:")]


def _eventfd_count(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("eventfd-count:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"fd {fd} is not an eventfd")


def _is_open(fd: int) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
        return True
    except FileNotFoundError:
        return False


def _engine_fds(c) -> list[int]:
    """The engine's three completion eventfds, as the connector's epoll
    watches them (the fourth target is the connector's own eventfd: the one
    an exists signals)."""
    targets = _epoll_targets(c.event_fd())
    assert len(targets) == 4, targets
    c.drain_completions()
    c.submit_batch_exists(["who-is-efd"])
    own = [fd for fd in targets if _eventfd_count(fd) != 0]
    assert len(own) == 1, own
    c.drain_completions()
    return [fd for fd in targets if fd != own[0]]


class _StuckControlPlane:
    """A hotplug add on the connector's control plane, stuck in the device
    probe (holding the engine's admin mutex) until `release()`."""

    def __init__(self, make_connector, tmp_path) -> None:
        st = os.stat("/dev/null")
        entry = tmp_path / "sys" / "dev" / "char" / f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        entry.mkdir(parents=True)
        self.fifo = str(entry / "uevent")
        os.mkfifo(self.fifo)
        self.c = make_connector(
            hotplug_enabled=True, http={"port": 0}, sysfs_root=str(tmp_path / "sys")
        )
        self.engine_fds = _engine_fds(self.c)
        addr = self.c.http_address

        def post() -> None:
            req = urllib.request.Request(
                f"http://{addr}/reconfigure/dax/l2/add",
                data=json.dumps({"device_path": "/dev/null", "size": 1 << 20}).encode(),
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(req, timeout=120).read()
            except Exception:  # noqa: BLE001 - the server is shut down under it
                pass

        self.poster = threading.Thread(target=post, daemon=True)
        self.poster.start()
        # Opening the FIFO's write end succeeds only once the probe has it
        # open for reading; with the write end held open, the probe's read
        # blocks (admin held) until release().
        deadline = time.monotonic() + 20
        while True:
            try:
                self.writer = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                assert e.errno == errno.ENXIO, e
                assert time.monotonic() < deadline, "the probe never opened the FIFO"
                time.sleep(0.01)
        self.closer = threading.Thread(target=self.c.close, daemon=True)
        self.closer.start()
        # close(): HTTP grace (5 s), then Engine::close closes the engine's
        # eventfds and blocks in close_all on the admin mutex.
        deadline = time.monotonic() + 30
        while any(_is_open(fd) for fd in self.engine_fds):
            assert time.monotonic() < deadline, "the engine's fds never closed"
            time.sleep(0.01)
        assert self.closer.is_alive(), "close() should be blocked on the stuck probe"

    def release(self) -> None:
        if self.writer is not None:
            os.close(self.writer)
            self.writer = None


def _reuse(numbers: list[int], data: bytes) -> dict[int, tuple[int, int]]:
    """Open a pipe at each freed fd number (as any other code in the process
    could by opening a file); `data` pre-written into each. Returns
    {number: (read end at that number, write end)}."""
    def high(fd: int) -> int:  # off the low numbers we want to reopen
        h = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 512)
        os.close(fd)
        return h

    ends = [tuple(high(fd) for fd in os.pipe()) for _ in numbers]
    out = {}
    for n, (r, w) in zip(numbers, ends):
        got = fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, n)
        os.close(r)
        if got != n:  # someone else took it first: leave it alone
            os.close(got)
            os.close(w)
            continue
        if data:
            os.write(w, data)
        out[n] = (n, w)
    assert out, "could not reopen any freed fd number"
    return out


def test_a_drain_during_close_reads_no_fd_the_engine_closed(make_connector, tmp_path):
    """A drain in the close window must not steal 8 bytes from whatever now
    owns the engine's old fd numbers (here: pipes holding data; in
    production: another connector's eventfd -- a lost wakeup there --, a
    socket, a file offset)."""
    s = _StuckControlPlane(make_connector, tmp_path)
    pipes = _reuse(s.engine_fds, b"not-ours")
    try:
        d = threading.Thread(target=s.c.drain_completions, daemon=True)
        d.start()
        d.join(10)
        assert not d.is_alive()
        left = {}
        for n, (r, _) in pipes.items():
            os.set_blocking(r, False)
            try:
                left[n] = os.read(r, 64)
            except BlockingIOError:
                left[n] = b""
    finally:
        s.release()
        s.closer.join(30)
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
    assert not s.closer.is_alive()
    stolen = [n for n, b in left.items() if b != b"not-ours"]
    assert not stolen, (
        f"drain_completions() read from fds {stolen}: numbers the engine had already closed "
        f"(Engine::close) and the process had reopened as pipes; their data is gone"
    )


def test_a_drain_during_close_never_blocks_on_a_reused_fd(make_connector, tmp_path):
    """The same window with a blocking fd at an old number: a drain that
    read it would block in read() holding the state mutex, so close() (and
    every other method, and pending(), which waits for that mutex holding
    the GIL) would hang."""
    s = _StuckControlPlane(make_connector, tmp_path)
    pipes = _reuse(s.engine_fds, b"")
    try:
        d = threading.Thread(target=s.c.drain_completions, daemon=True)
        d.start()
        d.join(2)
        s.release()  # the probe finishes; close() goes on to the state mutex
        s.closer.join(3)
        drain_hung, close_hung = d.is_alive(), s.closer.is_alive()
    finally:
        s.release()
        for _, w in pipes.values():  # unblock the drain's read
            os.write(w, b"\x01" * 8)
        d.join(10)
        s.closer.join(30)
        for r, w in pipes.values():
            os.close(r)
            os.close(w)
    assert not drain_hung and not close_hung, (
        f"drain_completions() blocked in read() on a reused fd (drain hung: {drain_hung}) "
        f"holding the state mutex; close() hung behind it (close hung: {close_hung})"
    )


def test_a_drain_during_close_leaves_another_connectors_wakeup(make_connector, tmp_path):
    """The realistic reuse: a second connector opened while the first one
    closes gets the freed numbers for its own engine eventfds. A first
    connector's drain that reset them would leave the second connector
    holding an undrained completion with an event_fd() that is not
    readable, so a bridge that drains on POLLIN (LMCache's demux loop)
    would never collect it -- until some later completion happens to
    signal again."""
    import select

    s = _StuckControlPlane(make_connector, tmp_path)
    # Any open by other code takes the lowest freed number; one such open
    # lines the second engine's eventfds up with the first one's old numbers.
    other = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        d = make_connector()
        d_fds = _engine_fds(d)
        shared = set(d_fds) & set(s.engine_fds)
        if not shared:
            pytest.skip(f"no fd number reused: {d_fds} vs {s.engine_fds}")
        p = select.poll()
        p.register(d.event_fd(), select.POLLIN)
        fid = None
        for kind in ("set", "get"):
            if kind == "set":
                fid = d.submit_batch_set(["k"], [b"x" * 100])
            else:
                fid = d.submit_batch_get(["k"], [bytearray(100)])
            assert p.poll(10_000), "the second connector's completion never signalled"
            signalled = [fd for fd in d_fds if _eventfd_count(fd) != 0]
            if set(signalled) & shared:
                break
            assert [x[0] for x in d.drain_completions()] == [fid]
        else:
            pytest.skip("no completion signalled on a shared number")
        t = threading.Thread(target=s.c.drain_completions, daemon=True)
        t.start()
        t.join(10)
        readable = bool(p.poll(500))
        got = [x[0] for x in d.drain_completions()]
    finally:
        s.release()
        s.closer.join(30)
        os.close(other)
    assert got == [fid], got
    assert readable, (
        f"connector 2 held completion {fid} but its event_fd was not readable: connector 1's "
        f"drain_completions() (closing) reset connector 2's engine eventfd (shared numbers {shared})"
    )

"""Review rv2: the exit handshake and the fork check against a caller whose
Python code (a key's ``to_string()``, a keys generator) runs inside a daxkv
call — real processes, real ``os.fork``."""

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
    """The child of a fork made inside a daxkv call's Python stretch left the
    window one below zero (the reset set 0, the stretch's end then took one):
    usize::MAX, so the child's exit hook waited its whole 5 s bound."""
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

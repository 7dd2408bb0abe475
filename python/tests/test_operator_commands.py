"""The operator's commands of python/README.md, run as written.

`operator/commands.txt` holds them (its header gives the format): per
LMCache path, a server command and the client commands an operator runs
against it. Each section runs here as real processes (LMCache 0.5.6's
`lmcache server`, `lmcache bench server --mode cpu`, `lmcache kvcache
clear`, `python -m lmcache.v1.standalone`, curl) on a memfd device, no GPU,
with free 127.0.0.1 ports swapped in, from a folder laid out as the
repository root (the reader's working directory); every wait is bounded. What each
path must show is checked from the commands' own output: the server comes
up and names daxkv in its log, the client commands exit 0, daxkv stores
and loads (its own `/metrics`; on the non-MP path a retrieve after LMCache's
CPU tier was cleared), and Ctrl-C stops the server cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

HERE = Path(__file__).parent / "operator"
ROOT = HERE.parent.parent.parent
START_S = 120.0
STEP_S = 120.0
STOP_S = 60.0


def sections() -> dict[str, list[str]]:
    """`commands.txt` → {path: [command, …]} (continuations joined)."""
    out: dict[str, list[str]] = {}
    cur: list[str] | None = None
    pending: str | None = None
    for line in (HERE / "commands.txt").read_text().splitlines():
        if pending is not None:
            pending += "\n" + line
            if not line.endswith("\\") and _balanced(pending):
                cur.append(pending)
                pending = None
            continue
        if line.startswith("### "):
            cur = out.setdefault(line[4:].strip(), [])
        elif line.startswith("$ "):
            assert cur is not None, f"a command before any section: {line}"
            cmd = line[2:]
            if cmd.endswith("\\") or not _balanced(cmd):
                pending = cmd
            else:
                cur.append(cmd)
    assert pending is None, f"unfinished command: {pending}"
    return out


def _balanced(cmd: str) -> bool:
    """No single-quoted string left open (a JSON argument spans lines)."""
    return cmd.count("'") % 2 == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def swap_ports(text: str, ports: dict[int, int]) -> str:
    return re.sub(r"\b(\d{4})\b", lambda m: str(ports.get(int(m.group(1)), m.group(1))), text)


def wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited {proc.returncode}:\n{tail(log)}"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} never answered within {START_S}s:\n{tail(log)}")


def tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def sample(text: str, name: str, **labels: str) -> float:
    """Sum of the samples `name{…}` whose labels include `labels`."""
    total, seen = 0.0, 0
    for line in text.splitlines():
        m = re.fullmatch(r"([a-z_]+)\{(.*)\} (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-z_0-9]+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            seen += 1
    assert seen, f"no sample {name}{labels} in:\n{text[:2000]}"
    return total


def run_section(name: str, health_path: str, without_dax: bool = False) -> list[str]:
    """Run section `name`: start its server, wait for `health_path` on its
    HTTP port, run the other commands (each must exit 0), stop the server
    with SIGINT. Returns the client commands' outputs and the server's log.
    `without_dax`: the YAML without its storage plugin (the control)."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (the README's commands use it)")
    cmds = sections()[name]
    p7000 = free_port()
    ports = {5555: free_port(), 8080: free_port(), 8766: free_port(), 7000: p7000, 6999: p7000 - 1}
    cmds = [swap_ports(c, ports) for c in cmds]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["LMCACHE_DISABLE_BANNER"] = "1"
    env["LMCACHE_TRACK_USAGE"] = "false"  # no usage reports leave the machine
    env["DO_NOT_TRACK"] = "1"
    # The checks read LMCache's INFO lines: a level another test of this
    # process set (bench_l2 quiets LMCache on import) must not hide them.
    env["LMCACHE_LOG_LEVEL"] = "INFO"
    with tempfile.TemporaryDirectory(prefix="daxkv-operator-") as tmp:
        # Laid out as the repository root, where the reader runs them: the
        # YAML at python/tests/operator/, its ports swapped.
        work = Path(tmp)
        at = work / HERE.relative_to(ROOT)
        at.mkdir(parents=True)
        for f in HERE.iterdir():
            if f.name != "commands.txt" and f.is_file():
                text = swap_ports(f.read_text(), ports)
                if without_dax:
                    plugin_keys = r"(storage_plugins|extra_config)|\s+(storage_plugin|dax)\."
                    text = "".join(
                        line for line in text.splitlines(keepends=True)
                        if not re.match(plugin_keys, line)
                    )
                (at / f.name).write_text(text)
        log = work / "server.log"
        with open(log, "wb") as out:
            server = subprocess.Popen(
                ["bash", "-c", "exec " + cmds[0]], cwd=work, env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            port = ports[7000] if name == "non_mp" else ports[8080]
            wait_http(f"http://127.0.0.1:{port}{health_path}", server, log)
            outputs = []
            for cmd in cmds[1:]:
                r = subprocess.run(
                    ["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                    timeout=STEP_S,
                )
                assert r.returncode == 0, (
                    f"{cmd}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n"
                    f"server:\n{tail(log)}"
                )
                outputs.append(r.stdout)
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGINT)
                try:
                    server.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait(timeout=10)
                    raise AssertionError(f"Ctrl-C did not stop the server in {STOP_S}s")
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, tail(log, 80)
        # uvicorn re-raises SIGINT after its shutdown (exit 130); the
        # standalone engine exits 0.
        assert server.returncode in (0, 130, -signal.SIGINT), (server.returncode, tail(log))
        return outputs + [text]


def check_mp_round_trip(outputs: list[str], l2_name: str) -> None:
    """The two bench runs around an L1 clear: the first stores (L1, then
    daxkv as L2), the second finds every chunk again after L1 was
    emptied, so it came back from daxkv; daxkv's /metrics agrees."""
    first, _, second, metrics = outputs[0], outputs[1], outputs[2], outputs[-2]
    assert "0/2 chunks hit" in first, first[-2000:]
    cold = re.findall(r"\[seq \d+/cold\] LOOKUP: (\d+)/(\d+) chunks hit", second)
    assert len(cold) == 3 and all(h == n != "0" for h, n in cold), second[-2000:]
    sums = re.findall(r"\[seq 0/(?:cold|warm)\] CHECKSUM: (\w+)", first + second)
    assert len(set(sums)) == 1, f"the bytes read back differ: {sums}"
    assert sample(metrics, "daxkv_keys_total", l2_name=l2_name, op="store", result="ok") == 6
    assert sample(metrics, "daxkv_keys_total", l2_name=l2_name, op="load", result="ok") >= 6
    assert sample(metrics, "daxkv_keys_total", l2_name=l2_name, op="lookup", result="ok") >= 6


def test_readme_shows_these_commands():
    """python/README.md shows every command of commands.txt and the YAML
    file, verbatim (the test above runs the same text)."""
    readme = (ROOT / "python" / "README.md").read_text()
    for name, cmds in sections().items():
        for cmd in cmds:
            assert cmd in readme, f"python/README.md lacks the {name} command:\n{cmd}"
    yaml = (HERE / "dax-nonmp.yaml").read_text().splitlines()
    body = "\n".join(line for line in yaml if not line.startswith("#"))
    assert body in readme, "python/README.md's YAML differs from operator/dax-nonmp.yaml"
    # The top-level README shows the recommended path's server command.
    top = (ROOT / "README.md").read_text()
    server = sections()["plugin"][0]
    assert server in top, f"README.md lacks the plugin server command:\n{server}"


def test_native_plugin_commands_run_as_written():
    """`native_plugin`: `lmcache server` with `DaxConnector` on a memfd,
    stores and loads through LMCache's own client, daxkv's /metrics on its
    control-plane port (lookups counted), clean stop."""
    out = run_section("native_plugin", "/healthcheck")
    check_mp_round_trip(out, "native_plugin")


def test_plugin_commands_run_as_written():
    """`plugin`: the same with `DaxL2Adapter`, plus a hotplug add through
    LMCache's `/reconfigure/plugin/l2/add`, then daxkv's /metrics on the
    adapter's own port shows the round trip and the second device."""
    out = run_section("plugin", "/healthcheck")
    check_mp_round_trip(out, "plugin")
    log = out[-1]
    assert re.search(
        r"daxkv DaxL2Adapter init: devices=\[memfd \(1024 MiB\)\] slot_bytes=2097152 "
        r"hotplug=on http=127\.0\.0\.1:\d+",
        log,
    ), log[-3000:]
    assert '"status":"ok"' in out[3] and '"device_path":"memfd:kv1"' in out[3], out[3]
    assert sample(out[4], "daxkv_device_state", l2_name="plugin", path="memfd:kv1", state="active") == 1


def test_non_mp_commands_run_as_written():
    """Non-MP: LMCache's standalone engine (no vLLM, no GPU) loads
    `DaxBackend` from the YAML's storage plugin keys (the path run from the
    repository root), answers its health route, stores 512 tokens, and
    after its CPU tier is cleared retrieves all 512 again: the only other
    backend is daxkv's, so they came from daxkv; Ctrl-C stops it."""
    out = run_section("non_mp", "/periodic-threads-health")
    assert '"healthy":true' in out[0], out[0]
    backends, stored, cleared, retrieved = (json.loads(o) for o in out[1:5])
    assert backends == {"LocalCPUBackend": "LocalCPUBackend", "dax": "DaxBackend"}, (
        backends
    )
    assert stored["status"] == "success" and stored["num_tokens"] == 512, stored
    assert cleared["status"] == "success" and cleared["num_removed"] == 512, cleared
    assert retrieved["status"] == "success" and retrieved["num_retrieved"] == 512, retrieved
    # The control: the same commands without the storage plugin retrieve
    # nothing once the CPU tier is cleared.
    control = run_section("non_mp", "/periodic-threads-health", without_dax=True)
    assert json.loads(control[1]) == {"LocalCPUBackend": "LocalCPUBackend"}, control[1]
    assert json.loads(control[4])["num_retrieved"] == 0, control[4]
    log = out[-1]
    assert "Created backend: dax (DaxBackend)" in log, log[-3000:]
    assert "daxkv DaxBackend init: device=memfd" in log, log[-3000:]
    assert "LMCache engine stopped" in log, log[-3000:]

"""The native_plugin connector's metrics label and optional control plane
(adapter_params "l2_name" and "http"): a real HTTP server on 127.0.0.1,
driven with urllib, reconfiguring the connector's own engine."""

from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.error
import urllib.request

import pytest

import daxkv
from conftest import SLOT, drain_until, payload


def request(addr: str, method: str, path: str, body: object = None, token: str | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def devices(addr: str) -> list[dict]:
    status, body = request(addr, "GET", "/reconfigure/dax/l2/status")
    assert status == 200, body
    (adapter,) = json.loads(body)["adapters"]
    return adapter["status"]["devices"]


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name{labels}` (labels matched exactly)."""
    hits = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-z_]+)\{(.*)\} (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-z_0-9]+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        if got == labels:
            hits.append(float(m.group(3)))
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} samples"
    return hits[0]


def test_metrics_carry_l2_name(make_connector):
    c = make_connector(l2_name="dax-cxl0")
    assert c.l2_name == "dax-cxl0"
    assert c.http_address is None, "no control plane unless asked"
    keys = [f"m@k{i}" for i in range(3)]
    f = c.submit_batch_set(keys, [memoryview(payload(i, 1000)) for i in range(3)])
    assert drain_until(c, {f})[f][0]
    text = c.metrics_text()
    assert sample(text, "daxkv_ops_total", l2_name="dax-cxl0", op="store") == 1
    assert sample(text, "daxkv_keys_total", l2_name="dax-cxl0", op="store", result="ok") == 3
    assert sample(text, "daxkv_bytes_total", l2_name="dax-cxl0", op="store") == 3000
    for line in text.splitlines():
        if not line.startswith("#"):
            assert 'l2_name="dax-cxl0"' in line, line
    # The default label is the adapter type LMCache labels its L2 metrics with.
    d = make_connector()
    assert d.l2_name == "native_plugin"
    assert 'l2_name="native_plugin"' in d.metrics_text()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.metrics_text()


def test_control_plane_reconfigures_the_connector(make_connector, dax_file):
    with open(dax_file, "wb") as f:
        f.truncate(64 * SLOT)
    c = make_connector(hotplug_enabled=True, http={"port": 0}, l2_name="d0")
    addr = c.http_address
    assert addr is not None and addr.startswith("127.0.0.1:")
    assert request(addr, "GET", "/health")[0] == 200
    before = len(devices(addr))

    status, body = request(
        addr, "POST", "/reconfigure/dax/l2/add", {"device_path": dax_file, "size": 64 * SLOT}
    )
    assert status == 200, body
    after = devices(addr)
    assert len(after) == before + 1
    assert any(d["device_path"] == dax_file and d["state"] == "active" for d in after), after

    # The connector's engine is the one reconfigured: stores keep working,
    # and /metrics is the labelled text.
    keys = [f"m@h{i}" for i in range(40)]
    data = [payload(i, SLOT) for i in range(40)]
    f = c.submit_batch_set(keys, [memoryview(d) for d in data])
    assert drain_until(c, {f})[f][0]
    dst = [bytearray(SLOT) for _ in keys]
    f = c.submit_batch_get(keys, [memoryview(d) for d in dst])
    assert drain_until(c, {f})[f][0]
    assert [bytes(d) for d in dst] == data
    status, text = request(addr, "GET", "/metrics")
    assert status == 200
    assert sample(text, "daxkv_hotplug_operations_total", l2_name="d0", operation="add", outcome="ok") == 1

    # Bad input over HTTP: a clear error, nothing changed.
    status, body = request(addr, "POST", "/reconfigure/dax/l2/add", {"device_path": dax_file + "-missing", "size": 8192})
    assert status in (400, 404), body
    assert len(devices(addr)) == before + 1

    # close() stops the server: the port no longer accepts.
    host, port = addr.rsplit(":", 1)
    c.close()
    assert c.http_address is None
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()
    c.close()  # idempotent


def test_control_plane_token(make_connector):
    c = make_connector(http={"host": "127.0.0.1", "port": 0, "token": "s3cret"})
    addr = c.http_address
    assert request(addr, "GET", "/health")[0] == 200, "health needs no token"
    assert request(addr, "GET", "/reconfigure/dax/l2/status")[0] == 401
    assert request(addr, "GET", "/reconfigure/dax/l2/status", token="wrong")[0] == 401
    assert request(addr, "GET", "/reconfigure/dax/l2/status", token="s3cret")[0] == 200


def test_control_plane_refuses_browser_requests(make_connector):
    """The connector's server has the same guards as `daxkv serve`: a POST
    that is not JSON (a form, text/plain, no Content-Type) is 415, a foreign
    Host or a cross-site Origin 403; `allow_hosts` admits a name."""
    c = make_connector(hotplug_enabled=True, http={"port": 0, "allow_hosts": ["kv.internal"]})
    addr = c.http_address
    host, port = addr.rsplit(":", 1)
    body = json.dumps({"device_path": "memfd", "size": 8 * SLOT}).encode()

    def raw(headers: dict, data: bytes | None = body, method: str = "POST",
            path: str = "/reconfigure/dax/l2/add") -> int:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            if data is not None:
                conn.putheader("Content-Length", str(len(data)))
            conn.endheaders(data)
            return conn.getresponse().status
        finally:
            conn.close()

    before = len(devices(addr))
    ours = {"Host": addr}
    for ct in [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]:
        headers = dict(ours) if ct is None else {**ours, "Content-Type": ct}
        assert raw(headers) == 415, ct
    js = {"Content-Type": "application/json"}
    assert raw({"Host": f"evil.example:{port}", **js}) == 403
    assert raw({**ours, **js, "Origin": "http://evil.example"}) == 403
    assert raw({**ours, **js, "Origin": "null"}) == 403
    assert raw({"Host": f"evil.example:{port}"}, None, "GET", "/reconfigure/dax/l2/status") == 403
    assert raw({"Host": f"evil.example:{port}"}, None, "GET", "/health") == 200
    assert len(devices(addr)) == before, "a refused request changed the devices"
    assert raw({"Host": f"kv.internal:{port}"}, None, "GET", "/reconfigure/dax/l2/status") == 200
    c.close()
    with pytest.raises(RuntimeError, match="allow_hosts"):
        make_connector(http={"port": 0, "allow_hosts": ["not a host"]})


@pytest.mark.parametrize(
    "params, message",
    [
        ({"http": {"port": 0, "prot": 1}}, "http.prot: unknown key"),
        ({"http": {"port": 70000}}, "http.port: must be a port number"),
        ({"http": {"host": "localhost"}}, "http.host: not an IP address"),
        ({"http": {"allow_non_loopback": "yes"}}, "http.allow_non_loopback: must be true or false"),
        ({"http": [8080]}, "http: must be an object"),
        ({"l2_name": 3}, "l2_name: must be a string"),
        ({"http": {"allow_hosts": "kv"}}, "http.allow_hosts: must be a list of host names"),
        ({"http": {"allow_hosts": [1]}}, "http.allow_hosts: not a host name: 1"),
        ({"l2_name": ""}, "l2_name: must not be empty"),
    ],
)
def test_bad_control_params_name_the_key(make_connector, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_connector(**params)


def test_refused_server_leaves_nothing_running(make_connector):
    # A non-loopback address without allow_non_loopback is refused; the
    # engine opened for it is closed again (its worker threads end).
    import os

    def threads() -> int:
        # The kernel's count; a walk of /proc/self/task can skip live
        # threads while others exit.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))

    before = threads()
    with pytest.raises(RuntimeError, match="non-loopback"):
        make_connector(http={"host": "0.0.0.0", "port": 0})
    # A busy port: the bind error names the address.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            make_connector(http={"port": port})
    finally:
        s.close()
    assert threads() == before, "the refused connectors' engines left threads"


def test_plugin_adapter_metrics_carry_l2_name():
    """The plugin path's metrics carry `l2_name` too (default "plugin")."""
    pytest.importorskip("lmcache")
    from daxkv._daxkv import DaxL2Core

    params = {"slot_bytes": SLOT, "device_path": "memfd", "max_dax_size_gb": 64 * SLOT / 2**30}
    core = DaxL2Core(**params)
    try:
        assert core.l2_name == "plugin"
        assert core.http_address is None, "no server unless asked"
        text = core.metrics_text()
        assert sample(text, "daxkv_ops_total", l2_name="plugin", op="store") == 0
    finally:
        core.close()
    core = DaxL2Core(l2_name="dax-b", **params)
    try:
        assert 'daxkv_worker_panics_total{l2_name="dax-b"} 0' in core.metrics_text()
    finally:
        core.close()


def test_plugin_adapter_serves_metrics_and_health_on_its_own_port():
    """`adapter_params["http"]` on the plugin path: daxkv's `/metrics` and
    `/health` on a port of its own (LMCache 0.5.6's `lmcache server`
    serves no Prometheus `/metrics`), and no reconfigure route there: the
    adapter's hotplug goes through LMCache's `/reconfigure/plugin/l2/*`
    only. Built by LMCache's factory from the `--l2-adapter` JSON; close
    frees the port."""
    pytest.importorskip("lmcache")
    import argparse

    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )

    spec = {
        "type": "plugin", "module_path": "daxkv.lmcache", "class_name": "DaxL2Adapter",
        "adapter_params": {
            "slot_bytes": SLOT, "device_path": "memfd", "max_dax_size_gb": 64 * SLOT / 2**30,
            "hotplug_enabled": True, "l2_name": "dax-p", "http": {"port": 0, "token": "t0k"},
        },
    }
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    adapter = create_l2_adapter(parse_args_to_l2_adapters_config(args).adapters[0])
    try:
        addr = adapter.http_address
        assert addr is not None and addr.startswith("127.0.0.1:"), addr
        assert request(addr, "GET", "/health") == (200, '{"status":"ok"}')
        assert request(addr, "GET", "/metrics")[0] == 401, "the token guards /metrics"
        status, text = request(addr, "GET", "/metrics", token="t0k")
        assert status == 200, text
        assert sample(text, "daxkv_slots_total", l2_name="dax-p", device="0", path="memfd") == 64
        assert sample(text, "daxkv_ops_total", l2_name="dax-p", op="store") == 0
        assert text == adapter.metrics_text()
        # No daxkv reconfigure route on this port: nothing is added.
        status, body = request(addr, "GET", "/reconfigure/dax/l2/status", token="t0k")
        assert status == 200 and json.loads(body)["enabled"] is False, body
        status, body = request(
            addr, "POST", "/reconfigure/dax/l2/add", {"device_path": "memfd:x", "size": 64 * SLOT},
            token="t0k",
        )
        assert status == 404, body
        assert len(adapter.report_status()["devices"]) == 1
    finally:
        adapter.close()
    assert adapter.http_address is None
    host, port = addr.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2)


def test_plugin_adapter_http_refuses_an_add_allow_list():
    """`http.allow_prefixes` means nothing on a port with no `add` route:
    refused by the config check LMCache runs and by the constructor, with
    nothing left running."""
    pytest.importorskip("lmcache")
    from daxkv._daxkv import DaxL2Core

    params = {"slot_bytes": SLOT, "device_path": "memfd", "max_dax_size_gb": 64 * SLOT / 2**30}
    bad = {"port": 0, "allow_prefixes": ["/dev/shm"]}
    with pytest.raises(ValueError, match="http.allow_prefixes: not on the plugin path"):
        DaxL2Core.check_config(http=bad, **params)
    with pytest.raises(ValueError, match="http.allow_prefixes: not on the plugin path"):
        DaxL2Core(http=bad, **params)
    with pytest.raises(ValueError, match="http.bogus: unknown key"):
        DaxL2Core(http={"bogus": 1}, **params)


def test_native_exists_counts_as_lookup(make_connector):
    """`submit_batch_exists` (what LMCache's bridge calls for a lookup) is
    counted as `op="lookup"`: one op per call, keys by hit / miss, and its
    duration; on `/metrics` of the connector's control plane too."""
    c = make_connector(http={"port": 0})
    f = c.submit_batch_set(["m@e0", "m@e1"], [memoryview(payload(i, 100)) for i in range(2)])
    assert drain_until(c, {f})[f][0]
    f1 = c.submit_batch_exists(["m@e0", "m@e1", "m@nope"])
    f2 = c.submit_batch_exists(["m@nope"])
    done = drain_until(c, {f1, f2})
    assert done[f1][2] == [True, True, False] and done[f2][2] == [False]
    status, text = request(c.http_address, "GET", "/metrics")
    assert status == 200
    assert sample(text, "daxkv_ops_total", l2_name="native_plugin", op="lookup") == 2
    assert sample(text, "daxkv_keys_total", l2_name="native_plugin", op="lookup", result="ok") == 2
    assert sample(
        text, "daxkv_keys_total", l2_name="native_plugin", op="lookup", result="miss_or_fail"
    ) == 2
    assert sample(text, "daxkv_task_duration_seconds_count", l2_name="native_plugin", op="lookup") == 2
    # A store is not a lookup: its count is unchanged.
    assert sample(text, "daxkv_ops_total", l2_name="native_plugin", op="store") == 1

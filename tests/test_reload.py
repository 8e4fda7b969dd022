"""Hot reload of the policy: the pure diff, then real gateway processes reloaded by the admin
API, SIGHUP and a file change, under traffic, with valid, invalid and restart-only policies."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import parse_policy
from gateway.reload import diff_policies
from gateway.telemetry.logs import AccessLog
from loadtests.procs import wait_until
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    start_backends,
    start_gateway,
    stop_backends,
)
from tests.test_admission import max_concurrency
from tests.test_drain import STREAMS, start_streams
from tests.test_hardening import _connect, _read_response, _request, _status

# -- the pure diff ---------------------------------------------------------------------------


def _policy(instances: str, extra: str = "", top: str = "") -> str:
    return f"""
{top}
pools:
  chat:
    models: [m]
    instances: [{instances}]
{extra}
"""


A = '{name: a, url: "http://10.0.0.1:8000"}'
B = '{name: b, url: "http://10.0.0.2:8000"}'
B2 = '{name: b, url: "http://10.0.0.9:8000"}'
C = '{name: c, url: "http://10.0.0.3:8000"}'


def test_diff_instances_added_removed_and_moved() -> None:
    old = parse_policy(_policy(f"{A}, {B}"))
    new = parse_policy(_policy(f"{B2}, {C}"))
    diff = diff_policies(old, new)
    assert diff.restart_required == []
    assert diff.instances_added == ["chat/b", "chat/c"]  # b moved: a different backend
    assert diff.instances_removed == ["chat/a", "chat/b"]
    assert diff.pools_changed == []
    assert not diff.empty


def test_diff_pool_settings_and_pools() -> None:
    old = parse_policy(_policy(f"{A}, {B}"))
    new = parse_policy(
        _policy(f"{B}, {A}", "    breaker: {isolation: 7s}\n")
        + "  embed:\n    models: [e]\n    instances: [{name: e, url: 'http://10.0.0.4:8000'}]\n"
    )
    diff = diff_policies(old, new)
    assert diff.pools_changed == ["chat"]  # order of instances alone is no change
    assert diff.pools_added == ["embed"]
    assert diff.instances_added == ["embed/e"]
    assert diff_policies(new, old).pools_removed == ["embed"]
    assert diff_policies(old, old).empty


def test_diff_lists_restart_only_keys() -> None:
    old = parse_policy(_policy(A))
    new = parse_policy(
        _policy(
            A,
            top="listen: 0.0.0.0:9000\nadmin: {listen: 127.0.0.1:9999}\n"
            "limits: {max_request_bytes: 1MiB}\n"
            "shared: {redis_url: 'redis://127.0.0.1:6379/0'}\n"
            "telemetry: {tracing: true, service_name: x, log_format: json, access_log: true}",
        )
    )
    diff = diff_policies(old, new)
    assert diff.restart_required == [
        "admin.listen",
        "listen",
        "shared",
        "telemetry.log_format",
        "telemetry.service_name",
        "telemetry.tracing",
    ]
    assert diff.settings == ["limits.max_request_bytes", "telemetry.access_log"]


def test_diff_reports_reloadable_settings() -> None:
    old = parse_policy(_policy(A))
    new = parse_policy(
        _policy(
            A,
            top="limits: {max_connections: 5, max_uri_bytes: 1KiB, trusted_proxies: [10.0.0.0/8]}"
            "\ndrain: {timeout: 5s}\ntelemetry: {access_log: true}",
        )
    )
    diff = diff_policies(old, new)
    assert diff.restart_required == []
    assert not diff.empty and not diff.pools_or_auth
    assert diff.summary()["settings"] == [
        "drain.timeout",
        "limits.max_connections",
        "limits.max_uri_bytes",
        "limits.trusted_proxies",
        "telemetry.access_log",
    ]
    assert diff.summary()["pools_changed"] == []
    assert diff_policies(new, new).empty


# -- real processes --------------------------------------------------------------------------

# Every policy file is padded to this size and rewritten in place with its old mtime, so the
# file watcher (stat-based) does not see it: the admin API and SIGHUP tests then observe their
# own trigger, never a race with the watcher. The watcher test replaces the file instead.
FILE_SIZE = 4096


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    started = start_backends(("a", "b", "c", "k"), ["m"], "--ttft", "0", "--per-token", "0.01")
    yield started
    stop_backends(started)


def policy_text(backends: dict[str, Backend], names: list[str], pool_extra: str = "") -> str:
    instances = ", ".join(f'{{name: {n}, url: "{backends[n].url}"}}' for n in names)
    text = f"""{LOOPBACK_LISTENERS}
pools:
  chat:
    models: [m]
    instances: [{instances}]
    health: {{interval: 200ms, timeout: 200ms}}
{pool_extra}"""
    assert len(text) < FILE_SIZE
    return text + "#" * (FILE_SIZE - len(text) - 1) + "\n"


def with_top(
    backends: dict[str, Backend], top: str, names: tuple[str, ...] = ("a", "b", "k")
) -> str:
    """`policy_text` with top-level YAML lines, still FILE_SIZE long."""
    text = policy_text(backends, list(names)).replace("pools:\n", f"{top}\npools:\n", 1)
    return text[: FILE_SIZE - 1] + "\n"


def write_quietly(path: Path, text: str) -> None:
    """Rewrite in place (same inode), same size, old mtime: invisible to the watcher."""
    st = path.stat()
    assert len(text.encode()) == st.st_size
    with open(path, "r+", encoding="utf-8") as f:
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def replace_atomically(path: Path, text: str) -> None:
    """As a ConfigMap update does: a new file swapped in (a new inode)."""
    temp = path.with_suffix(".tmp")
    temp.write_text(text)
    os.replace(temp, path)


@pytest.fixture
def gateway(backends: dict[str, Backend], tmp_path: Path) -> Iterator[Gateway]:
    for backend in backends.values():
        backend.reset()
    gw = start_gateway(tmp_path / "policy.yaml", policy_text(backends, ["a", "b", "k"]))
    yield gw
    gw.stop()


def admin_state(gw: Gateway) -> dict[str, Any]:
    response = httpx.get(f"{gw.admin_url}/admin/state", timeout=5)
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def instances(gw: Gateway) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in admin_state(gw)["pools"]["chat"]["instances"]}


def reload(gw: Gateway) -> httpx.Response:
    return httpx.post(f"{gw.admin_url}/admin/reload", timeout=10)


def chat(stream: bool = False, max_tokens: int = 3) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": max_tokens,
    }


def big_chat() -> dict[str, object]:
    """A completion request of about 4 KiB."""
    return chat() | {"messages": [{"role": "user", "content": "x" * 4096}]}


def metric(gw: Gateway, line_start: str) -> float:
    text = httpx.get(f"{gw.admin_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in /metrics")


def stream_once(url: str) -> tuple[str, bool]:
    """One SSE completion: (instance that answered, whether it ended with [DONE])."""
    with (
        httpx.Client(timeout=20) as http,
        http.stream(
            "POST", f"{url}/v1/chat/completions", json=chat(stream=True, max_tokens=150)
        ) as r,
    ):
        assert r.status_code == 200
        body = "".join(r.iter_text())
        return r.headers["x-gateway-instance"], body.rstrip().endswith("data: [DONE]")


def test_reload_mid_traffic_keeps_state_and_drops_nothing(
    gateway: Gateway, backends: dict[str, Backend], tmp_path: Path
) -> None:
    admin = gateway.admin_url
    # b: isolated by the operator (state that must survive); k: serving (its counters too).
    httpx.post(f"{admin}/admin/instances/chat/b/isolate", timeout=5).raise_for_status()
    statuses: list[tuple[int, str]] = []
    stop = threading.Event()

    def steady() -> None:
        with httpx.Client(base_url=gateway.url, timeout=20) as http:
            while not stop.is_set():
                r = http.post("/v1/chat/completions", json=chat())
                statuses.append((r.status_code, r.headers.get("x-gateway-instance", "")))

    with ThreadPoolExecutor(max_workers=10) as pool:
        workers = [pool.submit(steady) for _ in range(3)]
        streams = [pool.submit(stream_once, gateway.url) for _ in range(6)]
        # Streams in flight on a (to be removed) and k (kept) when the reload lands.
        assert wait_until(
            lambda: (
                instances(gateway)["a"]["in_flight"] > 0
                and instances(gateway)["k"]["in_flight"] > 0
            ),
            timeout_s=5,
        )
        before = instances(gateway)
        write_quietly(
            tmp_path / "policy.yaml",
            policy_text(backends, ["b", "k", "c"], "    breaker: {isolation: 7s}\n"),
        )
        response = reload(gateway)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["reloaded"] is True and body["version"] == 2
        assert body["changes"]["instances_added"] == ["chat/c"]
        assert body["changes"]["instances_removed"] == ["chat/a"]
        assert body["changes"]["pools_changed"] == ["chat"]
        after = instances(gateway)
        reloaded_at = len(statuses)
        # Traffic after the reload reaches the new instance c (it passed its health check).
        assert wait_until(lambda: any(i == "c" for _, i in statuses[reloaded_at:]), timeout_s=5)
        stream_results = [s.result() for s in streams]
        stop.set()
        for w in workers:
            w.result()
    assert len(statuses) > 20
    assert all(status == 200 for status, _ in statuses), statuses
    # Every stream completed, the ones on the removed instance included.
    assert all(done for _, done in stream_results)
    assert any(name == "a" for name, _ in stream_results)
    # No new request went to a after the reload (the ones counted just before may finish).
    assert all(name != "a" for _, name in statuses[reloaded_at + 3 :])
    assert set(after) == {"b", "k", "c"}
    # Kept instances kept their state.
    assert after["b"]["state"] == "ISOLATED" and after["b"]["forced"]
    assert after["b"]["isolations"] == before["b"]["isolations"] == 1
    assert after["b"]["requests"] == before["b"]["requests"]
    assert after["k"]["requests"] >= before["k"]["requests"] > 0
    assert after["k"]["ewma"]["ttfb"]["samples"] >= before["k"]["ewma"]["ttfb"]["samples"]
    state = admin_state(gateway)["policy"]
    assert state["version"] == 2 and state["last_error"] is None
    assert metric(gateway, 'gateway_policy_reloads_total{result="ok"}') == 1
    assert metric(gateway, "gateway_policy_version") == 2


def test_invalid_policy_is_refused_and_the_old_one_keeps_serving(
    gateway: Gateway, backends: dict[str, Backend], tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    good = path.read_text()
    syntax = good.replace("pools:\n", "pools: [\n", 1)[: len(good)]
    semantic = policy_text(backends, ["a", "b"], "    breaker: {isolaton: 5s}\n")
    for bad, expected in ((syntax, f"{path}:"), (semantic, f"{path}:8: pools.chat.breaker")):
        write_quietly(path, bad[:-1] + "\n" if len(bad) == len(good) else bad)
        response = reload(gateway)
        assert response.status_code == 400
        body = response.json()
        assert body["reloaded"] is False and body["version"] == 1
        assert expected in body["error"], body["error"]
    assert "did you mean" in body["error"]
    # The old policy (a, b, k) still serves.
    assert set(instances(gateway)) == {"a", "b", "k"}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat(), timeout=10)
    assert r.status_code == 200
    policy_state = admin_state(gateway)["policy"]
    assert policy_state["version"] == 1
    assert policy_state["reloads"] == {"ok": 0, "error": 2}
    assert "isolaton" in policy_state["last_error"]
    assert metric(gateway, 'gateway_policy_reloads_total{result="error"}') == 2
    assert metric(gateway, 'gateway_policy_reloads_total{result="ok"}') == 0
    assert "policy reload refused" in gateway.proc.output()


def test_restart_only_change_is_refused(
    gateway: Gateway, backends: dict[str, Backend], tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    top = "limits: {max_request_bytes: 1KiB}\ntelemetry: {service_name: other}"
    write_quietly(path, with_top(backends, top, ("a", "b", "k", "c")))
    response = reload(gateway)
    assert response.status_code == 400
    body = response.json()
    assert body["reloaded"] is False
    assert "only after a restart" in body["error"]
    assert "telemetry.service_name" in body["error"]
    assert "limits" not in body["error"]  # reloadable: not what refuses it
    assert set(instances(gateway)) == {"a", "b", "k"}  # nothing of it applied
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=big_chat(), timeout=10)
    assert r.status_code == 200  # nor the limit that came with it


def test_sighup_reloads(gateway: Gateway, backends: dict[str, Backend], tmp_path: Path) -> None:
    write_quietly(tmp_path / "policy.yaml", policy_text(backends, ["a", "c"]))
    gateway.proc.signal(signal.SIGHUP)
    assert wait_until(lambda: admin_state(gateway)["policy"]["version"] == 2, timeout_s=5)
    assert set(instances(gateway)) == {"a", "c"}
    assert "source=SIGHUP" in gateway.proc.output() or '"source": "SIGHUP"' in (
        gateway.proc.output()
    )


def test_file_change_reloads_without_a_signal(
    gateway: Gateway, backends: dict[str, Backend], tmp_path: Path
) -> None:
    replace_atomically(tmp_path / "policy.yaml", policy_text(backends, ["k"]))
    assert wait_until(lambda: admin_state(gateway)["policy"]["version"] == 2, timeout_s=5)
    assert set(instances(gateway)) == {"k"}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat(), timeout=10)
    assert r.status_code == 200 and r.headers["x-gateway-instance"] == "k"
    models = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["m"]
    assert admin_state(gateway)["policy"]["reloads"] == {"ok": 1, "error": 0}


def admission_policy(backends: dict[str, Backend], batch_weight: float) -> str:
    return policy_text(
        backends,
        ["k"],
        "    admission:\n"
        "      concurrency: {mode: fixed, limit: 2}\n"
        f"      batch: {{weight: {batch_weight}}}\n",
    )


def test_reload_of_admission_settings_keeps_the_pools_slots(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    """Changed admission settings apply in place: the requests running before the reload
    still hold their slots, so a request arriving after it waits instead of taking a slot
    that is not free (the pool is never counted twice)."""
    for backend in backends.values():
        backend.reset()
    path = tmp_path / "policy.yaml"
    gw = start_gateway(path, admission_policy(backends, 1.0))
    try:

        def admission() -> dict[str, Any]:
            found: dict[str, Any] = admin_state(gw)["pools"]["chat"]["admission"]
            return found

        with ThreadPoolExecutor(max_workers=3) as pool:
            streams = [pool.submit(stream_once, gw.url) for _ in range(2)]  # ~1.5 s each
            assert wait_until(lambda: admission()["running"] == 2, timeout_s=5)
            write_quietly(path, admission_policy(backends, 3.0))
            assert reload(gw).status_code == 200
            late = pool.submit(
                lambda: httpx.post(f"{gw.url}/v1/chat/completions", json=chat(), timeout=20)
            )
            assert wait_until(lambda: sum(admission()["queued"].values()) == 1, timeout_s=5)
            assert admission()["running"] == 2  # still the two streams: the late one waits
            assert [s.result(timeout=20) for s in streams] == [("k", True)] * 2
            assert late.result(timeout=20).status_code == 200
        state = admission()
        assert state["running"] == 0
        assert state["weights"]["batch"] == pytest.approx(3.0)  # the new settings serve
        done = [r for r in backends["k"].requests() if r["path"] == "/v1/chat/completions"]
        assert len(done) == 3 and max_concurrency(done) == 2
    finally:
        gw.stop()


# -- reloadable settings outside the pools ---------------------------------------------------

LONG_PATH = "/v1/chat/completions?pad=" + "q" * (1000 - len("/v1/chat/completions?pad="))


def long_uri_status(gw: Gateway) -> int:
    """A 1000-byte URI, on a connection of its own."""
    return httpx.post(f"{gw.url}{LONG_PATH}", json=chat(), timeout=10).status_code


def test_reload_of_limits_applies_to_new_requests(
    gateway: Gateway, backends: dict[str, Backend], tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    url = f"{gateway.url}/v1/chat/completions"
    assert long_uri_status(gateway) == 200
    assert httpx.post(url, json=big_chat(), timeout=10).status_code == 200
    with _connect(gateway) as kept:  # open before the reload, used after it
        kept.sendall(_request())
        assert _status(_read_response(kept)) == 200
        write_quietly(
            path, with_top(backends, "limits: {max_uri_bytes: 512, max_request_bytes: 1KiB}")
        )
        response = reload(gateway)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["version"] == 2
        assert body["changes"]["settings"] == ["limits.max_request_bytes", "limits.max_uri_bytes"]
        assert body["changes"]["pools_changed"] == []
        # The connection opened before follows the new caps from its next request.
        kept.sendall(_request(path=LONG_PATH))
        assert _status(_read_response(kept)) == 414
    assert long_uri_status(gateway) == 414
    too_large = httpx.post(url, json=big_chat(), timeout=10)
    assert too_large.status_code == 413
    assert httpx.post(url, json=chat(), timeout=10).status_code == 200
    assert "settings=limits.max_request_bytes,limits.max_uri_bytes" in gateway.proc.output()
    # And back: the defaults serve again.
    write_quietly(path, policy_text(backends, ["a", "b", "k"]))
    assert reload(gateway).json()["version"] == 3
    assert long_uri_status(gateway) == 200
    assert httpx.post(url, json=big_chat(), timeout=10).status_code == 200


def test_reload_turns_the_access_log_on_and_off(
    gateway: Gateway, backends: dict[str, Backend], tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    url = f"{gateway.url}/v1/chat/completions"

    def access_lines() -> list[str]:
        return [line for line in gateway.proc.lines if "gateway.access" in line]

    assert httpx.post(url, json=chat(), timeout=10).status_code == 200  # off: no line
    write_quietly(path, with_top(backends, "telemetry: {access_log: true}"))
    response = reload(gateway)
    assert response.status_code == 200, response.text
    assert response.json()["changes"]["settings"] == ["telemetry.access_log"]
    assert httpx.post(url, json=chat(), timeout=10).status_code == 200
    assert wait_until(lambda: len(access_lines()) == 1, timeout_s=5)
    assert "status=200" in access_lines()[0] and "pool=chat" in access_lines()[0]
    write_quietly(path, policy_text(backends, ["a", "b", "k"]))
    assert reload(gateway).json()["changes"]["settings"] == ["telemetry.access_log"]
    assert httpx.post(url, json=chat(), timeout=10).status_code == 200
    time.sleep(AccessLog.FLUSH_AFTER_S * 4)  # a line would be out by now
    assert len(access_lines()) == 1


def test_reload_of_drain_settings_applies_at_sigterm(
    backends: dict[str, Backend], tmp_path: Path
) -> None:
    """Started with a 10 s delay and a 30 s timeout, reloaded to none and 300 ms: SIGTERM
    ends streams of 10 s at the new deadline."""
    for backend in backends.values():
        backend.reset()
    path = tmp_path / "policy.yaml"
    gw = start_gateway(path, with_top(backends, "drain: {delay: 10s, timeout: 30s}"))
    try:
        write_quietly(path, with_top(backends, "drain: {delay: 0s, timeout: 300ms}"))
        response = reload(gw)
        assert response.status_code == 200, response.text
        assert response.json()["changes"]["settings"] == ["drain.delay", "drain.timeout"]
        with ThreadPoolExecutor(STREAMS) as pool:
            futures = start_streams(pool, gw, max_tokens=1000)  # 10 s each
            gw.proc.signal(signal.SIGTERM)
            results = [f.result(timeout=10) for f in futures]
            code = gw.proc.proc.wait(5)
        assert code == 0
        # Cut at the reloaded deadline: under the first settings (40 s) every stream would
        # have run to its end, without an error event.
        for stream in results:
            events = stream.events()
            assert events[-1] == "[DONE]", events[-3:]
            assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        gw.stop()  # joins the output reader
        assert "drain started delay_s=0 timeout_s=0.3 " in gw.proc.output()
        finished = next(line for line in gw.proc.lines if "drain finished" in line)
        assert f"ended_at_deadline={STREAMS}" in finished, finished
    finally:
        gw.stop()

"""A pool's connection limit: requests beyond it wait for a connection, then fail over, or are
answered at once when no other instance has room; the gateway's own limit is never charged to
the instance."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import httpx

from loadtests.procs import wait_until
from tests.support import pool_policy, start_backend, start_gateway


def test_a_full_instance_is_not_charged_for_the_gateways_own_limit(tmp_path: Path) -> None:
    backend = start_backend("only", ["m"], "--ttft", "0", "--per-token", "0")
    settings = """
connections: {max: 1, max_idle: 1}
timeouts: {connect: 200ms}
"""
    gateway = start_gateway(tmp_path / "policy.yaml", pool_policy({"only": backend}, settings))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        backend.set_faults(hang_rate=1.0)  # the first request holds the only connection

        def hold() -> None:
            with contextlib.suppress(httpx.HTTPError):  # it hangs until it gives up: expected
                httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=3)

        holder = threading.Thread(target=hold, daemon=True)
        try:
            holder.start()
            assert wait_until(lambda: len(backend.requests()) == 1, timeout_s=10)
            reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
        finally:
            holder.join(10)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "upstream_connection_limit"
        assert reply.headers["x-gateway-error"] == "upstream_connection_limit"
        # One wait for the connection, not one per retry: nothing else could take it.
        assert reply.headers["x-gateway-attempts"] == "1"
        assert reply.headers["retry-after"] == "1"
        state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
        [instance] = state["pools"]["chat"]["instances"]
        assert instance["state"] == "ADMITTING"
        assert len(backend.requests()) == 1  # the second request never reached it
        backend.set_faults(hang_rate=0.0)
        ok = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
        assert ok.status_code == 200
        after = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
        # The hung request ended when its client left: nobody's failure either.
        assert after["pools"]["chat"]["instances"][0]["failures"] == 0
        metrics = scrape(gateway.admin_url)
        ids = '{backend="only",pool="chat"}'
        # It queued for the connection once and was refused (none came free).
        assert metrics[f"gateway_upstream_connection_waits_total{ids}"] == 1
        assert metrics[f"gateway_upstream_connection_limit_refusals_total{ids}"] == 1
        # The hung one's connection was reset when it ended: the third request opened another.
        assert metrics[f"gateway_upstream_connections_opened_total{ids}"] == 2
        assert metrics[f"gateway_upstream_connection_reuses_total{ids}"] == 0
        idle = '{backend="only",pool="chat",state="idle"}'
        assert metrics[f"gateway_upstream_connections{idle}"] == 1
    finally:
        gateway.stop()
        backend.stop()


def scrape(admin_url: str) -> dict[str, float]:
    """The gateway's metrics: each sample's name and labels, to its value."""
    text = httpx.get(f"{admin_url}/metrics", timeout=5).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples

"""The Grafana dashboard: well-formed, tidy, and querying only metrics the gateway exports.

The last test runs a real gateway against fake backends, drives it through OOMs, an isolation,
a probe and a timeout so every family has samples, then checks the dashboard's PromQL against
the scraped `/metrics`, in both directions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.procs import wait_until
from loadtests.prometheus_server import PrometheusServer
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    Gateway,
    closed_port,
    instances_yaml,
    start_backends,
    start_gateway,
    stop_backends,
)

DASHBOARD_PATH = (
    Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "gateway-dashboard.json"
)
METRIC_RE = re.compile(r"\b(?:gateway|process)_[a-z0-9_]+")
GRID_WIDTH = 24
UNITS = {"s", "reqps", "ops", "percentunit", "short"}
RANGE_FUNCTIONS = re.compile(r"\b(rate|irate|increase)\(")

Panel = dict[str, Any]


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD_PATH.read_text())
    return dashboard


def all_panels(dashboard: dict[str, Any]) -> list[Panel]:
    """Every panel, including those nested in collapsed rows."""
    found: list[Panel] = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def query_panels(dashboard: dict[str, Any]) -> list[Panel]:
    return [panel for panel in all_panels(dashboard) if panel["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in query_panels(dashboard) for target in panel["targets"]]


def referenced_metrics(dashboard: dict[str, Any]) -> set[str]:
    return {name for expr in expressions(dashboard) for name in METRIC_RE.findall(expr)}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


# -- the file alone --------------------------------------------------------------------------


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"].strip()
    assert dashboard["uid"]
    assert dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in query_panels(dashboard):
        assert panel["title"].strip()
        assert panel["targets"], f"{panel['title']}: no targets"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{panel['title']}: duplicate refIds"
        for target in panel["targets"]:
            assert isinstance(target.get("expr"), str) and target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, panel["title"]


def test_variables_select_datasource_pool_and_instance(dashboard: dict[str, Any]) -> None:
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # The instance variable selects the `backend` label (Prometheus owns `instance`).
    for name, label in (("pool", "pool"), ("instance", "backend")):
        var = variables[name]
        assert var["type"] == "query" and var["multi"] and var["includeAll"]
        assert var["definition"].startswith("label_values(")
        assert var["definition"].endswith(f", {label})")
        assert var["query"]["query"] == var["definition"]
    assert '$pool"' in variables["instance"]["definition"]  # instances of the chosen pools


def test_panels_are_laid_out_without_overlaps(dashboard: dict[str, Any]) -> None:
    boxes = []
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        assert grid["y"] >= 0, panel["title"]
        boxes.append((panel["title"], grid["x"], grid["y"], grid["w"], grid["h"]))
    for (name1, x1, y1, w1, h1), (name2, x2, y2, w2, h2) in combinations(boxes, 2):
        apart = x1 + w1 <= x2 or x2 + w2 <= x1 or y1 + h1 <= y2 or y2 + h2 <= y1
        assert apart, f"{name1!r} overlaps {name2!r}"


def test_queries_are_balanced_and_use_the_rate_interval(dashboard: dict[str, Any]) -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    for expr in expressions(dashboard):
        stack: list[str] = []
        for char in re.sub(r'"[^"]*"', '""', expr):  # label values may hold any character
            if char in "([{":
                stack.append(char)
            elif char in pairs:
                assert stack and stack.pop() == pairs[char], expr
        assert not stack, expr
        ranges = re.findall(r"\[([^\]]*)\]", expr)
        assert len(ranges) == len(RANGE_FUNCTIONS.findall(expr)), expr
        assert all(window == "$__rate_interval" for window in ranges), expr
        for metric in set(METRIC_RE.findall(expr)):
            if metric.endswith(("_total", "_bucket", "_sum", "_count")):
                uses = len(re.findall(rf"\b{metric}\b", expr))
                rated = len(re.findall(rf"\brate\({metric}\b", expr))
                assert uses == rated, f"{metric} not always under rate(): {expr}"


# -- against a running gateway ---------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, Backend]]:
    started = start_backends(("a", "b"), ["m"], "--ttft", "0.01", "--per-token", "0.001")
    try:
        started.update(start_backends(("c",), ["slow"], "--ttft", "0.01"))
        yield started
    finally:
        stop_backends(started)


@pytest.fixture(scope="module")
def gateway(
    backends: dict[str, Backend], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    chat_backends = {name: backends[name] for name in ("a", "b")}
    # Shared state pointed at a closed port: the replica decides alone, but the shared-state
    # families are exported as they would be in a cluster.
    policy = f"""
{LOOPBACK_LISTENERS}
metrics: {{listen: 127.0.0.1:0}}
shared: {{redis_url: "redis://127.0.0.1:{closed_port()}/0"}}
pools:
  chat:
    models: [m]
    instances: [{instances_yaml(chat_backends)}]
    breaker: {{consecutive_failures: 3, isolation: 200ms, max_isolation: 1s}}
  slow:
    models: [slow]
    instances: [{instances_yaml({"c": backends["c"]})}]
    timeouts: {{initial: 200ms, initial_per_token: 10ms, floor: 100ms}}
    retries: {{on: [connect_failure]}}
    # Discovery beside the listed instance, from a nameserver that refuses: its families are
    # exported (an error counted, nothing found) and the listed instance serves.
    discovery:
      dns: {{name: vllm.test, port: 9, timeout: 200ms, nameservers: ["127.0.0.1:{closed_port()}"]}}
    admission:
      concurrency: {{mode: fixed, limit: 4}}
      tokens: {{capacity: 100000}}
      vllm_signals: {{interval: 100ms}}
  # Nothing listens: its requests go to `chat`, through `claude` (another API family).
  gone:
    models: [gone]
    instances: [{{name: g, url: "http://127.0.0.1:{closed_port()}"}}]
    fallbacks: [claude, chat]
  claude:
    models: [claude]
    api: anthropic
    instances: [{instances_yaml({"c": backends["c"]})}]
"""
    gw = start_gateway(tmp_path_factory.mktemp("dashboard") / "policy.yaml", policy)
    yield gw
    gw.stop()


def chat(gateway: Gateway, model: str, count: int = 1) -> list[int]:
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        return [
            http.post("/v1/chat/completions", json={**CHAT, "model": model}).status_code
            for _ in range(count)
        ]


def instance_state(gateway: Gateway, pool: str, name: str) -> dict[str, Any]:
    state = httpx.get(f"{gateway.admin_url}/admin/state", timeout=5).json()
    (found,) = [inst for inst in state["pools"][pool]["instances"] if inst["name"] == name]
    result: dict[str, Any] = found
    return result


def scrape(gateway: Gateway) -> dict[str, set[str]]:
    """Sample names by family name, as the admin plane serves them now."""
    response = httpx.get(f"{gateway.admin_url}/metrics", timeout=5)
    response.raise_for_status()
    return {
        family.name: {sample.name for sample in family.samples}
        for family in text_string_to_metric_families(response.text)
    }


def drive_traffic(gateway: Gateway, backends: dict[str, Backend]) -> None:
    """OOMs until `b` is isolated, a probe once it recovers, and a timeout on `c`."""
    backends["b"].set_faults(oom_rate=1.0)
    try:
        statuses: list[int] = []
        while instance_state(gateway, "chat", "b")["state"] != "ISOLATED" and len(statuses) < 40:
            statuses += chat(gateway, "m")
        assert statuses == [200] * len(statuses)  # each OOM retried on `a`
        assert instance_state(gateway, "chat", "b")["state"] == "ISOLATED"
    finally:
        backends["b"].reset()
    assert wait_until(
        lambda: instance_state(gateway, "chat", "b")["isolation_remaining_s"] == 0, 5.0
    )
    assert wait_until(
        lambda: chat(gateway, "m") == [200] and bool(backends["b"].requests()), 5.0, 0.0
    ), "no probe reached the recovered instance"

    # Answered by `chat`: a completion passes `claude` over (another API family, a route not
    # translated); a chat completion is translated there and refused (it serves `slow` only).
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        completion = {"model": "gone", "prompt": "hello", "max_tokens": 4}
        assert http.post("/v1/completions", json=completion).status_code == 200
    assert chat(gateway, "gone") == [200]

    backends["c"].set_faults(hang_rate=1.0, hang_s=2.0)
    try:
        assert chat(gateway, "slow") == [504]
    finally:
        backends["c"].reset()

    # A stream cut once on each instance: resumed twice, whole. The same with two choices,
    # which cannot be resumed: ended with an error event.
    for extra, cuts in (({}, 1), ({"n": 2}, 3)):
        for name in ("a", "b"):
            backends[name].set_faults(die_next=cuts, die_after=2)
        body = {**CHAT, "model": "m", "stream": True, "max_tokens": 8, **extra}
        with httpx.Client(base_url=gateway.url, timeout=10) as http:
            text = http.post("/v1/chat/completions", json=body).text
        assert text.endswith("data: [DONE]\n\n")
        assert ('"error"' in text) == bool(extra)
    for name in ("a", "b"):
        backends[name].reset()


def test_dashboard_queries_only_metrics_the_gateway_exports(
    dashboard: dict[str, Any], gateway: Gateway, backends: dict[str, Backend]
) -> None:
    drive_traffic(gateway, backends)
    families = scrape(gateway)
    exported = set().union(*families.values())
    referenced = referenced_metrics(dashboard)

    missing = sorted(referenced - exported)
    assert not missing, f"the dashboard queries metrics the gateway does not export: {missing}"
    unused = sorted(name for name, samples in families.items() if not samples & referenced)
    assert not unused, f"exported families no panel shows: {unused}"
    # The traffic above produced the series the error and breaker panels rely on.
    for family in (
        "gateway_backend_ooms",
        "gateway_probes",
        "gateway_timeouts",
        "gateway_stream_resumes",
        "gateway_stream_resume_refusals",
    ):
        assert families[family], f"{family} has no samples"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, query) for every panel target, its variables given as Grafana would with
    every pool and backend selected (and a rate window that holds a few 1 s scrapes)."""
    found = []
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "30s")
            expr = expr.replace('"$pool"', '".*"').replace('"$instance"', '".*"')
            found.append((panel["title"], expr))
    return found


def test_every_panel_query_returns_data_from_a_real_prometheus(
    dashboard: dict[str, Any], gateway: Gateway, backends: dict[str, Backend]
) -> None:
    """A real Prometheus scrapes the gateway's metrics listener every second while the scenario
    runs; then every query of every panel, as Grafana sends it, returns series."""
    with PrometheusServer([gateway.proc.ready["metrics"]]) as prometheus:
        assert wait_until(lambda: prometheus.scrapes() >= 2, 30.0, 0.2)
        drive_traffic(gateway, backends)
        seen = prometheus.scrapes()
        assert wait_until(lambda: prometheus.scrapes() >= seen + 3, 30.0, 0.2)
        empty = [
            f"{title}: {expr}"
            for title, expr in panel_queries(dashboard)
            if not prometheus.query(expr)
        ]
        assert empty == []


def readme_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """The README's metric table: family name -> (type, label names); counters are named with
    `_total` there."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = text.index("| metric | type | labels | unit | meaning |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    table: dict[str, tuple[str, frozenset[str]]] = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name, kind = cells[0].strip("`"), cells[1]
        labels = frozenset(label.strip() for label in cells[2].split(",") if label.strip())
        table[name.removesuffix("_total") if kind == "counter" else name] = (kind, labels)
    return table


def test_the_readme_lists_every_metric_with_its_type_and_labels(
    gateway: Gateway, backends: dict[str, Backend]
) -> None:
    drive_traffic(gateway, backends)  # every family with samples, so its labels show
    response = httpx.get(f"{gateway.admin_url}/metrics", timeout=5)
    exported = {
        family.name: (
            family.type,
            frozenset(label for sample in family.samples for label in sample.labels) - {"le"},
        )
        for family in text_string_to_metric_families(response.text)
    }
    assert readme_metrics() == exported

"""The alert rules (`deploy/prometheus/gateway-alerts.yaml`): promtool checks them and runs their
unit tests, the PrometheusRule ships the same groups, and a real Prometheus scraping a real
gateway in a fault scenario fires the alerts for those faults and no other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from loadtests.procs import wait_until
from loadtests.prometheus_server import PrometheusServer
from tests.support import (
    LOOPBACK_LISTENERS,
    Backend,
    closed_port,
    instances_yaml,
    start_backends,
    start_gateway,
    stop_backends,
)

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "gateway-alerts.yaml"
RULE_TESTS = REPO / "tests" / "prometheus" / "gateway-alerts.test.yaml"
K8S_MONITORING = REPO / "deploy" / "k8s" / "monitoring"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is needed (scripts/install-system-deps)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, check=False)


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 9 rules found" in result.stdout


def test_the_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_prometheusrule_ships_the_same_groups() -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (scripts/install-system-deps)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S_MONITORING)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    (rule,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def _without_waiting(tmp_path: Path) -> Path:
    """The rules with every `for:` at 0: a test cannot wait the minutes an on-call would. The
    unit tests above check the real durations."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = tmp_path / "alerts.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


def test_a_real_prometheus_fires_the_alerts_of_a_fault_scenario(tmp_path: Path) -> None:
    """Faults: Redis unreachable, pool `down` with its only backend failing its health checks
    (requests go to it in panic), a refused policy reload. Pool `ok` serves normally."""
    backends: dict[str, Backend] = start_backends(("up", "down"), ["m", "d"])
    try:
        backends["down"].set_faults(unhealthy=True)
        policy_path = tmp_path / "policy.yaml"
        policy = f"""
{LOOPBACK_LISTENERS}
metrics: {{listen: 127.0.0.1:0}}
shared: {{redis_url: "redis://127.0.0.1:{closed_port()}/0"}}
pools:
  ok:
    models: [m]
    instances: [{instances_yaml({"up": backends["up"]})}]
  down:
    models: [d]
    instances: [{instances_yaml({"down": backends["down"]})}]
    health: {{interval: 500ms, timeout: 400ms}}
"""
        gateway = start_gateway(policy_path, policy)
        try:
            target = gateway.proc.ready["metrics"]
            with PrometheusServer([target], [_without_waiting(tmp_path)]) as prometheus:
                groups = prometheus.rule_groups()
                assert sum(len(g["rules"]) for g in groups) == 9
                assert wait_until(lambda: prometheus.scrapes() >= 2, 30.0, 0.2)
                with httpx.Client(base_url=gateway.url, timeout=10) as http:
                    for model in ("m", "d") * 10:  # `d` only panics: its instance is down
                        body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
                        assert http.post("/v1/chat/completions", json=body).status_code == 200
                policy_path.write_text(policy.replace("models: [d]", "models: []"))
                refused = httpx.post(f"{gateway.admin_url}/admin/reload", timeout=10)
                assert refused.status_code == 400
                expected = {
                    ("GatewayRedisUnreachable", ""),
                    ("GatewayNoInstanceAvailable", "down"),
                    ("GatewayPoolPanic", "down"),
                    ("GatewayPolicyReloadFailing", ""),
                }

                def firing() -> set[tuple[str, str]]:
                    return {
                        (a["labels"]["alertname"], a["labels"].get("pool", ""))
                        for a in prometheus.alerts()
                        if a["state"] == "firing"
                    }

                assert wait_until(lambda: expected <= firing(), 30.0, 0.2), firing()
                assert firing() == expected  # nothing about pool `ok`, no shedding...
        finally:
            gateway.stop()
    finally:
        stop_backends(backends)


@pytest.fixture(autouse=True)
def _tools() -> None:
    for tool in ("promtool", "prometheus"):
        assert shutil.which(tool), f"{tool} is needed (scripts/install-system-deps)"

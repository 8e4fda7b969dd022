"""The deployment files: container image, docker-compose and the Kubernetes manifests.

Offline apart from PyPI: the manifests are checked against the Kubernetes schemas bundled with
kubernetes-validate, kustomize's generators are rendered here (no kustomize, kubectl or docker),
and the Dockerfile's builder commands run in a scratch virtualenv.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import Policy, load_policy, parse_policy, split_host_port
from tests import uv_lock

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "docker-compose.yml"
KUBERNETES_VERSION = "1.30"
KUSTOMIZATIONS = ["sidecar", "central", "redis"]
POLICY_COPIES = {"sidecar": "policies/sidecar.yaml", "central": "policies/central.yaml"}
GATEWAY_CONTAINER = "gateway"
# The gateway's shutdown on SIGTERM (deploy/k8s/README.md): not-ready, keep serving this long,
# then drain in-flight streams until this deadline.
SHUTDOWN_DELAY_S = 5
DRAIN_DEADLINE_S = 40
# The image's install, run by the `image_venv` fixture inside whichever of its tests
# runs first: each of those tests' pytest timeout leaves room for it on top of its own waits.
INSTALL_TIMEOUT_S = 300

Manifest = dict[str, Any]


# --- kustomize, the little of it these files use ------------------------------------------------


def _load_all(path: Path) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _kustomization(name: str) -> Manifest:
    data = yaml.safe_load((K8S / name / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _generator_files(entry: Manifest) -> dict[str, Path]:
    """configMapGenerator `files`: `path` (key = file name) or `key=path`."""
    files = {}
    for item in entry.get("files", []):
        key, _, path = item.rpartition("=")
        files[key or Path(path).name] = Path(path)
    return files


def render(name: str) -> list[Manifest]:
    """The kustomization's resources plus its generated ConfigMaps (names without the hash)."""
    kustomization = _kustomization(name)
    unsupported = set(kustomization) - {"apiVersion", "kind", "resources", "configMapGenerator"}
    assert not unsupported, f"render() does not apply {sorted(unsupported)}: extend it"
    docs: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        docs.extend(_load_all(K8S / name / resource))
    for entry in kustomization.get("configMapGenerator", []):
        data = {
            key: (K8S / name / path).read_text() for key, path in _generator_files(entry).items()
        }
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": entry["name"]},
                "data": data,
            }
        )
    return docs


def _of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]


def _workloads(docs: list[Manifest]) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")]


def _gateway_workloads() -> Iterator[tuple[str, Manifest, Manifest]]:
    """(kustomization, workload, gateway container) for every workload running the gateway."""
    for name in KUSTOMIZATIONS:
        for workload in _workloads(render(name)):
            for container in workload["spec"]["template"]["spec"]["containers"]:
                if container["name"] == GATEWAY_CONTAINER:
                    yield name, workload, container


def _env_values(container: Manifest, pod_name: str) -> dict[str, str]:
    """The container's literal and downward-API env, as the gateway would see it."""
    values: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            values[item["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), item["value"]
            )
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[item["name"]] = pod_name
        else:
            values[item["name"]] = "from-a-secret"
    return values


def _policy_of(name: str, workload: Manifest, container: Manifest) -> Policy:
    """The policy the container mounts, parsed with the container's environment."""
    docs = render(name)
    pod = workload["spec"]["template"]["spec"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/gateway")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = next(
        c
        for c in _of_kind(docs, "ConfigMap")
        if c["metadata"]["name"] == volume["configMap"]["name"]
    )
    env = _env_values(container, f"{workload['metadata']['name']}-0")
    assert env.get("GATEWAY_POLICY", "/etc/gateway/policy.yaml") == "/etc/gateway/policy.yaml"
    saved = dict(os.environ)
    try:
        os.environ.update(env)
        return parse_policy(configmap["data"]["policy.yaml"], f"{name}/policy.yaml")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _port_number(container: Manifest, port: int | str) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"no containerPort named {port!r} in container {container['name']}"
    return int(numbers[0])


# --- Kubernetes manifests ------------------------------------------------------------------------


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_match_the_kubernetes_schemas(name: str) -> None:
    docs = render(name)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            first_line = str(exc).splitlines()[0]
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {first_line}")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_selectors_match_their_pods(name: str) -> None:
    docs = render(name)
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in _workloads(docs)]
    for workload in _workloads(docs):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    for doc in _of_kind(docs, "Service") + _of_kind(docs, "PodDisruptionBudget"):
        selector = doc["spec"]["selector"]
        selector = selector.get("matchLabels", selector) if doc["kind"] != "Service" else selector
        assert any(selector.items() <= labels.items() for labels in pod_labels), doc["metadata"]


@pytest.mark.parametrize(("name", "original"), sorted(POLICY_COPIES.items()))
def test_policy_copies_equal_the_shipped_policies(name: str, original: str) -> None:
    (entry,) = _kustomization(name)["configMapGenerator"]
    assert _generator_files(entry) == {"policy.yaml": Path("policy.yaml")}
    copy = K8S / name / "policy.yaml"
    assert copy.read_text() == (ROOT / original).read_text(), (
        f"{copy.relative_to(ROOT)} differs from {original}: cp {original} {copy.relative_to(ROOT)}"
    )


def _strings(data: object) -> Iterator[str]:
    """The string values of parsed YAML: what the policy loader expands (not comments)."""
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for value in data.values():
            yield from _strings(value)
    elif isinstance(data, list):
        for value in data:
            yield from _strings(value)


def test_every_gateway_gets_its_policy_and_the_variables_it_names() -> None:
    seen = set()
    for name, workload, container in _gateway_workloads():
        seen.add(name)
        data = yaml.safe_load((K8S / name / "policy.yaml").read_text())
        needed = {m for text in _strings(data) for m in re.findall(r"\$\{(\w+)\}", text)}
        names = {item["name"] for item in container.get("env", [])}
        assert needed <= names, f"{name}: {sorted(needed - names)} not in the container's env"
        policy = _policy_of(name, workload, container)
        if "POD_NAME" in needed:
            instances = [i.name for pool in policy.pools.values() for i in pool.instances]
            assert instances == [f"{workload['metadata']['name']}-0"]
        replica_id = {i["name"]: i for i in container["env"]}["GATEWAY_REPLICA_ID"]
        assert replica_id["value"] == "$(POD_NAME)"
    assert seen == set(POLICY_COPIES)


def test_probes_and_services_use_the_policys_data_port() -> None:
    for name, workload, container in _gateway_workloads():
        policy = _policy_of(name, workload, container)
        data_port = split_host_port(policy.listen)[1]
        admin_port = split_host_port(policy.admin.listen)[1]
        probes = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
        for probe, path in probes.items():
            get = container[probe]["httpGet"]
            assert get["path"] == path, (name, probe)
            assert _port_number(container, get["port"]) == data_port, (name, probe)
        exposed = {_port_number(container, p["containerPort"]) for p in container["ports"]}
        assert policy.metrics.listen is not None, f"{name}: Prometheus needs metrics.listen"
        metrics_port = split_host_port(policy.metrics.listen)[1]
        assert exposed == {data_port, metrics_port}, f"{name}: data and metrics, never admin"
        assert _port_number(container, "metrics") == metrics_port
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(metrics_port),
            "prometheus.io/path": "/metrics",
        }
        services = _of_kind(render(name), "Service")
        gateway_services = [
            s for s in services if any(p["targetPort"] == "http" for p in s["spec"]["ports"])
        ]
        assert gateway_services, f"{name}: no Service targets the gateway"
        for service in services:
            for port in service["spec"]["ports"]:
                assert port.get("targetPort") != "metrics", f"{name}: scraped from pods"
                assert admin_port not in (port["port"], port.get("targetPort")), (
                    f"{name}: Service {service['metadata']['name']} exposes the admin plane"
                )
            for port in service["spec"]["ports"]:
                if port["targetPort"] == "http":
                    assert _port_number(container, port["targetPort"]) == data_port


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kubectl_kustomize_renders_the_manifests_and_they_match_the_schemas(name: str) -> None:
    """kustomize itself (kubectl's, offline) renders what `render()` reads, hash suffixes
    aside, and its output validates too."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (scripts/install-system-deps)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]

    def names(items: list[Manifest]) -> set[tuple[str, str]]:
        return {(d["kind"], re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])) for d in items}

    assert names(docs) == names(render(name))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_central_gateways_discover_the_sidecar_pods_with_least_privilege() -> None:
    """The central policy watches the EndpointSlices of a Service the sidecar manifests create,
    on a port it has, selecting the vLLM pods; its service account may only read slices; and
    the instance names agree: the pod name, which is what each sidecar calls its vLLM."""
    central = render("central")
    ((_, workload, container),) = [g for g in _gateway_workloads() if g[0] == "central"]
    (pool,) = _policy_of("central", workload, container).pools.values()
    assert pool.instances == ()
    assert pool.discovery is not None and pool.discovery.kubernetes is not None
    watched = pool.discovery.kubernetes
    assert watched.namespace is None  # the gateway's own: where the manifests are applied
    sidecar = render("sidecar")
    service = next(
        s for s in _of_kind(sidecar, "Service") if s["metadata"]["name"] == watched.service
    )
    assert service["spec"]["clusterIP"] == "None"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == watched.port]
    (vllm_pods,) = _workloads(sidecar)
    assert vllm_pods["kind"] == "Deployment"
    labels = vllm_pods["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    vllm = next(
        c for c in vllm_pods["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
    )
    assert _port_number(vllm, port["targetPort"]) == 8000
    sidecar_policy = yaml.safe_load((K8S / "sidecar" / "policy.yaml").read_text())
    (sidecar_pool,) = sidecar_policy["pools"].values()
    assert [i["name"] for i in sidecar_pool["instances"]] == ["${POD_NAME}"]

    account = workload["spec"]["template"]["spec"]["serviceAccountName"]
    assert [a["metadata"]["name"] for a in _of_kind(central, "ServiceAccount")] == [account]
    (binding,) = _of_kind(central, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert not _of_kind(central, "ClusterRole") and not _of_kind(central, "ClusterRoleBinding")
    (role,) = _of_kind(central, "Role")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]


def test_the_podmonitor_scrapes_every_gateway_on_its_metrics_port() -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (scripts/install-system-deps)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "monitoring")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    (monitor,) = [doc for doc in docs if doc["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expression["operator"] == "In"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    selected = set()
    for _, workload, container in _gateway_workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels.get(expression["key"]) in expression["values"], workload["metadata"]
        assert any(port["name"] == "metrics" for port in container["ports"])
        selected.add(workload["metadata"]["name"])
    assert selected == {"llm-gateway", "vllm-llama-8b"}


def test_central_service_exposes_8080_only() -> None:
    (service,) = _of_kind(render("central"), "Service")
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(8080, "http")]


def test_central_admin_token_comes_from_a_secret_that_exists() -> None:
    docs = render("central")
    (deployment,) = _of_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    policy = load_policy(K8S / "central" / "policy.yaml")
    env = {item["name"]: item for item in container["env"]}
    ref = env[policy.admin.token_env]["valueFrom"]["secretKeyRef"]
    secrets = {s["metadata"]["name"]: s for s in _of_kind(docs, "Secret")}
    secret = secrets[ref["name"]]
    assert ref["key"] in secret.get("stringData", {}) | secret.get("data", {})
    source = (K8S / "central" / "secret.yaml").read_text()
    assert "PLACEHOLDER" in source and "kubectl create secret" in source


def test_central_scaling_and_disruption() -> None:
    docs = render("central")
    (deployment,) = _of_kind(docs, "Deployment")
    (hpa,) = _of_kind(docs, "HorizontalPodAutoscaler")
    (pdb,) = _of_kind(docs, "PodDisruptionBudget")
    assert deployment["spec"]["replicas"] == 3
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert hpa["spec"]["minReplicas"] >= 3 > pdb["spec"]["minAvailable"] == 2
    assert pdb["apiVersion"] == "policy/v1"
    affinity = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"]


def _prestop_seconds(container: Manifest) -> int:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def test_graceful_shutdown_fits_the_grace_period() -> None:
    gateway_shutdown = SHUTDOWN_DELAY_S + DRAIN_DEADLINE_S
    for name, workload, gateway in _gateway_workloads():
        # The numbers below are the policy's own drain settings.
        drain = _policy_of(name, workload, gateway).drain
        assert (drain.delay, drain.timeout) == (SHUTDOWN_DELAY_S, DRAIN_DEADLINE_S), name
        pod = workload["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        assert grace == 60
        assert _prestop_seconds(gateway) + gateway_shutdown < grace, name
        for other in pod["containers"]:
            if other is not gateway:  # the backend must serve the streams being drained
                assert gateway_shutdown <= _prestop_seconds(other) < grace, (name, other["name"])
        for number in (str(grace), str(SHUTDOWN_DELAY_S), str(DRAIN_DEADLINE_S)):
            assert number in (K8S / name / f"{workload['kind'].lower()}.yaml").read_text()
    readme = (K8S / "README.md").read_text()
    assert "terminationGracePeriodSeconds: 60" in readme
    assert f"**{SHUTDOWN_DELAY_S} s**" in readme and f"**up to {DRAIN_DEADLINE_S} s**" in readme


def test_gateway_containers_are_locked_down() -> None:
    for name, _, container in _gateway_workloads():
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == 10001, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"]["drop"] == ["ALL"], name
        resources = container["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), name
        assert {"cpu", "memory"} <= resources["limits"].keys(), name


def test_redis_service_is_the_one_the_policies_name() -> None:
    (service,) = _of_kind(render("redis"), "Service")
    host_port = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    for original in POLICY_COPIES.values():
        policy = parse_policy((ROOT / original).read_text().replace("${POD_NAME}", "pod-0"))
        assert policy.shared is not None
        assert f"//{host_port}/" in policy.shared.redis_url


# --- docker-compose ------------------------------------------------------------------------------


def _compose() -> Manifest:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def test_compose_services_and_policy() -> None:
    services = _compose()["services"]
    assert {"redis", "gateway", "backend-a", "backend-b"} <= services.keys()
    assert services["redis"]["image"].startswith("redis:7")
    gateway = services["gateway"]
    (mount,) = [v for v in gateway["volumes"] if ":/etc/gateway/policy.yaml" in v]
    source = COMPOSE.parent / mount.split(":")[0]
    assert source.is_file()
    policy = load_policy(source)
    assert gateway["environment"]["GATEWAY_POLICY"] == "/etc/gateway/policy.yaml"
    data_port = split_host_port(policy.listen)[1]
    admin_host, admin_port = split_host_port(policy.admin.listen)
    assert f"{data_port}:{data_port}" in gateway["ports"]
    assert f"127.0.0.1:{admin_port}:{admin_port}" in gateway["ports"]
    if admin_host not in ("127.0.0.1", "localhost", "::1"):
        assert policy.admin.token_env in gateway["environment"]
    assert policy.shared is not None and policy.shared.redis_url.startswith("redis://redis:")
    (pool,) = policy.pools.values()
    for instance in pool.instances:
        backend = services[instance.url.split("//")[1].split(":")[0]]
        assert backend["build"]["target"] == "fake"
        args = backend["command"]
        assert args[args.index("--port") + 1] == instance.url.rsplit(":", 1)[1]
        assert args[args.index("--host") + 1] == "0.0.0.0"
        assert set(args[args.index("--models") + 1].split(",")) == set(pool.models)
    assert set(gateway["depends_on"]) == {"redis", "backend-a", "backend-b", "jaeger"}


def _mounts(service: Manifest) -> dict[str, Path]:
    """A compose service's read-only mounts: container path -> file in the repository."""
    found = {}
    for volume in service["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro", volume
        path = COMPOSE.parent / source
        assert path.is_file(), volume
        found[target] = path
    return found


def test_compose_shows_the_gateway_working_metrics_dashboard_and_traces() -> None:
    """Prometheus scrapes the gateway's metrics listener with the alert rules loaded, Grafana
    has it as its data source and the dashboard provisioned, and traces go to Jaeger."""
    services = _compose()["services"]
    policy = load_policy(COMPOSE.parent / "compose-policy.yaml")
    assert policy.metrics.listen is not None and policy.telemetry.tracing
    metrics_port = split_host_port(policy.metrics.listen)[1]

    prometheus = _mounts(services["prometheus"])
    config = yaml.safe_load(prometheus["/etc/prometheus/prometheus.yml"].read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"gateway:{metrics_port}"]}]
    assert config["rule_files"] == ["/etc/prometheus/gateway-alerts.yaml"]
    rules = prometheus["/etc/prometheus/gateway-alerts.yaml"]
    assert rules == DEPLOY / "prometheus" / "gateway-alerts.yaml"

    grafana = _mounts(services["grafana"])
    sources = yaml.safe_load(
        grafana["/etc/grafana/provisioning/datasources/gateway.yaml"].read_text()
    )
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load(
        grafana["/etc/grafana/provisioning/dashboards/gateway.yaml"].read_text()
    )
    (provider,) = providers["providers"]
    folder = provider["options"]["path"]
    dashboards = [target for target in grafana if target.startswith(folder + "/")]
    assert [grafana[target] for target in dashboards] == [
        DEPLOY / "grafana" / "gateway-dashboard.json"
    ]

    gateway = services["gateway"]
    endpoint = gateway["environment"]["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    assert endpoint == "http://jaeger:4318/v1/traces"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in ("prometheus", "grafana", "jaeger"):
        for port in services[name]["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name}: this machine only"


# --- Dockerfile ----------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending
    result = []
    for line in lines:
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in _instructions():
        if word == "FROM":
            parts = rest.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", rest
            current = stages.setdefault(parts[2], [])
        current.append((word, rest))
    return stages


def test_dockerfile_stages() -> None:
    stages = _stages()
    assert list(stages) == ["builder", "fake", "runtime"]  # `docker build` builds the last
    for stage in stages.values():
        assert stage[0] == ("FROM", stage[0][1])
        assert stage[0][1].split()[0] == "python:3.11-slim"
    runtime = stages["runtime"]
    text = " ".join(f"{w} {r}" for w, r in runtime)
    for tool in ("gcc", "build-essential", "apt-get", "curl"):
        assert tool not in text
    copies = [r for w, r in runtime if w == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"]
    (user,) = [r for w, r in runtime if w == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert "--uid 10001" in text
    assert "GATEWAY_POLICY=/etc/gateway/policy.yaml" in text
    (expose,) = [r for w, r in runtime if w == "EXPOSE"]
    assert expose.split() == ["8080", "9901", "9090"]


def test_dockerfile_healthcheck_uses_the_standard_library() -> None:
    (check,) = [r for w, r in _stages()["runtime"] if w == "HEALTHCHECK"]
    command = json.loads(check[check.index("CMD") + 3 :])
    assert command[:2] == ["python", "-c"]
    assert "http://127.0.0.1:8080/healthz" in command[2]
    ast.parse(command[2])


def _entrypoint() -> list[str]:
    (entrypoint,) = [r for w, r in _stages()["runtime"] if w == "ENTRYPOINT"]
    command = json.loads(entrypoint)
    assert isinstance(command, list)
    return command


def test_dockerfile_entrypoint_execs_the_gateway() -> None:
    command = _entrypoint()
    assert command[:2] == ["/bin/sh", "-c"]
    assert command[2].startswith('exec gateway run --policy "$GATEWAY_POLICY"')


def _copy_from_context(stage: list[tuple[str, str]], root: Path) -> None:
    """The stage's COPY lines from the build context (not `--from=`), into `root` as its /."""
    for word, rest in stage:
        if word != "COPY" or rest.startswith("--from="):
            continue
        source, dest = rest.split()
        target = root / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / source).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "out")
            shutil.copytree(ROOT / source, target, ignore=ignore)
        else:
            shutil.copy(ROOT / source, target)


# The builder stage's RUN lines, in order: uv at the locked version, then the lock's runtime
# part, the dependencies before the code.
BUILDER_RUNS = [
    "python /src/scripts/bootstrap-uv /opt/uv",
    "/opt/uv/bin/uv sync --project /src --locked --no-editable --no-install-project",
    "/opt/uv/bin/uv sync --project /src --locked --no-editable",
]


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv built with the builder stage's own ENV, COPY and RUN lines, in a folder
    standing for the image's /."""
    builder = _stages()["builder"]
    work = tmp_path_factory.mktemp("image")
    root = work / "root"  # stands for the image's /

    def inside(word: str) -> str:
        return str(root / word.lstrip("/")) if word.startswith("/") else word

    env = dict(os.environ)
    for word, rest in builder:
        if word == "ENV":
            for assignment in shlex.split(rest):
                name, _, value = assignment.partition("=")
                env[name] = inside(value)
    # The image's `python` is the one its virtualenvs are made from, with pip of its own (this
    # test's venv, made by uv, has none): the interpreter this venv was made from.
    python = getattr(sys, "_base_executable", sys.executable)
    env["UV_PYTHON"] = python
    env.pop("VIRTUAL_ENV", None)
    env.pop("UV_NO_CACHE", None)  # uv's cache is this machine's: the same files, by hash
    _copy_from_context(builder, root)
    runs = [rest for word, rest in builder if word == "RUN"]
    assert runs == BUILDER_RUNS
    for run in runs:
        argv = [inside(a) for a in shlex.split(run)]
        argv = [python, *argv[1:]] if argv[0] == "python" else argv
        done = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=INSTALL_TIMEOUT_S, check=False
        )
        assert done.returncode == 0, f"{run}: {done.stderr[-3000:]}"
    return Path(env["UV_PROJECT_ENVIRONMENT"])


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 60)
def test_the_image_holds_exactly_the_locks_runtime_part(image_venv: Path) -> None:
    site_packages = next((image_venv / "lib").glob("python3.*/site-packages"))
    assert uv_lock.installed(site_packages) == uv_lock.closure(set())
    # uv, which installed it, stayed behind in its own virtualenv.
    assert not (image_venv / "bin" / "uv").exists()


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
def test_the_built_virtualenv_checks_the_policies(image_venv: Path) -> None:
    gateway = image_venv / "bin" / "gateway"
    env = {**os.environ, "POD_NAME": "vllm-llama-8b-0"}
    policies = [
        DEPLOY / "compose-policy.yaml",
        K8S / "sidecar" / "policy.yaml",
        K8S / "central" / "policy.yaml",
    ]
    done = subprocess.run(
        [str(gateway), "check", *map(str, policies)],
        capture_output=True,
        text=True,
        env=env,
        cwd=image_venv.parent,  # not the repository: the installed package, not ./gateway
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": ok") == len(policies)


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 180)
def test_the_entrypoint_makes_the_gateway_pid_1_and_it_stops_on_sigterm(
    image_venv: Path, tmp_path: Path
) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "listen: 127.0.0.1:0\n"
        "admin: {listen: 127.0.0.1:0}\n"
        "pools:\n"
        "  p:\n"
        "    models: [m]\n"
        "    instances: [{name: a, url: 'http://127.0.0.1:9'}]\n"
    )
    env = {
        **os.environ,
        "PATH": f"{image_venv / 'bin'}:{os.environ['PATH']}",
        "GATEWAY_POLICY": str(policy),
    }
    # The ENTRYPOINT as docker runs it, with `--log-level info` as the compose file's command.
    process = subprocess.Popen(
        [*_entrypoint(), "--log-level", "info"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "gateway READY" in line:
                break
        assert any("gateway READY" in line for line in lines), "".join(lines)
        # exec: the shell's process is now the gateway, so SIGTERM reaches it directly.
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
        assert any(part.endswith(b"gateway") for part in cmdline[:2]), cmdline
        assert b"run" in cmdline and b"info" in cmdline, cmdline
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=SHUTDOWN_DELAY_S + DRAIN_DEADLINE_S + 10)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
def test_the_fake_target_serves_as_the_compose_file_runs_it(
    image_venv: Path, tmp_path: Path
) -> None:
    fake = _stages()["fake"]
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in fake
    _copy_from_context(fake, tmp_path)
    (workdir,) = [rest for word, rest in fake if word == "WORKDIR"]
    (entrypoint,) = [json.loads(rest) for word, rest in fake if word == "ENTRYPOINT"]
    assert entrypoint[0] == "python"
    args = _compose()["services"]["backend-a"]["command"]
    args = [("0" if a == "8000" else a) for a in args]  # any free port here
    host = args.index("--host") + 1
    args[host] = "127.0.0.1"
    process = subprocess.Popen(
        [str(image_venv / "bin" / "python"), *entrypoint[1:], *args],
        cwd=tmp_path / workdir.lstrip("/"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("fake-vllm READY name=a port="), line
    finally:
        process.kill()
        process.wait()

"""deploy/kubernetes: every manifest is valid against the Kubernetes API schemas (kubernetes-validate ships them, so
this runs offline), and the pieces fit together: Services select pod templates, every argument and environment
variable configures the service it is given to (checked against the services' real argparse parsers), probes
and scrapes point at container ports, grace periods outlast the drains."""
from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import yaml
from kubernetes_validate import validate
from opentelemetry.sdk import environment_variables as otel_environment_variables

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSIONS = ("1.27", "1.37")   # 1.27: gRPC probes are GA; 1.37: the newest schemas kubernetes-validate ships
FERRY_PACKAGES = ("ferry", "router", "scheduler", "gpu_worker", "kernels", "protos")
DOWNWARD_API_SAMPLES = {"metadata.name": "ferry-scheduler-7d9c-x2x4q", "metadata.namespace": "ferry",
                        "status.podIP": "10.4.0.17"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


# --- reading the manifests ---------------------------------------------------------------------------------
def kustomization() -> dict:
    return yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    """Every object the kustomization applies, in file order."""
    found = []
    for name in kustomization()["resources"]:
        found += [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]
    return found


def of_kind(kind: str) -> list[dict]:
    return [r for r in resources() if r["kind"] == kind]


def pod_templates() -> list[dict]:
    return [d["spec"]["template"] for d in of_kind("Deployment")]


def ferry_containers() -> list[tuple[str, dict, dict]]:
    """(service module, container, pod spec) for every container running `python -m router|scheduler`."""
    found = []
    for template in pod_templates():
        for container in template["spec"]["containers"]:
            command = container.get("command", [])
            if command[:2] == ["python", "-m"]:
                found.append((command[2], container, template["spec"]))
    return found


def container_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ConfigMaps first, then env in order, $(VAR) expanded."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_map(source["configMapRef"]["name"]))
    for var in container.get("env", []):
        env[var["name"]] = expand(env_value(var), env)
    return env


def env_value(var: dict) -> str:
    if "value" in var:
        return var["value"]
    source = var["valueFrom"]
    if "fieldRef" in source:
        return DOWNWARD_API_SAMPLES[source["fieldRef"]["fieldPath"]]
    return "secret-value"


def config_map(name: str) -> dict[str, str]:
    return next(c["data"] for c in of_kind("ConfigMap") if c["metadata"]["name"] == name)


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_ports(container: dict) -> dict[str, int]:
    return {port.get("name", str(port["containerPort"])): port["containerPort"] for port in container["ports"]}


def resolves_to_port(port: int | str, container: dict) -> bool:
    ports = container_ports(container)
    return port in ports if isinstance(port, str) else port in ports.values()


# --- the services' real command lines ----------------------------------------------------------------------
class ParserCaptured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("captured")
        self.parser = parser


def service_parser(module: str, env: dict[str, str]) -> argparse.ArgumentParser:
    """The argparse parser `python -m <module>` builds under `env` (its main() runs until it parses)."""
    main = importlib.import_module(f"{module}.__main__").main

    def capture(parser: argparse.ArgumentParser, *args, **kwargs):
        raise ParserCaptured(parser)

    with mock.patch.dict(os.environ, env, clear=True), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            main()
        except ParserCaptured as captured:
            return captured.parser
    raise AssertionError(f"{module}.__main__.main() never parsed its arguments")


def parsed_args(module: str, container: dict) -> argparse.Namespace:
    """The container's args as its service parses them; every flag spelled out in full (argparse would also take
    an abbreviation, which a later flag can make ambiguous)."""
    env = container_env(container)
    args = [expand(arg, env) for arg in container.get("args", [])]
    parser = service_parser(module, env)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    unknown = [arg.split("=")[0] for arg in args if arg.startswith("--") and arg.split("=")[0] not in flags]
    assert not unknown, f"python -m {module} has no flag {unknown}"
    try:
        return parser.parse_args(args)
    except SystemExit:
        raise AssertionError(f"python -m {module} rejects its container args {args}") from None


def sets_a_flag_default(module: str, name: str, env: dict[str, str]) -> bool:
    sentinel = "4242"   # parses as any type a flag's default is built with (str, int, float)
    parser = service_parser(module, {**env, name: sentinel})
    return any(str(action.default) in (sentinel, "4242.0") for action in parser._actions)


def read_by_ferry(name: str) -> bool:
    sources = (path for package in FERRY_PACKAGES for path in (ROOT / package).rglob("*.py"))
    return any(f'"{name}"' in path.read_text() for path in sources)


# --- tests -------------------------------------------------------------------------------------------------
def test_kustomization_applies_every_manifest_in_the_folder():
    manifests = {path.name for path in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization()["resources"]) == sorted(manifests)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_api_schemas(version: str):
    for resource in resources():
        validate(resource, version, strict=True)   # raises naming the field


def test_every_service_selects_a_pod_template_and_its_ports():
    for service in of_kind("Service"):
        selector = service["spec"]["selector"].items()
        templates = [t for t in pod_templates() if selector <= t["metadata"]["labels"].items()]
        assert templates, f"Service {service['metadata']['name']} selects no pod template"
        for port in service["spec"]["ports"]:
            assert any(resolves_to_port(port["targetPort"], c) for t in templates for c in t["spec"]["containers"])


def test_every_disruption_budget_and_autoscaler_targets_a_workload():
    for budget in of_kind("PodDisruptionBudget"):
        labels = budget["spec"]["selector"]["matchLabels"].items()
        assert any(labels <= t["metadata"]["labels"].items() for t in pod_templates())
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    for autoscaler in of_kind("HorizontalPodAutoscaler"):
        target = deployments[autoscaler["spec"]["scaleTargetRef"]["name"]]
        for container in target["spec"]["template"]["spec"]["containers"]:
            assert "cpu" in container["resources"]["requests"], "CPU utilization needs a CPU request"


def test_every_probe_port_is_a_container_port():
    for template in pod_templates():
        for container in template["spec"]["containers"]:
            for probe in (container[p] for p in PROBES if p in container):
                handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
                if handler is not None:
                    assert resolves_to_port(handler["port"], container), (container["name"], handler)


@pytest.mark.parametrize("module", ["router", "scheduler"])
def test_every_arg_is_a_real_flag_and_the_served_ports_are_container_ports(module: str):
    containers = [c for m, c, _ in ferry_containers() if m == module]
    assert containers, f"no container runs python -m {module}"
    for container in containers:
        args = parsed_args(module, container)
        ports = container_ports(container)
        assert args.port == ports["grpc"]
        if module == "router":
            assert args.http_port == ports["http"] and args.http_host == "0.0.0.0"
        else:
            assert args.metrics_port == ports["metrics"]
        assert args.host == "0.0.0.0", "other pods must reach the service"


def test_every_env_var_configures_the_service_it_is_given_to():
    for module, container, _ in ferry_containers():
        env = container_env(container)
        referenced = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", yaml.safe_dump(container)))
        for name in env:
            assert (name in referenced or name in vars(otel_environment_variables) or read_by_ferry(name)
                    or sets_a_flag_default(module, name, env)), f"{name} configures nothing in {module}"


def test_env_var_check_rejects_a_name_no_flag_reads():
    assert not sets_a_flag_default("scheduler", "FERRY_NOT_A_FLAG", {})
    assert not read_by_ferry("FERRY_NOT_A_FLAG")
    assert sets_a_flag_default("scheduler", "FERRY_ADVERTISE_HOST", {})


def test_grace_period_outlasts_the_drain_timeout():
    for module, container, pod in ferry_containers():
        drain = parsed_args(module, container).drain_timeout
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert pod["terminationGracePeriodSeconds"] > drain + pre_stop_s, module


def test_schedulers_take_one_gpu_each_and_register_their_pod_ip():
    (container,) = [c for m, c, _ in ferry_containers() if m == "scheduler"]
    for limits in (container["resources"]["requests"], container["resources"]["limits"]):
        assert limits["nvidia.com/gpu"] == 1
    args = parsed_args("scheduler", container)
    assert args.advertise_host == DOWNWARD_API_SAMPLES["status.podIP"]
    assert args.device == "cuda"
    assert container["readinessProbe"]["grpc"]["service"] == "ferry.Scheduler"


def test_routers_see_the_model_cache_where_schedulers_register_their_model_paths():
    mounts = {}
    for module, container, pod in ferry_containers():
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        mounts[module] = {(claims[m["name"]], m["mountPath"]) for m in container["volumeMounts"] if m["name"] in claims}
    assert mounts["scheduler"] and mounts["scheduler"] <= mounts["router"]
    (scheduler,) = [c for m, c, _ in ferry_containers() if m == "scheduler"]
    cache_dir = container_env(scheduler)["FERRY_CACHE_DIR"]
    assert any(cache_dir.startswith(path + "/") for _, path in mounts["scheduler"])


def test_prometheus_scrapes_every_ferry_metrics_port():
    scrape = yaml.safe_load(config_map("ferry-prometheus")["prometheus.yml"])["scrape_configs"][0]
    assert scrape["relabel_configs"][0]["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    for module, container, _ in ferry_containers():
        template = next(t for t in pod_templates() if container in t["spec"]["containers"])
        annotations = template["metadata"]["annotations"]
        args = parsed_args(module, container)
        metrics_port = args.http_port if module == "router" else args.metrics_port
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics_port


def secret_refs(container: dict) -> dict[str, tuple[str, str, bool]]:
    """env name -> (Secret, key, optional) for every variable the container takes from a Secret."""
    return {var["name"]: (ref["name"], ref["key"], ref.get("optional", False)) for var in container.get("env", [])
            if "secretKeyRef" in (ref := var.get("valueFrom", {})) and (ref := ref["secretKeyRef"])}


def test_routers_schedulers_and_redis_share_the_generated_secret():
    (generator,) = kustomization()["secretGenerator"]
    assert generator["envs"] == ["secrets.env"]
    assert "/deploy/kubernetes/secrets.env" in (ROOT / ".gitignore").read_text().split(), "secrets stay out of git"
    wanted = {"FERRY_CLUSTER_TOKEN": (generator["name"], "cluster-token", False),
              "FERRY_REDIS_PASSWORD": (generator["name"], "redis-password", False)}
    for module, container, _ in ferry_containers():
        assert wanted.items() <= secret_refs(container).items(), module
    (redis,) = [c for t in pod_templates() for c in t["spec"]["containers"] if c["name"] == "redis"]
    refs = secret_refs(redis)
    assert refs["REDIS_PASSWORD"] == refs["REDISCLI_AUTH"] == (generator["name"], "redis-password", False)
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"

"""deploy/kubernetes: every manifest is valid against the Kubernetes API schemas (kubernetes-validate ships them, so
this runs offline), and the pieces fit together: Services select pod templates, every argument and environment
variable configures the service it is given to (checked against the services' real argparse parsers), probes
and scrapes point at container ports, grace periods outlast the drains, and no secret is on a command line. The
disaggregated prefill/decode overlay (deploy/kubernetes-pd) is valid too, and its prefill schedulers are the base's
schedulers but for their name and role."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import redis
import yaml
from kubernetes_validate import validate
from opentelemetry.sdk import environment_variables as otel_environment_variables

from base import environment
from ferry.launcher import free_port
from scheduler.__main__ import check_exposure
from tests.services_fixtures import redis_answers, wait_until

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
PD_OVERLAY = ROOT / "deploy" / "kubernetes-pd"
KUBERNETES_VERSIONS = ("1.27", "1.37")   # 1.27: gRPC probes are GA; 1.37: the newest schemas kubernetes-validate ships
DOWNWARD_API_SAMPLES = {"metadata.name": "ferry-scheduler-7d9c-x2x4q", "metadata.namespace": "ferry",
                        "status.podIP": "10.4.0.17"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
SECRET_FLAGS = ("--requirepass", "--masterauth", "--cluster-token", "--redis-password", "--api-key", "-a")
SECRET_NAMED = re.compile(r"\$\(\w*(PASSWORD|TOKEN|SECRET|KEY|AUTH)\w*\)")   # a $(VAR) the kubelet would expand


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


def overlay_resources() -> list[dict]:
    """The objects the P/D overlay adds to the base (its own files)."""
    overlay = yaml.safe_load((PD_OVERLAY / "kustomization.yaml").read_text())
    return [doc for name in overlay["resources"] if name.endswith(".yaml")
            for doc in yaml.safe_load_all((PD_OVERLAY / name).read_text()) if doc]


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
    return name in environment.VARIABLES   # every variable Ferry reads is declared there


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


def test_schedulers_take_one_gpu_per_rank_and_register_their_pod_ip():
    (container,) = [c for m, c, _ in ferry_containers() if m == "scheduler"]
    args = parsed_args("scheduler", container)
    assert args.tensor_parallel_size == 1
    for limits in (container["resources"]["requests"], container["resources"]["limits"]):
        assert limits["nvidia.com/gpu"] == args.tensor_parallel_size
    assert args.advertise_host == DOWNWARD_API_SAMPLES["status.podIP"]
    assert args.device == "cuda"
    assert container["readinessProbe"]["grpc"]["service"] == "ferry.Scheduler"
    assert args.cluster_token and not args.insecure
    check_exposure(args.host, args.cluster_token, args.insecure)   # would refuse to start on 0.0.0.0 without it


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_the_tensor_parallel_size_set_once_is_the_schedulers_flag_and_its_gpus(tmp_path: Path):
    """kubectl kustomize's output, with config.yaml's FERRY_TENSOR_PARALLEL_SIZE changed: the replacements in the
    kustomization copy it into the scheduler pod's GPU request and limit."""
    shutil.copytree(MANIFESTS, tmp_path, dirs_exist_ok=True)
    (tmp_path / "secrets.env").write_text("cluster-token=t\nredis-password=p\n")
    config = tmp_path / "config.yaml"
    config.write_text(config.read_text().replace('FERRY_TENSOR_PARALLEL_SIZE: "1"', 'FERRY_TENSOR_PARALLEL_SIZE: "4"'))
    built = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    rendered = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    (deployment,) = [r for r in rendered if r["kind"] == "Deployment" and r["metadata"]["name"] == "ferry-scheduler"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (size,) = [r["data"]["FERRY_TENSOR_PARALLEL_SIZE"] for r in rendered if r["kind"] == "ConfigMap"
               and "FERRY_TENSOR_PARALLEL_SIZE" in r["data"]]
    assert size == "4" and "$(FERRY_TENSOR_PARALLEL_SIZE)" in container["args"]
    for limits in (container["resources"]["requests"], container["resources"]["limits"]):
        assert int(limits["nvidia.com/gpu"]) == 4
    validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_pd_overlay_is_the_base_and_every_manifest_in_its_folder():
    overlay = yaml.safe_load((PD_OVERLAY / "kustomization.yaml").read_text())
    manifests = {path.name for path in PD_OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert overlay["resources"] == ["../kubernetes", *sorted(manifests)]
    assert overlay["namespace"] == kustomization()["namespace"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_pd_overlays_manifests_are_valid_against_the_kubernetes_api_schemas(version: str):
    for resource in overlay_resources():
        validate(resource, version, strict=True)


def renamed(resource: dict, old: str, new: str) -> dict:
    return yaml.safe_load(yaml.safe_dump(resource).replace(old, new))


def test_the_prefill_schedulers_are_the_schedulers_but_for_their_name_and_role():
    """So the copy cannot drift from the base: every other field (probes, secrets, GPUs, grace period) is the same."""
    base = {(r["kind"], r["metadata"]["name"]): r for r in resources()}
    for resource in overlay_resources():
        as_base = renamed(resource, "ferry-prefill-scheduler", "ferry-scheduler")
        if resource["kind"] == "Deployment":
            (container,) = as_base["spec"]["template"]["spec"]["containers"]
            assert container["args"][-2:] == ["--role", "prefill"]
            assert parsed_args("scheduler", container).role == "prefill"
            del container["args"][-2:]
        assert as_base == base[(resource["kind"], "ferry-scheduler")]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not installed")
def test_the_pd_overlay_runs_prefill_and_decode_schedulers_each_on_its_gpus(tmp_path: Path):
    shutil.copytree(MANIFESTS, tmp_path / MANIFESTS.name)
    shutil.copytree(PD_OVERLAY, tmp_path / PD_OVERLAY.name)
    (tmp_path / MANIFESTS.name / "secrets.env").write_text("cluster-token=t\nredis-password=p\n")
    config = tmp_path / MANIFESTS.name / "config.yaml"
    config.write_text(config.read_text().replace('FERRY_TENSOR_PARALLEL_SIZE: "1"', 'FERRY_TENSOR_PARALLEL_SIZE: "2"'))
    built = subprocess.run(["kubectl", "kustomize", str(tmp_path / PD_OVERLAY.name)], capture_output=True, text=True,
                           timeout=60)
    assert built.returncode == 0, built.stderr
    rendered = {r["metadata"]["name"]: r for r in yaml.safe_load_all(built.stdout) if r and r["kind"] == "Deployment"}
    for name, role in (("ferry-prefill-scheduler", "prefill"), ("ferry-scheduler", "decode")):
        deployment = rendered[name]
        validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
        assert deployment["metadata"]["namespace"] == "ferry"
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert parsed_args("scheduler", container).role == role
        for limits in (container["resources"]["requests"], container["resources"]["limits"]):
            assert int(limits["nvidia.com/gpu"]) == 2
    assert secret_refs(rendered["ferry-prefill-scheduler"]["spec"]["template"]["spec"]["containers"][0]) == \
        secret_refs(rendered["ferry-scheduler"]["spec"]["template"]["spec"]["containers"][0])


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
    assert secret_refs(redis)["REDISCLI_AUTH"] == (generator["name"], "redis-password", False)
    assert redis_password_file(generator["name"]) in redis["command"][-1]


def redis_password_file(secret: str) -> str:
    """Where the redis container finds the `redis-password` key of `secret`, mounted as a file."""
    (template,) = [t for t in pod_templates() if any(c["name"] == "redis" for c in t["spec"]["containers"])]
    (volume,) = [v for v in template["spec"]["volumes"] if v.get("secret", {}).get("secretName") == secret]
    (redis,) = template["spec"]["containers"]
    (mount,) = [m for m in redis["volumeMounts"] if m["name"] == volume["name"]]
    (item,) = [i for i in volume["secret"]["items"] if i["key"] == "redis-password"]
    return f"{mount['mountPath']}/{item['path']}"


def command_lines(container: dict) -> list[list[str]]:
    """Every argv the container runs: its process, its probes' and its lifecycle hooks' commands."""
    hooks = [container.get(p, {}) for p in PROBES] + list(container.get("lifecycle", {}).values())
    return [container.get("command", []) + container.get("args", [])] + [h.get("exec", {}).get("command", [])
                                                                         for h in hooks]


def secrets_on_command_lines(container: dict) -> list[list[str]]:
    """The container's argvs that carry a secret: a $(VAR) taken from a Secret or named like one, or a flag that
    takes a secret's value."""
    from_secrets, found = set(secret_refs(container)), []
    for argv in command_lines(container):
        text = " ".join(argv)
        expanded = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))
        flags = {word.strip("'\"").split("=")[0] for word in text.split()} & set(SECRET_FLAGS)
        if expanded & from_secrets or SECRET_NAMED.search(text) or flags:
            found.append(argv)
    return found


def test_no_secret_is_on_any_command_line():
    """Any process on the node can read another's argv (ps): secrets reach containers as files or environment, and
    a shell feeds them on (printf is a builtin) rather than exec'ing a program with them as arguments."""
    for template in pod_templates():
        for container in template["spec"].get("initContainers", []) + template["spec"]["containers"]:
            assert not secrets_on_command_lines(container), container["name"]


def test_secret_check_catches_a_password_passed_as_an_argument():
    from_secret = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    assert secrets_on_command_lines({"args": ["--save", "", "--requirepass", "$(REDIS_PASSWORD)"],
                                     "env": [from_secret]})
    assert secrets_on_command_lines({"command": ["sh", "-c", 'exec redis-server --requirepass "$PASS"']})
    assert secrets_on_command_lines({"readinessProbe": {"exec": {"command": ["redis-cli", "-a", "$(PASS)", "ping"]}}})
    assert not secrets_on_command_lines({"args": ["--scheduler-id", "$(POD_NAME)", "--cluster-token-file", "/s/t"]})


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_manifests_redis_requires_the_password_from_its_secret_file(tmp_path):
    """The redis container's own command, run here on the secret file's copy: Redis takes the password from it, and
    no process's command line shows it."""
    (redis_container,) = [c for t in pod_templates() for c in t["spec"]["containers"] if c["name"] == "redis"]
    password, port = secrets.token_hex(16), free_port()
    secret_file = redis_password_file(kustomization()["secretGenerator"][0]["name"])
    (tmp_path / "redis-password").write_text(password + "\n")
    *shell, script = redis_container["command"]
    script = script.replace(secret_file, str(tmp_path / "redis-password")) + f" --port {port} --bind 127.0.0.1"
    server = subprocess.Popen([*shell, script], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: redis_answers(f"redis://:{password}@127.0.0.1:{port}"), "the manifest's redis up",
                   timeout=15)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert not [args for args in command_lines_of_every_process() if password in args]
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def command_lines_of_every_process() -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found.append(cmdline.read_bytes().decode(errors="replace"))
        except OSError:   # gone, or not ours to read
            pass
    return found

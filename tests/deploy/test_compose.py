"""docker-compose.yml (alone and with its monitoring and GPU overrides) is valid compose with the services the
design names; the GPU override runs the CUDA image; the `pd` profile adds prefill schedulers beside the schedulers
that decode; both images install every package Ferry ships."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [(), ("docker-compose.monitoring.yml",), ("docker-compose.gpu.yml",),
             ("docker-compose.gpu.yml", "docker-compose.monitoring.yml")]
needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="the docker-compose binary is not installed")


def compose(files: tuple[str, ...], *command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """env: the environment the compose files interpolate (default: this process's)."""
    flags = [arg for name in ("docker-compose.yml", *files) for arg in ("-f", str(ROOT / name))]
    return subprocess.run(["docker-compose", *flags, *command], capture_output=True, text=True, timeout=60, env=env)


def resolved_services(files: tuple[str, ...], *flags: str, **variables: str | None) -> dict:
    """The services as compose resolves them (`flags` before `config`, e.g. a profile), each of `variables` set to
    its value or, where None, unset."""
    env = {key: value for key, value in os.environ.items() if key not in variables}
    env.update({key: value for key, value in variables.items() if value is not None})
    resolved = compose(files, *flags, "config", env=env)
    assert resolved.returncode == 0, resolved.stderr
    return yaml.safe_load(resolved.stdout)["services"]


def scheduler_service(files: tuple[str, ...], tensor_parallel_size: str | None) -> dict:
    """The scheduler service as compose resolves it, FERRY_TENSOR_PARALLEL_SIZE set to this or unset."""
    return resolved_services(files, FERRY_TENSOR_PARALLEL_SIZE=tensor_parallel_size)["scheduler"]


@needs_compose
def test_compose_file_is_valid_and_names_every_service():
    check = compose((), "config", "-q")
    assert check.returncode == 0, check.stderr
    services = yaml.safe_load(compose((), "config").stdout)["services"]
    assert {name for name, service in services.items() if "profiles" not in service} == {
        "secrets", "redis", "jaeger", "router", "scheduler"}
    assert {name: service["profiles"] for name, service in services.items() if "profiles" in service} == {
        "prefill-scheduler": ["pd"]}


@needs_compose
@pytest.mark.parametrize("overrides", OVERRIDES, ids=lambda files: "+".join(files) or "base")
def test_compose_overrides_are_valid(overrides: tuple[str, ...]):
    check = compose(overrides, "config", "-q")
    assert check.returncode == 0, check.stderr


def flag_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@needs_compose
def test_gpu_override_runs_schedulers_on_the_cuda_image_with_one_gpu_each():
    scheduler = scheduler_service(("docker-compose.gpu.yml",), None)
    assert scheduler["build"]["dockerfile"] == "Dockerfile.cuda"
    assert flag_value(scheduler["command"], "--device") == "cuda"
    assert flag_value(scheduler["command"], "--tensor-parallel-size") == "1"
    (devices,) = scheduler["deploy"]["resources"]["reservations"]["devices"]
    assert (devices["driver"], devices["capabilities"], int(devices["count"])) == ("nvidia", ["gpu"], 1)


@needs_compose
@pytest.mark.parametrize("overrides", [(), ("docker-compose.gpu.yml",)], ids=["cpu", "gpu"])
def test_the_tensor_parallel_size_reaches_the_scheduler_and_its_gpu_reservation(overrides: tuple[str, ...]):
    scheduler = scheduler_service(overrides, "4")
    assert flag_value(scheduler["command"], "--tensor-parallel-size") == "4"
    if overrides:
        (devices,) = scheduler["deploy"]["resources"]["reservations"]["devices"]
        assert int(devices["count"]) == 4


@needs_compose
@pytest.mark.parametrize("overrides", [(), ("docker-compose.gpu.yml",)], ids=["cpu", "gpu"])
def test_the_pd_profile_runs_prefill_schedulers_beside_the_schedulers_that_decode(overrides: tuple[str, ...]):
    services = resolved_services(overrides, "--profile", "pd", FERRY_SCHEDULER_ROLE="decode",
                                 FERRY_TENSOR_PARALLEL_SIZE="2")
    prefill, decode = services["prefill-scheduler"], services["scheduler"]
    assert flag_value(prefill["command"], "--role") == "prefill" and flag_value(decode["command"], "--role") == "decode"
    assert flag_value(prefill["command"], "--tensor-parallel-size") == "2"
    without_role = {key: value for key, value in prefill.items() if key not in ("command", "profiles")}
    assert without_role == {key: value for key, value in decode.items() if key != "command"}
    assert [arg for arg in prefill["command"] if arg != "prefill"] == [arg for arg in decode["command"]
                                                                      if arg != "decode"]


@needs_compose
def test_schedulers_do_everything_unless_told_their_role():
    scheduler = resolved_services((), FERRY_SCHEDULER_ROLE=None)["scheduler"]
    assert flag_value(scheduler["command"], "--role") == "both"


def shipped_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_image_installs_every_package_ferry_ships(dockerfile: str):
    top_level = {name.split(".")[0] for name in shipped_packages()}
    assert "scheduler" in top_level
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / dockerfile).read_text(), re.MULTILINE))
    assert top_level <= copied, f"{dockerfile} leaves out {top_level - copied}"
    assert re.search(r'pip install --no-build-isolation "?\.', (ROOT / dockerfile).read_text())


def test_install_ships_every_package_of_the_source_tree():
    shipped = set(shipped_packages())
    in_tree = {".".join(init.parent.relative_to(ROOT).parts) for top in shipped if "." not in top
               for init in (ROOT / top).rglob("__init__.py")}
    assert in_tree <= shipped, f"pyproject.toml leaves out {in_tree - shipped}"


def mounts(service: dict) -> dict[str, str]:
    """volume -> where the service mounts it (compose v1 writes "source:target:mode", v2 a mapping)."""
    found = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"])
        found[source] = target
    return found


@needs_compose
@pytest.mark.parametrize("overrides", OVERRIDES, ids=lambda files: "+".join(files) or "base")
def test_router_and_schedulers_carry_the_stacks_cluster_token_and_redis_password(overrides: tuple[str, ...]):
    services = yaml.safe_load(compose(overrides, "config").stdout)["services"]
    for name in ("router", "scheduler"):
        command, mounted = services[name]["command"], mounts(services[name])
        for flag, secret in (("--cluster-token-file", "cluster-token"), ("--redis-password-file", "redis-password")):
            assert command[command.index(flag) + 1] == f"{mounted['ferry-secrets']}/{secret}", (name, flag)


@needs_compose
def test_compose_redis_requires_the_generated_password_and_publishes_no_port():
    services = yaml.safe_load(compose((), "config").stdout)["services"]
    script = services["secrets"]["command"][-1]
    assert "requirepass" in script and "/dev/urandom" in script
    redis = services["redis"]
    assert redis["command"] == ["redis-server", "/secrets/redis.conf"] and "ports" not in redis
    assert redis["depends_on"]["secrets"]["condition"] == "service_completed_successfully"

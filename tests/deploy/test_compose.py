"""docker-compose.yml (alone and with its monitoring and GPU overrides) is valid compose with the services the
design names; the GPU override runs the CUDA image; both images install every package Ferry ships."""
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


def scheduler_service(files: tuple[str, ...], tensor_parallel_size: str | None) -> dict:
    """The scheduler service as compose resolves it, FERRY_TENSOR_PARALLEL_SIZE set to this or unset."""
    env = {key: value for key, value in os.environ.items() if key != "FERRY_TENSOR_PARALLEL_SIZE"}
    if tensor_parallel_size is not None:
        env["FERRY_TENSOR_PARALLEL_SIZE"] = tensor_parallel_size
    resolved = compose(files, "config", env=env)
    assert resolved.returncode == 0, resolved.stderr
    return yaml.safe_load(resolved.stdout)["services"]["scheduler"]


@needs_compose
def test_compose_file_is_valid_and_names_every_service():
    check = compose((), "config", "-q")
    assert check.returncode == 0, check.stderr
    assert set(compose((), "config", "--services").stdout.split()) == {"secrets", "redis", "jaeger", "router",
                                                                        "scheduler"}


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

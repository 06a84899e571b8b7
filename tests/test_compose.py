"""docker-compose.yml (alone and with its monitoring and GPU overrides) is valid compose with the services the
design names; the GPU override runs the CUDA image; both images install every package Ferry ships."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = [(), ("docker-compose.monitoring.yml",), ("docker-compose.gpu.yml",),
             ("docker-compose.gpu.yml", "docker-compose.monitoring.yml")]
needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="the docker-compose binary is not installed")


def compose(files: tuple[str, ...], *command: str) -> subprocess.CompletedProcess:
    flags = [arg for name in ("docker-compose.yml", *files) for arg in ("-f", str(ROOT / name))]
    return subprocess.run(["docker-compose", *flags, *command], capture_output=True, text=True, timeout=60)


@needs_compose
def test_compose_file_is_valid_and_names_every_service():
    check = compose((), "config", "-q")
    assert check.returncode == 0, check.stderr
    assert set(compose((), "config", "--services").stdout.split()) == {"redis", "jaeger", "router", "scheduler"}


@needs_compose
@pytest.mark.parametrize("overrides", OVERRIDES, ids=lambda files: "+".join(files) or "base")
def test_compose_overrides_are_valid(overrides: tuple[str, ...]):
    check = compose(overrides, "config", "-q")
    assert check.returncode == 0, check.stderr


@needs_compose
def test_gpu_override_runs_schedulers_on_the_cuda_image_with_one_gpu_each():
    scheduler = yaml.safe_load(compose(("docker-compose.gpu.yml",), "config").stdout)["services"]["scheduler"]
    assert scheduler["build"]["dockerfile"] == "Dockerfile.cuda"
    assert scheduler["command"][scheduler["command"].index("--device") + 1] == "cuda"
    devices = scheduler["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_image_installs_every_package_ferry_ships(dockerfile: str):
    listed = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    packages = re.findall(r'"([^"]+)"', listed)
    assert "scheduler" in packages
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / dockerfile).read_text(), re.MULTILINE))
    assert set(packages) <= copied, f"{dockerfile} leaves out {set(packages) - copied}"
    assert re.search(r'pip install --no-build-isolation "?\.', (ROOT / dockerfile).read_text())

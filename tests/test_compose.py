"""docker-compose.yml is a valid compose file with the services the design names."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="the docker-compose binary is not installed")
def test_compose_file_is_valid_and_names_every_service():
    check = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    services = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "--services"],
                              capture_output=True, text=True, timeout=60).stdout.split()
    assert set(services) == {"redis", "jaeger", "router", "scheduler"}

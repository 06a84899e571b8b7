"""Every FERRY_* variable is declared, with its default and meaning, in base/environment.py, and read only there."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from base import environment

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("base", "ferry", "scheduler", "router", "gpu_worker", "kernels", "protos", "benchmarks")
NAME = re.compile(r"""["'](FERRY_[A-Z0-9_]+)["']""")
READ = re.compile(r"os\.getenv\(|environ\.get\(|environ\[[^\]]+\](?!\s*=[^=])|\bin os\.environ")


def stray_reads(root: Path) -> list[str]:
    """'path:line' for every read of a FERRY_* variable outside base/environment.py: os.environ / os.getenv with
    the name, or with a constant holding it; and every FERRY_* name the module does not declare."""
    found = []
    for path in (p for package in PACKAGES for p in (root / package).rglob("*.py")):
        if path == root / "base" / "environment.py":
            continue
        lines = path.read_text().splitlines()
        constants = {m.group(1) for line in lines if (m := re.match(r"\s*([A-Z_]+)\s*=\s*" + NAME.pattern, line))}
        for number, line in enumerate(lines, 1):
            names_one = NAME.search(line) or any(re.search(rf"\b{c}\b", line) for c in constants)
            undeclared = [n for n in NAME.findall(line) if n not in environment.VARIABLES]
            if (READ.search(line) and names_one) or undeclared:
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_ferry_variables_are_read_only_through_base_environment():
    assert stray_reads(ROOT) == []


@pytest.mark.parametrize("line", ['level = os.environ.get("FERRY_LOG_LEVEL", "INFO")',
                                  'port = os.getenv("FERRY_METRICS_PORT")',
                                  'on = os.environ["FERRY_CPU_KERNELS"] != "0"',
                                  'ENV = "FERRY_EVENT_LOOP"\nloop = os.environ.get(ENV)',
                                  'child = {"FERRY_NEW_KNOB": "1"}'])
def test_the_check_finds_a_read_outside_the_module(tmp_path: Path, line: str):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "stray.py").write_text(f"import os\n{line}\n")
    assert stray_reads(tmp_path)


def test_the_check_leaves_setting_a_childs_environment_alone(tmp_path: Path):
    (tmp_path / "ferry").mkdir()
    (tmp_path / "ferry" / "launch.py").write_text('env = {**os.environ, "FERRY_CLUSTER_TOKEN": token}\n'
                                                  'os.environ["FERRY_CPU_GGUF_BLOCKS"] = "0"\n')
    assert stray_reads(tmp_path) == []


def test_a_variable_is_read_when_used_and_parsed(monkeypatch):
    monkeypatch.setenv("FERRY_CPU_KERNELS", "0")
    monkeypatch.setenv("FERRY_METRICS_PORT", "9100")
    monkeypatch.delenv("FERRY_TEST_CRASH_ON_TOKEN", raising=False)
    assert environment.FERRY_CPU_KERNELS is False and environment.FERRY_METRICS_PORT == 9100
    assert environment.FERRY_TEST_CRASH_ON_TOKEN is None
    monkeypatch.setenv("FERRY_CPU_KERNELS", "1")
    assert environment.FERRY_CPU_KERNELS is True


def test_every_variable_says_what_it_does_and_an_undeclared_one_is_an_error():
    assert all(variable.meaning for variable in environment.VARIABLES.values())
    with pytest.raises(AttributeError):
        environment.FERRY_NO_SUCH_VARIABLE

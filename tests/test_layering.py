"""The packages' imports only point down: protos (the contract) < base < kernels < gpu_worker < scheduler; router
sits on protos and base only; the apps on top: ferry on all of those, benchmarks above ferry (ferry never imports
benchmarks: `ferry bench` runs them as `python -m benchmarks`). No module imports one that imports it back, directly
or round a longer circle. And router never loads torch, transformers or triton, not even through a module it
imports. Every import counts: module level, inside functions, TYPE_CHECKING.

The tests follow the house: every test file is in a room, tests/unit/<package>/ or one of conftest's ROOMS; a unit
test of a package imports that package, those below it and the harness (the fixtures in tests/, and the apps, which
build models and drive a whole engine), and never starts a process.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ["protos", "base", "kernels", "gpu_worker", "scheduler"]   # each may import those before it
APPS = ["ferry", "benchmarks"]                                     # the same, above the core and router
ALLOWED = {**{package: set(CORE[:i + 1]) for i, package in enumerate(CORE)},
           "router": {"protos", "base", "router"},
           **{app: set(CORE) | {"router"} | set(APPS[:i + 1]) for i, app in enumerate(APPS)}}
HEAVY = {"torch", "transformers", "triton"}
TESTS = ROOT / "tests"
HARNESS = {"tests", *APPS}
STARTS_PROCESSES = ["subprocess", "multiprocessing", "tests.services_fixtures", "tests.openai_fixtures"]


def imported_modules(source: str, module: str) -> list[str]:
    """Dotted names a module's source imports: `from a.b import c` gives a.b and a.b.c (c may be a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, module)
            found += [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return found


def absolute_base(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module
    parent = module.split(".")[:-node.level]
    return ".".join(parent + ([node.module] if node.module else []))


def package_modules(root: Path, packages: list[str]) -> dict[str, Path]:
    modules = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def layering_violations(root: Path, allowed: dict[str, set[str]]) -> list[str]:
    """'module imports name' for every import of one of allowed's packages that its own package may not make."""
    violations = []
    for module, path in package_modules(root, list(allowed)).items():
        package = module.split(".")[0]
        for name in imported_modules(path.read_text(), module):
            target = name.split(".")[0]
            if target in allowed and target not in allowed[package]:
                violations.append(f"{module} imports {name}")
    return sorted(set(violations))


def module_imports(source: str, module: str, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that a module's source imports, file to file: `from a import b` is a/b.py where
    that is a module, else a/__init__.py (the packages an import passes through are not counted)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, module)
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return found & set(modules) - {module}


def import_circles(root: Path, packages: list[str]) -> list[list[str]]:
    """Every set of modules that import one another round a circle (strongly connected components of the import
    graph, Tarjan's algorithm), each sorted."""
    modules = package_modules(root, packages)
    graph = {module: sorted(module_imports(path.read_text(), module, modules)) for module, path in modules.items()}
    order, lowest, stack, circles = {}, {}, [], []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for imported in graph[module]:
            if imported not in order:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], order[imported])
        if lowest[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(circles)


def third_party_reached(root: Path, packages: list[str], start: str) -> set[str]:
    """Top-level names of what start's modules import outside `packages`, directly or through modules of them."""
    modules = package_modules(root, packages)
    seen, todo, reached = set(), [m for m in modules if m.split(".")[0] == start], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in imported_modules(modules[module].read_text(), module):
            parts = name.split(".")
            if parts[0] in packages:   # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
                todo += [prefix for i in range(len(parts)) if (prefix := ".".join(parts[:i + 1])) in modules]
            else:
                reached.add(parts[0])
    return reached


def unit_test_violations(tests: Path, allowed: dict[str, set[str]]) -> list[str]:
    """'path imports name' for every import a test in tests/unit/<package>/ may not make: a package above its own
    (other than the harness), or what starts a process; 'path is in no package's room' for one outside them."""
    violations = []
    for path in sorted((tests / "unit").rglob("test_*.py")):
        where = path.relative_to(tests)
        room = where.parts[1]
        if room not in allowed:
            violations.append(f"{where} is in no package's room")
            continue
        for name in imported_modules(path.read_text(), ".".join(("tests", *where.with_suffix("").parts))):
            starts = any(name == p or name.startswith(f"{p}.") for p in STARTS_PROCESSES)
            target = name.split(".")[0]
            if starts or (target in allowed and target not in allowed[room] | HARNESS):
                violations.append(f"{where} imports {name}")
    return sorted(set(violations))


def misplaced_tests(tests: Path, rooms: tuple[str, ...]) -> list[str]:
    """Test files outside tests/unit/ and the rooms (test_layering.py checks the whole house: it stays at tests/)."""
    return sorted(str(path.relative_to(tests)) for path in tests.rglob("test_*.py")
                  if path.relative_to(tests).parts[0] not in ("unit", *rooms) and path.name != "test_layering.py")


def test_no_package_imports_one_above_it():
    assert layering_violations(ROOT, ALLOWED) == []


def test_no_module_imports_one_that_imports_it_back():
    assert import_circles(ROOT, list(ALLOWED)) == []


def test_ferry_never_imports_the_benchmarks():
    assert [v for v in layering_violations(ROOT, ALLOWED) if v.startswith("ferry")] == []
    assert "benchmarks" not in ALLOWED["ferry"]


def test_router_never_loads_the_model_libraries():
    assert third_party_reached(ROOT, list(ALLOWED), "router") & HEAVY == set()


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_catch_an_upward_import_and_torch_behind_a_lower_package(tmp_path):
    write(tmp_path, {"protos/__init__.py": "", "protos/wire.py": "import json\n",
                     "base/__init__.py": "", "base/shared.py": "from . import helpers\n",
                     "base/helpers.py": "def f():\n    import torch\n",
                     "scheduler/__init__.py": "", "scheduler/loop.py": "from protos import wire\n",
                     "router/__init__.py": "", "router/core.py": "from base.shared import f\nimport scheduler.loop\n"})
    allowed = {package: ALLOWED[package] for package in ("protos", "base", "scheduler", "router")}
    assert layering_violations(tmp_path, allowed) == ["router.core imports scheduler.loop"]
    assert "torch" in third_party_reached(tmp_path, list(allowed), "router")
    (tmp_path / "router/core.py").write_text("from protos.wire import json\n")
    assert layering_violations(tmp_path, allowed) == []
    assert third_party_reached(tmp_path, list(allowed), "router") & HEAVY == set()


def test_the_circle_check_finds_a_circle_through_a_type_only_import_and_not_through_a_package(tmp_path):
    write(tmp_path, {"base/__init__.py": "def select():\n    from base import b\n",
                     "base/a.py": "from base import b\n",
                     "base/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from base.c import C\n",
                     "base/c.py": "from base.a import *\n",
                     "ferry/__init__.py": "", "ferry/cli.py": "import benchmarks.cli\n",
                     "benchmarks/__init__.py": "", "benchmarks/cli.py": "from ferry import cli\n"})
    assert import_circles(tmp_path, ["base"]) == [["base.a", "base.b", "base.c"]]
    (tmp_path / "base/c.py").write_text("")
    assert import_circles(tmp_path, ["base"]) == []
    assert import_circles(tmp_path, ["ferry", "benchmarks"]) == [["benchmarks.cli", "ferry.cli"]]
    allowed = {package: ALLOWED[package] for package in ("base", "ferry", "benchmarks")}
    assert layering_violations(tmp_path, allowed) == ["ferry.cli imports benchmarks.cli"]


def test_every_test_is_in_a_room_and_unit_tests_import_down_in_one_process():
    from tests.conftest import ROOMS
    assert misplaced_tests(TESTS, ROOMS) == []
    assert unit_test_violations(TESTS, ALLOWED) == []


def test_the_checks_catch_a_unit_test_that_imports_up_or_starts_a_process(tmp_path):
    write(tmp_path, {"unit/router/test_up.py": "from router import core\nfrom scheduler.core import Scheduler\n",
                     "unit/kernels/test_probe.py": "def test_probe():\n    import subprocess\n",
                     "unit/scheduler/test_served.py": "from tests.services_fixtures import wait_until\n",
                     "unit/scheduler/test_engine.py": "from ferry import Engine\nfrom tests.engine_fixtures import e\n",
                     "unit/httpd/test_misfiled.py": "", "test_loose.py": "", "services/test_stack.py": ""})
    assert unit_test_violations(tmp_path, ALLOWED) == [
        "unit/httpd/test_misfiled.py is in no package's room", "unit/kernels/test_probe.py imports subprocess",
        "unit/router/test_up.py imports scheduler.core", "unit/router/test_up.py imports scheduler.core.Scheduler",
        "unit/scheduler/test_served.py imports tests.services_fixtures",
        "unit/scheduler/test_served.py imports tests.services_fixtures.wait_until"]
    assert misplaced_tests(tmp_path, ("services",)) == ["test_loose.py"]

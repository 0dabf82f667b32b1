"""The house rules that keep the code base one-directional (docs/architecture.md).

Imports point down the layers below and never up; a package never reaches a layer above it, so
no two packages import each other. The client library stands beside the server and shares only
the protocol package with it. The distribution installs one top-level name, ``shoal``.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import REPO_ROOT

# Rank of each part of `shoal`: a module may import only parts of a lower rank (or its own part).
LAYERS: dict[str, int] = {
    "__main__": 11,
    "cli": 10,
    "app": 9,  # wiring
    "config_commands": 8,
    "tools": 8,  # tools that drive a server
    "frontend": 8,  # front-end worker processes: a transport over a remote core
    "grpc": 7,
    "http": 7,
    "metrics": 7,  # transports
    "core": 6,  # the facade every transport calls
    "lifecycle": 5,
    "instances": 4,  # executors: they implement the schedulers' contract (scheduling.base)
    "scheduling": 3,
    "backends": 3,
    "repository": 2,
    "dataplane": 2,
    "logs": 2,
    "tracing": 2,  # logs: what every process reads to log by
    "settings": 1,
    "statistics": 1,
    "request_types": 1,  # what a request carries: tensors, requests, responses
    "errors": 1,
    "off_loop": 1,  # when work leaves the event loop: one rule for every layer
    "descriptors": 1,
    "clients": 1,  # the client library: the protocol is all it shares with the server
    "protocol": 0,
    "__init__": 0,
}
PACKAGE_FOLDERS = {"shoal": REPO_ROOT / "server", "shoal.clients": REPO_ROOT / "clients"}


def _modules() -> dict[str, Path]:
    """Every source module by its installed name."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_FOLDERS.items():
        for path in folder.rglob("*.py"):
            if path.name.endswith("_pb2.py") or (package == "shoal" and path.is_relative_to(REPO_ROOT / "clients")):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__" and len(parts) > 1:
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _part(module: str) -> str:
    """The layer a ``shoal.*`` module belongs to: its first name below ``shoal``."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    return imported


def test_imports_point_down_the_layers() -> None:
    upward = []
    for module, path in _modules().items():
        source = _part(module)
        assert source in LAYERS, f"{module}: a new part of shoal; give it a layer in LAYERS"
        for target in sorted(_imports(path)):
            if not target.startswith("shoal.") or target.split(".")[1] not in LAYERS:
                continue
            destination = _part(target)
            if destination != source and LAYERS[destination] >= LAYERS[source]:
                upward.append(
                    f"{module} imports {target} ({source} {LAYERS[source]} -> {destination} {LAYERS[destination]})"
                )
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def _module_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of other modules (a type-checking import counts: it is still a circle
    for the reader). ``from package import module`` is an edge to the module, not to the package."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named = {f"{node.module}.{alias.name}" for alias in node.names}
                submodules = named & modules.keys()
                targets |= submodules
                if len(submodules) < len(named) and node.module in modules:
                    targets.add(node.module)
        edges[module] = targets - {module}
    return edges


def test_no_two_modules_import_each_other_even_through_others() -> None:
    """No import circle between modules, however long (a package's ``__init__`` re-exporting what its
    own modules import from it is the one kind left, and there is none today)."""
    edges = _module_edges(_modules())
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles: list[str] = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                walk(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_import_of_the_folder_names() -> None:
    """Code imports `shoal.*`, never the folders `server` or `clients` (they are not installed)."""
    wrong = [
        f"{module} imports {target}"
        for module, path in _modules().items()
        for target in _imports(path)
        if target.split(".")[0] in {"server", "clients"}
    ]
    for folder in ("tests", "bench"):
        wrong += [
            f"{path} imports {target}"
            for path in (REPO_ROOT / folder).rglob("*.py")
            for target in _imports(path)
            if target.split(".")[0] in {"server", "clients"}
        ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", ["server", "clients"])
def test_no_generic_top_level_module_is_installed(tmp_path: Path, name: str) -> None:
    """Outside the repository, `server` and `clients` are free for the user's own code."""
    (tmp_path / f"{name}.py").write_text("MINE = True\n")
    code = f"import {name}, shoal.clients, shoal.cli; print({name}.MINE, {name}.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", str(tmp_path / f"{name}.py")]


def test_python_dash_m_shoal_is_the_shoal_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shoal", "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.startswith("shoal "), result.stdout + result.stderr


def test_no_test_folder_shadows_a_module_a_script_in_tests_imports() -> None:
    """A script run from tests/ (tests/kserve_clients.py, in KServe's venv) has tests/ first on its path:
    a subject folder named ``http`` hid the standard library's ``http`` from KServe's client there."""

    def installed(name: str) -> bool:  # the repository's own top-level folders (clients/, deploy/) do not count
        spec = importlib.util.find_spec(name)
        if spec is None:
            return False
        places = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
        return any(not Path(place).resolve().is_relative_to(REPO_ROOT) for place in places)

    shadowing = [
        folder.name
        for folder in (REPO_ROOT / "tests").iterdir()
        if (folder / "__init__.py").is_file() and (folder.name in sys.stdlib_module_names or installed(folder.name))
    ]
    assert not shadowing, f"tests/ folders named as importable modules: {shadowing}"

"""The house rules that keep the code base one-directional (docs/architecture.md).

Imports point down the layers below and never up; a package never reaches a layer above it, so
no two packages import each other. The client library stands beside the server and shares only
the protocol package with it. Three distributions install one top-level name, ``shoal`` (a PEP 420
namespace), each from a source root in which a file's path is its import name.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributions import declared, normalised
from tests.models import REPO_ROOT

# Rank of each part of `shoal`: a module may import only parts of a lower rank (or its own part).
LAYERS: dict[str, int] = {
    "__main__": 11,
    "cli": 10,
    "app": 9,  # wiring
    "tools": 8,  # tools that drive a server
    "frontend": 8,  # front-end worker processes: a transport over a remote core
    "grpc": 7,
    "http": 7,
    "metrics": 7,  # transports
    "core": 6,  # the facade every transport calls
    "lifecycle": 5,
    "instances": 4,  # executors: they implement the schedulers' contract (scheduling.base)
    "configuring": 4,  # the config pipeline and the config commands: the backends describe, lifecycle loads
    "scheduling": 3,
    "backends": 3,
    "repository": 2,
    "dataplane": 2,
    "logs": 2,
    "event_loops": 2,  # which asyncio loop a serving process runs
    "tracing": 2,  # logs: what every process reads to log by
    "settings": 1,
    "statistics": 1,
    "custom_metrics": 1,  # Python models' metric families: written by the backends, read by /metrics
    "request_types": 1,  # what a request carries: tensors, requests, responses
    "errors": 1,
    "off_loop": 1,  # when work leaves the event loop: one rule for every layer
    "descriptors": 1,
    "clients": 1,  # the client library: the protocol is all it shares with the server
    "protocol": 0,
}
# The source root of each distribution (pyproject.toml beside it, or above it for the server's):
# below it, a file's path is its import name.
SOURCE_ROOTS = {
    "shoal": REPO_ROOT / "server",
    "shoal-client": REPO_ROOT / "clients",
    "shoal-protocol": REPO_ROOT / "proto",
}


def _import_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every source module by its import name, which is its path below its source root."""
    return {
        _import_name(root, path): path
        for root in SOURCE_ROOTS.values()
        for path in (root / "shoal").rglob("*.py")
        if not path.name.endswith("_pb2.py")
    }


def _part(module: str) -> str:
    """The layer a ``shoal.*`` module belongs to: its first name below ``shoal``."""
    return module.split(".")[1]


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


def test_every_module_is_imported_from_its_path() -> None:
    """What the installs resolve is what the folders say: ``shoal.core.host`` is ``server/shoal/core/host.py``,
    ``shoal.clients.client`` is ``clients/shoal/clients/client.py`` (found, not imported)."""
    modules = _modules()
    assert {"shoal.cli", "shoal.core.host", "shoal.clients.client", "shoal.protocol.codec"} <= modules.keys()
    elsewhere = []
    for name, path in sorted(modules.items()):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or Path(spec.origin).resolve() != path.resolve():
            elsewhere.append(f"{name}: {path} in the tree, {spec and spec.origin} installed")
    assert not elsewhere, "\n".join(elsewhere)
    assert not (REPO_ROOT / "server" / "shoal" / "__init__.py").exists(), "shoal is a namespace over three folders"


@pytest.mark.parametrize("distribution", ["shoal-client", "shoal-protocol"])
def test_the_client_side_imports_only_what_its_distributions_declare(distribution: str) -> None:
    """The client library installs without the server's dependencies (no onnxruntime or uvicorn to get
    ``shoal.clients``): every third-party module the client's and the protocol's code imports comes
    from a distribution their own pyproject.toml files declare."""
    root = SOURCE_ROOTS[distribution]
    allowed = declared(root / "pyproject.toml")
    if distribution == "shoal-client":
        allowed |= declared(SOURCE_ROOTS["shoal-protocol"] / "pyproject.toml")
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    for path in sorted((root / "shoal").rglob("*.py")):
        for name in sorted({target.split(".")[0] for target in _imports(path)}):
            if name in sys.stdlib_module_names or name in {"shoal", "__future__"}:
                continue
            if not {normalised(d) for d in providers.get(name, [])} & allowed:
                undeclared.append(f"{path.relative_to(REPO_ROOT)} imports {name} ({providers.get(name)})")
    assert not undeclared, "\n".join(undeclared)


@pytest.mark.parametrize("name", ["server", "clients", "setup", "compile_protos"])
def test_no_generic_top_level_module_is_installed(tmp_path: Path, name: str) -> None:
    """Outside the repository, `server` and `clients` are free for the user's own code, and the protocol's
    build scripts (proto/setup.py, proto/compile_protos.py) are not importable."""
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

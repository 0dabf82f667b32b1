"""The client library is a distribution of its own: shoal-client (clients/) over shoal-protocol (proto/).

A service that calls Shoal installs ``pip install ./proto ./clients`` and gets ``shoal.clients`` and
``shoal-load`` without the server's dependencies, as tritonclient installs without Triton.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import RunningServer
from tests.distributions import declared, normalised
from tests.models import REPO_ROOT


def _wheel(project: Path, out: Path) -> zipfile.ZipFile:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(project)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def test_each_client_side_wheel_holds_its_package_and_nothing_of_the_server(tmp_path: Path) -> None:
    protocol = _wheel(REPO_ROOT / "proto", tmp_path / "proto").namelist()
    client = _wheel(REPO_ROOT / "clients", tmp_path / "clients").namelist()
    for names, package in ((protocol, "shoal/protocol/"), (client, "shoal/clients/")):
        strays = [name for name in names if not name.startswith(package) and ".dist-info/" not in name]
        assert not strays, strays
    assert {"shoal/protocol/grpc_service_pb2.py", "shoal/protocol/codec.py", "shoal/protocol/py.typed"} <= set(
        protocol
    ), protocol
    assert {"shoal/clients/client.py", "shoal/clients/loadtest/cli.py"} <= set(client), client


def _server_only_modules() -> list[str]:
    """Top-level modules that distributions the server declares (and the client side does not) install, and no
    distribution the client side declares does (``opentelemetry`` counts: the SDK installs part of it)."""

    ours = {"shoal-protocol", "shoal-client"}
    client_side = declared(REPO_ROOT / "proto" / "pyproject.toml", extras=False) | declared(
        REPO_ROOT / "clients" / "pyproject.toml", extras=False
    )
    server_only = declared(REPO_ROOT / "pyproject.toml", extras=False) - client_side - ours
    return sorted(
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if (providers := {normalised(d) for d in distributions}) & server_only and not providers & client_side
    )


REFUSING = """
import importlib, importlib.abc, json, pkgutil, sys
import numpy as np
SERVER_ONLY = set(json.loads(sys.argv[1]))

class ServerOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        names = name.split(".")
        ours = names[0] == "shoal" and len(names) > 1 and names[1] not in {"clients", "protocol"}
        if names[0] in SERVER_ONLY or ours:
            raise ImportError(f"the client imported {name}, which only the server's distribution installs")
        return None

sys.meta_path.insert(0, ServerOnly())
import shoal.clients, shoal.protocol
for package in (shoal.clients, shoal.protocol):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if not module.name.endswith(".__main__"):  # runs shoal-load
            importlib.import_module(module.name)
from shoal.clients import InferenceClient
a = np.arange(16, dtype=np.int32).reshape(1, 16)
with InferenceClient(sys.argv[2], timeout_s=30) as client:
    print(client.infer("simple", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist())
"""


def test_the_client_serves_a_call_without_any_of_the_servers_modules(example_server: RunningServer) -> None:
    """Every module of shoal.clients and shoal.protocol imports, and a call is answered, while importing any
    module only the server's distribution brings (onnxruntime, uvloop, OpenTelemetry, shoal.core...) fails."""
    server_only = _server_only_modules()
    assert {"onnxruntime", "uvloop", "opentelemetry"} <= set(server_only), server_only
    done = subprocess.run(
        [sys.executable, "-c", REFUSING, json.dumps(server_only), example_server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[2 * v for v in range(16)]]

"""The command line: serve from `shoal` and `python -m shoal`, clear errors, clean exit on SIGTERM."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True, text=True, timeout=60)


def test_help_lists_triton_flag_names() -> None:
    result = run("serve", "--help")
    assert result.returncode == 0
    for flag in (
        "--model-repository",
        "--grpc-port",
        "--grpc-address",
        "--log-verbose",
        "--reuse-grpc-port",
        "--exit-timeout-secs",
        "--metrics-address",
    ):
        assert flag in result.stdout


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["serve"], "--model-repository"),
        (["serve", "--model-repository", "/nonexistent/repo"], "is not a folder"),
        (["serve", "--model-repository", ".", "--grpc-port", "70000"], "port must be in 0..65535"),
        (["serve", "--model-repository", ".", "--strict-readiness", "maybe"], "expected true or false"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_fail_clearly(args: list[str], phrase: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert phrase in result.stderr


def test_shoal_entry_point_serves_and_exits_zero_on_sigterm(tmp_path: Path, server_factory) -> None:
    """`python -m shoal --model-repository ...` (no subcommand) means serve."""
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo)
    with grpc.insecure_channel(server.url) as channel:
        assert InferenceStub(channel).ModelReady(pb.ModelReadyRequest(name="simple")).ready
    assert server.stop() == 0
    assert "Started GRPCInferenceService" in server.log()


@pytest.mark.parametrize(("script", "expected"), [("shoal", "shoal "), ("shoal-load", "usage: shoal-load")])
def test_console_scripts_are_installed(script: str, expected: str) -> None:
    path = shutil.which(script, path=str(Path(sys.executable).parent))
    assert path is not None, f"the `{script}` console script is missing: pip install -e ./proto -e ./clients -e ."
    result = subprocess.run(
        [path, "--version" if script == "shoal" else "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.startswith(expected)

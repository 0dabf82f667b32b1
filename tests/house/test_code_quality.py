"""The code stays ruff-formatted, ruff- and mypy-clean (STYLE.md): checked with every test run, not by hand."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.models import REPO_ROOT

# The source roots below which a file's path is its import name (tests/house/test_architecture.py).
SOURCE_ROOTS = ("server", "clients", "proto")


def test_ruff_is_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "server", "clients", "tests", "bench", "model_repository", "proto"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_applied() -> None:
    """One formatter, applied once and kept: ``ruff format`` (pyproject's line length) leaves every file as it is."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "server",
            "clients",
            "tests",
            "bench",
            "model_repository",
            "proto",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    """mypy reads the ``shoal`` namespace from the three source roots, as the installs do."""
    packages = [f"{root}/shoal" for root in SOURCE_ROOTS]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--explicit-package-bases", *packages, "bench"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MYPYPATH": os.pathsep.join(SOURCE_ROOTS)},
    )
    assert result.returncode == 0, result.stdout + result.stderr

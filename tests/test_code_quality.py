"""The code stays ruff- and mypy-clean (STYLE.md): checked with every test run, not by hand."""

from __future__ import annotations

import subprocess
import sys

from tests.models import REPO_ROOT


def test_ruff_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "server", "clients", "tests", "bench",
                             "model_repository", "proto"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "server", "clients", "bench"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr

"""The code stays ruff-formatted, ruff- and mypy-clean (STYLE.md): checked with every test run, not by hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.models import REPO_ROOT

# Where each installed package's source lives (setup.py installs server/ as `shoal`).
PACKAGE_FOLDERS = {"shoal": REPO_ROOT / "server", "shoal/clients": REPO_ROOT / "clients"}


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


def _package_view(root: Path) -> Path:
    """A folder in which the sources sit under their import names (``shoal/``, ``shoal/clients/``).

    mypy finds modules by folder, and cannot follow the import hook of an editable install that
    maps ``shoal`` to ``server/``; links to the real files give it the installed layout.
    """
    for package, folder in PACKAGE_FOLDERS.items():
        target = root / package
        target.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():
            if entry.name != "__pycache__" and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    return root


def test_mypy_is_clean(tmp_path: Path) -> None:
    view = _package_view(tmp_path / "view")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", str(view / "shoal"), "bench"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MYPYPATH": str(view)},
    )
    assert result.returncode == 0, result.stdout + result.stderr

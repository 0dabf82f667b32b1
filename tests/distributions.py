"""What the repository's pyproject.toml files declare, for the tests of the three distributions."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path


def normalised(distribution: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(pyproject: Path, extras: bool = True) -> set[str]:
    """The distributions ``pyproject`` depends on (with its extras' when ``extras``), names normalised."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    if extras:
        requirements += [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return {normalised(re.match(r"[A-Za-z0-9._-]+", requirement).group()) for requirement in requirements}

"""Model folders and version folders in a repository, and safe model-name resolution."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from server.errors import load_failed, unknown_model

logger = logging.getLogger(__name__)

# A model name is one path component of ordinary characters: never '..', never a separator.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
# Triton ignores version folders that are not integers or that start with '0'.
_VERSION_NAME = re.compile(r"^[1-9][0-9]*$")


def is_safe_model_name(name: str) -> bool:
    return bool(_MODEL_NAME.match(name)) and ".." not in name


def model_dir(repository: Path, name: str) -> Path:
    """The folder of model ``name``, refusing names that could point outside the repository."""
    if not is_safe_model_name(name):
        raise unknown_model(name)
    root = repository.resolve()
    path = (root / name).resolve()
    if path.parent != root:
        raise unknown_model(name)
    return path


def list_models(repository: Path) -> list[str]:
    """Names of the model folders in the repository, sorted; unsafe names are skipped."""
    if not repository.is_dir():
        raise load_failed(f"model repository {repository} is not a folder")
    names = []
    for entry in sorted(repository.iterdir()):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        if not is_safe_model_name(entry.name) or entry.resolve().parent != repository.resolve():
            logger.warning("skipping model folder %r: unsafe name or it points outside the repository", entry)
            continue
        names.append(entry.name)
    return names


def list_versions(folder: Path, warn: bool = True) -> list[int]:
    """Integer version folders of a model; others are skipped (with a warning unless ``warn`` is off)."""
    versions = []
    for entry in sorted(folder.iterdir()):
        if not entry.is_dir():
            continue
        if _VERSION_NAME.match(entry.name):
            versions.append(int(entry.name))
        elif not warn:
            continue
        elif entry.name.isdigit():
            logger.warning("model %s: skipping version folder %r (zero-padded)", folder.name, entry.name)
        elif entry.name not in {"configs", "tuning", "__pycache__"}:  # tuning/: `shoal config tune` output
            logger.warning("model %s: skipping folder %r (not an integer version)", folder.name, entry.name)
    return sorted(versions)

"""Model folders and version folders in a repository, and the one check every path goes through.

Nothing in a repository is opened, stat'ed or listed before ``checked_path`` has turned its
repository-relative name into a real path (symlinks resolved) inside the repository. A path
that leads outside is refused with one message that names only what the caller gave, so the
answer is the same whether or not the target exists. Messages name files relative to the
repository (``simple/1/model.onnx``), never by their absolute path on the server.

What "inside" means (the containment rule):

- The repository is its real path: ``/mnt/models`` may itself be a symlink (KServe's ``oci://``
  modelcar mounts it so).
- A top-level entry is a model folder wherever it really lies: whoever lays out the repository
  chooses its top level, and KServe's ``kserve-storage`` local download puts a symlink in place
  of each top-level entry, pointing outside the repository. Only an entry whose target is the
  repository or a folder holding it is no model folder (it would make everything "inside").
- Below a top-level entry, every path must resolve inside the repository or inside the real
  path of that same model folder. A config, version folder, model file, label file or weight
  file that a symlink or ``..`` leads anywhere else is refused, so a model folder can never
  reach the rest of the file system, nor another model folder placed outside the repository.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path, PurePath

from shoal.errors import ShoalError, load_failed, shown, unknown_model

logger = logging.getLogger(__name__)

# A model name is one path component of ordinary characters: never '..', never a separator.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
# Triton ignores version folders that are not integers or that start with '0'.
_VERSION_NAME = re.compile(r"^[1-9][0-9]*$")
# The longest file name the usual file systems take (NAME_MAX); longer ones cannot exist.
MAX_NAME_BYTES = 255
CONFIG_FILENAME = "config.pbtxt"
# Files whose presence in an integer folder marks it as a version folder (see looks_like_model_folder).
_MODEL_FILENAMES = ("model.onnx", "model.pt", "model.pt2")


def is_safe_model_name(name: str) -> bool:
    return bool(_MODEL_NAME.match(name)) and ".." not in name and len(name.encode()) <= MAX_NAME_BYTES


def outside(relative: str | PurePath) -> ShoalError:
    """The one refusal for a path that leads out of the repository (or cannot be a path in it)."""
    return load_failed(f"'{shown(str(relative))}' is not a path inside the model repository")


def checked_path(repository: Path, relative: str | PurePath) -> Path:
    """The real path of ``relative`` (a path inside ``repository``), every symlink resolved.

    Refuses absolute paths, ``..`` that climbs out, symlinks (at any depth) whose target is
    outside the repository, and names too long to exist or holding a NUL byte (which no file
    name can; resolving one raises ValueError), all with the same ``outside`` message;
    nothing is opened and the target's existence plays no part.
    """
    path = PurePath(relative)
    if path.is_absolute() or "\0" in str(path) or any(len(os.fsencode(part)) > MAX_NAME_BYTES for part in path.parts):
        raise outside(relative)
    root = repository.resolve()
    try:
        real = (root / path).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise outside(relative) from None
    if not real.is_relative_to(root):
        folder = _linked_model_folder(root, path.parts[0]) if path.parts else None
        if folder is None or not real.is_relative_to(folder):
            raise outside(relative)
    return real


def _linked_model_folder(root: Path, name: str) -> Path | None:
    """The real path of top-level entry ``name`` of repository ``root`` (a real path) when it is a
    symlink to a folder elsewhere (the module docstring's rule); None for any other entry."""
    if not is_safe_model_name(name):
        return None
    entry = root / name
    try:
        if not entry.is_symlink():
            return None
        real = entry.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, a loop, unreadable
        return None
    if real.is_relative_to(root) or root.is_relative_to(real) or not real.is_dir():
        return None  # inside the repository (the usual rule holds), or the repository or a folder above it
    return real


def checked_version_dir(folder: Path, version: int) -> Path:
    """The real path of a version folder of model folder ``folder``, after checking it and every
    entry below it (external weight files, a ``model.onnx/`` folder) with ``checked_path``, through
    symlinked subfolders too: ``1/sub -> ../data`` stays inside, but ``data/w.bin -> /secret`` in it
    must be refused as well (each real folder is walked once, so a symlink loop ends)."""
    relative = PurePath(folder.name, str(version))
    real = checked_path(folder.parent, relative)
    walked = {real}
    pending = [(relative, real)] if real.is_dir() else []
    while pending:
        here, here_real = pending.pop()
        for entry in here_real.iterdir():
            entry_real = checked_path(folder.parent, here / entry.name)
            if entry_real.is_dir() and entry_real not in walked:
                walked.add(entry_real)
                pending.append((here / entry.name, entry_real))
    return real


def relative_name(repository: Path, path: Path) -> str:
    """``path`` as messages name it: relative to the repository where it lies inside."""
    for root in (repository, repository.resolve()):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return path.name


def without_repository_path(repository: Path, text: str) -> str:
    """``text`` with the repository's absolute path taken out, so the files it names read relative;
    a model folder linked from outside (the module docstring's rule) reads as its name."""
    real = repository.resolve()
    if os.sep in text and real.is_dir():
        for entry in real.iterdir():
            folder = _linked_model_folder(real, entry.name) if entry.is_symlink() else None
            if folder is not None:
                text = text.replace(str(folder) + os.sep, entry.name + os.sep).replace(str(folder), entry.name)
    for root in {str(repository.resolve()), str(repository.absolute())}:
        text = text.replace(root + os.sep, "").replace(root, ".")
    return text


def model_dir(repository: Path, name: str) -> Path:
    """The folder of model ``name``, refusing names that could point outside the repository."""
    if not is_safe_model_name(name):
        raise unknown_model(name)
    root = repository.resolve()
    if not _is_model_entry(root, name):
        raise unknown_model(name)
    return root / name


def _is_model_entry(root: Path, name: str) -> bool:
    """Top-level entry ``name`` of ``root`` (a real path) may be a model folder: a folder in the
    repository, or a symlink to one elsewhere (the module docstring's rule)."""
    try:
        real = (root / name).resolve()
    except (OSError, RuntimeError):
        return False
    return real.parent == root or _linked_model_folder(root, name) is not None


def _skip_reason(root: Path, name: str) -> str:
    """Why top-level entry ``name`` of ``root`` (a real path), a folder, is no model folder."""
    if not is_safe_model_name(name):
        return "unsafe name"
    try:
        real = (root / name).resolve()
    except (OSError, RuntimeError):  # changed since it was listed
        return "it cannot be resolved"
    if root.is_relative_to(real):
        return "it links to the repository itself or a folder holding it"
    return "it links to a folder inside the repository below its top level"


def looks_like_model_folder(folder: Path) -> bool:
    """A model folder rather than a repository: it holds a config.pbtxt, or an integer folder
    with a model file in it."""
    if (folder / CONFIG_FILENAME).is_file():
        return True
    return any(
        _VERSION_NAME.match(entry.name) and any((entry / f).exists() for f in _MODEL_FILENAMES)
        for entry in folder.iterdir()
        if entry.is_dir()
    )


def is_version_name(name: str) -> bool:
    """A folder name Triton takes as a version: an integer without leading zeros."""
    return bool(_VERSION_NAME.match(name))


def looks_like_version_folder(folder: Path) -> bool:
    """A version folder of a model (``repo/m/1``): an integer name and a model file in it."""
    return is_version_name(folder.name) and any((folder / f).exists() for f in _MODEL_FILENAMES)


def model_folder_problem(repository: Path) -> str:
    """What to tell an operator who passed a model folder as the repository; "" when it is none."""
    if not looks_like_model_folder(repository):
        return ""
    return (
        f"{repository} is a model folder, not a model repository: pass its parent folder "
        f"({repository.resolve().parent})"
    )


def list_models(repository: Path, warn: bool = True) -> list[str]:
    """Names of the model folders in the repository, sorted; unsafe names are skipped.

    Refuses a model folder given as the repository; warns (unless ``warn`` is off) when the
    repository holds no model folder.
    """
    if not repository.is_dir():
        raise load_failed(f"model repository {repository} is not a folder")
    problem = model_folder_problem(repository)
    if problem:
        raise load_failed(problem)
    names = []
    for entry in sorted(repository.iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        if not is_safe_model_name(entry.name) or not _is_model_entry(repository.resolve(), entry.name):
            logger.warning("skipping model folder %r: %s", entry.name, _skip_reason(repository.resolve(), entry.name))
            continue
        names.append(entry.name)
    if not names and warn:
        logger.warning("model repository %s holds no model folders", repository)
    return names


def list_versions(folder: Path, warn: bool = True) -> list[int]:
    """Integer version folders of a model; others are skipped (with a warning unless ``warn`` is off).

    ``folder`` is a model folder in a repository (its parent); a version folder that leads
    outside the repository refuses the model.
    """
    repository = folder.parent
    versions = []
    for entry in sorted(folder.iterdir()):
        if _VERSION_NAME.match(entry.name):
            if checked_path(repository, PurePath(folder.name, entry.name)).is_dir():
                versions.append(int(entry.name))
        elif not warn or not entry.is_dir():
            continue
        elif entry.name.isdigit():
            logger.warning("model %s: skipping version folder %r (zero-padded)", folder.name, entry.name)
        elif entry.name not in {"configs", "tuning", "__pycache__"}:  # tuning/: `shoal config tune` output
            logger.warning("model %s: skipping folder %r (not an integer version)", folder.name, entry.name)
    return sorted(versions)

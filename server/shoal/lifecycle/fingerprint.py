"""What a reload compares to tell what changed in a model folder: its config file and each version
folder, digested apart, so that a version whose own files did not change can keep serving."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from shoal.errors import ShoalError
from shoal.repository import scanner
from shoal.repository.config import CONFIG_FILENAME

# What a model's versions never read: Python's bytecode caches (at any depth), and at the model folder's
# top `shoal config tune`'s output (its candidates' folder, its tuned config).
BYTECODE = "__pycache__"
NOT_READ = frozenset({BYTECODE, "tuning", "config.tuned.pbtxt"})


@dataclass(frozen=True)
class Fingerprint:
    """Digests of config.pbtxt, of each version folder (its real path, its files' names and what their
    status says of their contents), and of the model folder's other files (``initial_state/``,
    ``warmup/``...), which every version reads."""

    config: str
    versions: tuple[tuple[int, str], ...]
    others: str = ""

    def version(self, number: int) -> str | None:
        """The digest of version folder ``number``; None where there is no such folder."""
        return dict(self.versions).get(number)


def fingerprint_of(folder: Path) -> Fingerprint:
    """Changes when config.pbtxt, a version folder or a file in one, or another file of the model
    folder changes (poll mode; a reload keeps a version only if its folder and the others are the same).

    Every path is checked first; a file whose real path is outside the repository counts by name only.
    A version folder's digest holds its own real path and its files': a link retargeted to another
    folder is a change even where that folder's files have the same names, sizes and mtimes (an
    image or archive that normalizes timestamps). A file counts by its device and inode besides its
    size and mtime: a file replaced by another of the same size and mtime (``rsync -a``, ``mv``, a
    reproducible archive unpacked) is a change (it kept the old weights serving). Not its change time,
    which a ``chmod`` or a hard link (``shoal config tune`` links the model's files) moves with nothing
    changed; so a file overwritten in place with the same size and mtime is not seen, as in Triton,
    which reads mtimes only. A file that vanished or a dangling link (an editor's lock file) counts as
    missing, never as an error (it stopped the server at start).
    """
    repository = folder.parent
    config = scanner.checked_path(repository, PurePath(folder.name, CONFIG_FILENAME))
    config_digest = hashlib.sha256(config.read_bytes() if config.is_file() else b"").hexdigest()
    versions = []
    numbers = scanner.list_versions(folder, warn=False) if folder.is_dir() else []
    for version in numbers:
        digest = hashlib.sha256()
        version_dir = scanner.checked_path(repository, PurePath(folder.name, str(version)))
        digest.update(str(version_dir).encode())
        _digest_files(digest, repository, PurePath(folder.name, str(version)), _tree(version_dir), version_dir)
        versions.append((version, digest.hexdigest()))
    others = hashlib.sha256()
    skipped = {CONFIG_FILENAME, *NOT_READ, *(str(number) for number in numbers)}
    if folder.is_dir():
        for entry in sorted(folder.iterdir()):
            if entry.name in skipped:
                continue
            inside = _tree(entry) if entry.is_dir() and not entry.is_symlink() else []
            _digest_files(others, repository, PurePath(folder.name), [entry, *inside], folder)
    return Fingerprint(config_digest, tuple(versions), others.hexdigest())


def _tree(folder: Path) -> list[Path]:
    """Every path under ``folder``, sorted, bytecode caches left out."""
    return sorted(path for path in folder.rglob("*") if BYTECODE not in path.relative_to(folder).parts)


def _digest_files(digest: Any, repository: Path, under: PurePath, paths: list[Path], root: Path) -> None:
    """Each path's name (relative to ``root``, the folder ``under`` names in the repository) and status."""
    for path in paths:
        relative = path.relative_to(root)
        try:
            real = scanner.checked_path(repository, under / relative)
        except ShoalError:
            digest.update(f"|{relative}:outside".encode())
            continue
        try:
            found = os.stat(real)
        except OSError:  # gone since it was listed, or a dangling link
            digest.update(f"|{relative}:missing".encode())
            continue
        digest.update(f"|{relative}:{real}:{found.st_size}:{found.st_mtime_ns}:{found.st_dev}:{found.st_ino}".encode())


def fingerprint_or_none(folder: Path) -> Fingerprint | None:
    """The fingerprint, or None where a path leads outside the repository (the load says which) or the
    folder changed under the walk (the next poll looks again)."""
    try:
        return fingerprint_of(folder)
    except (ShoalError, OSError):
        return None

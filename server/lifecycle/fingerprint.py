"""What poll mode compares to tell a changed model folder: a digest of its config and version files."""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePath

from shoal.errors import ShoalError
from shoal.repository import scanner
from shoal.repository.config import CONFIG_FILENAME


def fingerprint_of(folder: Path) -> str:
    """Changes when config.pbtxt, a version folder or a file in one changes (poll mode).

    Every path is checked first; a file whose real path is outside the repository counts by name only.
    """
    repository = folder.parent
    digest = hashlib.sha256()
    config = scanner.checked_path(repository, PurePath(folder.name, CONFIG_FILENAME))
    digest.update(config.read_bytes() if config.is_file() else b"")
    for version in scanner.list_versions(folder, warn=False) if folder.is_dir() else []:
        digest.update(f"|{version}".encode())
        version_dir = scanner.checked_path(repository, PurePath(folder.name, str(version)))
        for path in sorted(version_dir.rglob("*")):
            relative = path.relative_to(version_dir)
            try:
                real = scanner.checked_path(repository, PurePath(folder.name, str(version), relative))
            except ShoalError:
                digest.update(f"|{version}/{relative}:outside".encode())
                continue
            stat = real.stat()
            digest.update(f"|{version}/{relative}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def fingerprint_or_empty(folder: Path) -> str:
    """The fingerprint, or ``""`` where a path leads outside the repository (the load says which)."""
    try:
        return fingerprint_of(folder)
    except ShoalError:
        return ""

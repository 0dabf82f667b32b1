"""What a reload compares to tell what changed in a model folder: its config file and each version
folder, digested apart, so that a version whose own files did not change can keep serving."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path, PurePath

from shoal.errors import ShoalError
from shoal.repository import scanner
from shoal.repository.config import CONFIG_FILENAME


@dataclass(frozen=True)
class Fingerprint:
    """Digests of config.pbtxt and of each version folder (its real path, its files' names, sizes and mtimes)."""

    config: str
    versions: tuple[tuple[int, str], ...]

    def version(self, number: int) -> str | None:
        """The digest of version folder ``number``; None where there is no such folder."""
        return dict(self.versions).get(number)


def fingerprint_of(folder: Path) -> Fingerprint:
    """Changes when config.pbtxt, a version folder or a file in one changes (poll mode).

    Every path is checked first; a file whose real path is outside the repository counts by name only.
    A version folder's digest holds its own real path and its files': a link retargeted to another
    folder is a change even where that folder's files have the same names, sizes and mtimes (an
    image or archive that normalizes timestamps).
    """
    repository = folder.parent
    config = scanner.checked_path(repository, PurePath(folder.name, CONFIG_FILENAME))
    config_digest = hashlib.sha256(config.read_bytes() if config.is_file() else b"").hexdigest()
    versions = []
    for version in scanner.list_versions(folder, warn=False) if folder.is_dir() else []:
        digest = hashlib.sha256()
        version_dir = scanner.checked_path(repository, PurePath(folder.name, str(version)))
        digest.update(str(version_dir).encode())
        for path in sorted(version_dir.rglob("*")):
            relative = path.relative_to(version_dir)
            try:
                real = scanner.checked_path(repository, PurePath(folder.name, str(version), relative))
            except ShoalError:
                digest.update(f"|{relative}:outside".encode())
                continue
            stat = real.stat()
            digest.update(f"|{relative}:{real}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        versions.append((version, digest.hexdigest()))
    return Fingerprint(config_digest, tuple(versions))


def fingerprint_or_none(folder: Path) -> Fingerprint | None:
    """The fingerprint, or None where a path leads outside the repository (the load says which)."""
    try:
        return fingerprint_of(folder)
    except ShoalError:
        return None

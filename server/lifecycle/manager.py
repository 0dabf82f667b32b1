"""The registry of models: load the repository, track each version's state, resolve requests.

Control mode ``none`` (Triton's default): every model in the repository is loaded at
start and stays. A model whose config or file is broken is UNAVAILABLE with its reason;
the others load and serve.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from server.errors import ErrorCode, ShoalError, unknown_model
from server.lifecycle.configure import configure
from server.lifecycle.model import ModelVersion
from server.lifecycle.state import ModelState
from server.repository import scanner
from server.repository.config import ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class VersionEntry:
    version: int
    state: ModelState
    reason: str = ""
    served: ModelVersion | None = None


@dataclass
class ModelEntry:
    name: str
    spec: ModelSpec | None
    state: ModelState
    reason: str = ""
    versions: dict[int, VersionEntry] = field(default_factory=dict)

    def ready_versions(self) -> list[int]:
        return sorted(v for v, e in self.versions.items() if e.state is ModelState.READY)


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: ModelState
    reason: str


class ModelManager:
    def __init__(self, repository: Path, strict_model_config: bool = False) -> None:
        self.repository = repository
        self.strict_model_config = strict_model_config
        self._models: dict[str, ModelEntry] = {}

    def load_all(self) -> None:
        """Load every model in the repository; failures are recorded, never raised."""
        for name in scanner.list_models(self.repository):
            self._models[name] = self._load_model(name)

    def _load_model(self, name: str) -> ModelEntry:
        folder = scanner.model_dir(self.repository, name)
        try:
            spec = configure(folder, self.strict_model_config).spec
        except ShoalError as exc:
            logger.error("model %s: %s", name, exc.message)
            return ModelEntry(name, None, ModelState.UNAVAILABLE, exc.message)
        available = scanner.list_versions(folder)
        chosen = spec.version_policy.select(available)
        if not chosen:
            reason = f"model '{name}': no version folder matches the version policy (found {available})"
            logger.error(reason)
            return ModelEntry(name, spec, ModelState.UNAVAILABLE, reason)
        entry = ModelEntry(name, spec, ModelState.READY)
        for version in chosen:
            entry.versions[version] = self._load_version(spec, version, folder / str(version))
        if not entry.ready_versions():
            entry.state = ModelState.UNAVAILABLE
            entry.reason = "; ".join(e.reason for e in entry.versions.values())
        return entry

    @staticmethod
    def _load_version(spec: ModelSpec, version: int, folder: Path) -> VersionEntry:
        try:
            served = ModelVersion.load(spec, version, folder)
        except ShoalError as exc:
            logger.error("model %s version %d: %s", spec.name, version, exc.message)
            return VersionEntry(version, ModelState.UNAVAILABLE, exc.message)
        except Exception as exc:  # a backend bug must not take the other models down
            logger.exception("model %s version %d: unexpected load failure", spec.name, version)
            return VersionEntry(version, ModelState.UNAVAILABLE, f"unexpected load failure: {exc}")
        return VersionEntry(version, ModelState.READY, served=served)

    # -- queries ---------------------------------------------------------------------------------

    def entry(self, name: str) -> ModelEntry:
        model = self._models.get(name)
        if model is None:
            raise unknown_model(name)
        return model

    def resolve(self, name: str, version: str) -> ModelVersion:
        """The version to serve: ``""`` means the highest READY one, as Triton."""
        model = self.entry(name)
        if not version:
            ready = model.ready_versions()
            if not ready:
                raise ShoalError(
                    ErrorCode.UNAVAILABLE, f"model '{name}' has no available versions: {model.reason}"
                )
            chosen = model.versions[ready[-1]]
        else:
            number = int(version) if version.isdigit() else None
            found = model.versions.get(number) if number is not None else None
            if found is None:
                raise unknown_model(name, version)
            chosen = found
        if chosen.served is None:
            raise ShoalError(
                ErrorCode.UNAVAILABLE,
                f"model '{name}' version {chosen.version} is not ready: {chosen.reason}",
            )
        return chosen.served

    def is_ready(self, name: str, version: str) -> bool:
        try:
            self.resolve(name, version)
        except ShoalError:
            return False
        return True

    def all_ready(self) -> bool:
        return all(m.state is ModelState.READY for m in self._models.values())

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        rows = []
        for model in sorted(self._models.values(), key=lambda m: m.name):
            if not model.versions:
                rows.append(IndexEntry(model.name, "", model.state, model.reason))
            for version in sorted(model.versions.values(), key=lambda v: v.version):
                rows.append(IndexEntry(model.name, str(version.version), version.state, version.reason))
        return [r for r in rows if not ready_only or r.state is ModelState.READY]

    def statistics(self, name: str, version: str) -> list[ModelVersion]:
        """Versions to report: every ready version of every model for name ``""``, as Triton."""
        if not name:
            return [e.served for m in self._models.values() for e in m.versions.values() if e.served]
        if version:
            return [self.resolve(name, version)]
        model = self.entry(name)
        return [e.served for e in model.versions.values() if e.served]

    async def close(self) -> None:
        for model in self._models.values():
            for version in model.versions.values():
                if version.served is not None:
                    await version.served.close()
                    version.served = None
                    version.state = ModelState.UNAVAILABLE
                    version.reason = "unloaded"

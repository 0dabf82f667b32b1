"""The registry of models: load, reload and unload without dropping a request; resolve requests.

Control modes, as Triton's: ``none`` loads every model at start and never changes; ``poll``
also rescans the repository every ``poll_secs`` (added, removed and changed models);
``explicit`` loads only the ``startup_models`` and then what RepositoryModelLoad asks.

A (re)load builds the new entry off the event loop (load, then warm up every copy) while
the old one keeps serving; the registry then swaps in one assignment on the event loop,
and the old entry drains (its queued and running requests finish) before its weights are
freed. A request resolves its version and enqueues without yielding to the loop in
between, so it lands either on the old entry before its drain starts, or on the new one.
A failed reload leaves the old entry serving and records the reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from google.protobuf import json_format

from shoal.errors import ErrorCode, ShoalError, invalid, unknown_model
from shoal.lifecycle.budgets import LoadBudget, MemoryLedger
from shoal.lifecycle.configure import configure, model_file
from shoal.lifecycle.model import ModelVersion, placements
from shoal.lifecycle.state import ModelState
from shoal.protocol import config_pb2
from shoal.repository import scanner
from shoal.repository.config import CONFIG_FILENAME, ModelSpec

logger = logging.getLogger(__name__)

CONTROL_MODES = ("none", "poll", "explicit")
# A requested version: ASCII digits only ('²' is a digit to str.isdigit, not to int).
_VERSION = re.compile(r"^[0-9]{1,18}$")


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
    fingerprint: str = ""

    def ready_versions(self) -> list[int]:
        return sorted(v for v, e in self.versions.items() if e.state is ModelState.READY)


@dataclass(frozen=True)
class IndexEntry:
    name: str
    version: str
    state: ModelState | None  # None: in the repository, never loaded
    reason: str


class ModelManager:
    def __init__(
        self,
        repository: Path,
        strict_model_config: bool = False,
        control_mode: str = "none",
        on_change: Callable[[], None] | None = None,
        memory_budgets: dict[str, int] | None = None,
    ) -> None:
        if control_mode not in CONTROL_MODES:
            raise ValueError(f"control mode must be one of {CONTROL_MODES}")
        self.repository = repository
        self.strict_model_config = strict_model_config
        self.control_mode = control_mode
        self.on_change = on_change
        # Device ("cpu", "gpu:0") -> bytes all loaded models together may hold there.
        self.memory_budgets = memory_budgets or {}
        self._ledger = MemoryLedger(self.memory_budgets, self.memory_in_use)
        self._models: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- loading -------------------------------------------------------------------------------------

    async def start(self, startup_models: tuple[str, ...] = ()) -> None:
        """Load what the control mode says to load at start."""
        if self.control_mode == "explicit" and "*" not in startup_models:
            names = list(startup_models)
        else:
            names = scanner.list_models(self.repository)
        for name in names:
            try:
                await self.load(name)
            except ShoalError as exc:
                logger.error("model %s: %s", name, exc.message)

    async def load(self, name: str, config_override: str | None = None) -> None:
        """Load or reload ``name``; ``config_override`` is a ModelConfig as JSON (RepositoryModelLoad)."""
        folder = scanner.model_dir(self.repository, name)
        if not folder.is_dir():
            raise ShoalError(ErrorCode.UNAVAILABLE, f"failed to load '{name}': no such model folder in the repository")
        base = _parse_override(name, config_override) if config_override else None
        async with self._locks.setdefault(name, asyncio.Lock()):
            old = self._models.get(name)
            if old is None or not old.ready_versions():  # nothing serving: the index shows LOADING
                self._models[name] = ModelEntry(name, None, ModelState.LOADING)
            try:
                entry, reserved = await asyncio.to_thread(self._build_entry, name, folder, base)
            except BaseException:
                if old is not None:
                    self._models[name] = old
                else:
                    self._models.pop(name, None)
                raise
            if not entry.ready_versions():
                self._ledger.release(reserved)
                if old is not None and old.ready_versions():
                    old.reason = f"reload failed, previous version kept serving: {entry.reason}"
                    self._changed()
                    raise ShoalError(ErrorCode.UNAVAILABLE, f"failed to load '{name}': {entry.reason}")
                self._models[name] = entry
                self._changed()
                if old is not None:
                    await self._retire(old)
                raise ShoalError(ErrorCode.UNAVAILABLE, f"failed to load '{name}': {entry.reason}")
            with self._ledger.settling(reserved):  # the entry's bytes now count as in use, not reserved
                self._models[name] = entry  # the switch: one assignment on the event loop
            self._changed()
            if old is not None:
                await self._retire(old)

    async def unload(self, name: str) -> None:
        """Stop routing to ``name``, let its queued and running requests finish, free the weights."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            old = self._models.get(name)
            if old is None or old.spec is None and not old.versions:
                raise ShoalError(ErrorCode.UNAVAILABLE, f"failed to unload '{name}': the model is not loaded")
            self._models[name] = ModelEntry(name, old.spec, ModelState.UNAVAILABLE, "unloaded")
            self._changed()
            await self._retire(old)

    def memory_in_use(self) -> dict[str, int]:
        """Bytes the loaded versions hold, per device (also read from load threads: copies first)."""
        used: dict[str, int] = {}
        for model in list(self._models.values()):
            for version in list(model.versions.values()):
                served = version.served
                if served is not None:
                    for device, byte_size in served.memory_bytes.items():
                        used[str(device)] = used.get(str(device), 0) + byte_size
        return used

    def _build_entry(
        self, name: str, folder: Path, base: config_pb2.ModelConfig | None
    ) -> tuple[ModelEntry, dict[str, int]]:
        """Runs in a worker thread: configure, load and warm every version the policy selects.

        Returns the entry and the memory it reserved in the ledger (the caller ends the reservation)."""
        try:
            fingerprint = fingerprint_of(folder)
        except ShoalError:
            fingerprint = ""  # a path leads outside: configure says which
        try:
            spec = configure(folder, self.strict_model_config, base=base).spec
            available = scanner.list_versions(folder, warn=False)
        except ShoalError as exc:
            return ModelEntry(name, None, ModelState.UNAVAILABLE, exc.message, fingerprint=fingerprint), {}
        chosen = spec.version_policy.select(available)
        if not chosen:
            reason = f"model '{name}': no version folder matches the version policy (found {available})"
            return ModelEntry(name, spec, ModelState.UNAVAILABLE, reason, fingerprint=fingerprint), {}
        entry = ModelEntry(name, spec, ModelState.READY, fingerprint=fingerprint)
        budget = LoadBudget(self._ledger, spec, {str(d) for d in _devices(spec)})
        try:
            for version in chosen:
                loaded = self._load_within_budget(spec, folder, version, budget)
                loaded.reason = scanner.without_repository_path(self.repository, loaded.reason)
                entry.versions[version] = loaded
        except BaseException:
            self._ledger.release(budget.reserved)
            raise
        if not entry.ready_versions():
            entry.state = ModelState.UNAVAILABLE
            entry.reason = "; ".join(e.reason for e in entry.versions.values())
        return entry, budget.reserved

    @staticmethod
    def _load_within_budget(spec: ModelSpec, folder: Path, version: int, budget: LoadBudget) -> VersionEntry:
        try:  # every path checked before anything is opened or stat'ed
            version_dir = scanner.checked_version_dir(folder, version)
            path = model_file(spec.default_model_filename, folder, version)
        except ShoalError as exc:
            return VersionEntry(version, ModelState.UNAVAILABLE, exc.message)
        refusal = budget.refuse_before(path)
        if refusal:
            return VersionEntry(version, ModelState.UNAVAILABLE, refusal)
        loaded = _load_version(spec, version, version_dir)
        if loaded.served is None:
            budget.forget_estimate()
            return loaded
        refusal = budget.refuse_after({str(d): b for d, b in loaded.served.memory_bytes.items()})
        if refusal:
            loaded.served.pool.close()
            return VersionEntry(version, ModelState.UNAVAILABLE, refusal)
        return loaded

    async def _retire(self, entry: ModelEntry) -> None:
        for version in entry.versions.values():
            if version.served is not None:
                served, version.served = version.served, None
                version.state = ModelState.UNLOADING
                await served.close()
                version.state = ModelState.UNAVAILABLE
                version.reason = "unloaded"
        logger.info("model %s: previous instance drained and unloaded", entry.name)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- polling -------------------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Pick up added, removed and changed model folders (poll mode)."""
        present = set(scanner.list_models(self.repository, warn=False))
        for name in sorted(present):
            entry = self._models.get(name)
            try:
                fingerprint = fingerprint_of(self.repository / name)
            except ShoalError:
                fingerprint = ""  # a path that leads outside: the load says so
            changed = entry is None or fingerprint != entry.fingerprint
            if changed:
                logger.info("model %s: %s, loading", name, "new" if entry is None else "changed")
                try:
                    await self.load(name)
                except ShoalError as exc:
                    logger.error("model %s: %s", name, exc.message)
        for name in sorted(set(self._models) - present):
            if self._models[name].versions:
                logger.info("model %s: folder removed, unloading", name)
                await self.unload(name)
            del self._models[name]
            self._changed()

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.poll_once()
            except ShoalError as exc:  # e.g. the repository now looks like a model folder
                logger.error("repository poll: %s", exc.message)
            except Exception:  # noqa: BLE001 - a bad scan must not stop polling
                logger.exception("repository poll failed")

    # -- queries -------------------------------------------------------------------------------------

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
                raise ShoalError(ErrorCode.UNAVAILABLE, f"model '{name}' has no available versions: {model.reason}")
            chosen = model.versions[ready[-1]]
        else:
            number = int(version) if _VERSION.match(version) else None
            found = model.versions.get(number) if number is not None else None
            if found is None:
                raise unknown_model(name, version)
            chosen = found
        if chosen.served is None:
            raise ShoalError(
                ErrorCode.UNAVAILABLE, f"model '{name}' version {chosen.version} is not ready: {chosen.reason}"
            )
        return chosen.served

    def is_ready(self, name: str, version: str) -> bool:
        try:
            served = self.resolve(name, version)
        except ShoalError:
            return False
        return served.can_serve()

    def names(self) -> list[str]:
        return sorted(self._models)

    def all_ready(self) -> bool:
        return all(m.state is ModelState.READY for m in self._models.values() if m.reason != "unloaded")

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        rows = []
        for model in sorted(self._models.values(), key=lambda m: m.name):
            if not model.versions:
                rows.append(IndexEntry(model.name, "", model.state, model.reason))
            for version in sorted(model.versions.values(), key=lambda v: v.version):
                reason = version.reason or (model.reason if version.state is ModelState.READY else "")
                rows.append(IndexEntry(model.name, str(version.version), version.state, reason))
        if not ready_only and self.control_mode == "explicit":
            loaded = set(self._models)
            rows += [IndexEntry(n, "", None, "") for n in scanner.list_models(self.repository, warn=False)
                     if n not in loaded]
            rows.sort(key=lambda r: r.name)
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
        """Drain and unload everything (shutdown)."""
        for entry in list(self._models.values()):
            await self._retire(entry)


def _devices(spec: ModelSpec) -> set[Any]:
    try:
        return {p.device for p in placements(spec)}
    except ShoalError:
        return set()


def _load_version(spec: ModelSpec, version: int, folder: Path) -> VersionEntry:
    try:
        served = ModelVersion.load(spec, version, folder)
    except ShoalError as exc:
        logger.error("model %s version %d: %s", spec.name, version, exc.message)
        return VersionEntry(version, ModelState.UNAVAILABLE, exc.message)
    except Exception as exc:  # a backend bug must not take the other models down
        logger.exception("model %s version %d: unexpected load failure", spec.name, version)
        return VersionEntry(version, ModelState.UNAVAILABLE, f"unexpected load failure: {exc}")
    try:
        served.warm_up()
    except Exception as exc:  # noqa: BLE001 - zeros may be no valid input; real requests decide
        logger.warning("model %s version %d: warm-up with zero inputs failed: %s", spec.name, version, exc)
    return VersionEntry(version, ModelState.READY, served=served)


def _parse_override(name: str, text: str) -> config_pb2.ModelConfig:
    """A load's ``config`` parameter: a whole ModelConfig as a JSON object, replacing config.pbtxt."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise invalid(f"failed to load '{name}': the config parameter is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise invalid(f"failed to load '{name}': the config parameter must be a JSON object (a ModelConfig), "
                      f"got a JSON {type(document).__name__}")
    try:
        config = json_format.ParseDict(document, config_pb2.ModelConfig())
    except json_format.ParseError as exc:
        raise invalid(f"failed to load '{name}': the config parameter is not a valid ModelConfig: {exc}") from None
    if config.name and config.name != name:
        raise invalid(f"failed to load '{name}': the config override names model '{config.name}'")
    return config


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

"""From a model folder to a ``ModelSpec``: the one pipeline the server, ``shoal config check``
and ``shoal config generate`` share.

read config.pbtxt (optional unless strict) → backend fields from the model file → auto-complete
from the model file when inputs or outputs are missing (not in strict mode) → normalize →
validate → labels → spec. Every file is reached through ``scanner.checked_path`` (nothing outside the
repository is opened) and messages name files relative to the repository.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from google.protobuf import json_format

from shoal.backends.base import check_own_model_file, complete_own_config, describe_model, resolve_kind
from shoal.backends.devices import cuda_device_count
from shoal.errors import MAX_ECHO_CHARS, ShoalError, invalid, load_failed, shown
from shoal.protocol import config_pb2, wire_names
from shoal.repository import ensemble_config, scanner, unhonoured
from shoal.repository.config import (
    CONFIG_FILENAME,
    DEFAULT_MODEL_FILENAMES,
    InstanceGroupSpec,
    InstanceKind,
    ModelSpec,
    detect_backend,
    normalize,
    nul_in_file_names,
    read_config,
    read_labels,
    to_spec,
    validate_filename,
)
from shoal.repository.config import validate as validate_config
from shoal.repository.model_io import ModelIO, check_io, complete
from shoal.repository.sequence_spec import backend_spec


@dataclass
class Configured:
    spec: ModelSpec
    config: config_pb2.ModelConfig  # the completed, normalized config
    reasons: dict[str, str] = field(default_factory=dict)  # field → why auto-complete chose it
    completed: bool = False  # whether anything came from the model file
    warnings: tuple[str, ...] = ()  # fields set that Shoal does not honour and that cannot change an answer


def model_file(filename: str, folder: Path, version: int) -> Path:
    """The checked real path of a version's model file (the version folder itself without a file name)."""
    parts = (str(version), filename) if filename else (str(version),)
    return scanner.checked_path(folder.parent, PurePath(folder.name, *parts))


@dataclass(frozen=True)
class ConfigOverride:
    """A load's ``config`` parameter: a whole ModelConfig that replaces config.pbtxt, checked at once."""

    config: config_pb2.ModelConfig

    @classmethod
    def parse(cls, name: str, document: dict[str, Any]) -> ConfigOverride:
        """``document`` is the JSON object the transport decoded (INVALID_ARGUMENT if it is no ModelConfig)."""
        try:
            config = json_format.ParseDict(document, config_pb2.ModelConfig())
        except json_format.ParseError as exc:
            raise invalid(
                f"failed to load '{shown(name)}': the config parameter is not a valid ModelConfig: "
                f"{_shortened(wire_names(str(exc)), document)}"
            ) from None
        if config.name and config.name != name:
            raise invalid(f"failed to load '{shown(name)}': the config override names model '{shown(config.name)}'")
        problem = nul_in_file_names(config)
        if problem is not None:
            raise invalid(f"failed to load '{shown(name)}': {problem}")
        return cls(config)


def _shortened(text: str, document: Any) -> str:
    """``text`` (an error about ``document``) with each long key or string of the document in it shortened."""
    long_strings: set[str] = set()
    pending = [document]
    while pending:  # a walk, not recursion: the client chose the depth
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
            pending.extend(item.keys())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str) and len(item) > MAX_ECHO_CHARS:
            long_strings.add(item)
    for value in sorted(long_strings, key=len, reverse=True):
        if value in text:
            text = text.replace(value, shown(value))
    return text


def configure(folder: Path, strict: bool, base: config_pb2.ModelConfig | None = None) -> Configured:
    """The spec for ``folder`` (a model folder; its parent is the repository); ``base`` replaces
    config.pbtxt (the generator passes overrides). Messages name files relative to the repository."""
    folder = Path(os.path.abspath(folder))  # "." names its folder; symlinks stay for checked_path
    try:
        return _configure(folder, strict, base)
    except ShoalError as exc:
        raise ShoalError(exc.code, scanner.without_repository_path(folder.parent, exc.message)) from None


def _configure(folder: Path, strict: bool, base: config_pb2.ModelConfig | None) -> Configured:
    name = folder.name
    if base is not None:
        config = config_pb2.ModelConfig()
        config.CopyFrom(base)
    elif strict or scanner.checked_path(folder.parent, PurePath(name, CONFIG_FILENAME)).is_file():
        config = read_config(folder)  # in strict mode a missing file is an error
    else:
        config = config_pb2.ModelConfig()
    if not config.name:
        config.name = name
    validate_filename(config, name)  # before any file is looked for under that name
    versions = [folder / str(v) for v in scanner.list_versions(folder)]
    detect_backend(config, versions)
    reasons: dict[str, str] = {}
    completed = False
    if not strict and (own := complete_own_config(config, folder)) is not None:  # a Python model's own, as Triton
        config = own
    if not (config.input and config.output) and not ensemble_config.is_ensemble(config):  # no model file to ask
        if strict:
            raise load_failed(
                f"model '{name}': config lists no {'inputs' if not config.input else 'outputs'} and "
                "--strict-model-config is on, so Shoal does not complete it from the model file"
            )
        config, reasons = complete(config, describe(config, folder))
        completed = True
    warnings = refuse_or_warn_unhonoured(config, name)  # what the user's config (or auto-complete) set, before defaults
    config = normalize(config, name, auto_kind=auto_kind)
    validate_config(config, name)
    return Configured(to_spec(config, read_labels(folder, config)), config, reasons, completed, warnings)


def refuse_or_warn_unhonoured(config: config_pb2.ModelConfig, name: str) -> tuple[str, ...]:
    """Refuse the first field set that Shoal does not honour and that could change an answer; the
    messages for the rest (``repository/unhonoured.py`` says which is which)."""
    found = unhonoured.findings(config)
    for finding in found:
        if finding.treatment is unhonoured.Treatment.REFUSED:
            raise load_failed(finding.message(name))
    return tuple(finding.message(name) for finding in found)


def auto_kind(backend: str, group: config_pb2.ModelInstanceGroup) -> int:
    """The kind a KIND_AUTO group resolves to on this host (as placement will resolve it), so that
    its default instance count is Triton's for that kind (normalize)."""
    spec = InstanceGroupSpec(group.name, InstanceKind.AUTO, group.count, tuple(group.gpus))
    kind = resolve_kind(backend, spec, cuda_device_count())
    value: int = config_pb2.ModelInstanceGroup.Kind.Value(kind.value)
    return value


def describe(config: config_pb2.ModelConfig, folder: Path) -> ModelIO:
    """What the newest version's model file declares."""
    if not config.backend:
        raise load_failed(f"model '{config.name}': no platform or backend set, and no model file to tell")
    versions = scanner.list_versions(folder, warn=False)
    if not versions:
        raise load_failed(f"model '{config.name}': no version folder to read the model file from")
    filename = config.default_model_filename or DEFAULT_MODEL_FILENAMES.get(config.backend, "")
    label = PurePath(folder.name, str(versions[-1]), filename)
    scanner.checked_version_dir(folder, versions[-1])  # the model file may name others beside it
    return describe_model(config.backend, scanner.checked_path(folder.parent, label), str(label))


def check_against_model(configured: Configured, folder: Path) -> None:
    """Every version's model file against the config (what the backend checks at load)."""
    spec = configured.spec
    if spec.ensemble is not None:  # no model file: its steps are checked against the composing models at load
        return
    folder = Path(os.path.abspath(folder))
    for version in spec.version_policy.select(scanner.list_versions(folder)):
        scanner.checked_version_dir(folder, version)
        path = model_file(configured.config.default_model_filename, folder, version)
        label = scanner.relative_name(folder.parent, path)
        if check_own_model_file(spec.backend, path, str(label)):  # a model.py: imported, as an instance does
            continue
        check_io(backend_spec(spec), describe_model(spec.backend, path, label))

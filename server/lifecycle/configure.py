"""From a model folder to a ``ModelSpec``: the one pipeline the server, ``shoal config check``
and ``shoal config generate`` share.

read config.pbtxt (optional unless strict) → backend fields from the model file → auto-complete
from the model file when inputs or outputs are missing (not in strict mode) → normalize →
validate → spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from server.backends.base import describe_model
from server.errors import load_failed
from server.pb import config_pb2
from server.repository import scanner
from server.repository.config import (
    CONFIG_FILENAME,
    DEFAULT_MODEL_FILENAMES,
    ModelSpec,
    detect_backend,
    normalize,
    read_config,
    to_spec,
)
from server.repository.config import validate as validate_config
from server.repository.model_io import ModelIO, check_io, complete


@dataclass
class Configured:
    spec: ModelSpec
    config: config_pb2.ModelConfig  # the completed, normalized config
    reasons: dict[str, str] = field(default_factory=dict)  # field → why auto-complete chose it
    completed: bool = False  # whether anything came from the model file


def model_file(config: config_pb2.ModelConfig, version_dir: Path) -> Path:
    return version_dir / config.default_model_filename if config.default_model_filename else version_dir


def configure(folder: Path, strict: bool, base: config_pb2.ModelConfig | None = None) -> Configured:
    """The spec for ``folder``; ``base`` replaces config.pbtxt (the generator passes overrides)."""
    name = folder.name
    if base is not None:
        config = config_pb2.ModelConfig()
        config.CopyFrom(base)
    elif (folder / CONFIG_FILENAME).is_file() or strict:
        config = read_config(folder)  # in strict mode a missing file is an error, with its path
    else:
        config = config_pb2.ModelConfig()
    if not config.name:
        config.name = name
    versions = [folder / str(v) for v in scanner.list_versions(folder)]
    detect_backend(config, versions)
    reasons: dict[str, str] = {}
    completed = False
    if not (config.input and config.output):
        if strict:
            raise load_failed(
                f"model '{name}': config lists no {'inputs' if not config.input else 'outputs'} and "
                "--strict-model-config is on, so Shoal does not complete it from the model file"
            )
        config, reasons = complete(config, describe(config, versions))
        completed = True
    config = normalize(config, name)
    validate_config(config, name)
    return Configured(to_spec(config), config, reasons, completed)


def describe(config: config_pb2.ModelConfig, versions: list[Path]) -> ModelIO:
    """What the newest version's model file declares."""
    if not config.backend:
        raise load_failed(f"model '{config.name}': no platform or backend set, and no model file to tell")
    if not versions:
        raise load_failed(f"model '{config.name}': no version folder to read the model file from")
    filename = config.default_model_filename or DEFAULT_MODEL_FILENAMES.get(config.backend, "")
    return describe_model(config.backend, versions[-1] / filename)


def check_against_model(configured: Configured, folder: Path) -> None:
    """Every version's model file against the config (what the backend checks at load)."""
    spec = configured.spec
    for version in spec.version_policy.select(scanner.list_versions(folder)):
        path = model_file(configured.config, folder / str(version))
        check_io(spec, describe_model(spec.backend, path))

"""The backend contract and the one place that picks a backend by name.

A backend module exposes ``load(spec, model_path, device, threads) -> LoadedModel`` and
``gpu_available() -> bool`` (whether it can run a model on a CUDA device here). ``load`` checks
the config against the model file and refuses to load on a mismatch, naming the
tensor. A ``LoadedModel`` holds one copy of the weights on one device; its ``run``
is called concurrently by every executor of that device, so it must be thread-safe.
Heavy libraries (onnxruntime, torch) are imported by their backend module alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from shoal.backends.devices import Device
from shoal.errors import load_failed
from shoal.protocol.types import DataType
from shoal.repository.config import ModelSpec
from shoal.repository.model_io import ModelIO

_BACKEND_MODULES = {
    "onnxruntime": "shoal.backends.onnxruntime",
    "identity": "shoal.backends.identity",
    "pytorch": "shoal.backends.pytorch",
}


class LoadedModel(Protocol):
    # Bytes of weights this copy holds on its device: counted where the framework can (PyTorch:
    # parameters and buffers), else the model file's size, which the weights dominate (ONNX).
    weight_bytes: int

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Execute one batch: config-named inputs in, the requested config-named outputs back."""
        ...

    def close(self) -> None:
        """Release the weights."""
        ...


def supported_backends() -> list[str]:
    return sorted(_BACKEND_MODULES)


def backend_gpu_available(backend: str) -> bool:
    """Whether ``backend`` can run a model on a CUDA device in this process (resolves KIND_AUTO).

    An unknown backend answers False; its load fails with the unsupported-backend message.
    """
    module_name = _BACKEND_MODULES.get(backend)
    if module_name is None:
        return False
    available: bool = importlib.import_module(module_name).gpu_available()
    return available


def describe_model(backend: str, model_path: Path, label: str = "") -> ModelIO:
    """What a model file declares about its tensors (for auto-complete and config checks).

    ``model_path`` is a checked real path (``scanner.checked_path``); ``label`` names it in messages.
    """
    module_name = _BACKEND_MODULES.get(backend)
    if module_name is None:
        raise load_failed(f"backend '{backend}' is not supported (supported: {', '.join(supported_backends())})")
    module = importlib.import_module(module_name)
    if not hasattr(module, "describe"):
        raise load_failed(f"backend '{backend}' has no model file to read tensors from; list them in the config")
    if not model_path.exists():
        raise load_failed(f"model file {label or model_path} not found")
    io: ModelIO = module.describe(model_path)
    return io


def probe_model(backend: str, model_path: Path, inputs: list[tuple[str, DataType, tuple[int, ...]]]) -> ModelIO:
    """Run a model without a signature (TorchScript) on zeros of ``inputs`` to learn its outputs."""
    module = importlib.import_module(_BACKEND_MODULES[backend])
    if not hasattr(module, "probe"):
        raise load_failed(f"backend '{backend}' cannot probe a model")
    if not model_path.exists():
        raise load_failed(f"model file {model_path} not found")
    io: ModelIO = module.probe(model_path, inputs)
    return io


def load_model(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> LoadedModel:
    """Load one copy; ``threads`` is this copy's share of the cores (backends may override from config)."""
    module_name = _BACKEND_MODULES.get(spec.backend)
    if module_name is None:
        raise load_failed(
            f"model '{spec.name}': backend '{spec.backend}' is not supported "
            f"(supported: {', '.join(supported_backends())})"
        )
    module = importlib.import_module(module_name)
    loaded: LoadedModel = module.load(spec, model_path, device, threads)
    return loaded

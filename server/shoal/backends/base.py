"""The backend contract and the one place that picks a backend by name.

A backend module exposes ``load(spec, model_path, device, threads) -> LoadedModel`` and
``gpu_available() -> bool`` (whether it can run a model on a CUDA device here). ``load`` checks
the config against the model file and refuses to load on a mismatch, naming the
tensor. A ``LoadedModel`` holds one copy of the weights on one device; its ``run``
is called concurrently by every executor of that device, so it must be thread-safe.
Heavy libraries (onnxruntime, torch) are imported by their backend module alone.

What each backend is and can do is declared once, in ``BACKENDS`` (readable without importing
a framework); its module's hooks do it. ``Backend`` reads both, and the instance strategy
(``shoal.instances.strategy``) and the config pipeline (``shoal.configuring.pipeline``) choose
from them, so nothing above the backends names a framework. The optional hooks:

- ``share_weights(loaded) -> handle``: put a loaded copy's weights where other processes can
  reach them (a picklable handle), and ``attach(spec, model_path, device, handle, threads) ->
  LoadedModel``: run inside a worker process, build a copy over those weights without loading
  them again. Together they make process instances possible; ``WORKER_PRELOAD`` names the
  modules a worker's fork server imports once, so every worker shares their pages.
- ``complete_config(config, folder)`` and ``check_model_file(model_path, label)``: for a backend
  whose model file is code that says what the model takes (a Python model's
  ``auto_complete_config`` and import), not a graph whose tensors ``describe`` reads.
- ``validate_request(spec, inputs)``: per-request checks the config cannot express (ONNX
  Runtime's string tensors must hold UTF-8), run before the request is queued, so a bad request
  fails alone instead of failing the batch it would have joined.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from shoal.backends.devices import Device
from shoal.errors import load_failed
from shoal.protocol import config_pb2
from shoal.protocol.types import DataType
from shoal.repository.config import InstanceGroupSpec, InstanceKind, ModelSpec
from shoal.repository.model_io import ModelIO


@dataclass(frozen=True)
class Declared:
    """What a backend is, declared where it can be read without importing its framework (a refusal
    lists the backends that could; configuring a model asks without loading torch). A test holds
    each flag to the module's hooks."""

    module: str
    # Worker processes attach to one loaded copy's weights (``share_weights``, ``attach``).
    process_instances: bool = False
    # The model file is code that completes its own config (``complete_config``, ``check_model_file``).
    self_described: bool = False
    # No weights to share: each instance loads the model itself, and is handed lists of requests
    # (its loaded models are ``RequestModel``s); the strategy builds these instances its own way.
    own_instances: bool = False


BACKENDS: dict[str, Declared] = {
    "onnxruntime": Declared("shoal.backends.onnxruntime"),
    "identity": Declared("shoal.backends.identity"),
    "pytorch": Declared("shoal.backends.pytorch", process_instances=True),
    "python": Declared("shoal.backends.python", self_described=True, own_instances=True),
}


def outputs_as_returned(backend: str) -> bool:
    """Whether ``backend``'s models answer each request with its outputs as the model returned them,
    datatype and shape, unchecked against the config: the Python backend's (``own_instances``), whose
    ``execute`` answers each request with a response of its own, as Triton's Python backend sends it
    (a Triton model that fills an INT32 output from an INT64 array answers INT64 there). A feed
    model's batch outputs are split by the config's shape, so they are checked against it."""
    declared = BACKENDS.get(backend)
    return declared is not None and declared.own_instances


def backends_that(capability: str) -> list[str]:
    """The backends declaring ``capability`` (a ``Declared`` flag), for messages that name them."""
    return [name for name, declared in BACKENDS.items() if getattr(declared, capability)]


class LoadedModel(Protocol):
    """One loaded copy of a model, as an instance runs it: a ``FeedModel`` or a ``RequestModel``,
    as its ``runs_requests`` declares."""

    # Bytes of weights this copy holds on its device: counted where the framework can (PyTorch:
    # parameters and buffers), else the model file's size, which the weights dominate (ONNX).
    weight_bytes: int
    # True: a batch is run as its list of queued requests (``RequestModel``: the Python backend, whose
    # ``execute`` takes requests, as Triton's); False: as one feed (``FeedModel``: every other backend).
    runs_requests: bool

    def close(self) -> None:
        """Release the weights."""
        ...


class FeedModel(LoadedModel, Protocol):
    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Execute one batch: config-named inputs in, the requested config-named outputs back."""
        ...


class RequestModel(LoadedModel, Protocol):
    def run_requests(self, batch: Sequence[Any]) -> list[Any]:
        """Each queued request's outputs (name -> array), or a ShoalError that fails it alone."""
        ...

    def bind_host(self, host: Any, caller: Any) -> None:
        """Where its calls to other models go (BLS), and the version that makes them (``caller``)."""
        ...


def supported_backends() -> list[str]:
    return sorted(BACKENDS)


def backend_gpu_available(backend: str) -> bool:
    """Whether ``backend`` can run a model on a CUDA device in this process (resolves KIND_AUTO).

    An unknown backend answers False; its load fails with the unsupported-backend message.
    """
    declared = BACKENDS.get(backend)
    if declared is None:
        return False
    available: bool = importlib.import_module(declared.module).gpu_available()
    return available


def resolve_kind(backend: str, group: InstanceGroupSpec, gpus: int) -> InstanceKind:
    """KIND_AUTO as Triton resolves it: the GPU when ``gpus`` CUDA devices exist, every GPU the
    group lists is one of them and the model's ``backend`` can run on them here; else the CPU.
    Other kinds stay as written (an impossible KIND_GPU fails later, with its own message)."""
    if group.kind is not InstanceKind.AUTO:
        return group.kind
    if gpus == 0 or any(not 0 <= index < gpus for index in group.gpus):
        return InstanceKind.CPU
    return InstanceKind.GPU if backend_gpu_available(backend) else InstanceKind.CPU


def describe_model(backend: str, model_path: Path, label: str = "") -> ModelIO:
    """What a model file declares about its tensors (for auto-complete and config checks).

    ``model_path`` is a checked real path (``scanner.checked_path``); ``label`` names it in messages.
    """
    declared = BACKENDS.get(backend)
    if declared is None:
        raise load_failed(f"backend '{backend}' is not supported (supported: {', '.join(supported_backends())})")
    module = importlib.import_module(declared.module)
    if not hasattr(module, "describe"):
        raise load_failed(f"backend '{backend}' has no model file to read tensors from; list them in the config")
    if not model_path.exists():
        raise load_failed(f"model file {label or model_path} not found")
    io: ModelIO = module.describe(model_path)
    return io


def complete_own_config(config: config_pb2.ModelConfig, folder: Path) -> config_pb2.ModelConfig | None:
    """The config as the model's own code completes it, for a ``self_described`` backend; None for the
    others (their configs are completed from what the model file declares, ``describe_model``)."""
    declared = BACKENDS.get(config.backend)
    if declared is None or not declared.self_described:
        return None
    completed: config_pb2.ModelConfig = importlib.import_module(declared.module).complete_config(config, folder)
    return completed


def check_own_model_file(backend: str, model_path: Path, label: str) -> bool:
    """For a ``self_described`` backend: LOAD_FAILED unless the model file loads as an instance's would
    load it, and True; False for the others (checked against ``describe_model``)."""
    declared = BACKENDS.get(backend)
    if declared is None or not declared.self_described:
        return False
    importlib.import_module(declared.module).check_model_file(model_path, label)
    return True


def probe_model(backend: str, model_path: Path, inputs: list[tuple[str, DataType, tuple[int, ...]]]) -> ModelIO:
    """Run a model without a signature (TorchScript) on zeros of ``inputs`` to learn its outputs."""
    module = importlib.import_module(BACKENDS[backend].module)
    if not hasattr(module, "probe"):
        raise load_failed(f"backend '{backend}' cannot probe a model")
    if not model_path.exists():
        raise load_failed(f"model file {model_path} not found")
    io: ModelIO = module.probe(model_path, inputs)
    return io


def load_model(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> LoadedModel:
    """Load one copy; ``threads`` is this copy's share of the cores (backends may override from config)."""
    return backend_for(spec).load(spec, model_path, device, threads)


def backend_for(spec: ModelSpec) -> Backend:
    """The backend ``spec`` names, its module imported; LOAD_FAILED when Shoal has no such backend."""
    declared = BACKENDS.get(spec.backend)
    if declared is None:
        raise load_failed(
            f"model '{spec.name}': backend '{spec.backend}' is not supported "
            f"(supported: {', '.join(supported_backends())})"
        )
    return Backend(spec.backend, declared, importlib.import_module(declared.module))


class Backend:
    """One backend's module and the hooks it offers (see the module docstring).

    The hooks are looked up when called, not copied, so a backend module stays the one place
    that defines them.
    """

    def __init__(self, name: str, declared: Declared, module: ModuleType) -> None:
        self.name = name
        self.declared = declared
        self._module = module

    def load(self, spec: ModelSpec, model_path: Path, device: Device, threads: int) -> LoadedModel:
        loaded: LoadedModel = self._module.load(spec, model_path, device, threads)
        return loaded

    def gpu_available(self) -> bool:
        available: bool = self._module.gpu_available()
        return available

    @property
    def worker_preload(self) -> tuple[str, ...]:
        """Modules a worker process needs: its fork server imports them once, before any worker."""
        return tuple(getattr(self._module, "WORKER_PRELOAD", ()))

    def share_weights(self, loaded: LoadedModel) -> Any:
        """Move ``loaded``'s weights where worker processes can attach to them; a picklable handle."""
        return self._module.share_weights(loaded)

    def attach(self, spec: ModelSpec, model_path: Path, device: Device, handle: Any, threads: int) -> LoadedModel:
        """Inside a worker: a copy of the model over the weights behind ``handle`` (no second copy)."""
        attached: LoadedModel = self._module.attach(spec, model_path, device, handle, threads)
        return attached

    def validate_request(self, spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> None:
        """Refuse (INVALID_ARGUMENT) a request this backend cannot run; a no-op where it has no checks."""
        check = getattr(self._module, "validate_request", None)
        if check is not None:
            check(spec, inputs)

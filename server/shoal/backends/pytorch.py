"""PyTorch backend: TorchScript (``model.pt``), ``torch.export`` programs (``model.pt2``), and
eager modules saved whole with ``torch.save`` (parameter ``pickled_module: true``).

One module per device, in eval mode, run under ``torch.inference_mode`` by every executor of
that device; on a GPU each executor thread gets its own CUDA stream. Inputs follow Triton's
PyTorch conventions: names ``<NAME>__<index>`` are passed by index, names matching the
module's forward arguments by those names, anything else in config order. Outputs: a tensor,
a tuple/list (``<NAME>__<index>`` or config order) or a dict (by name).

TorchScript carries no types or shapes, so the load runs the module once on zeros of the
config's shapes and refuses, naming the tensor, when an output's type or shape contradicts
the config.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from shoal.backends.devices import Device
from shoal.errors import invalid, load_failed
from shoal.protocol.types import DataType
from shoal.repository.config import ModelSpec, TensorSpec
from shoal.repository.model_io import IOTensor, ModelIO

logger = logging.getLogger(__name__)

_TORCH_TYPES = {
    DataType.BOOL: torch.bool,
    DataType.UINT8: torch.uint8,
    DataType.INT8: torch.int8,
    DataType.INT16: torch.int16,
    DataType.INT32: torch.int32,
    DataType.INT64: torch.int64,
    DataType.FP16: torch.float16,
    DataType.FP32: torch.float32,
    DataType.FP64: torch.float64,
    DataType.BF16: torch.bfloat16,
}
_INDEXED = re.compile(r"^.+__(\d+)$")
# What a worker process of a process instance imports; its fork server imports them once.
WORKER_PRELOAD = ("torch", "shoal.backends.pytorch")


def _index(name: str) -> int | None:
    match = _INDEXED.match(name)
    return int(match.group(1)) if match else None


class TorchModel:
    runs_requests = False  # one feed per batch

    def __init__(self, module: Any, spec: ModelSpec, device: torch.device, argument_names: list[str]) -> None:
        self._module = module
        self._device = device
        self._spec = spec
        self._input_order = _input_order(spec, argument_names)
        self._streams = threading.local()
        self.weight_bytes = sum(t.numel() * t.element_size() for t in _tensors_of(module))

    @property
    def module(self) -> Any:
        return self._module

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            if self._device.type == "cuda":
                stream = getattr(self._streams, "stream", None)
                if stream is None:
                    stream = self._streams.stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]
                with torch.cuda.stream(stream):
                    result = self._module(*self._arguments(inputs))
                    values = self._outputs(result)
                stream.synchronize()
            else:
                values = self._outputs(self._module(*self._arguments(inputs)))
        return {name: _to_numpy(values[name], own=True) for name in outputs}

    def _arguments(self, inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
        return [_to_torch(name, inputs[name]).to(self._device, non_blocking=True) for name in self._input_order]

    def _outputs(self, result: Any) -> dict[str, torch.Tensor]:
        names = [t.name for t in self._spec.outputs]
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, Mapping):
            missing = [n for n in names if n not in result]
            if missing:
                raise RuntimeError(f"the model returned no output named {missing[0]!r} (keys: {sorted(result)})")
            return {n: result[n] for n in names}
        values = list(result)
        indices = [_index(n) for n in names]
        positions = [i for i in indices if i is not None]
        if len(positions) != len(names):
            positions = list(range(len(names)))
        if max(positions, default=-1) >= len(values):
            raise RuntimeError(f"the model returned {len(values)} output(s), the config lists {len(names)}")
        return {n: values[p] for n, p in zip(names, positions, strict=True)}

    def close(self) -> None:
        del self._module
        if self._device.type == "cuda":
            torch.cuda.empty_cache()


def load(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> TorchModel:
    if not model_path.is_file():
        raise load_failed(f"model '{spec.name}': model file {model_path} not found")
    unsupported = [t.name for t in (*spec.inputs, *spec.outputs) if t.datatype not in _TORCH_TYPES]
    if unsupported:
        raise load_failed(f"model '{spec.name}': tensor(s) {unsupported} have a type the PyTorch backend lacks")
    target = _torch_device(spec, device)
    configured = spec.parameters.get("intra_op_thread_count", "")
    torch.set_num_threads(int(configured) if configured.isdigit() else threads)  # process-wide in torch
    try:
        module, names = read_module(spec, model_path, target)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for unreadable files
        raise load_failed(f"model '{spec.name}': PyTorch cannot load {model_path}: {exc}") from exc
    if names and len(names) != len(spec.inputs):
        raise load_failed(
            f"model '{spec.name}': the model's forward takes {len(names)} input(s) {names}, "
            f"the config lists {len(spec.inputs)} {[t.name for t in spec.inputs]}"
        )
    model = TorchModel(module, spec, target, names)
    _trial_run(spec, model)
    logger.info("model %s: PyTorch module on %s (%.1f MB of weights)", spec.name, target, model.weight_bytes / 2**20)
    return model


def is_pickled(spec: ModelSpec) -> bool:
    """An eager ``nn.Module`` saved whole with ``torch.save`` (opt-in: unpickling runs code)."""
    return spec.parameters.get("pickled_module", "false").lower() == "true"


def read_module(spec: ModelSpec, model_path: Path, target: torch.device) -> tuple[Any, list[str]]:
    """The module and its forward's argument names; ``target`` may be the meta device (no weights)."""
    if is_pickled(spec):
        module = torch.load(str(model_path), map_location=target, weights_only=False)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"the file holds a {type(module).__name__}, not a torch.nn.Module")
        return module.eval(), list(inspect.signature(module.forward).parameters)
    if model_path.suffix == ".pt2":
        program = torch.export.load(str(model_path))
        names = [s.arg.name for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        return program.module().to(target), names
    module = torch.jit.load(str(model_path), map_location=target)  # type: ignore[no-untyped-call]
    return module.eval(), [a.name for a in module.forward.schema.arguments][1:]  # without self


def share_weights(model: TorchModel) -> dict[str, torch.Tensor]:
    """Move a loaded module's parameters and buffers to shared memory; name → tensor.

    The dict is the handle workers attach to: torch.multiprocessing pickles a shared CPU tensor as
    its shared-memory segment and a CUDA tensor as a CUDA IPC handle, so no weight is copied.
    """
    shared = {}
    for name, tensor in [*model.module.named_parameters(), *model.module.named_buffers()]:
        if tensor.device.type == "cpu":
            tensor.share_memory_()
        shared[name] = tensor.detach()
    return shared


def attach(
    spec: ModelSpec, model_path: Path, device: Device, shared: dict[str, torch.Tensor], threads: int
) -> TorchModel:
    """In a worker process: the module's code, with every parameter and buffer the server's shared tensor."""
    torch.set_num_threads(threads)
    target = torch.device("cpu") if device.kind == "cpu" else torch.device("cuda", device.index)
    if model_path.suffix == ".pt2" and not is_pickled(spec):
        # torch.export reads weights onto the CPU only. The module is pointed at the server's shared
        # tensors while still there, so its own copy is dropped and never reaches the device; only
        # then do the few tensors that are not parameters or buffers (lifted constants) move.
        module, names = read_module(spec, model_path, torch.device("cpu"))
        _point_at_shared(module, shared)
        module.to(target)  # parameters and buffers are there already: nothing of theirs is copied
    else:
        # The code only, onto the meta device (no weight allocated here), then every parameter
        # and buffer pointed at the server's shared tensor.
        module, names = read_module(spec, model_path, torch.device("meta"))
        if is_pickled(spec):
            module.load_state_dict({k: shared[k] for k in module.state_dict()}, strict=True, assign=True)
        else:
            for name in [*dict(module.named_parameters()), *dict(module.named_buffers())]:
                owner = module
                *path, attribute = name.split(".")
                for part in path:
                    owner = getattr(owner, part)
                owner._c.setattr(attribute, shared[name])  # ScriptModules take attributes only this way
    return TorchModel(module, spec, target, names)


def _point_at_shared(module: Any, shared: dict[str, torch.Tensor]) -> None:
    """Replace every parameter and buffer of an ``nn.Module`` by the server's shared tensor (no copy).

    Aliases (tied weights) get the tensor of the first name, as ``named_parameters`` reports them.
    """
    first_name: dict[int, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        source = shared[first_name.setdefault(id(tensor), name)]
        owner = module
        *path, attribute = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        if attribute in owner._parameters:
            owner._parameters[attribute] = torch.nn.Parameter(source, requires_grad=False)
        else:
            owner._buffers[attribute] = source


def gpu_available() -> bool:
    """This torch is a CUDA build and sees a device (a CPU-only wheel on a GPU host does not)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _torch_device(spec: ModelSpec, device: Device) -> torch.device:
    if device.kind != "gpu":
        return torch.device("cpu")
    if not gpu_available():
        raise load_failed(f"model '{spec.name}': a GPU instance group needs a CUDA build of torch and a GPU")
    return torch.device("cuda", device.index)


def _input_order(spec: ModelSpec, argument_names: list[str]) -> list[str]:
    names = [t.name for t in spec.inputs]
    indices = [_index(n) for n in names]
    if all(i is not None for i in indices):
        return [name for _, name in sorted(zip(indices, names, strict=True))]
    if argument_names and set(argument_names) == set(names):
        return list(argument_names)
    return names


def _trial_run(spec: ModelSpec, model: TorchModel) -> None:
    """Run zeros of the config's shapes once; refuse outputs whose type or shape contradict the config."""
    batch = [1] if spec.max_batch_size > 0 else []
    feed = {
        t.name: np.zeros(batch + [1 if d == -1 else d for d in t.dims], t.datatype.numpy_dtype) for t in spec.inputs
    }
    try:
        results = model.run(feed, [t.name for t in spec.outputs])
    except Exception as exc:  # noqa: BLE001 - any failure here means the config does not fit the model
        raise load_failed(
            f"model '{spec.name}': a trial run on zeros of the config's input shapes failed: {exc}"
        ) from exc
    for tensor in spec.outputs:
        _check_output(spec, tensor, results[tensor.name], batch)


def _check_output(spec: ModelSpec, tensor: TensorSpec, value: np.ndarray, batch: list[int]) -> None:
    label = f"model '{spec.name}': output '{tensor.name}'"
    produced = DataType.from_numpy(value.dtype)
    if produced is not tensor.datatype:
        raise load_failed(
            f"{label} is {tensor.datatype.config_name} in the config but the model returns {produced.config_name}"
        )
    expected = batch + list(tensor.dims)
    shape = list(value.shape)
    if len(shape) != len(expected) or any(e not in (-1, s) for e, s in zip(expected, shape, strict=True)):
        raise load_failed(f"{label} has dims {expected} in the config (batch 1) but the model returns {shape}")


def _to_torch(name: str, array: np.ndarray) -> torch.Tensor:
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    if array.dtype.kind in "OSU":
        raise invalid(f"input '{name}': the PyTorch backend takes no BYTES tensors")
    return torch.from_numpy(np.ascontiguousarray(array))


def _to_numpy(value: torch.Tensor, own: bool = False) -> np.ndarray:
    """The tensor's values as numpy; with ``own``, in memory of their own: ``.cpu()`` copies a device's
    tensor, and a CPU tensor is copied here, as Triton's backend copies every output into its response.
    A module may answer in a tensor it keeps (a buffer it refills every batch, or an input it stored),
    which its next batch rewrites while this batch's responses are still being encoded."""
    copied = value.device.type != "cpu"
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        array = value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = value.numpy()
    return np.array(array, copy=True) if own and not copied else array


def _tensors_of(module: Any) -> list[torch.Tensor]:
    try:
        return [*module.parameters(), *module.buffers()]
    except (AttributeError, RuntimeError):
        return []


def probe(model_path: Path, inputs: list[tuple[str, DataType, tuple[int, ...]]]) -> ModelIO:
    """What a TorchScript/exported model does with zero inputs of these per-sample shapes.

    Tried with a batch dimension first (batches of 1 and 2: every output must follow the batch),
    then without. Outputs are named as Triton's PyTorch convention (``OUTPUT__<i>``), or by key
    when the model returns a dict.
    """
    if model_path.suffix == ".pt2":
        module = torch.export.load(str(model_path)).module()
    else:
        module = torch.jit.load(str(model_path), map_location="cpu").eval()  # type: ignore[no-untyped-call]

    def run(batch: list[int]) -> list[tuple[str, torch.Tensor]]:
        arguments = [torch.zeros(batch + list(dims), dtype=_TORCH_TYPES[datatype]) for _, datatype, dims in inputs]
        with torch.inference_mode():
            result = module(*arguments)
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, Mapping):
            return [(str(k), v) for k, v in result.items()]
        return [(f"OUTPUT__{i}", v) for i, v in enumerate(result)]

    errors = []
    for batched in (True, False):
        try:
            first = run([1] if batched else [])
            if batched:
                second = run([2])
                pairs = zip(first, second, strict=True)
                if not all(a.shape[:1] == (1,) and b.shape[:1] == (2,) for (_, a), (_, b) in pairs):
                    raise RuntimeError("an output does not follow the batch dimension")
        except Exception as exc:  # noqa: BLE001 - the next form is tried; both failing is reported
            errors.append(f"{'with' if batched else 'without'} a batch dimension: {exc}")
            continue
        lead: tuple[int | None, ...] = (None,) if batched else ()
        return ModelIO(
            tuple(IOTensor(name, datatype, lead + dims) for name, datatype, dims in inputs),
            tuple(
                IOTensor(name, DataType.from_numpy(_to_numpy(value).dtype), lead + tuple(value.shape[len(lead) :]))
                for name, value in first
            ),
        )
    raise load_failed(f"{model_path}: the model does not run on zeros of the given inputs: {'; '.join(errors)}")

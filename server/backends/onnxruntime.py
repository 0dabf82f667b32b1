"""ONNX Runtime backend: one InferenceSession per device, run concurrently by executors.

ORT sessions are thread-safe for ``run``, so every executor of a device shares the one
session and with it one copy of the weights. The CPU execution provider is the
default; instance groups of kind GPU use the CUDA execution provider and the load
fails, with a clear message, when it is missing or silently falls back to CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from server.backends.devices import Device
from server.errors import invalid, load_failed
from server.repository.config import ModelSpec, TensorSpec
from server.types import DataType

logger = logging.getLogger(__name__)

_ORT_TYPES = {
    "tensor(bool)": DataType.BOOL,
    "tensor(uint8)": DataType.UINT8,
    "tensor(uint16)": DataType.UINT16,
    "tensor(uint32)": DataType.UINT32,
    "tensor(uint64)": DataType.UINT64,
    "tensor(int8)": DataType.INT8,
    "tensor(int16)": DataType.INT16,
    "tensor(int32)": DataType.INT32,
    "tensor(int64)": DataType.INT64,
    "tensor(float16)": DataType.FP16,
    "tensor(float)": DataType.FP32,
    "tensor(double)": DataType.FP64,
    "tensor(string)": DataType.BYTES,
    "tensor(bfloat16)": DataType.BF16,
}


class OnnxModel:
    def __init__(self, session: ort.InferenceSession, spec: ModelSpec) -> None:
        self._session = session
        self._string_inputs = {t.name for t in spec.inputs if t.datatype is DataType.BYTES}
        self._string_outputs = {t.name for t in spec.outputs if t.datatype is DataType.BYTES}

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        feed = {name: _to_ort_strings(name, a) if name in self._string_inputs else a
                for name, a in inputs.items()}
        results = self._session.run(list(outputs), feed)
        return {
            name: _from_ort_strings(value) if name in self._string_outputs else value
            for name, value in zip(outputs, results, strict=True)
        }

    def close(self) -> None:
        del self._session


def load(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> OnnxModel:
    if not model_path.is_file():
        raise load_failed(f"model '{spec.name}': model file {model_path} not found")
    options = ort.SessionOptions()
    configured = spec.parameters.get("intra_op_thread_count", "")
    if configured and not configured.isdigit():
        raise load_failed(f"model '{spec.name}': parameter intra_op_thread_count must be an integer")
    options.intra_op_num_threads = int(configured) if configured else threads
    providers = _providers(spec, device)
    try:
        session = ort.InferenceSession(str(model_path), sess_options=options, providers=providers)
    except Exception as exc:  # ORT raises several private exception types for corrupt files
        raise load_failed(f"model '{spec.name}': ONNX Runtime cannot load {model_path}: {exc}") from exc
    if device.kind == "gpu" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise load_failed(
            f"model '{spec.name}': the CUDA execution provider did not load (session runs on "
            f"{session.get_providers()}); check the CUDA libraries"
        )
    check_io(spec, [_io(a) for a in session.get_inputs()], [_io(a) for a in session.get_outputs()])
    logger.info("model %s: ONNX Runtime session on %s (%s)", spec.name, device, session.get_providers()[0])
    return OnnxModel(session, spec)


def _providers(spec: ModelSpec, device: Device) -> list[Any]:
    if device.kind != "gpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise load_failed(
            f"model '{spec.name}': a GPU instance group needs onnxruntime-gpu; the installed "
            f"onnxruntime offers {ort.get_available_providers()}"
        )
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:  # use the CUDA libraries that torch's wheels ship, when they are installed
            preload()
        except Exception:  # noqa: BLE001 - best effort; the provider check after load decides
            logger.debug("onnxruntime.preload_dlls failed", exc_info=True)
    return [("CUDAExecutionProvider", {"device_id": device.index}), "CPUExecutionProvider"]


def _io(arg: Any) -> tuple[str, str, list[int | None]]:
    shape = [d if isinstance(d, int) and d >= 0 else None for d in (arg.shape or [])]
    return arg.name, arg.type, shape


def check_io(
    spec: ModelSpec,
    model_inputs: list[tuple[str, str, list[int | None]]],
    model_outputs: list[tuple[str, str, list[int | None]]],
) -> None:
    """Refuse a config whose tensors contradict the model; the message names the tensor."""
    by_name_in = {name: (t, s) for name, t, s in model_inputs}
    by_name_out = {name: (t, s) for name, t, s in model_outputs}
    for tensor in spec.inputs:
        if tensor.name not in by_name_in:
            raise load_failed(
                f"model '{spec.name}': input '{tensor.name}' is not an input of the model "
                f"(model inputs: {sorted(by_name_in)})"
            )
        _check_tensor(spec, "input", tensor, *by_name_in[tensor.name])
    configured = {t.name for t in spec.inputs}
    missing = [name for name in by_name_in if name not in configured]
    if missing:
        raise load_failed(f"model '{spec.name}': model input(s) {missing} are missing from the config")
    for tensor in spec.outputs:
        if tensor.name not in by_name_out:
            raise load_failed(
                f"model '{spec.name}': output '{tensor.name}' is not an output of the model "
                f"(model outputs: {sorted(by_name_out)})"
            )
        _check_tensor(spec, "output", tensor, *by_name_out[tensor.name])


def _check_tensor(
    spec: ModelSpec, kind: str, tensor: TensorSpec, ort_type: str, model_shape: list[int | None]
) -> None:
    label = f"model '{spec.name}': {kind} '{tensor.name}'"
    model_type = _ORT_TYPES.get(ort_type)
    if model_type is None:
        raise load_failed(f"{label} has type {ort_type}, which Shoal does not support")
    if model_type is not tensor.datatype:
        raise load_failed(
            f"{label} is {tensor.datatype.config_name} in the config but {model_type.config_name} in the model"
        )
    if model_type is DataType.BF16:
        raise load_failed(f"{label}: BF16 tensors cannot be fed through the ONNX Runtime Python API")
    expected = list(tensor.reshape if tensor.reshape is not None else tensor.dims)
    shape = model_shape
    if spec.max_batch_size > 0:
        if not model_shape or model_shape[0] is not None:
            raise load_failed(
                f"{label}: max_batch_size is {spec.max_batch_size} but the model's first dimension "
                f"is not variable (model shape {_show(model_shape)}); set max_batch_size: 0"
            )
        shape = model_shape[1:]
    if len(shape) != len(expected) or any(
        m is not None and m != c for m, c in zip(shape, expected, strict=True)
    ):
        batch = "[-1] + " if spec.max_batch_size > 0 else ""
        raise load_failed(
            f"{label} has dims {batch}{expected} in the config but shape {_show(model_shape)} in the model"
        )


def _show(shape: list[int | None]) -> str:
    return "[" + ", ".join("-1" if d is None else str(d) for d in shape) + "]"


def _to_ort_strings(name: str, array: np.ndarray) -> np.ndarray:
    """ORT string tensors take Python str; BYTES elements must be UTF-8 to get there."""
    try:
        return np.vectorize(lambda b: b.decode("utf-8") if isinstance(b, bytes) else str(b), otypes=[object])(
            array
        )
    except UnicodeDecodeError as exc:
        raise invalid(
            f"input '{name}': a BYTES element is not valid UTF-8, which ONNX Runtime string tensors need"
        ) from exc


def _from_ort_strings(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda s: s.encode("utf-8") if isinstance(s, str) else bytes(s), otypes=[object])(
        np.asarray(array, dtype=object)
    )

"""ONNX Runtime backend: one InferenceSession per device, run concurrently by executors.

ORT sessions are thread-safe for ``run``, so every executor of a device shares the one
session and with it one copy of the weights. The CPU execution provider is the
default; instance groups of kind GPU use the CUDA execution provider and the load
fails, with a clear message, when it is missing or silently falls back to CPU.
ONNX Runtime's telemetry is turned off before the library loads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# ONNX Runtime's telemetry (on by default in its wheels) starts when the library loads: it writes a
# device id and an event database (error messages, paths, CPU details) under
# ~/.cache/Microsoft/DeveloperTools/.onnxruntime/ and uploads them. Only this variable, set before
# the import, stops all of it; the API call below also stops the events of this process.
os.environ["ORT_DISABLE_TELEMETRY"] = "1"
import onnxruntime as ort  # noqa: E402 - after the telemetry switch above

from shoal.backends.devices import Device
from shoal.errors import invalid, load_failed
from shoal.protocol.types import DataType
from shoal.repository.config import ModelSpec
from shoal.repository.model_io import IOTensor, ModelIO, check_io

logger = logging.getLogger(__name__)
ort.disable_telemetry_events()

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
    runs_requests = False  # one feed per batch

    def __init__(self, session: ort.InferenceSession, spec: ModelSpec, weight_bytes: int) -> None:
        self._session = session
        self.weight_bytes = weight_bytes  # the model file's size: ORT does not report its initializers
        self._string_inputs = {t.name for t in spec.inputs if t.datatype is DataType.BYTES}
        self._string_outputs = {t.name for t in spec.outputs if t.datatype is DataType.BYTES}
        # Inputs that are scalars in the model: fed as scalars whatever config dims of 1s they
        # arrive in (dims [1] without a reshape), as Triton's ORT backend does.
        self._scalar_inputs = {arg.name for arg in session.get_inputs() if not arg.shape}

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        feed = {name: _to_ort_strings(name, a) if name in self._string_inputs else a for name, a in inputs.items()}
        for name in self._scalar_inputs & feed.keys():
            feed[name] = feed[name].reshape(())
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
    options = session_options(spec, threads)
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
    io = _model_io(session)
    check_io(spec, io)
    bf16 = [t.name for t in io.inputs + io.outputs if t.datatype is DataType.BF16]
    if bf16:
        raise load_failed(f"model '{spec.name}': BF16 tensors {bf16} cannot be fed through the ONNX Runtime Python API")
    logger.info("model %s: ONNX Runtime session on %s (%s)", spec.name, device, session.get_providers()[0])
    return OnnxModel(session, spec, model_path.stat().st_size)


def session_options(spec: ModelSpec, threads: int) -> ort.SessionOptions:
    """Threads: ``intra_op_thread_count`` or ``threads``. Spinning: ONNX Runtime's own default (on), unless
    ``allow_spinning`` is "false".

    ONNX Runtime's pool threads spin a short while on their core after each parallel section,
    waiting for more work, where without it each section wakes them again (tens of µs a wake-up).
    Measured (bench/ort_spinning.py, docs/benchmarks.md): on an MLP whose matrix products go
    parallel, spinning gave 1.11-1.26x the throughput for 1.12-1.54x the CPU per request, the event
    loop sharing the cores (two instances' pool threads outnumbering them too); on a model too small
    to go parallel it changes nothing. The Triton the benchmarks run beside Shoal keeps the default
    too. "false": where CPU time counts more than throughput.
    """
    options = ort.SessionOptions()
    configured = spec.parameters.get("intra_op_thread_count", "")
    if configured and not configured.isdigit():
        raise load_failed(f"model '{spec.name}': parameter intra_op_thread_count must be an integer")
    options.intra_op_num_threads = int(configured) if configured else threads
    spinning = spec.parameters.get("allow_spinning", "true").strip().lower()
    if spinning not in ("true", "false"):
        raise load_failed(f'model \'{spec.name}\': parameter allow_spinning must be "true" or "false"')
    for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
        options.add_session_config_entry(key, "1" if spinning == "true" else "0")
    return options


def gpu_available() -> bool:
    """The installed onnxruntime offers the CUDA execution provider (onnxruntime-gpu, not onnxruntime)."""
    return "CUDAExecutionProvider" in ort.get_available_providers()


def validate_request(spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> None:
    """BYTES inputs must hold UTF-8 (ORT's Python API takes ``str``). Checked per request before it
    is queued, so a bad request is refused alone and never fails the batch it would have joined."""
    for tensor in spec.inputs:
        if tensor.datatype is DataType.BYTES and tensor.name in inputs:
            _check_utf8(spec, tensor.name, inputs[tensor.name])


def _check_utf8(spec: ModelSpec, name: str, data: np.ndarray) -> None:
    for index, item in enumerate(np.asarray(data, dtype=object).reshape(-1)):
        if isinstance(item, bytes):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError:
                raise invalid(
                    f"input '{name}' for model '{spec.name}': BYTES element {index} is not valid UTF-8, "
                    f"which {spec.backend} string tensors need"
                ) from None


def _providers(spec: ModelSpec, device: Device) -> list[Any]:
    if device.kind != "gpu":
        return ["CPUExecutionProvider"]
    if not gpu_available():
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


def describe(model_path: Path) -> ModelIO:
    """The model file's inputs and outputs (names, datatypes, shapes), read through a CPU session."""
    try:
        session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises several private exception types for corrupt files
        raise load_failed(f"ONNX Runtime cannot load {model_path}: {exc}") from exc
    return _model_io(session)


def _model_io(session: ort.InferenceSession) -> ModelIO:
    def tensor(arg: Any) -> IOTensor:
        shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in (arg.shape or []))
        return IOTensor(arg.name, _ORT_TYPES.get(arg.type), shape, arg.type)

    return ModelIO(tuple(tensor(a) for a in session.get_inputs()), tuple(tensor(a) for a in session.get_outputs()))


def _to_ort_strings(name: str, array: np.ndarray) -> np.ndarray:
    """ORT string tensors take Python str; BYTES elements must be UTF-8 to get there."""
    try:
        decoded: np.ndarray = np.vectorize(
            lambda b: b.decode("utf-8") if isinstance(b, bytes) else str(b), otypes=[object]
        )(array)
        return decoded
    except UnicodeDecodeError as exc:
        raise invalid(
            f"input '{name}': a BYTES element is not valid UTF-8, which ONNX Runtime string tensors need"
        ) from exc


def _from_ort_strings(array: np.ndarray) -> np.ndarray:
    encoded: np.ndarray = np.vectorize(
        lambda s: s.encode("utf-8") if isinstance(s, str) else bytes(s), otypes=[object]
    )(np.asarray(array, dtype=object))
    return encoded

"""The identity backend: output i is input i, unchanged. No model file.

A real backend (not a mock) for tests, smoke runs and protocol checks: every
datatype, BYTES with arbitrary bytes and BF16 included, round-trips exactly. The
model parameter ``execute_delay_ms`` makes each execution sleep, to stand in for work.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from shoal.backends.devices import Device
from shoal.errors import load_failed
from shoal.repository.config import ModelSpec


class IdentityModel:
    weight_bytes = 0
    runs_requests = False  # one feed per batch

    def __init__(self, pairs: dict[str, str], delay_s: float) -> None:
        self._input_for_output = pairs
        self._delay_s = delay_s

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        if self._delay_s:
            time.sleep(self._delay_s)
        return {name: inputs[self._input_for_output[name]] for name in outputs}

    def close(self) -> None:
        pass


def gpu_available() -> bool:
    """Never: the identity backend runs on the CPU, so KIND_AUTO places it there."""
    return False


def load(spec: ModelSpec, model_path: Path, device: Device, threads: int) -> IdentityModel:
    if device.kind == "gpu":
        raise load_failed(
            f"model '{spec.name}': the identity backend runs on the CPU only; use KIND_CPU or KIND_AUTO, not KIND_GPU"
        )
    if len(spec.inputs) != len(spec.outputs):
        raise load_failed(f"model '{spec.name}': the identity backend needs as many outputs as inputs")
    for tensor_in, tensor_out in zip(spec.inputs, spec.outputs, strict=True):
        if tensor_in.datatype != tensor_out.datatype:
            raise load_failed(
                f"model '{spec.name}': output '{tensor_out.name}' is {tensor_out.datatype.value} "
                f"but input '{tensor_in.name}' is {tensor_in.datatype.value}"
            )
    try:
        delay_s = float(spec.parameters.get("execute_delay_ms", "0")) / 1000
    except ValueError as exc:
        raise load_failed(f"model '{spec.name}': parameter execute_delay_ms is not a number") from exc
    pairs = {o.name: i.name for i, o in zip(spec.inputs, spec.outputs, strict=True)}
    return IdentityModel(pairs, delay_s)

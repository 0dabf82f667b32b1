"""Requests with tensors in registered shared-memory regions, in the process that holds the models.

The transports only parse where a tensor lives (``RegionInput``, ``RegionSlice``); the host
resolves the region here. Inputs are read from the client's segment (one copy, ``Window.read``;
BYTES decoded); outputs are encoded and written into it once the request is answered, and the
response carries them with no data (``InferResponse.in_regions``). An unknown region, an
out-of-range window, a size that does not match the shape and an output region too small get
Triton's messages and codes.

CUDA regions go the same way; their copies wait on the device (and behind whatever the device
is doing), so a request with one is read and written on a worker thread, never on the loop.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shoal.core.wire import decode_raw
from shoal.dataplane.cuda import CudaWindow
from shoal.dataplane.regions import RegionRegistry, Window
from shoal.errors import ErrorCode, ShoalError, shown
from shoal.off_loop import OFF_LOOP_BYTES, OFF_LOOP_ELEMENTS
from shoal.protocol import codec
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, Tensor


def with_region_inputs(registry: RegionRegistry, request: InferRequest) -> InferRequest:
    """``request`` with its shared-memory inputs read into ``inputs`` (views, not copies)."""
    read = []
    for source in request.region_inputs:
        window = registry.window(source.where.region, source.where.offset, source.where.byte_size)
        data = decode_raw(
            source.name, source.datatype, source.shape, window.read().data, request.model_name, request.id
        )
        read.append(Tensor(source.name, source.datatype, source.shape, data))
    return dataclasses.replace(request, inputs=(*request.inputs, *read), region_inputs=())


def output_windows(registry: RegionRegistry, request: InferRequest) -> dict[str, Window | CudaWindow]:
    """Where each output goes, located before the model runs: a bad region fails the request at once,
    and one unregistered meanwhile is still written (the window holds the segment open)."""
    return {
        name: registry.window(where.region, where.offset, where.byte_size)
        for name, where in request.output_regions.items()
    }


def write_region_outputs(windows: dict[str, Window | CudaWindow], response: InferResponse) -> InferResponse:
    """Write the outputs that go to shared memory there; they stay in the response without data."""
    outputs = []
    for tensor in response.outputs:
        window = windows.get(tensor.name)
        if window is None:
            outputs.append(tensor)
            continue
        raw = codec.to_raw(tensor.datatype, tensor.data)
        if len(raw) > window.byte_size:
            raise ShoalError(
                ErrorCode.INTERNAL,
                (
                    f"shared memory size specified with the request for output '{shown(tensor.name)}' "
                    f"({window.byte_size} bytes) should be at least {len(raw)} bytes to hold the results"
                ),
            )
        window.write(raw)
        outputs.append(Tensor(tensor.name, tensor.datatype, tensor.shape, np.empty(0, tensor.data.dtype)))
    return dataclasses.replace(
        response, outputs=tuple(outputs), in_regions=frozenset(windows) & {t.name for t in outputs}
    )


# Region bytes past off_loop.OFF_LOOP_BYTES are copied (preadv/pwrite of a client's segment) off the
# event loop: a 256 MiB tensor read on the loop stalled every other call on it for most of a second.


def costly(registry: RegionRegistry, request: InferRequest) -> bool:
    """Region inputs to read off the event loop: large ones, many BYTES elements, or any in CUDA regions."""
    if any(registry.on_device(r.where.region) for r in request.region_inputs):
        return True
    if sum(r.where.byte_size for r in request.region_inputs) > OFF_LOOP_BYTES:
        return True
    return sum(math.prod(r.shape) for r in request.region_inputs if r.datatype is DataType.BYTES) > OFF_LOOP_ELEMENTS


def costly_outputs(windows: dict[str, Window | CudaWindow]) -> bool:
    """Outputs to write off the event loop: into CUDA regions, or large."""
    return (
        any(isinstance(w, CudaWindow) for w in windows.values())
        or sum(w.byte_size for w in windows.values()) > OFF_LOOP_BYTES
    )

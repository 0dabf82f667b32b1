"""Triton's ``model_warmup``: samples built at load and run on every loaded copy before the version takes traffic.

Why here: Triton users rely on a sample that fails to fail the load (a version that cannot answer its
own warm-up is UNAVAILABLE with the reason, never READY), and on the first real request not paying
for lazy initialisation. A sample is built as a client's request would be (``request_checks.prepare``: the
same checks, the same reshape into the backend's shapes), so a sample a client could not send fails
the load with the words a client would get. Data: ``zero_data`` (zeros; empty strings for BYTES),
``random_data`` (uniform random values; BYTES get zeros, as Triton), ``input_data_file`` (the raw
bytes of a file in the model's ``warmup/`` folder, read through the repository's path checks; BYTES
as length-prefixed elements): one sample, each row of a ``batch_size`` batch, as Triton's core reads
it (backend_model_instance.cc: ``batch_size`` requests of batch 1, each given the file). A sample
runs ``count`` times (0: once), batch size 0 is skipped, as Triton does.

Python models run each sample as queued requests (``run_on_requests``: one per row of a batching
model's sample, as Triton's core sends them), as a client's would reach ``execute``: its BLS calls
go to the serving loop, and a decoupled model's responses go to a sink that keeps the first error
and waits (``STREAM_TIMEOUT_S`` at most) for the FINAL flag.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import numpy as np
from google.protobuf import json_format

from shoal.errors import ErrorCode, ShoalError, load_failed
from shoal.lifecycle import request_checks
from shoal.protocol import config_pb2
from shoal.protocol.codec import WireFormatError, deserialize_bytes
from shoal.protocol.types import DataType
from shoal.repository import scanner
from shoal.repository.config import ModelSpec
from shoal.request_types import InferRequest, Tensor

WARMUP_FOLDER = "warmup"
STREAM_TIMEOUT_S = 60.0  # a decoupled Python model's warm-up request: its FINAL flag comes within this


@dataclass(frozen=True)
class Sample:
    name: str
    feed: dict[str, np.ndarray]  # in the backend's shapes, as a prepared request's
    outputs: tuple[str, ...]
    runs: int


def samples(spec: ModelSpec, model_folder: Path) -> list[Sample]:
    """The config's warm-up samples, built and checked; ShoalError (load failed) names the first bad one."""
    built = []
    for document in spec.config_json.get("model_warmup") or []:
        warmup = json_format.ParseDict(document, config_pb2.ModelWarmup())
        if warmup.batch_size == 0:
            continue
        where = f"model '{spec.name}': warm-up sample '{warmup.name}'"
        if spec.max_batch_size == 0 and warmup.batch_size != 1:
            raise load_failed(
                f"{where}: batch_size must be 1 for a model that does not batch "
                f"(max_batch_size 0), got {warmup.batch_size}"
            )
        if warmup.batch_size > spec.max_batch_size > 0:
            raise load_failed(
                f"{where}: batch_size {warmup.batch_size} is more than max_batch_size {spec.max_batch_size}"
            )
        inputs = tuple(
            _tensor(where, name, value, warmup.batch_size, spec, model_folder)
            for name, value in sorted(warmup.inputs.items())
        )
        request = InferRequest(spec.name, "", f"warmup:{warmup.name}", inputs)
        try:
            prepared = request_checks.prepare(spec, request)
        except ShoalError as exc:
            raise load_failed(f"{where}: {exc.message}") from None
        built.append(Sample(warmup.name, prepared.feed, tuple(prepared.outputs), max(1, warmup.count)))
    return built


def _tensor(
    where: str, name: str, value: config_pb2.ModelWarmup.Input, batch_size: int, spec: ModelSpec, model_folder: Path
) -> Tensor:
    try:
        datatype = DataType.from_config_name(config_pb2.DataType.Name(value.data_type))
    except (KeyError, ValueError):
        raise load_failed(f"{where}: input '{name}' has no valid data_type") from None
    if any(d < 0 for d in value.dims):
        raise load_failed(f"{where}: input '{name}' dims {list(value.dims)} must be fixed (no -1)")
    shape = ((batch_size,) if spec.max_batch_size > 0 else ()) + tuple(value.dims)
    count = math.prod(shape)
    kind = value.WhichOneof("input_data_type")
    if kind == "input_data_file":  # one sample, as Triton reads it: each of the batch's rows is the file's
        raw = _read_file(where, name, value.input_data_file, model_folder)
        sample = _from_bytes(where, name, raw, datatype, math.prod(value.dims))
        data = np.tile(sample, count // max(1, sample.size)) if sample.size else sample
    elif datatype is DataType.BYTES:  # zero or random: empty strings, as Triton
        data = np.empty(count, dtype=object)
        data[:] = [b""] * count
    elif kind == "random_data":
        data = _random(datatype, count)
    elif kind == "zero_data":
        data = np.zeros(count, dtype=datatype.numpy_dtype)
    else:
        raise load_failed(f"{where}: input '{name}' sets none of zero_data, random_data, input_data_file")
    return Tensor(name, datatype, shape, data.reshape(shape))


def _read_file(where: str, name: str, filename: str, model_folder: Path) -> bytes:
    relative = PurePath(model_folder.name, WARMUP_FOLDER, filename)
    path = scanner.checked_path(model_folder.parent, relative)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise load_failed(f"{where}: input '{name}': cannot read {relative}: {exc.strerror}") from None


def _from_bytes(where: str, name: str, raw: bytes, datatype: DataType, count: int) -> np.ndarray:
    """``count`` elements from a warm-up file: the whole file for BYTES (length-prefixed elements, as
    Triton reads it), the first ``count`` elements' bytes for the others (more is ignored, as Triton)."""
    if datatype is DataType.BYTES:
        try:
            return deserialize_bytes(raw, count)
        except WireFormatError as exc:  # the model's file: its load fails, nothing else
            raise load_failed(f"{where}: input '{name}': {exc}") from None
    needed = count * datatype.item_size
    if len(raw) < needed:
        raise load_failed(f"{where}: input '{name}' needs {needed} bytes, but its input_data_file holds {len(raw)}")
    return np.frombuffer(raw[:needed], dtype=datatype.numpy_dtype.newbyteorder("<")).astype(datatype.numpy_dtype)


def _random(datatype: DataType, count: int) -> np.ndarray:
    generator = np.random.default_rng()
    dtype = datatype.numpy_dtype
    if dtype == np.bool_:
        return generator.integers(0, 2, count).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return generator.integers(max(info.min, -128), min(info.max, 127), count, endpoint=True).astype(dtype)
    return generator.random(count).astype(dtype)


class SampleFailed(Exception):
    """A sample's run failed, in Triton 2.51's words (checked with run_triton.sh): ``failed to run warmup
    sample 'w': <the model's error>``."""

    def __init__(self, sample: str, cause: BaseException) -> None:
        why = cause.message if isinstance(cause, ShoalError) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"failed to run warmup sample '{sample}': {why}")


@dataclass(frozen=True)
class _WarmupRequest:
    """What a Python model reads of a queued request's core request (``runner.request_data``, ``sink_of``)."""

    id: str
    parameters: dict[str, Any] = field(default_factory=dict)
    sink: _StreamSink | None = None


@dataclass(frozen=True)
class _Queued:
    """A sample as the scheduler would queue it for a model that runs lists of requests."""

    feed: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    context: _WarmupRequest


class _StreamSink:
    """A decoupled model's warm-up responses, put from any thread: the first error kept, the FINAL flag awaited."""

    cancelled = False

    def __init__(self) -> None:
        self.error: ShoalError | None = None
        self.final = threading.Event()

    def put(self, item: Any, final: bool) -> None:
        if isinstance(item, ShoalError) and self.error is None:
            self.error = item
        if final:
            self.final.set()


def run_on_requests(
    model: Any,
    sample: Sample,
    decoupled: bool,
    batching: bool,
    admitted: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> None:
    """Run ``sample`` ``runs`` times on a model that takes queued requests (a Python model's
    ``run_requests``), each run inside ``admitted()`` (the rate limiter's hold); ShoalError with the
    model's own words if an execution failed. A batching model's sample of ``batch_size`` rows is that
    many requests of one row in one call of ``execute``, as Triton's core sends it
    (backend_model_instance.cc)."""
    feeds = [sample.feed]
    if batching and sample.feed:
        rows = next(iter(sample.feed.values())).shape[0]
        feeds = [{name: array[row : row + 1] for name, array in sample.feed.items()} for row in range(rows)]
    for _ in range(sample.runs):
        sinks = [_StreamSink() if decoupled else None for _ in feeds]
        queued = [
            _Queued(feed, sample.outputs, _WarmupRequest(f"warmup:{sample.name}", sink=sink))
            for feed, sink in zip(feeds, sinks, strict=True)
        ]
        with admitted():
            outcomes = model.run_requests(queued)
        for outcome in outcomes:
            if isinstance(outcome, ShoalError):
                raise outcome
        for sink in sinks:
            if sink is None:
                continue
            if not sink.final.wait(STREAM_TIMEOUT_S):
                raise ShoalError(
                    ErrorCode.INTERNAL,
                    f"the model sent no response with the FINAL flag within {STREAM_TIMEOUT_S:.0f} s",
                )
            if sink.error is not None:
                raise sink.error

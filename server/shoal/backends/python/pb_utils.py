"""``triton_python_backend_utils``: the module Triton's Python models import as ``pb_utils``.

The same names and behaviour model authors use with Triton's Python backend (its README and
``src/resources/triton_python_backend_utils.py``), written for Shoal: tensors are numpy arrays
in the model's process, requests and responses are plain objects, and a BLS request
(``InferenceRequest(...).exec()``) goes to the host through the link the runner installs
(``set_host_link``): a direct call in thread mode, the instance's pipe in process mode.
``shoal.backends.python.runner`` registers this module under the name
``triton_python_backend_utils`` before a model file is imported.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from shoal import custom_metrics
from shoal.protocol import codec
from shoal.protocol.types import DataType

logger = logging.getLogger("triton_python_backend_utils")

# Response sender flags and request flags, Triton's values.
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
# What a request carries as properties, not parameters (Triton's front end takes them out: timeout(), flags())
RESERVED_PARAMETERS = frozenset({"timeout", "priority", "sequence_id", "sequence_start", "sequence_end"})
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# TRITONSERVER_DataType values, in Triton's order.
TRITONSERVER_TYPE_INVALID = 0
_TYPE_ORDER = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
    "BF16",
)
TRITONSERVER_TYPE_BOOL, TRITONSERVER_TYPE_UINT8, TRITONSERVER_TYPE_UINT16, TRITONSERVER_TYPE_UINT32 = 1, 2, 3, 4
TRITONSERVER_TYPE_UINT64, TRITONSERVER_TYPE_INT8, TRITONSERVER_TYPE_INT16, TRITONSERVER_TYPE_INT32 = 5, 6, 7, 8
TRITONSERVER_TYPE_INT64, TRITONSERVER_TYPE_FP16, TRITONSERVER_TYPE_FP32, TRITONSERVER_TYPE_FP64 = 9, 10, 11, 12
TRITONSERVER_TYPE_BYTES, TRITONSERVER_TYPE_BF16 = 13, 14
_BY_CODE = {code: DataType(name) for code, name in enumerate(_TYPE_ORDER, start=1)}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """``TYPE_FP32`` (a config's spelling) → ``numpy.float32``; ``TYPE_STRING`` → ``numpy.object_``."""
    return DataType.from_config_name(triton_type_string).numpy_dtype.type


def triton_to_numpy_type(data_type: int) -> Any:
    """A TRITONSERVER_TYPE_* code → the numpy type (BYTES: ``numpy.object_``)."""
    datatype = _BY_CODE.get(data_type)
    return None if datatype is None else datatype.numpy_dtype.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """A numpy type → its TRITONSERVER_TYPE_* code (``numpy.object_`` and ``bytes_``: BYTES)."""
    try:
        name = DataType.from_numpy(np.dtype(data_type)).value
    except (TypeError, ValueError):
        return None
    return _TYPE_ORDER.index(name) + 1


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray:
    """BYTES elements as Triton lays them out: each a 4-byte little-endian length, then the bytes (an
    element that is no ``bytes`` as the UTF-8 of its ``str``, as Triton's)."""
    return np.frombuffer(codec.serialize_bytes(np.asarray(input_tensor)), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """The inverse of ``serialize_byte_tensor``: an object array of ``bytes``."""
    data, items, offset = bytes(encoded_tensor), [], 0
    while offset < len(data):
        length = int.from_bytes(data[offset : offset + 4], "little")
        items.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return np.array(items, dtype=np.object_)


def _text(value: Any) -> Any:
    """``bytes`` as the ``str`` they encode (UTF-8), anything else as it is.

    Triton's ``pb_utils`` classes are C++ behind pybind11, which takes ``bytes`` wherever it takes a
    string: its BLS example passes ``model_name.as_numpy()[0]``, the ``bytes`` of a BYTES input, as
    the model name. Shoal's take them the same way (names, ids, messages, JSON parameters).
    """
    return bytes(value).decode("utf-8") if isinstance(value, _BYTES_TYPES) else value


_BYTES_TYPES = (bytes, bytearray)


def _parameters_text(parameters: dict[str, Any] | str | bytes | None) -> str:
    """Parameters as the JSON text ``parameters()`` returns; none as ``{}`` without a JSON encoder (per request)."""
    parameters = _text(parameters)
    if isinstance(parameters, str):
        return parameters
    return json.dumps(parameters) if parameters else "{}"


def _encoded_now(array: np.ndarray) -> np.ndarray:
    """A BYTES array's elements as the ``bytes`` they are sent as, in an array of their own."""
    items = array.reshape(-1).tolist()
    encoded_items = codec.elements_bytes(items)
    if encoded_items is items:  # all bytes already: the same immutable elements, in an array of their own
        return array.copy()
    encoded = np.empty(array.shape, dtype=np.object_)
    encoded.reshape(-1)[:] = encoded_items
    return encoded


def _as_sent(response: Any) -> Any:
    """A response as it stands when it is sent: Triton's ``send`` copies its tensors (into shared memory)
    there, so the model may reuse its arrays at once (a response not built right is left for the runner
    to report)."""
    if not isinstance(response, InferenceResponse) or response.has_error():
        return response
    tensors = [
        Tensor._received(t.name(), np.array(t._wire_data(), copy=True)) if isinstance(t, Tensor) else t
        for t in response.output_tensors()
    ]
    return InferenceResponse(tensors, parameters=response.parameters())


def _name(value: str | bytes) -> str:
    """A name or id given as ``str`` or ``bytes`` (``_text``), as a ``str``."""
    return str(_text(value))


class TritonError:
    """An error a model returns in a response (``InferenceResponse(error=TritonError(...))``)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = str(_text(message)), code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


class TritonModelException(Exception):
    """What a model raises (and what a failed BLS ``exec`` may raise) in Triton's API."""

    def message(self) -> str:
        return str(self)


class Tensor:
    """A named tensor: numpy data on the CPU.

    A BYTES tensor is encoded when it is built, as Triton's is (its ``PbTensor`` runs
    ``serialize_byte_tensor`` in the constructor): what a response or a BLS call carries is the
    content the elements had then (each ``bytes`` as it is, anything else the UTF-8 of its ``str``),
    even if the model goes on to reuse the array for the next response. ``as_numpy`` gives the
    array the model passed, as Triton's does (a copy when it was not contiguous, as Triton's).
    A numeric tensor refers to the model's array, as Triton's: a response returned from ``execute``
    carries what the array holds when ``execute`` returns, one sent through a response sender what
    it held at ``send`` (``InferenceResponseSender`` copies it then, as Triton's does).
    """

    def __init__(self, name: str | bytes, data: Any, dtype: Any = None) -> None:
        array = np.asarray(data) if dtype is None else np.asarray(data, dtype=dtype)
        if array.dtype.kind in "SU":  # Triton keeps strings as BYTES objects
            array = array.astype(np.object_)
        if not array.flags.c_contiguous:  # a copy now, as Triton's PbTensor takes one (not a view read later)
            array = np.ascontiguousarray(array)
        self._name, self._data = _name(name), array
        self._sent = _encoded_now(array) if array.dtype == np.object_ else array

    @classmethod
    def _received(cls, name: str, array: np.ndarray) -> Tensor:
        """An input as the server hands it over: a ``str`` name and an array of a Triton datatype
        already (BYTES as ``bytes`` objects), so none of the constructor's conversions apply (per request)."""
        tensor = cls.__new__(cls)
        tensor._name, tensor._data, tensor._sent = name, array, array
        return tensor

    def _wire_data(self) -> np.ndarray:
        """What a response or a BLS call carries: the array, BYTES as encoded when the tensor was built."""
        return self._sent

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._data

    def shape(self) -> list[int]:
        return list(self._data.shape)

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._data.dtype)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data (numeric tensors only, as in Triton)."""
        return self._data.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor over any DLPack producer (a torch tensor, a numpy array) or capsule; CPU memory only."""
        producer = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        return Tensor(name, np.from_dlpack(producer))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._data.dtype})"


class _Capsule:
    """Wraps a bare DLPack capsule so numpy's ``from_dlpack`` accepts it."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def get_input_tensor_by_name(inference_request: Any, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor  # type: ignore[no-any-return]
    return None


def get_output_tensor_by_name(inference_response: Any, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor  # type: ignore[no-any-return]
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((item for item in model_config.get("input", ()) if item.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((item for item in model_config.get("output", ()) if item.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """Whether the config makes the model decoupled (``model_transaction_policy { decoupled: true }``)."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


class InferenceResponse:
    """One response: output tensors, or an error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or ())
        self._error = error
        self._parameters = _parameters_text(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class HostLink(Protocol):
    """How a model reaches the server: BLS calls and responses sent through a response sender."""

    def infer(self, request: InferenceRequest) -> InferenceResponse: ...

    def infer_async(self, request: InferenceRequest) -> Awaitable[InferenceResponse]: ...

    def infer_stream(self, request: InferenceRequest) -> Iterator[InferenceResponse]: ...


_host: HostLink | None = None


def set_host_link(link: HostLink | None) -> None:
    """Installed by the runner: where ``InferenceRequest.exec`` sends its request."""
    global _host
    _host = link


# Triton's words for a BLS call while no link is installed (in ``initialize``, or outside a server).
BLS_OUTSIDE_EXECUTE = "BLS is only supported during the 'execute' function."


def _link() -> HostLink:
    if _host is None:
        raise TritonModelException(BLS_OUTSIDE_EXECUTE)
    return _host


class InferenceResponseSender:
    """A request's response sender: responses sent here answer it (with FINAL as the last flag).

    For a decoupled model the runner gives it ``on_send``: each response goes on to the client as
    it is sent, from whichever thread sends it (Triton's repeat example sends from its own thread
    after ``execute`` returned); otherwise the responses are kept for ``execute``'s caller.
    """

    def __init__(
        self, request: InferenceRequest, on_send: Callable[[InferenceResponse | None, bool], None] | None = None
    ) -> None:
        self._request: InferenceRequest | None = request
        self._on_send = on_send
        self._lock = threading.Lock()
        self.responses: list[InferenceResponse] = []
        self.final = False
        self.closed = threading.Event()  # set with the FINAL flag, or when the client is gone
        self.cancelled = False
        self._detached = False  # the batch is over: what is sent goes nowhere

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        response = _as_sent(response)
        with self._lock:  # one sender may be used from several threads; FINAL closes it once
            if self.final:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            self.final = final
            if self._on_send is not None:
                self._on_send(response, final)
            elif response is not None and not self._detached:
                self.responses.append(response)
        if final:
            self.closed.set()

    def is_cancelled(self) -> bool:
        """The request's word while its batch runs (``InferenceRequest.is_cancelled``), then the last one."""
        request = self._request
        return self.cancelled or (request is not None and request.is_cancelled())

    def cancel(self) -> None:
        """The client is gone: ``is_cancelled`` says so (the request's too, for good), and nobody waits for
        FINAL any longer."""
        self.cancelled = True
        request = self._request
        if request is not None:
            request._cancelled = True
        self.closed.set()

    def _detach(self) -> None:
        """The batch is over: the sender lets go of its request and of where responses went (they refer
        to the request's inputs, views of memory the request owned, which would otherwise wait for a full
        collection), and keeps what it says: a model thread asking for it later gets this one, closed
        (FINAL: a send raises; cancelled: a send goes nowhere), never a fresh one that piles responses up."""
        with self._lock:
            self._request, self._on_send, self._detached = None, None, True


class InferenceTrace:
    """A request's trace, as ``request.trace()`` gives it; pass it as ``InferenceRequest(trace=...)`` to
    nest a BLS call's trace under the request's (Triton traces the call only then). ``trace_id`` 0: the
    request is not traced."""

    def __init__(self, trace_id: int = 0, context: str = "") -> None:
        self.trace_id = trace_id
        self._context = context

    def get_context(self) -> str | None:
        """The trace's OpenTelemetry context, as Triton's: a JSON object whose ``traceparent`` names the
        model's span (and the client's ``tracestate``), for the model to continue the trace in what it
        calls; None when the request is not traced or the mode is not opentelemetry."""
        return self._context or None


class InferenceRequest:
    """A request: one the model received, or one it builds to call another model (BLS)."""

    def __init__(
        self,
        model_name: str | bytes = "",
        inputs: Iterable[Tensor] = (),
        requested_output_names: Iterable[str | bytes] = (),
        request_id: str | bytes = "",
        correlation_id: int | str | bytes = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._model_name, self._model_version = _name(model_name), model_version
        self._inputs = list(inputs)
        self._requested = [_name(name) for name in requested_output_names]
        self._request_id = _name(request_id)
        self._correlation_id: int | str = _text(correlation_id)
        self._flags, self._timeout = flags, timeout
        self._parameters: str | dict[str, Any] = _parameters_text(parameters)
        self._sender: InferenceResponseSender | None = None
        self._cancelled = False
        self._probe: Callable[[], bool] | None = None  # while a decoupled batch runs: has the client left?
        self._trace = trace if isinstance(trace, InferenceTrace) else InferenceTrace()

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> set[str]:
        """A set, as Triton 2.51's (run on ``run_triton.sh``): a model may use set operations on it."""
        return set(self._requested)

    def request_id(self) -> str:
        return self._request_id

    def trace(self) -> InferenceTrace:
        return self._trace

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    @classmethod
    def _received(
        cls,
        inputs: list[Tensor],
        requested_output_names: list[str],
        request_id: str,
        correlation_id: int | str,
        parameters: dict[str, Any],
        trace: InferenceTrace,
    ) -> InferenceRequest:
        """A request the model receives, from values the server checked already: its parameters (a dict
        of the request's own) become JSON text only if the model asks for them (most never do)."""
        request = cls.__new__(cls)
        request._model_name, request._model_version = "", -1
        request._inputs, request._requested = inputs, requested_output_names
        request._request_id, request._correlation_id = request_id, correlation_id
        request._flags, request._timeout = 0, 0
        if parameters and not RESERVED_PARAMETERS.isdisjoint(parameters):
            # Properties of the request, not parameters, as Triton's front end takes them out.
            timeout = parameters.pop("timeout", 0)
            request._timeout = timeout if isinstance(timeout, int) and not isinstance(timeout, bool) else 0
            if parameters.pop("sequence_start", False) is True:
                request._flags |= TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
            if parameters.pop("sequence_end", False) is True:
                request._flags |= TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
            parameters.pop("sequence_id", None)
            parameters.pop("priority", None)
        request._parameters = parameters if parameters else "{}"
        request._sender, request._cancelled, request._probe, request._trace = None, False, None, trace
        return request

    def parameters(self) -> str:
        """The request's parameters as a JSON string, as Triton gives them."""
        if not isinstance(self._parameters, str):  # a received request's, made text on first use
            self._parameters = _parameters_text(self._parameters)
        return self._parameters

    def is_cancelled(self) -> bool:
        """Whether the request's client left: asked of the server while its decoupled batch runs (during
        ``execute`` too, where a model streams until it is cancelled), and true for good once it was."""
        if not self._cancelled and self._probe is not None and self._probe():
            self._cancelled = True
        return self._cancelled

    def set_release_flags(self, flags: int) -> None:
        """Accepted for compatibility: Shoal releases every request when its responses are in."""

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            self._sender = InferenceResponseSender(self)
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on the named model of the same server and wait for its response; with
        ``decoupled=True`` an iterator of the responses as they come (the last may be empty, when
        the model sent its FINAL flag alone), as Triton's."""
        if decoupled:
            return _link().infer_stream(self)
        return _link().infer(self)

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """Like ``exec``, awaited (from an ``async def execute``); several may run at once. With
        ``decoupled=True`` it resolves once the first response came, to an iterator of the responses
        (that one first, the rest read as it is iterated), as Triton's stub resolves it."""
        if decoupled:
            return _first_came(_link().infer_stream(self))  # the call is made here, not when awaited
        return _link().infer_async(self)


async def _first_came(responses: Iterator[InferenceResponse]) -> Iterator[InferenceResponse]:
    """``responses`` once its first has come, read on a thread of the running loop's executor (the
    loop goes on with the model's other awaits meanwhile). A stream always has a first response
    (its last may be empty, the FINAL flag alone)."""
    first = await asyncio.get_running_loop().run_in_executor(None, next, responses)
    return itertools.chain((first,), responses)


class Logger:
    """Triton's model logger; lines go to Shoal's logging (logger ``triton_python_backend_utils``)."""

    INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3
    _LEVELS = {INFO: logging.INFO, WARNING: logging.WARNING, ERROR: logging.ERROR, VERBOSE: logging.DEBUG}

    @classmethod
    def log(cls, message: str, level: int = INFO) -> None:
        logger.log(cls._LEVELS.get(level, logging.INFO), "%s", _text(message))

    @classmethod
    def log_info(cls, message: str) -> None:
        logger.info("%s", _text(message))

    @classmethod
    def log_warn(cls, message: str) -> None:
        logger.warning("%s", _text(message))

    @classmethod
    def log_error(cls, message: str) -> None:
        logger.error("%s", _text(message))

    @classmethod
    def log_verbose(cls, message: str) -> None:
        logger.debug("%s", _text(message))


class LogLevel:
    INFO, WARNING, ERROR, VERBOSE = Logger.INFO, Logger.WARNING, Logger.ERROR, Logger.VERBOSE


class MetricsLink(Protocol):
    """How a model's metrics reach the server's registry (``shoal.custom_metrics``): the registry itself
    for a thread instance (``custom_metrics.InstanceMetrics``), a pipe to the server for a worker
    process (``shoal.instances.metrics_pipe``). Each call is answered by the server, so instances share
    a series; refusals raise ``CustomMetricError`` in Triton's words."""

    instance_name: str

    def family(self, name: str, description: str, kind: int) -> None: ...

    def metric(self, name: str, labels: dict[str, str], buckets: list[float] | None) -> int: ...

    def increment(self, series_id: int, value: float) -> None: ...

    def set(self, series_id: int, value: float) -> None: ...

    def observe(self, series_id: int, value: float) -> None: ...

    def value(self, series_id: int) -> float: ...

    def release(self, name: str) -> None: ...


_metrics: MetricsLink | None = None  # the process's: a worker's pipe, or the server's registry
_metrics_here = threading.local()  # a thread instance's own, while its initialize, execute or finalize runs


def set_metrics_link(link: MetricsLink | None, this_thread: bool = False) -> None:
    """Installed by the runner: where ``MetricFamily`` and ``Metric`` go, for the process or this thread."""
    global _metrics
    if this_thread:
        _metrics_here.link = link
    else:
        _metrics = link


def _metrics_link() -> MetricsLink:
    link: MetricsLink | None = getattr(_metrics_here, "link", None) or _metrics
    if link is None:
        raise TritonModelException("custom metrics need the model to be served by a Shoal server")
    return link


def _refused(link: MetricsLink, exc: custom_metrics.CustomMetricError) -> str:
    return f"Failed to process the request for model '{link.instance_name}', message: {exc}"


class MetricFamily:
    """Triton's custom metric family: a name, a description and a kind, shared by the server's models
    (two made with one name and kind are one family; a name taken by another kind is refused). The
    family and its series live while an object made for it does (and its instance is loaded)."""

    COUNTER, GAUGE, HISTOGRAM = custom_metrics.COUNTER, custom_metrics.GAUGE, custom_metrics.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:
        if not isinstance(name, str) or not isinstance(description, str) or kind not in custom_metrics.KIND_NAMES:
            raise TypeError("MetricFamily(name: str, description: str, kind: MetricFamily.COUNTER, GAUGE or HISTOGRAM)")
        self._link = _metrics_link()
        # Plain values: a str subclass (an enum's) might not unpickle in the server, and pybind takes its text.
        name, description = str.__str__(name), str.__str__(description)
        self._name, self._kind = name, int(kind)
        try:
            self._link.family(name, description, self._kind)
        except custom_metrics.CustomMetricError as exc:
            raise TritonModelException(f"Error when creating MetricFamily: {_refused(self._link, exc)}") from None
        weakref.finalize(self, self._link.release, name)

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        """The family's series with these labels (made if new; one series per labels, server-wide)."""
        return Metric(self, labels, buckets)


class Metric:
    """One series of a family: a counter's or a gauge's value, or a histogram's observations. Its
    operations are the server's, answered there (``value()`` reads what every instance added). It
    keeps its family's object alive (Triton refuses its operations once the family is deleted)."""

    def __init__(
        self, family: MetricFamily, labels: dict[str, str] | None = None, buckets: list[float] | None = None
    ) -> None:
        self._family, self._link = family, family._link
        if family._kind == MetricFamily.HISTOGRAM and buckets is None:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        if family._kind != MetricFamily.HISTOGRAM and buckets is not None:
            raise TritonModelException("Failed to create metric. Unexpected buckets found.")
        plain = {
            str.__str__(key) if isinstance(key, str) else key: str.__str__(value) if isinstance(value, str) else value
            for key, value in dict(labels or {}).items()
        }
        try:
            self._id = self._link.metric(family._name, plain, None if buckets is None else [float(b) for b in buckets])
        except custom_metrics.CustomMetricError as exc:
            raise TritonModelException(f"Error when creating Metric: {_refused(self._link, exc)}") from None

    def increment(self, value: float) -> None:
        self._act("increment", "Failed to increment metric value", value)

    def set(self, value: float) -> None:
        self._act("set", "Failed to set metric value", value)

    def observe(self, value: float) -> None:
        self._act("observe", "Failed to observe metric value", value)

    def value(self) -> float:
        try:
            return self._link.value(self._id)
        except custom_metrics.CustomMetricError as exc:
            raise TritonModelException(f"Failed to get metric value: {_refused(self._link, exc)}") from None

    def _act(self, operation: str, failed: str, value: float) -> None:
        if isinstance(value, bool | str | bytes) or not isinstance(value, int | float | np.number):
            raise TypeError(f"{operation}(): the value must be a number, not {type(value).__name__}")
        try:
            getattr(self._link, operation)(self._id, float(value))
        except custom_metrics.CustomMetricError as exc:
            raise TritonModelException(f"{failed}: {_refused(self._link, exc)}") from None

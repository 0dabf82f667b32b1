"""BLS: a Python model's ``InferenceRequest(...).exec()`` served by the same server's core.

A call becomes a ``BlsCall`` (plain, picklable: it crosses the instance's pipe in process mode),
then the core's ``InferRequest``; the host runs it through the target model's own version, so
its scheduler, batching and statistics apply as to any client's request (never through gRPC).
The lifecycle passes the host's entry point down as a ``HostInfer``: a callable that starts the
request on the server's event loop and returns a ``concurrent.futures.Future``, so it can be
called from an instance thread and never runs a model on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shoal.backends.python import pb_utils
from shoal.errors import ShoalError
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, Tensor

logger = logging.getLogger(__name__)

# The host's entry point: (request, sink or None, caller=...) -> the execution's future; with a sink (a
# BLS ``exec(decoupled=True)``) a decoupled model's responses go to ``sink.put(item, final)`` as they
# come. ``caller`` is the calling model's version as the lifecycle gave it (``bind_host``), or None
# when unknown; the host refuses a call that would wait for the very instance that makes it.

HostInfer = Callable[..., "concurrent.futures.Future[InferResponse]"]
_ENDED = object()  # queued after a streaming call's last response: its execution ended
_running = threading.local()  # thread mode: the calling version, on a thread running its instance's execute


def _caller_here() -> Any:
    return getattr(_running, "caller", None)


@dataclass(frozen=True)
class BlsCall:
    model_name: str
    model_version: str  # "": the newest ready version
    request_id: str
    inputs: Mapping[str, np.ndarray]
    requested: tuple[str, ...]
    parameters: Mapping[str, Any] = field(default_factory=dict)
    decoupled: bool = False  # exec(decoupled=True): any number of responses, the last one final
    trace_id: int = 0  # InferenceRequest(trace=request.trace()): the calling request's trace, to nest under


@dataclass(frozen=True)
class BlsResult:
    outputs: Mapping[str, np.ndarray] | None = None
    error: str = ""


class CallbackSink:
    """Where a decoupled model puts a BLS call's responses (from any thread): on to ``deliver``."""

    cancelled = False

    def __init__(self, deliver: Callable[[BlsResult, bool], None]) -> None:
        self._deliver = deliver

    def put(self, item: Mapping[str, np.ndarray] | ShoalError | None, final: bool) -> None:
        if isinstance(item, ShoalError) and not final:
            # Triton 2.51's BLS iterator leaves out an error response sent before FINAL (checked with
            # run_triton.sh: fails_midway's responses 1, 2, <error>, 4 iterate as 1, 2, 4).
            logger.warning("a BLS call's response was an error, left out as Triton does: %s", item.message)
            return
        self._deliver(part_result(item), final)


def part_result(item: Mapping[str, np.ndarray] | ShoalError | None) -> BlsResult:
    """One streamed response as a BlsResult: outputs, an error, or no outputs (a bare FINAL flag)."""
    if isinstance(item, ShoalError):
        return BlsResult(error=item.message)
    return BlsResult(outputs=dict(item or {}))


def streamed(host: HostInfer | None, call: BlsCall, caller: Any = None) -> Iterator[tuple[BlsResult, bool]]:
    """A decoupled call's responses as they come, in the calling thread; the last one is final.

    The call starts here, when it is made, as Triton's does (and a process instance's, sent at once):
    not when its responses are first read, or calls of one sequence read in another order than made
    would reach the model in that order, and a call never read would never run.
    A model that is not decoupled gives its one response; a failure (or an execution that ended
    without FINAL) ends the iteration with an error or empty final response.
    """
    items: queue.SimpleQueue[tuple[Any, bool]] = queue.SimpleQueue()
    future = start(host, call, CallbackSink(lambda result, final: items.put((result, final))), caller)
    future.add_done_callback(lambda _: items.put((_ENDED, True)))
    return _responses(items, future)


def _responses(
    items: queue.SimpleQueue[tuple[Any, bool]], future: concurrent.futures.Future[InferResponse]
) -> Iterator[tuple[BlsResult, bool]]:
    while True:
        result, final = items.get()
        if result is _ENDED:
            ended = result_of(future)
            yield (ended if ended.outputs is None or ended.outputs else BlsResult(outputs={})), True
            return
        yield result, final
        if final:
            return


def call_of(request: pb_utils.InferenceRequest, decoupled: bool = False) -> BlsCall:
    version = request.model_version()
    parameters = json.loads(request.parameters() or "{}")
    if request.timeout():
        parameters.setdefault("timeout", int(request.timeout()))
    # A call into a sequence-batched model: the correlation id and flags as a client's request parameters.
    if request.correlation_id() not in (0, ""):
        parameters.setdefault("sequence_id", request.correlation_id())
    if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
        parameters.setdefault("sequence_start", True)
    if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
        parameters.setdefault("sequence_end", True)
    return BlsCall(
        request.model_name(),
        "" if version < 0 else str(version),
        request.request_id(),
        {tensor.name(): tensor._wire_data() for tensor in request.inputs()},
        tuple(request._requested),  # in the order the model named them
        parameters,
        decoupled,
        request.trace().trace_id,
    )


def core_request(call: BlsCall) -> InferRequest:
    tensors = []
    for name, data in call.inputs.items():
        array = np.asarray(data)
        tensors.append(Tensor(name, DataType.from_numpy(array.dtype), tuple(array.shape), array))
    return InferRequest(
        model_name=call.model_name,
        model_version=call.model_version,
        id=call.request_id,
        inputs=tuple(tensors),
        requested_outputs=call.requested or None,
        parameters=dict(call.parameters),
    )


def result_of(future: concurrent.futures.Future[InferResponse]) -> BlsResult:
    """The finished future's outputs, or its error's message (a ShoalError's own text)."""
    try:
        response = future.result()
    except ShoalError as exc:
        return BlsResult(error=exc.message)
    except Exception as exc:  # noqa: BLE001 - the calling model sees it as response.error()
        return BlsResult(error=f"{type(exc).__name__}: {exc}")
    return BlsResult({tensor.name: tensor.data for tensor in response.outputs})


def _copied(result: BlsResult) -> BlsResult:
    """``result`` with outputs of its own (a thread-mode caller's)."""
    if not result.outputs:
        return result
    return BlsResult({name: np.array(data, copy=True) for name, data in result.outputs.items()})


def _own_call(request: pb_utils.InferenceRequest, decoupled: bool = False) -> BlsCall:
    """A thread-mode call with inputs of its own, copied when it is made, as a process instance's
    call is packed into its arena then and Triton's stub copies it into its shared memory: the
    caller may fill the same array again while its ``async_exec`` call is still queued."""
    call = call_of(request, decoupled)
    return replace(call, inputs={name: np.array(data, copy=True) for name, data in call.inputs.items()})


def response_of(result: BlsResult) -> pb_utils.InferenceResponse:
    if result.outputs is None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(result.error))
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor._received(name, np.asarray(data)) for name, data in result.outputs.items()]
    )


def start(
    host: HostInfer | None, call: BlsCall, sink: Any = None, caller: Any = None
) -> concurrent.futures.Future[InferResponse]:
    """Hand ``call`` to the host; a failed future when the model is not served by a server."""
    if host is not None:
        try:
            return host(core_request(call), sink, caller=caller, trace_id=call.trace_id)
        except Exception as exc:  # noqa: BLE001 - e.g. a datatype numpy has and Triton has not
            failed: concurrent.futures.Future[InferResponse] = concurrent.futures.Future()
            failed.set_exception(exc)
            return failed
    failed = concurrent.futures.Future()
    failed.set_exception(RuntimeError("BLS needs the model to be served by a Shoal server"))
    return failed


@contextlib.contextmanager
def running_as(caller: Any) -> Iterator[None]:
    """While a thread instance runs ``execute`` on this thread, its BLS calls from this thread name
    ``caller``. Only this thread: the link is one for the whole server (``pb_utils.set_host_link``), and
    a thread the model started cannot be told apart from another model's, so its calls name no caller."""
    previous = getattr(_running, "caller", None)
    _running.caller = caller
    try:
        yield
    finally:
        _running.caller = previous


@contextlib.contextmanager
def initializing() -> Iterator[None]:
    """While a thread instance's ``initialize`` runs on this thread: its BLS calls raise Triton's
    ``TritonModelException`` (another thread model's link may be installed, and would serve them)."""
    _running.initializing = True
    try:
        yield
    finally:
        _running.initializing = False


def _refuse_in_initialize() -> None:
    if getattr(_running, "initializing", False):
        raise pb_utils.TritonModelException(pb_utils.BLS_OUTSIDE_EXECUTE)


class ThreadLink:
    """In thread mode: BLS calls go straight to the host from the calling thread. The caller gets
    copies of the outputs, as a process instance's caller does (read from the arena) and as Triton's
    stub does: the callee's arrays may be its own (a table it returns) or another request's."""

    def __init__(self, host: HostInfer | None) -> None:
        self.host = host

    def infer(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        _refuse_in_initialize()
        return response_of(_copied(result_of(start(self.host, _own_call(request), caller=_caller_here()))))

    def infer_stream(self, request: pb_utils.InferenceRequest) -> Iterator[pb_utils.InferenceResponse]:
        _refuse_in_initialize()
        parts = streamed(self.host, _own_call(request, decoupled=True), _caller_here())
        return (response_of(_copied(result)) for result, _ in parts)

    def infer_async(self, request: pb_utils.InferenceRequest) -> Awaitable[pb_utils.InferenceResponse]:
        _refuse_in_initialize()
        future = start(self.host, _own_call(request), caller=_caller_here())

        async def wait() -> pb_utils.InferenceResponse:
            await asyncio.wait([asyncio.wrap_future(future)])  # a failure is read below, not raised
            return response_of(_copied(result_of(future)))

        return wait()

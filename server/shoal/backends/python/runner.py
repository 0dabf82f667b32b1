"""Runs a ``TritonPythonModel``: import ``model.py``, ``initialize(args)``, ``execute`` batches, ``finalize``.

The same code runs in an instance's worker process (the default) and on an instance thread in
the server (``process_instances: false``); only the ``HostLink`` that carries BLS calls differs.
A batch is a list of requests, never concatenated (Triton does not concatenate for Python
models). Each request gets its own outcome: its outputs, or an error with Triton's wording
where Triton has one (an ``execute`` that raises, a wrong number of responses), so one bad
request never fails the server and a failing ``execute`` fails only its batch.

What the model's code raises is caught whatever it is, ``BaseException`` included: ``sys.exit``
(argparse on bad arguments calls it), ``KeyboardInterrupt``, ``asyncio.CancelledError`` or
``GeneratorExit`` in ``execute`` fails that batch's requests with Triton's execute wording, in
``initialize`` fails that load, in ``finalize`` is logged while the unload goes on. In a thread
instance such an exception would otherwise reach the server's event loop and stop the server or
read as the server's own cancellation; in a worker process it would end the worker. The ones that
are no ``Exception`` are logged once, since the model meant to stop more than its batch.

A thread instance imports its folder's files in an import context of its own
(``shoal.backends.python.imports``: the rule is written there); a worker process puts the folder
first on its ``sys.path``, as Triton's stub does, the process being the model's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shoal.backends.python import pb_utils
from shoal.backends.python.imports import UTILS_NAME, ModelImports
from shoal.errors import ErrorCode, ShoalError
from shoal.protocol.types import DataType
from shoal.repository import config_json

logger = logging.getLogger(__name__)

MODULE_NAME = UTILS_NAME
_HIDDEN_FRAMES = (str(Path(__file__).resolve().parents[2]), str(Path(asyncio.__file__).parent), "<frozen importlib.")
# TritonError codes → the names of Shoal's error codes (shoal.errors.ErrorCode values).
_ERROR_CODES = {
    pb_utils.TritonError.INVALID_ARG: "invalid_argument",
    pb_utils.TritonError.NOT_FOUND: "not_found",
    pb_utils.TritonError.UNAVAILABLE: "unavailable",
    pb_utils.TritonError.UNSUPPORTED: "unsupported",
    pb_utils.TritonError.ALREADY_EXISTS: "already_exists",
}


# A decoupled model's response on its way out: (request index in the batch, its outcome or None for
# a bare FINAL flag, whether it is the final one).
Emit = Callable[[int, "Outcome | None", bool], None]
CANCEL_POLL_S = 0.05  # how often a batch waiting for FINAL flags looks for requests the client gave up


@dataclass(slots=True)
class RequestData:
    """One request of a batch, as the model receives it. Made per request on both sides of a process
    instance's pipe, and read once (``ModelRunner._requests``): slotted, not frozen (a frozen dataclass
    sets each field through ``object.__setattr__``, 3x the cost to make)."""

    inputs: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]  # the outputs to return (the requested ones, else all)
    request_id: str = ""
    correlation_id: int | str = 0
    parameters: Mapping[str, Any] = field(default_factory=dict)
    trace_id: int = 0  # the request's trace, when it is sampled: a BLS call made with trace= nests under it
    trace_context: str = ""  # its OpenTelemetry context (``trace().get_context()``); "": none


@dataclass(frozen=True)
class Outcome:
    """A request's result: its outputs, or an error (``code``: a shoal ErrorCode value)."""

    outputs: dict[str, np.ndarray] | None = None
    error: str = ""
    code: str = "internal"

    def result(self) -> dict[str, np.ndarray] | ShoalError:
        """What the scheduler hands back to the request: its outputs, or the error to raise."""
        return self.outputs if self.outputs is not None else ShoalError(ErrorCode(self.code), self.error)


def request_data(
    feed: Mapping[str, np.ndarray], outputs: Sequence[str], request: Any, traced: Any = None
) -> RequestData:
    """A queued request as the model sees it; ``request`` is the core's InferRequest (None in tests),
    ``traced`` its trace when it is sampled (the pending request's)."""
    trace_id, context = (traced.id, traced.context()) if traced is not None else (0, "")
    if request is None:
        return RequestData(feed, tuple(outputs), trace_id=trace_id, trace_context=context)
    parameters = dict(request.parameters)
    sequence_id = parameters.get("sequence_id", 0)
    return RequestData(feed, tuple(outputs), request.id, sequence_id, parameters, trace_id, context)


def install_utils() -> None:
    """Make ``import triton_python_backend_utils`` find Shoal's module."""
    sys.modules.setdefault(MODULE_NAME, pb_utils)


def import_model_class(model_file: Path, imports: ModelImports | None = None) -> Any:
    """Import ``model_file`` and return its ``TritonPythonModel``: within ``imports`` (a thread
    instance's own context), else as Triton does, its folder first on ``sys.path`` (a process of its own)."""
    install_utils()
    module = _import_on_path(model_file) if imports is None else imports.load(model_file)
    model_class = getattr(module, "TritonPythonModel", None)
    if model_class is None:
        raise AttributeError(f"{model_file.name} defines no class TritonPythonModel")
    return model_class


def _import_on_path(model_file: Path) -> Any:
    folder = str(model_file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    digest = hashlib.sha1(str(model_file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"shoal_python_model_{digest}", model_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {model_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def describe_error(exc: BaseException) -> str:
    """``Type: message`` then Triton's ``At:`` frames (innermost first), as its load and execute errors read.

    Frames of Shoal, asyncio and the import machinery are left out: the model author's own code is
    what the frames show.
    """
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError):
        return text
    frames = [
        frame for frame in traceback.extract_tb(exc.__traceback__) if not frame.filename.startswith(_HIDDEN_FRAMES)
    ]
    if not frames:
        return text
    lines = [f"  {frame.filename}({frame.lineno}): {frame.name}" for frame in reversed(frames)]
    return text + "\n\nAt:\n" + "\n".join(lines) + "\n"


def model_args(
    config: Mapping[str, Any], model_file: Path, instance_name: str, kind: str, device_id: int, version: int
) -> dict[str, str]:
    """``initialize``'s ``args``, the keys and string values Triton's Python backend gives."""
    return {
        "model_config": json.dumps(config_json.model_config(dict(config))),
        "model_instance_kind": kind,
        "model_instance_name": instance_name,
        "model_instance_device_id": str(device_id),
        "model_repository": str(model_file.parent.parent),
        "model_version": str(version),
        "model_name": str(config.get("name", "")),
    }


_INTEGER_LISTS = {"dims", "shape", "preferred_batch_size"}
_INTEGER_KEYS = {"max_queue_delay_microseconds", "default_timeout_microseconds", "max_queue_size"}


def triton_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The completed config as Triton's JSON has it: numbers as numbers, the fields models read present."""

    def fix(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: fix(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [int(v) if key in _INTEGER_LISTS else fix(v) for v in value]
        return int(value) if key in _INTEGER_KEYS and isinstance(value, str) else value

    fixed: dict[str, Any] = fix(dict(config))
    for key, default in (
        ("platform", ""),
        ("backend", "python"),
        ("max_batch_size", 0),
        ("input", []),
        ("output", []),
        ("parameters", {}),
        ("instance_group", []),
    ):
        fixed.setdefault(key, default)
    return fixed


class ModelRunner:
    """One instance of a Python model: the user's object, its output datatypes, its event loop.

    ``isolated``: import the model's files in an import context of this instance's own (a thread
    instance), released by ``finalize`` or by a failed start. ``metrics``: where the model's custom
    metrics go while its code runs on the calling thread (a thread instance's; a worker process
    installs its pipe for the whole process instead).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        model_file: Path,
        args: dict[str, str],
        isolated: bool = False,
        metrics: pb_utils.MetricsLink | None = None,
    ) -> None:
        self.instance_name = args["model_instance_name"]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._imports = ModelImports(model_file.parent) if isolated else None
        self._metrics = metrics
        try:
            with self._metrics_here():
                self.model = import_model_class(model_file, self._imports)()
                initialize = getattr(self.model, "initialize", None)
                if initialize is not None:
                    self._await(initialize(args))
        except BaseException:
            self._release()
            raise

    @contextlib.contextmanager
    def _metrics_here(self) -> Iterator[None]:
        """While the model's code runs on this thread, its metrics go to this instance's link."""
        if self._metrics is None:
            yield
            return
        pb_utils.set_metrics_link(self._metrics, this_thread=True)
        try:
            yield
        finally:
            pb_utils.set_metrics_link(None, this_thread=True)

    def _await(self, result: Any) -> Any:
        """A coroutine (async initialize/execute) runs to its end on this instance's loop; else as is."""
        if not inspect.isawaitable(result):
            return result
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(result)

    @staticmethod
    def _requests(items: Sequence[RequestData]) -> list[pb_utils.InferenceRequest]:
        received, wrapped = pb_utils.InferenceRequest._received, pb_utils.Tensor._received
        return [
            received(
                [wrapped(name, array) for name, array in item.inputs.items()],
                list(item.outputs),
                item.request_id,
                item.correlation_id,
                dict(item.parameters),
                pb_utils.InferenceTrace(item.trace_id, item.trace_context),
            )
            for item in items
        ]

    def execute_decoupled(
        self, items: Sequence[RequestData], emit: Emit, is_cancelled: Callable[[int], bool] = lambda index: False
    ) -> None:
        """Run a decoupled model's batch: each response goes to ``emit`` as the model sends it.

        Returns once every request got its FINAL flag (possibly from the model's own threads after
        ``execute`` returned) or was cancelled, so the instance is held until then. An ``execute``
        that raises or returns something other than None closes the requests still open with an
        error response, as Triton's Python backend does.
        """
        requests = self._requests(items)
        senders = []
        for index, (item, request) in enumerate(zip(items, requests, strict=True)):
            sender = pb_utils.InferenceResponseSender(request, functools.partial(self._forward, emit, index, item))
            request._sender = sender
            request._probe = functools.partial(is_cancelled, index)
            senders.append(sender)
        try:
            with self._metrics_here():
                self._run_decoupled(requests, senders, is_cancelled)
        finally:
            # A request and its sender refer to each other: without this, the request's inputs (views of
            # memory the request owned, such as a front-end worker's arena) would wait for a full
            # garbage collection after the stream ended, not go with the last reference.
            _batch_over(requests)

    def _run_decoupled(
        self,
        requests: list[pb_utils.InferenceRequest],
        senders: list[pb_utils.InferenceResponseSender],
        is_cancelled: Callable[[int], bool],
    ) -> None:
        try:
            returned = self._await(self.model.execute(requests))
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the batch fails, the instance goes on
            message = f"Failed to process the request(s) for model '{self.instance_name}', message: {self._raised(exc)}"
            return self._close_open(senders, message)
        if returned is not None:
            return self._close_open(
                senders,
                f"Python model '{self.instance_name}' is using the decoupled mode "
                "and the execute function must return None.",
            )
        # Until every request is FINAL or cancelled; each tick passes on every open request's
        # cancellation, not only the one waited on (a later request's client may leave first).
        open_senders = list(enumerate(senders))
        while open_senders:
            open_senders[0][1].closed.wait(CANCEL_POLL_S)
            for index, sender in open_senders:
                if not sender.closed.is_set() and is_cancelled(index):
                    sender.cancel()
            open_senders = [(index, sender) for index, sender in open_senders if not sender.closed.is_set()]

    def _forward(self, emit: Emit, index: int, item: RequestData, response: Any, final: bool) -> None:
        emit(index, None if response is None else self._outcome(item, response), final)

    @staticmethod
    def _close_open(senders: Sequence[pb_utils.InferenceResponseSender], message: str) -> None:
        for sender in senders:
            try:
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                    pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            except pb_utils.TritonModelException:
                pass  # it was closed already

    def execute(self, items: Sequence[RequestData]) -> list[Outcome]:
        requests = self._requests(items)
        metrics = self._metrics  # as ``_metrics_here``, without a generator's cost on every batch
        if metrics is not None:
            pb_utils.set_metrics_link(metrics, this_thread=True)
        try:
            return self._execute(items, requests)
        finally:
            if metrics is not None:
                pb_utils.set_metrics_link(None, this_thread=True)
            _batch_over(requests)  # a sender the model asked for refers back to its request: a cycle

    def _execute(self, items: Sequence[RequestData], requests: list[pb_utils.InferenceRequest]) -> list[Outcome]:
        try:
            returned = self._await(self.model.execute(requests))
            responses = None if returned is None else list(returned)  # a generator runs the model's code here
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the batch fails, the instance goes on
            return self._failed(items, self._raised(exc))
        if responses is None:  # the responses may have gone through the response senders
            responses = [self._sent(request) for request in requests]
            if any(response is None for response in responses):
                return self._failed(
                    items,
                    "execute returned None, and not every request was answered "
                    "through its response sender with TRITONSERVER_RESPONSE_COMPLETE_FINAL",
                )
        if len(responses) != len(requests):
            return self._failed(
                items,
                "Number of InferenceResponse objects do not match the number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, "
                f"and InferenceResponse(s) size is:{len(responses)}\n",
            )
        return [self._outcome(item, response) for item, response in zip(items, responses, strict=True)]

    def _raised(self, exc: BaseException) -> str:
        """The text of what ``execute`` raised; one that is no Exception (SystemExit...) is logged too."""
        text = describe_error(exc)
        if not isinstance(exc, Exception):
            logger.error(
                "model instance %s: execute raised %s; only this batch fails", self.instance_name, text.rstrip()
            )
        return text

    def _failed(self, items: Sequence[RequestData], message: str) -> list[Outcome]:
        text = f"Failed to process the request(s) for model '{self.instance_name}', message: {message}"
        return [Outcome(error=text) for _ in items]

    @staticmethod
    def _sent(request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse | None:
        sender = request._sender
        if sender is None or not sender.final or len(sender.responses) != 1:
            return None
        return sender.responses[0]

    def _outcome(self, item: RequestData, response: Any) -> Outcome:
        if not isinstance(response, pb_utils.InferenceResponse):
            return Outcome(
                error=f"model '{self.instance_name}' returned {type(response).__name__}, not an InferenceResponse"
            )
        error = response.error()
        if error is not None:
            return Outcome(error=error.message(), code=_ERROR_CODES.get(error.code(), "internal"))
        given = {tensor.name(): tensor._wire_data() for tensor in response.output_tensors()}
        outputs = {}
        for name in item.outputs:
            if name not in given:
                # As Triton's Python backend: a response carries the outputs the model gave it (each
                # response of a streaming model often carries one of them), a requested one it lacks too.
                continue
            array = np.asarray(given[name])
            try:
                # Its datatype goes with it (an INT64 array answers INT64 whatever the config declares),
                # as Triton's Python backend answers; one numpy has and Triton has not fails the request.
                DataType.from_numpy(array.dtype)
            except ValueError:
                return Outcome(
                    error=f"model '{self.instance_name}': output '{name}' has numpy dtype {array.dtype}, "
                    "which has no Triton datatype"
                )
            outputs[name] = array
        return Outcome(outputs=outputs)

    def finalize(self) -> None:
        """The model's ``finalize``; what it raises is logged, and the instance is released all the same."""
        finalize = getattr(self.model, "finalize", None)
        try:
            if finalize is not None:
                with self._metrics_here():
                    self._await(finalize())
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: an unload always completes
            logger.error("model instance %s: finalize raised %s", self.instance_name, describe_error(exc).rstrip())
        finally:
            self._release()

    def _release(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self._imports is not None:
            self._imports.close()
            self._imports = None


def _batch_over(requests: Sequence[pb_utils.InferenceRequest]) -> None:
    """The batch is over: no more asking the server whether a client left, and each sender lets go of
    its request (``InferenceResponseSender._detach``) while the request keeps it, closed."""
    for request in requests:
        request._probe = None
        if request._sender is not None:
            request._sender._detach()

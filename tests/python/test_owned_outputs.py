"""What a thread instance's model hands over is copied when it hands it over, as Triton's stub copies it.

Found by the review of session 48: a Python model on a thread instance that fills one buffer of its
own for every request (``self.buf``) and returns it gave its answers as views of that buffer; the
next batch rewrote it while the earlier answer was still being encoded, waited for an ensemble's
next step or went into the response cache (359 of 360 answers wrong through an ensemble). The same
for a BLS call's inputs, which the caller may fill again while its ``async_exec`` call is still
queued. A process instance copies these (its arenas); Triton's stub copies them into its shared
memory. A response sent through a sender (a decoupled model's) was copied as sent already: kept so.
And a thread instance's ``exec(decoupled=True)`` call starts when it is made, as a process
instance's and Triton's do (found by the review of the fixes): it started when its responses were
first read, so two calls of one sequence read in reverse reached the model in reverse.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from shoal.backends.devices import CPU
from shoal.backends.python import ThreadInstance, bls, pb_utils
from shoal.configuring.pipeline import configure
from shoal.request_types import InferRequest, InferResponse
from tests.python_models import reuses_buffer, write_model

CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT64 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT64 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "process_instances" value: {{ string_value: "false" }} }}
{extra}
"""
# Decoupled: two responses per request from the same buffer, IN then IN + 1.
SENDS_FROM_ONE_BUFFER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.buf = np.zeros(4, np.int64)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.buf[:] = value
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.buf)]))
            self.buf[:] = value + 1
            sender.send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", self.buf)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
"""


def _instance(tmp_path: Path, source: str, extra: str = "") -> ThreadInstance:
    folder = write_model(tmp_path, "reuser", CONFIG.format(extra=extra), source)
    spec = configure(folder, strict=False).spec
    return ThreadInstance(spec, folder / "1" / "model.py", CPU, "reuser_0", 1)


class _Sink:
    def __init__(self) -> None:
        self.items: list[tuple[Any, bool]] = []
        self.cancelled = False

    def put(self, item: Any, final: bool) -> None:
        self.items.append((item, final))


def _pending(value: np.ndarray, sink: _Sink | None = None) -> SimpleNamespace:
    context = None
    if sink is not None:
        context = InferRequest("reuser", "", "", (), sink=sink)
    return SimpleNamespace(feed={"IN": value}, outputs=("OUT",), context=context, size=1)


def test_an_answer_is_not_rewritten_by_the_models_next_batch(tmp_path: Path) -> None:
    instance = _instance(tmp_path, reuses_buffer())
    try:
        first, second = np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64) + 100
        (answer,) = instance.run_requests([_pending(first)])
        instance.run_requests([_pending(second)])
    finally:
        instance.close()
    assert isinstance(answer, dict)
    assert answer["OUT"].tolist() == first.tolist()


def test_each_response_a_decoupled_model_sends_holds_what_it_held_when_sent(tmp_path: Path) -> None:
    instance = _instance(tmp_path, SENDS_FROM_ONE_BUFFER, "model_transaction_policy { decoupled: true }")
    sink = _Sink()
    value = np.arange(4, dtype=np.int64) + 7
    try:
        instance.run_requests([_pending(value, sink)])
    finally:
        instance.close()
    assert [(item["OUT"].tolist(), final) for item, final in sink.items] == [
        (value.tolist(), False),
        ((value + 1).tolist(), True),
    ]


def test_a_bls_calls_inputs_are_taken_when_the_call_is_made() -> None:
    """``async_exec``: the caller refills its array before the call is served."""
    seen: list[list[int]] = []
    queued: list[tuple[InferRequest, concurrent.futures.Future[InferResponse]]] = []

    def host(request: InferRequest, sink: Any, caller: Any = None, trace_id: int = 0) -> Any:
        future: concurrent.futures.Future[InferResponse] = concurrent.futures.Future()
        queued.append((request, future))  # served later, as a queued call is
        return future

    link = bls.ThreadLink(host)
    buffer = np.arange(4, dtype=np.int64)
    request = pb_utils.InferenceRequest(
        model_name="callee", requested_output_names=["OUT"], inputs=[pb_utils.Tensor("IN", buffer)]
    )
    waiting = link.infer_async(request)
    buffer[:] = -1  # the caller's next use of its array
    for call, future in queued:
        seen.append(call.inputs[0].data.tolist())
        future.set_result(InferResponse("callee", "1", "", ()))
    asyncio.run(_wait(waiting))
    assert seen == [[0, 1, 2, 3]]


async def _wait(waiting: Any) -> None:
    await waiting


def test_a_streamed_bls_call_starts_when_it_is_made() -> None:
    started: list[str] = []

    def host(request: InferRequest, sink: Any, caller: Any = None, trace_id: int = 0) -> Any:
        started.append(request.id)
        future: concurrent.futures.Future[InferResponse] = concurrent.futures.Future()
        future.set_result(InferResponse("callee", "1", request.id, ()))
        return future

    link = bls.ThreadLink(host)
    calls = [
        pb_utils.InferenceRequest(
            model_name="callee",
            request_id=name,
            requested_output_names=["OUT"],
            inputs=[pb_utils.Tensor("IN", np.zeros(1, np.int64))],
        )
        for name in ("first", "second")
    ]
    streams = [link.infer_stream(call) for call in calls]
    assert started == ["first", "second"]  # before either is read
    for stream in reversed(streams):
        assert [response.has_error() for response in stream] == [False]

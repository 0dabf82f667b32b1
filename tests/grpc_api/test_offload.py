"""Large inference messages are converted on a worker thread: the event loop keeps answering meanwhile.

Unit tests of the servicer on ``asyncio.run``, with a core that echoes its input: no server, no model.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Callable
from typing import Any

import pytest

from shoal.grpc import convert
from shoal.grpc.servicer import InferenceServicer
from shoal.off_loop import OFF_LOOP_BYTES, OFF_LOOP_ELEMENTS
from shoal.protocol import service_pb2
from shoal.request_types import InferRequest, InferResponse, Tensor


class _NoMetadata:
    """A servicer context with no metadata: all ModelInfer asks of it (the client's trace context)."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


NO_METADATA = _NoMetadata()


class EchoCore:
    """The one core call ModelInfer makes: the first input comes back as output ``OUT``."""

    async def infer(self, request: InferRequest, origin: object = None) -> InferResponse:
        tensor = request.inputs[0]
        return InferResponse(
            request.model_name, "1", request.id, (Tensor("OUT", tensor.datatype, tensor.shape, tensor.data),)
        )


def _strings_request(count: int) -> service_pb2.ModelInferRequest:
    """``count`` strings of lengths 0, 3 and 12 in turn (not all of one length: read one by one)."""
    cycle = [b"", b"abc", b"twelve bytes"]
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="IN", datatype="BYTES", shape=[count])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(s)) + s for s in cycle) * (count // 3))
    return request


def _infer(request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
    servicer = InferenceServicer(EchoCore())  # type: ignore[arg-type]
    return asyncio.run(servicer.ModelInfer(request, NO_METADATA))  # type: ignore[arg-type]


def _recording(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bool]:
    """Replace ``convert.<name>`` by a wrapper that notes whether each call ran on the main thread."""
    on_main: list[bool] = []
    original: Callable[..., Any] = getattr(convert, name)

    def wrapper(*args: Any) -> Any:
        on_main.append(threading.current_thread() is threading.main_thread())
        return original(*args)

    monkeypatch.setattr(convert, name, wrapper)
    return on_main


@pytest.mark.parametrize(("count", "off_loop"), [(3, False), (OFF_LOOP_ELEMENTS // 3 * 3 + 3, True)])
def test_bytes_messages_are_converted_off_the_loop_past_a_size(
    monkeypatch: pytest.MonkeyPatch, count: int, off_loop: bool
) -> None:
    decoded_on_main = _recording(monkeypatch, "infer_request")
    encoded_on_main = _recording(monkeypatch, "infer_response")
    response = _infer(_strings_request(count))
    assert list(response.outputs[0].shape) == [count]
    assert decoded_on_main == [not off_loop] and encoded_on_main == [not off_loop]


def test_large_fixed_size_inputs_are_converted_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_on_main = _recording(monkeypatch, "infer_request")
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="IN", datatype="FP32", shape=[1, OFF_LOOP_BYTES // 4 + 1])
    request.raw_input_contents.append(bytes(OFF_LOOP_BYTES + 4))
    _infer(request)
    assert decoded_on_main == [False]


def test_the_loop_keeps_answering_while_a_large_bytes_request_converts() -> None:
    """600k strings take a good part of a second to decode and encode. Converted on the loop, they
    held it throughout: a ticker on the loop ran once, after. Off the loop it runs all along (every
    few ms; counted rather than timed, as a loaded machine may pause any thread now and then)."""
    request = _strings_request(600_000)

    async def scenario() -> int:
        servicer = InferenceServicer(EchoCore())  # type: ignore[arg-type]
        infer = asyncio.create_task(servicer.ModelInfer(request, NO_METADATA))  # type: ignore[arg-type]
        ticks = 0
        while not infer.done():
            await asyncio.sleep(0)
            ticks += 1
        assert len((await infer).raw_output_contents[0]) == len(request.raw_input_contents[0])
        return ticks

    assert asyncio.run(scenario()) >= 5

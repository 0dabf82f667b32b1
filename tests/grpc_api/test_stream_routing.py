"""ModelStreamInfer when a model's transaction policy changes under a stream: the servicer on ``asyncio.run``
with a core that plays the reload's window, no server. (The reload itself, through a real server in both
layouts: tests/python/test_decoupled.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from shoal.core import StreamedResponse
from shoal.errors import DecoupledRefused
from shoal.grpc.servicer import InferenceServicer
from shoal.protocol import service_pb2 as pb
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, Tensor


class _NoMetadata:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class TurnedDecoupledCore:
    """The stream asked before the reload (not decoupled); the request ran after it (decoupled): the
    one-answer path refuses it, the streaming path answers it twice and then FINAL."""

    async def model_decoupled(self, name: str, version: str) -> bool:
        return False

    async def infer(self, request: InferRequest, origin: Any = None) -> InferResponse:
        raise DecoupledRefused()

    async def infer_stream(self, request: InferRequest, origin: Any = None) -> AsyncIterator[StreamedResponse]:
        for value in (1, 2):
            outputs = (Tensor("OUT", DataType.INT32, (1,), np.array([value], dtype=np.int32)),)
            yield StreamedResponse(InferResponse("m", "1", request.id, outputs), False)
        yield StreamedResponse(None, True)

    def sent(self, trace_id: int, started_ns: int, ended_ns: int, last: bool = True) -> None:
        pass


def test_a_request_whose_model_turned_decoupled_before_it_ran_gets_its_streamed_answers() -> None:
    async def main() -> list[pb.ModelStreamInferResponse]:
        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            message = pb.ModelInferRequest(model_name="m", id="r1")
            message.inputs.add(name="IN", datatype="INT32", shape=[1]).contents.int_contents.append(7)
            message.parameters["triton_enable_empty_final_response"].bool_param = True
            yield message

        servicer = InferenceServicer(TurnedDecoupledCore())  # type: ignore[arg-type]
        return [answer async for answer in servicer.ModelStreamInfer(requests(), _NoMetadata())]

    answers = asyncio.run(main())
    assert [answer.error_message for answer in answers] == ["", "", ""]  # not ModelInfer's refusal
    assert [answer.infer_response.id for answer in answers] == ["r1"] * 3
    assert [answer.infer_response.parameters["triton_final_response"].bool_param for answer in answers] == [
        False,
        False,
        True,
    ]
    assert [len(answer.infer_response.raw_output_contents) for answer in answers] == [1, 1, 0]

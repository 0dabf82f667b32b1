"""The core's ``InferStream`` with no transport: plain strings in, plain strings out (issue 26 item 2).

The order it keeps is Triton's stream handler's (answers of ordinary models in arrival order, a
decoupled model's as they come, a sequence's requests one after the other); the gRPC tests
(test_stream_infer.py, test_decoupled.py) check the same through a real server. Last, the local core's
``infer_stream`` when a reload changes the version between its two choices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shoal.core.local import LocalCore
from shoal.core.stream import InferStream, Route
from shoal.errors import DecoupledRefused, ErrorCode, ShoalError, rebuilt
from shoal.protocol.types import DataType
from shoal.request_types import InferRequest, InferResponse, Tensor


class FakeCore:
    """Only what ``InferStream`` asks: whether a model is decoupled (and how often it was asked)."""

    def __init__(self, decoupled: set[str]) -> None:
        self.decoupled = decoupled
        self.asked: list[str] = []

    async def model_decoupled(self, name: str, version: str) -> bool:
        self.asked.append(name)
        if name == "missing":
            raise ShoalError(ErrorCode.MODEL_NOT_FOUND, "unknown")
        return name in self.decoupled


def route(message: str) -> Route:
    """``model:id[:sequence]``."""
    model, _, rest = message.partition(":")
    _, _, sequence = rest.partition(":")
    return Route(model, "", sequence or None)


async def collect(stream: InferStream[str, str], messages: list[str]) -> list[str]:
    async def source() -> AsyncIterator[str]:
        for message in messages:
            yield message

    return [answer async for answer in stream.answers(source())]


def run(coroutine: object) -> list[str]:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


def test_ordinary_answers_keep_arrival_order_though_later_ones_finish_first() -> None:
    finished: list[str] = []

    async def main() -> list[str]:
        done = {name: asyncio.Event() for name in "abc"}
        waits_for = {"a": "b", "b": "c"}  # the order of completion is c, b, a

        async def answer(message: str) -> str:
            name = message.split(":")[1]
            if name in waits_for:
                await done[waits_for[name]].wait()
            finished.append(message)
            done[name].set()
            return f"answer {message}"

        async def stream(message: str, put: Callable[[str], None]) -> None:
            raise AssertionError("no model here is decoupled")

        return await collect(InferStream(FakeCore(set()), route, answer, stream), ["m:a", "m:b", "m:c"])

    answers = run(main())
    assert finished == ["m:c", "m:b", "m:a"]  # they ran concurrently
    assert answers == ["answer m:a", "answer m:b", "answer m:c"]


def test_a_decoupled_models_answers_go_out_as_they_come_and_the_stream_waits_for_the_last() -> None:
    async def main() -> list[str]:
        gate = asyncio.Event()
        spoken = 0

        async def answer(message: str) -> str:
            await gate.wait()  # the ordinary answer is held until both decoupled requests have spoken
            return f"answer {message}"

        async def stream(message: str, put: Callable[[str], None]) -> None:
            nonlocal spoken
            put(f"{message} part 1")
            put(f"{message} part 2")
            spoken += 1
            if spoken == 2:
                gate.set()
            await gate.wait()
            put(f"{message} final")

        core = FakeCore({"dec"})
        answers = await collect(InferStream(core, route, answer, stream), ["plain:1", "dec:2", "dec:3"])
        assert core.asked == ["plain", "dec", "dec"]  # asked per request: a reload may change it
        return answers

    answers = run(main())
    # The ordinary answer was queued first, so the decoupled parts written after it wait behind it.
    assert answers[0] == "answer plain:1"
    assert sorted(answers[1:]) == sorted(f"dec:{i} {part}" for i in (2, 3) for part in ("part 1", "part 2", "final"))
    for i in (2, 3):
        mine = [a for a in answers if a.startswith(f"dec:{i}")]
        assert mine == [f"dec:{i} part 1", f"dec:{i} part 2", f"dec:{i} final"]


def test_a_sequences_requests_run_one_after_the_other_and_others_do_not_wait() -> None:
    running: set[str] = set()
    overlaps: list[tuple[str, str]] = []

    async def answer(message: str) -> str:
        model, request, sequence = (message.split(":") + [""])[:3]
        for other in running:
            if sequence and other.endswith(f":{sequence}"):
                overlaps.append((other, message))
        running.add(message)
        await asyncio.sleep(0.02)
        running.discard(message)
        return message

    async def stream(message: str, put: Callable[[str], None]) -> None:
        raise AssertionError("no model here is decoupled")

    messages = ["m:1:7", "m:2:7", "m:3", "m:4:7", "m:5:8"]
    answers = run(collect(InferStream(FakeCore(set()), route, answer, stream), messages))
    assert answers == messages
    assert overlaps == []


def test_in_flight_requests_are_bounded_by_the_slots() -> None:
    peak = 0
    now = 0

    async def answer(message: str) -> str:
        nonlocal peak, now
        now += 1
        peak = max(peak, now)
        await asyncio.sleep(0.01)
        now -= 1
        return message

    async def stream(message: str, put: Callable[[str], None]) -> None:
        raise AssertionError("no model here is decoupled")

    messages = [f"m:{i}" for i in range(20)]
    answers = run(collect(InferStream(FakeCore(set()), route, answer, stream, max_in_flight=3), messages))
    assert answers == messages
    assert peak == 3


def test_a_model_the_core_does_not_know_takes_the_one_answer_path() -> None:
    async def answer(message: str) -> str:
        return f"refused {message}"

    async def stream(message: str, put: Callable[[str], None]) -> None:
        raise AssertionError("an unknown model is not streamed")

    assert run(collect(InferStream(FakeCore(set()), route, answer, stream), ["missing:1"])) == ["refused missing:1"]


def test_a_failure_reading_the_stream_reaches_the_reader_after_what_was_answered() -> None:
    async def answer(message: str) -> str:
        return message

    async def stream(message: str, put: Callable[[str], None]) -> None:
        raise AssertionError("no model here is decoupled")

    async def main() -> list[str]:
        async def source() -> AsyncIterator[str]:
            yield "m:1"
            raise ValueError("malformed")

        seen: list[str] = []
        with pytest.raises(ValueError, match="malformed"):
            async for item in InferStream(FakeCore(set()), route, answer, stream).answers(source()):
                seen.append(item)
        return seen

    assert run(main()) == ["m:1"]


def test_the_decoupled_refusal_crosses_a_process_boundary_as_its_type() -> None:
    refused = DecoupledRefused()
    again = rebuilt(refused.code.value, refused.message, refused.kind)
    assert type(again) is DecoupledRefused and again.message == refused.message
    assert again.code is ErrorCode.UNSUPPORTED
    plain = rebuilt(ErrorCode.NOT_FOUND.value, "gone", "")
    assert type(plain) is ShoalError and plain.code is ErrorCode.NOT_FOUND


def test_a_request_whose_model_turned_decoupled_after_it_was_routed_streams_its_answers() -> None:
    """The model was reloaded as decoupled between the stream's question and the request's run: the
    one-answer path refuses it (``DecoupledRefused``), and the stream sends it down the streaming path,
    its answers before the stream's end, where it once failed the request in ModelInfer's words."""

    async def main() -> list[str]:
        async def answer(message: str) -> str:
            if message.startswith("flipped"):
                raise DecoupledRefused()
            return f"answer {message}"

        async def stream(message: str, put: Callable[[str], None]) -> None:
            for part in ("1", "2", "final"):
                await asyncio.sleep(0)
                put(f"{message} part {part}")

        return await collect(InferStream(FakeCore(set()), route, answer, stream), ["plain:1", "flipped:2", "plain:3"])

    answers = run(main())
    assert answers[0] == "answer plain:1"
    assert sorted(answers[1:]) == ["answer plain:3", "flipped:2 part 1", "flipped:2 part 2", "flipped:2 part final"]
    assert answers.index("flipped:2 part 1") < answers.index("flipped:2 part final")


class ReloadedAsPlain:
    """A manager whose model is decoupled when ``infer_stream`` chooses the version and plain when the
    request runs (a reload between the two choices)."""

    def __init__(self) -> None:
        self.choices = 0

    def resolve(self, name: str, version: str) -> Any:
        self.choices += 1
        if self.choices == 1:
            return SimpleNamespace(spec=SimpleNamespace(decoupled=True, name=name), version=1)

        async def infer(request: InferRequest) -> InferResponse:
            out = Tensor("OUT", DataType.INT32, (1,), np.array([42], dtype=np.int32))
            return InferResponse(name, "2", request.id, (out,))

        return SimpleNamespace(spec=SimpleNamespace(decoupled=False, name=name), version=2, infer=infer)


def test_a_streamed_request_answered_by_a_version_reloaded_as_plain_gets_that_answer() -> None:
    """The plain version answers the request itself, not through the sink: its answer is the stream's
    one response, final, where it was once lost ("the model's execution ended before it sent the FINAL flag")."""

    async def main() -> list[Any]:
        core = LocalCore(ReloadedAsPlain())  # type: ignore[arg-type]
        return [part async for part in core.infer_stream(InferRequest("m", "", "r1", ()))]

    [part] = asyncio.run(main())
    assert part.final and not part.error
    assert part.response.model_version == "2" and int(part.response.outputs[0].data[0]) == 42

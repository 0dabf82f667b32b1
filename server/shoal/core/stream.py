"""One client stream of inference requests, answered in the order Triton's stream handler keeps.

Triton's stream handler (src/grpc/stream_infer_handler.cc) runs a stream's requests concurrently
but, for models that are not decoupled, writes their responses in arrival order; clients that send
no ids rely on it. A decoupled model's responses go out as they come, behind any ordered answer
already queued. The order is not gRPC's, so it lives here and the transport only translates: it
reads its messages, says where each goes (``Route``), and answers one (``answer``: one message,
a failure included) or streams one (``stream``: every message it puts).

A slot is taken before a request is read and freed once its answer is written: with every slot
taken the stream is not read, so the transport's flow control holds the client back. A request to a
decoupled model holds its slot until its final response. When the client half-closes, every
request in flight is answered, then the stream ends; if the reader of the answers stops, every
request in flight is cancelled. A request of a sequence starts only once the stream's previous
request of that sequence is answered, so a sequence runs in the order sent (Triton's sequence
batcher relies on it), in either process layout. Whether a model is decoupled is asked of the core
for each request, as Triton's handler asks: a model reloaded with another transaction policy is served
as it is now on a stream opened before (a front-end worker's core keeps the answers until the host
says a model changed); a request routed to one answer whose model was reloaded as decoupled before it
ran (``answer`` raises ``DecoupledRefused``) streams instead.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Hashable
from typing import Any, Generic, NamedTuple, TypeVar

from shoal.core import Core
from shoal.errors import DecoupledRefused

# Requests one stream may have in flight (read and not yet answered). Deep enough for a client
# pipelining on one stream to fill a dynamic batch; past it the stream is not read, so one stream
# holds at most this many decoded requests and a client that sends faster than the models answer
# is held back by the transport's flow control instead of being refused.
MAX_IN_FLIGHT_PER_STREAM = 32

Message = TypeVar("Message")  # what the transport reads: one request as it came
Answer = TypeVar("Answer")  # what the transport writes: one answer


class Route(NamedTuple):
    """Where one request goes: its model and version, and its sequence (None: it belongs to none)."""

    model: str
    version: str
    sequence: Hashable | None


class _Restreamed:
    """What an ordered request's place holds when the model turned out decoupled: its answers stream."""


RESTREAMED = _Restreamed()


class InferStream(Generic[Message, Answer]):
    """Orders one stream's answers; ``answers`` is the stream, read once.

    ``route(message)``: where it goes, read without decoding it. ``answer(message)``: its one answer
    (a failure is an answer too; ``DecoupledRefused`` raised: the model is decoupled after all).
    ``stream(message, put)``: a decoupled model's answers, each ``put`` as it comes (failures too); it
    returns after the last one.
    """

    def __init__(
        self,
        core: Core,
        route: Callable[[Message], Route],
        answer: Callable[[Message], Coroutine[Any, Any, Answer]],
        stream: Callable[[Message, Callable[[Answer], None]], Coroutine[Any, Any, None]],
        max_in_flight: int = MAX_IN_FLIGHT_PER_STREAM,
    ) -> None:
        self._core = core
        self._route = route
        self._answer = answer
        self._stream = stream
        self._max_in_flight = max_in_flight

    async def answers(self, messages: AsyncIterator[Message]) -> AsyncGenerator[Answer, None]:
        slots = asyncio.Semaphore(self._max_in_flight)
        # Answers in the order they are written, each with whether writing it frees a slot; None: the
        # client sent its last request and every request it sent is answered (a decoupled one: FINAL).
        queue: asyncio.Queue[tuple[asyncio.Future[Answer | _Restreamed], bool] | None] = asyncio.Queue()
        in_flight: set[asyncio.Task[Any]] = set()
        last_of_sequence: dict[tuple[str, Hashable], asyncio.Task[Answer | _Restreamed]] = {}

        def put(answer: Answer) -> None:
            written = asyncio.get_running_loop().create_future()
            written.set_result(answer)
            queue.put_nowait((written, False))

        def stream(message: Message) -> None:
            """A decoupled model's request: its answers go out as they come; it frees its slot after the last."""
            task = asyncio.create_task(self._stream(message, put))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            task.add_done_callback(lambda _: slots.release())

        async def read() -> None:
            try:
                await slots.acquire()
                async for message in messages:
                    route = self._route(message)
                    if await self._is_decoupled(route):
                        stream(message)
                        await slots.acquire()
                        continue
                    key = (route.model, route.sequence) if route.sequence is not None else None
                    after = last_of_sequence.get(key) if key is not None else None
                    answered = asyncio.create_task(self._answer_after(message, after, stream))
                    in_flight.add(answered)
                    answered.add_done_callback(in_flight.discard)
                    if key is not None:
                        last_of_sequence[key] = answered
                        answered.add_done_callback(functools.partial(_forget, last_of_sequence, key))
                    queue.put_nowait((answered, True))
                    await slots.acquire()
                # The client is done sending: answer what it sent, then end (a request answered in order may
                # still turn into a stream, whose answers must go before the end).
                while in_flight:
                    await asyncio.wait(set(in_flight))
            finally:
                queue.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                answer, frees_slot = item
                written = await answer
                if isinstance(written, _Restreamed):  # its answers stream, and it frees its slot after the last
                    continue
                yield written
                if frees_slot:
                    slots.release()
            await reader  # raises what ended the reading (a malformed message): the transport reports it
        finally:
            reader.cancel()
            for task in in_flight:
                task.cancel()

    async def _is_decoupled(self, route: Route) -> bool:
        try:
            return await self._core.model_decoupled(route.model, route.version)
        except Exception:  # noqa: BLE001 - not served: the one-answer path reports it in the stream
            return False

    async def _answer_after(
        self, message: Message, after: asyncio.Task[Any] | None, stream: Callable[[Message], None]
    ) -> Answer | _Restreamed:
        if after is not None:
            await asyncio.wait([after])
        try:
            return await self._answer(message)
        except DecoupledRefused:  # the model was reloaded as decoupled after this request was routed
            stream(message)
            return RESTREAMED


def _forget(
    last: dict[tuple[str, Hashable], asyncio.Task[Any]], key: tuple[str, Hashable], done: asyncio.Task[Any]
) -> None:
    """A sequence's answered request stops being the one its next request waits for."""
    if last.get(key) is done:
        del last[key]

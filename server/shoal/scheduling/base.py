"""The one execution contract between a scheduler and the instances.

A scheduler (the dynamic batcher, the sequence batcher) forms batches of queued requests and hands
each batch, as the list of its requests, to an ``Executor`` it got from the ``Runner``; the executor
answers each request with its outputs or an error of its own (``Executed``). The scheduler never
calls a backend. What an executor does with the list is its own: a backend that takes one feed per
batch (every backend but Python's) goes through ``batching.execute_as_one_feed``, which gathers the
requests' inputs, runs once and scatters the rows back; the Python backend runs the list as it is,
as Triton's does. Tests use fake runners.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from shoal.errors import ShoalError
from shoal.request_types import InferRequest
from shoal.statistics import Phases

Outputs = dict[str, np.ndarray]
# A request's own outputs checked against its model's config (and converted as the caller wants
# them); raises ShoalError when the model broke its config. The scheduler applies it to each
# request's part before it counts the request, so a request that fails it is a failure in the
# statistics, as Triton's backends count one whose outputs they cannot return.
OutputCheck = Callable[[Outputs], Outputs]


def checked(check: OutputCheck | None, part: Outputs) -> Outputs | ShoalError:
    """``part`` through the request's check: its outputs, or the error that fails the request."""
    if check is None:
        return part
    try:
        return check(part)
    except ShoalError as exc:
        return exc


class QueuedRequest(Protocol):
    """One request of a batch, as an executor sees it."""

    @property
    def feed(self) -> Mapping[str, np.ndarray]: ...  # its inputs, by config name

    @property
    def outputs(self) -> tuple[str, ...]: ...  # the outputs it asked for

    @property
    def size(self) -> int: ...  # the rows it adds to a batch

    @property
    def context(self) -> InferRequest | None: ...  # the core request it came from (a Python model reads it)


@dataclass(frozen=True)
class Executed:
    """A batch's outcome: per request, in the batch's order, its outputs or the error that fails it
    alone; and the execution's phases (input, infer, output), counted once for the batch."""

    results: Sequence[Outputs | ShoalError]
    phases: Phases


class ModelScheduler(Protocol):
    """What a model version asks of its scheduler (the dynamic batcher, the sequence batcher): Triton's
    scheduler interface, enqueue and wait, the count waiting, stop."""

    async def submit(
        self,
        feed: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        batch_size: int,
        parameters: Mapping[str, Any],
        context: Any = None,
        check: OutputCheck | None = None,
    ) -> Outputs:
        """Queue one request (``context``: the core request it came from) and wait for its own outputs,
        through ``check``."""
        ...

    @property
    def queued(self) -> int:
        """Requests not executing yet."""
        ...

    async def stop(self) -> None:
        """Finish what is queued and executing; refuse new requests."""
        ...


class Executor(Protocol):
    async def execute(self, batch: Sequence[QueuedRequest]) -> Executed:
        """Run ``batch``; an exception fails every request of it."""
        ...


E = TypeVar("E", bound=Executor)


class Runner(Protocol[E]):
    async def acquire(self) -> E:
        """Wait for a free executor."""
        ...

    def release(self, executor: E) -> None: ...

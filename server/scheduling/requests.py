"""Executing a batch as a list of requests, for executors that take one (Triton's Python backend).

Such an executor is never given concatenated inputs: it gets the batch's queued requests (each
with its own inputs, requested outputs and the core request it came from) and answers each with
its outputs or its own error. One request's error fails that request alone; the execution counts
once, with the batch's rows, as any other.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from shoal.errors import ErrorCode, ShoalError
from shoal.statistics import FailureReason, ModelStatistics, Phases

logger = logging.getLogger(__name__)

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
    feed: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]
    size: int
    arrival_ns: int
    context: Any
    check: OutputCheck | None


def takes_requests(executor: Any) -> bool:
    """Whether ``executor`` runs a batch as a list of requests (``run_requests``) instead of one feed."""
    return bool(getattr(executor, "takes_requests", False))


async def execute_each(
    executor: Any,
    batch: Sequence[QueuedRequest],
    statistics: ModelStatistics,
    release: Callable[[], None],
    settle: Callable[[Any, Outputs | BaseException], None],
) -> None:
    """Run ``batch`` on ``executor`` as a list, record the statistics and settle each request."""
    start = time.monotonic_ns()
    try:
        results: list[Outputs | ShoalError] = await executor.run_requests(batch)
        if len(results) != len(batch):
            raise ShoalError(ErrorCode.INTERNAL, f"{len(results)} results for {len(batch)} requests")
    except BaseException as exc:  # noqa: BLE001 - fails this batch's requests only
        release()
        if isinstance(exc, Exception) and not isinstance(exc, ShoalError):
            logger.error("a batch of %d request(s) failed", len(batch), exc_info=exc)
        now = time.monotonic_ns()
        for pending in batch:
            statistics.record_failure(now - pending.arrival_ns, FailureReason.BACKEND)
            settle(pending, exc)
        if not isinstance(exc, Exception):
            raise
        return
    release()
    done = time.monotonic_ns()
    phases = Phases(0, done - start, 0)
    statistics.record_execution(sum(p.size for p in batch), phases)
    for pending, result in zip(batch, results, strict=True):
        if not isinstance(result, ShoalError):
            result = checked(pending.check, result)
        if isinstance(result, ShoalError):
            statistics.record_failure(done - pending.arrival_ns, FailureReason.BACKEND)
        else:
            statistics.record_success(done - pending.arrival_ns, start - pending.arrival_ns, phases)
            also_count = getattr(pending, "also_count", None)  # an ensemble's totals, when it runs in one
            if also_count is not None:
                also_count.add(phases)
            traced = getattr(pending, "traced", None)
            if traced is not None:
                traced.executed(pending.arrival_ns, start, phases)
        settle(pending, result)

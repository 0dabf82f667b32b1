"""The scheduler in front of a model's instances: queues, priorities, queue policy, dynamic batching.

One scheduler per model version, shared by all its instances (as Triton's). A loop waits
for a free executor, then forms the next batch from the queue and hands it over; the
executor runs it on its own thread while the loop forms the next one.

Batch-forming rules (Triton's ``GetDynamicBatch``, core src/dynamic_batch_scheduler.cc), with
``max_pref`` the largest preferred size (``max_batch_size`` when none is configured) and
``delay`` the max queue delay:

1. Requests are taken in priority order (level 1 first), FIFO within a level; within each level
   the requests whose queue timeout expired with action DELAY come after that level's others and
   before any lower level's (Triton's PolicyQueue keeps a delayed queue per level). A request's
   own batch size counts in full; requests are never split.
2. The batch closes when the next request would exceed ``max_batch_size`` or its input shapes
   (batch dimension aside) differ from the batch's.
3. Reaching a preferred size marks a cut; when the next request would pass ``max_pref`` and no
   preferred size was reached, the current size is the cut ("saturated"). The walk goes on up to
   ``max_batch_size``.
4. A cut goes at once, unless the oldest request has waited ``delay``, in which case everything
   gathered goes, up to ``max_batch_size``. A closed batch, or one at ``max_pref`` or more, goes at
   once. With ``delay == 0`` what is queued goes as soon as an executor is free. Otherwise the loop
   waits for more requests until the oldest one's delay (or the next queue timeout) runs out, on
   the deadline clock (``clock.py``), which keeps sub-millisecond delays to within tens of µs.

A request's queue timeout is the policy's ``default_timeout_microseconds``; with
``allow_timeout_override`` the request's own ``timeout`` replaces it only when it is shorter, so a
policy without a default timeout (0) ignores it (Triton's ``PolicyQueue::Enqueue``, core
src/scheduler_utils.cc).

Without ``dynamic_batching`` every request is its own execution, FIFO.

Forming a batch costs what the batch holds, not what is queued: each level keeps its requests in
insertion-ordered dicts (a request leaves from anywhere in O(1): taken, cancelled or timed out),
queue timeouts are found on a heap of deadlines, and a batch is walked from the head. With the
whole queue walked and copied per batch, the cost per request grew from 16-38 µs at 2k queued to
167-313 µs at 32k; it is 11-17 µs at both now (``bench/batch_forming.py``, 2 shared cores).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.errors import ErrorCode, ShoalError, invalid
from shoal.repository.config import DynamicBatching, QueuePolicy
from shoal.scheduling.base import Executor, OutputCheck, Runner, checked
from shoal.scheduling.clock import deadline_clock
from shoal.scheduling.rate_limiter import Admission
from shoal.statistics import (
    ALSO_COUNT_PHASES,
    TRACED,
    FailureReason,
    ModelStatistics,
    PhaseTotals,
    Traced,
)

logger = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]


@dataclass(eq=False)
class Pending:
    """One queued request."""

    feed: Mapping[str, np.ndarray]
    outputs: tuple[str, ...]
    size: int  # rows it adds to a batch: its batch dimension, or 1
    signature: tuple[tuple[str, tuple[int, ...]], ...]  # input shapes without the batch dimension
    level: int
    arrival_ns: int
    deadline_ns: int | None
    delay_on_timeout: bool
    sequence: int
    future: asyncio.Future[Outputs] = field(repr=False)
    delayed: bool = False
    context: Any = None  # the core request it came from (a Python model reads it)
    check: OutputCheck | None = None  # its outputs checked before it counts as a success
    also_count: PhaseTotals | None = None  # the caller's aggregator (an ensemble's), if it set one
    traced: Traced | None = None  # its trace, when it is sampled (statistics.TRACED)


class Scheduler:
    def __init__(
        self,
        runner: Runner[Any],
        statistics: ModelStatistics,
        max_batch_size: int,
        batching: DynamicBatching | None,
        admission: Admission | None = None,
    ) -> None:
        self.runner = runner
        self.statistics = statistics
        self.admission = admission  # the rate limiter each execution passes, if it is on
        self._admitting = 0  # requests in batches waiting for the rate limiter
        self.batching = batching
        # Rows a batch may hold; 0 or no dynamic_batching means one request per execution.
        self.max_batch_size = max_batch_size if batching is not None else 0
        self.preferred = set(batching.preferred_batch_sizes) if batching else set()
        self.max_preferred = max(self.preferred, default=self.max_batch_size)
        self.delay_ns = batching.max_queue_delay_us * 1000 if batching else 0
        self.levels = max(1, batching.priority_levels) if batching else 1
        # Per level, by sequence: the waiting requests in arrival order, and those whose timeout
        # expired with action DELAY in the order they expired. Levels holding any: ``_in_use``.
        self._queues: dict[int, OrderedDict[int, Pending]] = {}
        self._delayed: dict[int, OrderedDict[int, Pending]] = {}
        self._in_use: set[int] = set()
        # (deadline_ns, sequence, level) of waiting requests with a queue timeout; entries of requests
        # that left otherwise stay until they reach the top (``_stale_deadlines`` of them), or until
        # they are the greater part and the heap is rebuilt.
        self._deadlines: list[tuple[int, int, int]] = []
        self._stale_deadlines = 0
        self._sequence = itertools.count()
        self._next_release = 0
        self._settled: dict[int, tuple[Pending, Outputs | BaseException | None]] = {}
        self._arrived = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._executions: set[asyncio.Task[None]] = set()
        self._stopping = False

    # -- submission ---------------------------------------------------------------------------------

    async def submit(
        self,
        feed: Mapping[str, np.ndarray],
        outputs: Sequence[str],
        batch_size: int,
        parameters: Mapping[str, Any],
        context: Any = None,
        check: OutputCheck | None = None,
    ) -> Outputs:
        """Queue one request and wait for its own rows of the outputs (through ``check``, if given)."""
        if self._stopping:
            raise ShoalError(ErrorCode.UNAVAILABLE, "the model is unloading")
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="scheduler")
        now = time.monotonic_ns()
        try:
            level = self._level(parameters)
            policy = self.batching.queue_policy(level) if self.batching else QueuePolicy()
            timeout_us = self._timeout_us(policy, parameters)
        except ShoalError:  # a bad request parameter: the request failed here
            self.statistics.record_failure(time.monotonic_ns() - now, FailureReason.OTHER)
            raise
        if policy.max_queue_size and self._waiting(level) >= policy.max_queue_size:
            self.statistics.record_failure(0, FailureReason.REJECTED)
            raise ShoalError(ErrorCode.UNAVAILABLE, "Exceeds maximum queue size")
        pending = Pending(
            feed=feed,
            outputs=tuple(outputs),
            size=max(1, batch_size),
            signature=tuple((name, array.shape[1:] if batch_size else array.shape) for name, array in feed.items()),
            level=level,
            arrival_ns=now,
            deadline_ns=now + timeout_us * 1000 if timeout_us else None,
            delay_on_timeout=policy.delay_on_timeout,
            sequence=next(self._sequence),
            future=asyncio.get_running_loop().create_future(),
            context=context,
            check=check,
            also_count=ALSO_COUNT_PHASES.get(),
            traced=TRACED.get(),
        )
        if pending.traced is not None:
            pending.traced.queued(feed)  # its inputs, as they are queued (the TENSORS level)
        self._queue(level)[pending.sequence] = pending
        self._in_use.add(level)
        timer = None
        if pending.deadline_ns is not None:
            heapq.heappush(self._deadlines, (pending.deadline_ns, pending.sequence, level))
            if not pending.delay_on_timeout:
                # Reject promptly at the deadline, even while every executor is busy.
                timer = deadline_clock().call_at(pending.deadline_ns, lambda: self._expire(time.monotonic_ns()))
        self._arrived.set()
        try:
            return await pending.future
        finally:
            if timer is not None:  # left the queue: its deadline no longer concerns this scheduler
                timer.cancel()
            if pending.future.cancelled() and self._remove(pending):  # the caller gave up while queued
                self.statistics.record_failure(time.monotonic_ns() - pending.arrival_ns, FailureReason.CANCELED)
                self._settle(pending, None)

    def _level(self, parameters: Mapping[str, Any]) -> int:
        """Priority 0, or beyond the configured levels, means the default level (as Triton)."""
        if self.batching is None or self.batching.priority_levels == 0:
            return 1
        priority = parameters.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise invalid(f"request parameter 'priority' must be an integer, got {priority!r}")
        if 1 <= priority <= self.batching.priority_levels:
            return priority
        return self.batching.default_priority_level

    @staticmethod
    def _timeout_us(policy: QueuePolicy, parameters: Mapping[str, Any]) -> int:
        """The policy's default timeout; an allowed override may only shorten it, so with no
        default timeout (0) a request's own ``timeout`` is ignored (Triton's PolicyQueue::Enqueue)."""
        timeout = policy.default_timeout_us
        requested = parameters.get("timeout")
        if requested is not None and policy.allow_timeout_override:
            if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
                raise invalid(f"request parameter 'timeout' must be a non-negative integer (µs), got {requested!r}")
            if 0 < requested < timeout:
                timeout = requested
        return timeout

    @property
    def queued(self) -> int:
        """Requests not executing yet: in the queues, and in batches waiting for the rate limiter."""
        return sum(self._waiting(level) for level in self._in_use) + self._admitting

    # -- the queues ---------------------------------------------------------------------------------

    def _queue(self, level: int) -> OrderedDict[int, Pending]:
        return self._queues.setdefault(level, OrderedDict())

    def _waiting(self, level: int) -> int:
        return len(self._queues.get(level, ())) + len(self._delayed.get(level, ()))

    def _remove(self, pending: Pending) -> bool:
        """Take ``pending`` out of its level's queue; False when it was no longer there."""
        queue = (self._delayed if pending.delayed else self._queues).get(pending.level)
        if queue is None or queue.pop(pending.sequence, None) is None:
            return False
        if pending.deadline_ns is not None and not pending.delayed:
            self._stale_deadlines += 1
        if not self._waiting(pending.level):
            self._in_use.discard(pending.level)
        return True

    def _waiting_in_order(self) -> Iterator[Pending]:
        """Level by level (1 first): the level's waiting requests, then its delayed ones."""
        for level in sorted(self._in_use):
            yield from self._queues.get(level, {}).values()
            yield from self._delayed.get(level, {}).values()

    # -- the loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            if self.admission is not None:
                self.admission.limiter.settle(self.admission)

    async def _serve(self) -> None:
        while True:
            executor = await self.runner.acquire()
            try:
                batch = await self._next_batch()
            except BaseException:
                self.runner.release(executor)
                raise
            task = asyncio.create_task(self._execute(executor, batch))
            self._executions.add(task)
            task.add_done_callback(self._executions.discard)
            # This loop waits for the next executor with no reference to the last batch: its
            # inputs may be views of memory the requests owned (a front-end worker's arena block
            # is reused only when no view of it is left), so an idle model must not hold them.
            del batch, task

    def _batch_ready(self) -> bool:
        """A batch can go at once (for the rate limiter: this model stages again in a few loop turns); the
        loop is woken, should it be waiting on a batching delay that no longer holds."""
        if self._stopping or not self._in_use:
            return False
        batch, _ = self._plan(time.monotonic_ns())
        if batch:
            self._arrived.set()
        return bool(batch)

    async def _next_batch(self) -> list[Pending]:
        while True:
            now = time.monotonic_ns()
            self._expire(now)
            batch, wait_ns = self._plan(now)
            if batch:
                for pending in batch:
                    self._remove(pending)
                return batch
            if self.admission is not None:  # it stages nothing now: the limiter need not wait for it
                self.admission.limiter.settle(self.admission)
            # Wait for the next arrival or the deadline, whichever comes first. The deadline clock
            # keeps sub-millisecond delays (asyncio's own timers round up to a whole millisecond).
            self._arrived.clear()
            timer = None if wait_ns is None else deadline_clock().call_at(now + wait_ns, self._arrived.set)
            try:
                await self._arrived.wait()
            finally:
                if timer is not None:
                    timer.cancel()

    def _expire(self, now: int) -> None:
        """Requests past their queue timeout are rejected, or delayed: moved behind the other requests
        of their own level (Triton's PolicyQueue::ApplyPolicy), in arrival order among those found
        together. Only the expired deadlines are looked at."""
        delayed = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, sequence, level = heapq.heappop(self._deadlines)
            pending = self._queues[level].get(sequence)
            if pending is None:  # it left before its deadline
                self._stale_deadlines -= 1
                continue
            self._remove(pending)
            self._stale_deadlines -= 1
            if pending.delay_on_timeout:
                delayed.append(pending)
            else:
                self.statistics.record_failure(now - pending.arrival_ns, FailureReason.REJECTED)
                self._settle(pending, ShoalError(ErrorCode.UNAVAILABLE, "Request timeout expired"))
        for pending in sorted(delayed, key=lambda p: p.sequence):
            pending.delayed = True
            self._delayed.setdefault(pending.level, OrderedDict())[pending.sequence] = pending
            self._in_use.add(pending.level)
        if self._stale_deadlines > max(1024, len(self._deadlines) // 2):
            self._deadlines = [entry for entry in self._deadlines if entry[1] in self._queues[entry[2]]]
            heapq.heapify(self._deadlines)
            self._stale_deadlines = 0

    def _next_deadline(self) -> int | None:
        """The earliest queue timeout of a waiting request (stale entries on top are dropped)."""
        while self._deadlines and self._deadlines[0][1] not in self._queues[self._deadlines[0][2]]:
            heapq.heappop(self._deadlines)
            self._stale_deadlines -= 1
        return self._deadlines[0][0] if self._deadlines else None

    def _plan(self, now: int) -> tuple[list[Pending], int | None]:
        """The batch to send now, or nothing and how long to wait (None: until a request arrives)."""
        candidates = self._waiting_in_order()
        if self.max_batch_size == 0:
            return [next(candidates)] if self._in_use else [], None
        chosen: list[Pending] = []
        rows = 0
        cut: int | None = None
        closed = False
        for pending in candidates:
            if chosen:
                if cut is None and rows + pending.size > self.max_preferred:
                    cut = len(chosen)  # saturated; the walk goes on, for a batch whose delay expired
                if rows + pending.size > self.max_batch_size or pending.signature != chosen[0].signature:
                    closed = True
                    break
            chosen.append(pending)
            rows += pending.size
            if rows in self.preferred:
                cut = len(chosen)
        if not chosen:
            return [], None
        age = now - min(p.arrival_ns for p in chosen)
        delay_exceeded = self.delay_ns > 0 and age >= self.delay_ns
        if cut is not None and not delay_exceeded:
            return chosen[:cut], None
        if closed or rows >= self.max_preferred or delay_exceeded or self.delay_ns == 0:
            return chosen, None
        wait = self.delay_ns - age
        deadline = self._next_deadline()
        return [], max(0, wait if deadline is None else min(wait, deadline - now))

    # -- execution ----------------------------------------------------------------------------------

    async def _execute(self, executor: Executor, batch: list[Pending]) -> None:
        if self.admission is None:
            await self._execute_counted(executor, batch)
            return
        # The batch is formed, then its instance waits for its resources (Triton's order): the wait counts
        # as queue time, as Triton's does, and its requests as pending, not executing.
        claim = self.admission.claim_of(executor)
        self._admitting += len(batch)
        try:
            await self.admission.limiter.acquire(claim)
        except BaseException:  # the loop is going away: the batch never ran
            self.runner.release(executor)
            for pending in batch:
                self._settle(pending, ShoalError(ErrorCode.UNAVAILABLE, "the server is stopping"))
            raise
        finally:
            self._admitting -= len(batch)
        try:
            await self._execute_counted(executor, batch)
        finally:
            self.admission.limiter.release(claim, more=self._batch_ready())

    async def _execute_counted(self, executor: Executor, batch: list[Pending]) -> None:
        self.statistics.executing += len(batch)
        try:
            await self._execute_batch(executor, batch)
        finally:
            self.statistics.executing -= len(batch)

    async def _execute_batch(self, executor: Executor, batch: list[Pending]) -> None:
        start = time.monotonic_ns()
        try:
            executed = await executor.execute(batch)
            if len(executed.results) != len(batch):
                raise ShoalError(ErrorCode.INTERNAL, f"{len(executed.results)} results for {len(batch)} requests")
        except BaseException as exc:  # noqa: BLE001 - fails this batch's requests only
            self.runner.release(executor)
            if isinstance(exc, Exception) and not isinstance(exc, ShoalError):
                logger.error("a batch of %d request(s) failed", len(batch), exc_info=exc)
            now = time.monotonic_ns()
            for pending in batch:
                self.statistics.record_failure(now - pending.arrival_ns, FailureReason.BACKEND)
                self._settle(pending, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.runner.release(executor)
        done = time.monotonic_ns()
        phases = executed.phases
        self.statistics.record_execution(sum(p.size for p in batch), phases)
        for pending, result in zip(batch, executed.results, strict=True):
            outcome = result if isinstance(result, ShoalError) else checked(pending.check, result)
            if isinstance(outcome, ShoalError):
                self.statistics.record_failure(done - pending.arrival_ns, FailureReason.BACKEND)
            else:
                self.statistics.record_success(done - pending.arrival_ns, start - pending.arrival_ns, phases)
                if pending.also_count is not None:
                    pending.also_count.add(phases)
                if pending.traced is not None:
                    pending.traced.executed(pending.arrival_ns, start, phases, outcome)
            self._settle(pending, outcome)

    def _settle(self, pending: Pending, outcome: Outputs | BaseException | None) -> None:
        """Complete a request; with ``preserve_ordering`` completions are released in arrival order."""
        if not (self.batching and self.batching.preserve_ordering):
            _complete(pending, outcome)
            return
        self._settled[pending.sequence] = (pending, outcome)
        while self._next_release in self._settled:
            _complete(*self._settled.pop(self._next_release))
            self._next_release += 1

    # -- stop ---------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Finish what is queued and executing, then stop the loop. New requests are refused."""
        self._stopping = True
        while self.queued and self._loop_task is not None and not self._loop_task.done():
            await asyncio.sleep(0.01)
        if self._executions:
            await asyncio.gather(*self._executions, return_exceptions=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)


def _complete(pending: Pending, outcome: Outputs | BaseException | None) -> None:
    if pending.future.done() or outcome is None:
        return
    if isinstance(outcome, BaseException):
        pending.future.set_exception(outcome)
    else:
        pending.future.set_result(outcome)

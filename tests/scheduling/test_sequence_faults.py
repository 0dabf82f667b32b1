"""The sequence batcher under clients that give up, and models that answer wrongly (fake instances)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import numpy as np
import pytest

from shoal.errors import ShoalError
from shoal.protocol.types import DataType
from shoal.repository.sequence_config import SequenceBatching, StateSpec
from shoal.scheduling.batching import execute_as_one_feed
from shoal.scheduling.sequence import SequenceScheduler
from shoal.statistics import ALSO_COUNT_PHASES, FailureReason, ModelStatistics, PhaseTotals
from tests.scheduling.test_sequence_scheduler import CONTROLS, scheduler, step


async def _queued(sched: object, count: int) -> None:
    """Until ``count`` requests wait in the scheduler (bounded)."""
    for _ in range(1000):
        if sched.queued == count:  # type: ignore[attr-defined]
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never {count} queued")


def test_a_sequence_given_up_in_the_backlog_can_start_again() -> None:
    """A backlogged sequence whose every request was cancelled is dropped when a slot frees, so its
    client's retried START takes that slot (it used to join a backlog nobody serves, forever)."""

    async def main() -> None:
        sched, _ = scheduler(max_batch_size=1)
        assert await step(sched, 1, 1.0, start=True) == 1.0
        waiting = asyncio.create_task(step(sched, 2, 1.0, start=True))  # no free slot: backlogged
        await _queued(sched, 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert await step(sched, 1, 1.0, end=True) == 2.0  # frees the slot
        assert await asyncio.wait_for(step(sched, 2, 3.0, start=True, end=True), 5) == 3.0
        assert sched.active_sequences == 0

    asyncio.run(main())


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_a_request_given_up_while_queued_counts_as_canceled(strategy: str) -> None:
    """As the dynamic batcher counts it (docs/operations.md: metrics, failures by reason): once, CANCELED; a
    request given up while its batch runs is answered by the model and counts as a success."""

    async def main() -> None:
        sched, runner = scheduler(max_batch_size=1, strategy=strategy)
        assert await step(sched, 1, 1.0, start=True) == 1.0
        running = asyncio.create_task(step(sched, 1, 1.0))
        queued = asyncio.create_task(step(sched, 1, 5.0))
        await asyncio.sleep(0)  # both routed; the first one's batch is taken, the second waits behind it
        queued.cancel()
        assert await running == 2.0
        await asyncio.gather(queued, return_exceptions=True)
        assert await step(sched, 1, 1.0, end=True) == 3.0  # the given-up request never ran
        statistics = sched.statistics
        assert (statistics.fail.count, statistics.failures[FailureReason.CANCELED]) == (1, 1)
        assert statistics.success.count == 3 and len(runner.log) == 3

    asyncio.run(main())


class WrongStateRows:
    """An accumulator whose first state output has no rows."""

    def __init__(self) -> None:
        self.calls = 0

    async def execute(self, batch):  # the feed adapter, as an instance's
        return await execute_as_one_feed(self.run, batch)

    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        self.calls += 1
        total = inputs["STATE_IN"] + inputs["IN"]
        return {"OUT": total, "STATE_OUT": total[:0] if self.calls == 1 else total}


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_outputs_without_a_row_per_request_fail_the_batch_and_the_lane_goes_on(strategy: str) -> None:
    """Such a batch used to raise in the lane's task, which died: its requests, and every later one
    of the instance's slots, waited forever (and so did unloading)."""

    async def main() -> None:
        sched, runner = scheduler(
            max_batch_size=2,
            strategy=strategy,
            max_candidate_sequences=2,
            preferred_batch_sizes=(2,),
            max_queue_delay_us=100_000,
        )
        runner.instances[0] = WrongStateRows()  # type: ignore[call-overload]
        with pytest.raises(ShoalError, match="output 'STATE_OUT' has shape \\[0, 1\\], not a batch of 1 rows"):
            await asyncio.wait_for(step(sched, 1, 1.0, start=True), 5)
        assert await asyncio.wait_for(step(sched, 3, 4.0, start=True, end=True), 5) == 4.0
        await asyncio.wait_for(sched.stop(), 5)

    asyncio.run(main())


def test_oldest_adds_each_requests_phases_to_its_own_callers_totals() -> None:
    """A request the slot sends after the one before it (not when it arrived) still counts into the
    totals its caller set (an ensemble's), not into those of the request that woke the slot."""

    async def counted(sched: SequenceScheduler, value: float, start: bool) -> PhaseTotals:
        totals = PhaseTotals()
        ALSO_COUNT_PHASES.set(totals)  # this task's own context, as an ensemble's step has
        await step(sched, 1, value, start=start)
        return totals

    async def main() -> None:
        sched, _ = scheduler(max_batch_size=1, strategy="oldest", preferred_batch_sizes=(1,))
        first, second = await asyncio.gather(counted(sched, 1.0, True), counted(sched, 2.0, False))
        assert first.infer_ns > 0 and second.infer_ns > 0
        assert first.infer_ns + second.infer_ns == sched.statistics.compute_infer.ns

    asyncio.run(main())


class Growing:
    """A state with variable dims that grows by one element per request: OUT is the sum of all sent."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    async def execute(self, batch):  # the feed adapter, as an instance's
        return await execute_as_one_feed(self.run, batch)

    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        self.batches.append(len(inputs["IN"]))
        state = np.concatenate([inputs["STATE_IN"], inputs["IN"]], axis=1)
        return {"OUT": state.sum(axis=1, keepdims=True), "STATE_OUT": state}


def test_sequences_whose_states_grew_apart_run_in_separate_batches() -> None:
    """Two sequences' variable-dims states of different lengths cannot be stacked: each runs as its own
    row beside a null row (it used to fail both requests, and every later batch that paired them)."""

    async def main() -> None:
        growing = StateSpec("STATE_IN", "STATE_OUT", DataType.FP32, (-1,))
        batching = SequenceBatching(strategy="direct", controls=CONTROLS, states=(growing,))
        model = Growing()
        sched = SequenceScheduler(SimpleNamespace(instances=[model]), ModelStatistics(), 2, batching, "grow")
        assert await step(sched, 1, 1.0, start=True) == 1.0
        assert await step(sched, 1, 1.0) == 2.0
        assert await asyncio.gather(step(sched, 1, 1.0), step(sched, 2, 5.0, start=True)) == [3.0, 5.0]
        assert await asyncio.gather(step(sched, 1, 1.0), step(sched, 2, 5.0, end=True)) == [4.0, 10.0]
        assert sched.statistics.fail.count == 0 and sched.statistics.inference_count == 6

    asyncio.run(main())


def test_unloading_does_not_wait_for_a_slot_for_requests_given_up_in_the_backlog() -> None:
    """``stop`` lets what is queued run; a backlogged request its client gave up is not queued (it used
    to hold ``stop`` until an idle sequence freed a slot: here a minute)."""

    async def main() -> None:
        sched, _ = scheduler(max_batch_size=1, max_sequence_idle_us=60_000_000)
        assert await step(sched, 1, 1.0, start=True) == 1.0
        waiting = asyncio.create_task(step(sched, 2, 1.0, start=True))
        await _queued(sched, 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert sched.queued == 0
        await asyncio.wait_for(sched.stop(), 5)

    asyncio.run(main())

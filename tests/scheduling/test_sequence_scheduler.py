"""The sequence batcher's rules, with fake instances: an accumulator whose state the batcher keeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shoal.errors import ShoalError
from shoal.protocol.types import DataType
from shoal.repository.sequence_config import Control, ControlKind, SequenceBatching, StateSpec
from shoal.scheduling import sequence as sequence_module
from shoal.scheduling.batching import execute_as_one_feed
from shoal.scheduling.sequence import SequenceScheduler
from shoal.statistics import ModelStatistics

CONTROLS = (
    Control(ControlKind.START, "START", DataType.INT32, 0, 1),
    Control(ControlKind.READY, "READY", DataType.FP32, 0.0, 1.0),
    Control(ControlKind.CORRID, "CORRID", DataType.UINT64),
)
STATE = StateSpec("STATE_IN", "STATE_OUT", DataType.FP32, (1,))


class Accumulator:
    """OUT = STATE_IN + IN (STATE_OUT the same); records every batch it runs."""

    def __init__(self, log: list[tuple[int, dict[str, np.ndarray]]], index: int) -> None:
        self.log = log
        self.index = index

    async def execute(self, batch):  # the feed adapter, as an instance's
        return await execute_as_one_feed(self.run, batch)

    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        self.log.append((self.index, {name: np.array(value) for name, value in inputs.items()}))
        await asyncio.sleep(0)
        total = inputs["STATE_IN"] + inputs["IN"]
        return {"OUT": total, "STATE_OUT": total}


class Instances:
    def __init__(self, count: int) -> None:
        self.log: list[tuple[int, dict[str, np.ndarray]]] = []
        self.instances = [Accumulator(self.log, index) for index in range(count)]


# The same controls for string correlation ids (a TYPE_STRING CORRID).
TEXT_CONTROLS = (*CONTROLS[:2], Control(ControlKind.CORRID, "CORRID", DataType.BYTES))


def scheduler(instances: int = 1, max_batch_size: int = 2, **options: Any) -> tuple[SequenceScheduler, Instances]:
    runner = Instances(instances)
    batching = SequenceBatching(
        strategy=options.pop("strategy", "direct"),
        controls=options.pop("controls", CONTROLS),
        states=(STATE,),
        **options,
    )
    return SequenceScheduler(runner, ModelStatistics(), max_batch_size, batching, "acc"), runner


async def step(
    sched: SequenceScheduler, cid: int | str, value: float, start: bool = False, end: bool = False, **parameters: Any
) -> float:
    feed = {"IN": np.array([[value]], dtype=np.float32)}
    result = await sched.submit(
        feed, ["OUT"], 1, {"sequence_id": cid, "sequence_start": start, "sequence_end": end, **parameters}
    )
    return float(result["OUT"][0, 0])


def test_interleaved_sequences_each_get_their_own_running_sum() -> None:
    async def main() -> None:
        sched, runner = scheduler()
        sums = await asyncio.gather(
            *(step(sched, cid, 1.0 * cid, start=True) for cid in (1, 2)),
        )
        assert sums == [1.0, 2.0]
        assert await step(sched, 2, 10.0) == 12.0
        assert await step(sched, 1, 5.0, end=True) == 6.0
        assert await step(sched, 2, 1.0, end=True) == 13.0
        # Slot 1 ran alone while slot 0 was empty: slot 0 was a null row (READY false, CORRID 0).
        _, lone = runner.log[-1]
        assert lone["READY"].tolist() == [[0.0], [1.0]]
        assert lone["CORRID"].tolist() == [[0], [2]]
        assert lone["START"].dtype == np.int32 and lone["CORRID"].dtype == np.uint64
        # As Triton counts them: a null row is in its batch's size, not among the inferences.
        assert sched.statistics.inference_count == sched.statistics.success.count == 5
        assert sum(size * stats.compute_infer.count for size, stats in sched.statistics.batch_stats.items()) == sum(
            len(batch["IN"]) for _, batch in runner.log
        )
        assert 2 in sched.statistics.batch_stats

    asyncio.run(main())


def test_errors_use_tritons_words() -> None:
    async def main() -> None:
        sched, _ = scheduler()
        with pytest.raises(ShoalError, match="must specify a non-zero or non-empty correlation ID"):
            await step(sched, 0, 1.0, start=True)
        with pytest.raises(
            ShoalError,
            match="inference request for sequence 7 to model 'acc' must specify the "
            "START flag on the first request of the sequence",
        ):
            await step(sched, 7, 1.0)
        with pytest.raises(ShoalError, match="invalid value type for 'sequence_start' parameter"):
            await step(sched, 7, 1.0, start=1)  # type: ignore[arg-type]
        with pytest.raises(ShoalError, match="must specify batch-size 1 due to requirements of sequence batcher"):
            await sched.submit({"IN": np.zeros((2, 1), np.float32)}, ["OUT"], 2, {"sequence_id": 3})
        assert sched.statistics.fail.count == 4

    asyncio.run(main())


def test_string_and_wrapped_uint64_ids_restart_after_end() -> None:
    async def main() -> None:
        sched, runner = scheduler(max_batch_size=1, controls=TEXT_CONTROLS)
        assert await step(sched, "alpha", 2.0, start=True) == 2.0
        assert await step(sched, "alpha", 3.0, end=True) == 5.0
        assert runner.log[-1][1]["CORRID"].tolist() == [[b"alpha"]]
        with pytest.raises(ShoalError, match="sequence alpha"):
            await step(sched, "alpha", 1.0)
        assert await step(sched, "alpha", 4.0, start=True, end=True) == 4.0  # restarted: state from zero
        sched, runner = scheduler(max_batch_size=1)
        assert await step(sched, -1, 1.0, start=True, end=True) == 1.0
        assert runner.log[-1][1]["CORRID"].tolist() == [[2**64 - 1]]

    asyncio.run(main())


def test_a_null_rows_string_corrid_is_no_sequences_id() -> None:
    """Found by the review of session 48: a null row's TYPE_STRING CORRID was "0", which a sequence's id
    may be. It is the empty string, as Triton copies its null request's id 0 there (length 0)."""

    async def main() -> None:
        sched, runner = scheduler(controls=TEXT_CONTROLS)
        await asyncio.gather(step(sched, "a", 1.0, start=True), step(sched, "0", 2.0, start=True))
        await step(sched, "a", 1.0, end=True)
        assert await step(sched, "0", 3.0, end=True) == 5.0  # alone in its batch: row 0 is a null row
        _, lone = runner.log[-1]
        assert lone["READY"].tolist() == [[0.0], [1.0]]
        assert lone["CORRID"].tolist() == [[b""], [b"0"]]

    asyncio.run(main())


def test_an_id_of_the_other_kind_than_the_corrid_control_is_refused_in_tritons_words() -> None:
    """Found by the review of session 48: a string id was fed to an integer CORRID as 0 (the null row's
    value, and every other string id's). Refused as Triton refuses it from 25.01 (2.51 fed raw bytes)."""

    async def main() -> None:
        numbers, runner = scheduler(max_batch_size=1)
        with pytest.raises(ShoalError) as text_id:
            await step(numbers, "7", 1.0, start=True)
        assert text_id.value.message == (
            "[request id: <id_unknown>] sequence batching control 'CORRID' data-type is 'BYTES', "
            "but model 'acc' expects 'UINT64'"
        )
        texts, text_runner = scheduler(max_batch_size=1, controls=TEXT_CONTROLS)
        with pytest.raises(ShoalError, match="data-type is 'UINT64', but model 'acc' expects 'BYTES'"):
            await step(texts, 7, 1.0, start=True)
        assert runner.log == text_runner.log == []  # neither model ran
        assert numbers.statistics.fail.count == texts.statistics.fail.count == 1
        without = SequenceScheduler(
            Instances(1), ModelStatistics(), 1, SequenceBatching("direct", states=(STATE,)), "acc"
        )
        assert await step(without, "7", 1.0, start=True, end=True) == 1.0  # no CORRID: any id

    asyncio.run(main())


def test_slots_spread_over_instances_and_the_backlog_waits_for_a_free_one() -> None:
    async def main() -> None:
        sched, runner = scheduler(instances=2, max_batch_size=1)
        await asyncio.gather(step(sched, 1, 1.0, start=True), step(sched, 2, 1.0, start=True))
        assert sorted(index for index, _ in runner.log) == [0, 1]
        waiting = asyncio.create_task(step(sched, 3, 5.0, start=True))
        refused = asyncio.create_task(step(sched, 4, 5.0, start=True, timeout=20_000))
        with pytest.raises(ShoalError, match="timeout of the corresponding sequence has been expired"):
            await refused
        assert not waiting.done() and sched.queued == 1
        assert await step(sched, 1, 1.0, end=True) == 2.0
        assert await waiting == 5.0  # took the slot sequence 1 freed

    asyncio.run(main())


def test_an_idle_sequence_loses_its_slot() -> None:
    async def main() -> None:
        sched, _ = scheduler(max_sequence_idle_us=30_000)
        assert await step(sched, 5, 1.0, start=True) == 1.0
        deadline = time.monotonic() + 5
        while sched.active_sequences and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        with pytest.raises(ShoalError, match="must specify the START flag"):
            await step(sched, 5, 1.0)

    asyncio.run(main())


def test_oldest_batches_ready_sequences_and_keeps_each_in_order() -> None:
    async def main() -> None:
        sched, runner = scheduler(
            strategy="oldest",
            max_batch_size=4,
            max_candidate_sequences=4,
            preferred_batch_sizes=(4,),
            max_queue_delay_us=2000,
        )

        async def sequence(cid: int) -> list[float]:
            sums = [await step(sched, cid, 1.0, start=True)]
            for _ in range(4):
                sums.append(await step(sched, cid, float(cid)))
            sums.append(await step(sched, cid, 0.0, end=True))
            return sums

        results = await asyncio.gather(*(sequence(cid) for cid in (1, 2, 3, 4)))
        for cid, sums in zip((1, 2, 3, 4), results, strict=True):
            assert sums == [1.0 + cid * k for k in range(5)] + [1.0 + 4 * cid]
        assert max(len(batch["IN"]) for _, batch in runner.log) > 1  # sequences were batched together
        assert sched.statistics.success.count == 24

    asyncio.run(main())


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_a_backlogged_sequence_whose_end_was_given_up_still_frees_its_slot(strategy: str) -> None:
    """The END a client gave up while its sequence waited in the backlog still ends the sequence once it
    holds a slot (its requests before the END run first), so the slot goes to the next sequence. It once
    stayed taken for good: every later sequence waited in the backlog, and an unload waited for them."""

    async def main() -> None:
        options: dict[str, Any] = {"max_candidate_sequences": 1} if strategy == "oldest" else {}
        sched, _ = scheduler(max_batch_size=1, strategy=strategy, **options)
        assert await step(sched, 1, 1.0, start=True) == 1.0  # sequence 1 holds the only slot
        start = asyncio.create_task(step(sched, 3, 5.0, start=True))
        end = asyncio.create_task(step(sched, 3, 7.0, end=True))
        while sched.queued < 2:  # both wait in the backlog
            await asyncio.sleep(0)
        end.cancel()
        await asyncio.wait([end])
        assert await step(sched, 1, 1.0, end=True) == 2.0  # sequence 3 moves in
        assert await start == 5.0
        fresh = step(sched, 10, 42.0, start=True, end=True)
        assert await asyncio.wait_for(fresh, 10) == 42.0
        assert sched.active_sequences == 0

    asyncio.run(main())


def test_a_sequence_found_idle_keeps_its_slot_for_the_grace_period_whatever_wakes_the_reaper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found idle, a sequence is released only once it is still idle ``IDLE_GRACE_NS`` later: another
    sequence's timer that runs the reaper within the grace releases nothing (it once did, and the END
    that came within the grace was refused for want of a START). The batcher's clock is played here."""
    clock = [10**12]
    monkeypatch.setattr(sequence_module, "time", SimpleNamespace(monotonic_ns=lambda: clock[0]))

    async def main() -> None:
        sched, _ = scheduler(max_sequence_idle_us=300_000)
        assert await step(sched, 1, 1.0, start=True) == 1.0
        clock[0] += 310_000_000  # idle past its limit: found so
        sched._reap()
        clock[0] += sequence_module.IDLE_GRACE_NS // 2  # another sequence's timer, within the grace
        sched._reap()
        assert await step(sched, 1, 2.0, end=True) == 3.0  # still its slot, its state
        assert await step(sched, 2, 5.0, start=True) == 5.0
        clock[0] += 310_000_000
        sched._reap()
        clock[0] += sequence_module.IDLE_GRACE_NS
        sched._reap()  # still idle a grace period after it was found: released
        assert sched.active_sequences == 0

    asyncio.run(main())

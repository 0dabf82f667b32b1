"""The scheduler's rules, with a fake runner whose executions the test opens and closes."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from shoal.errors import ShoalError
from shoal.repository.config import DynamicBatching, QueuePolicy
from shoal.scheduling import clock
from shoal.scheduling.batching import execute_as_one_feed
from shoal.scheduling.clock import DeadlineClock, deadline_clock
from shoal.scheduling.dynamic import Scheduler
from shoal.statistics import ModelStatistics

FAIL_VALUE = -999


class GatedExecutor:
    """Identity executor; each run waits for the test to open the gate when ``gated``."""

    def __init__(self, runner: FakeRunner, name: str) -> None:
        self.runner = runner
        self.name = name

    async def execute(self, batch):  # the feed adapter, as an instance's
        return await execute_as_one_feed(self.run, batch)

    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        self.runner.departures_ns.append(time.monotonic_ns())
        rows = inputs["IN"]
        self.runner.batches.append(rows[:, 0].tolist())
        self.runner.started.set()
        if self.runner.gated:
            gate = asyncio.Event()
            self.runner.gates.append(gate)
            await gate.wait()
        if (rows == FAIL_VALUE).any():
            raise RuntimeError("the model raised")
        return {"OUT": rows.copy()}


class FakeRunner:
    def __init__(self, count: int = 1, gated: bool = False) -> None:
        self.free: asyncio.Queue[GatedExecutor] = asyncio.Queue()
        for index in range(count):
            self.free.put_nowait(GatedExecutor(self, f"e{index}"))
        self.gated = gated
        self.gates: list[asyncio.Event] = []
        self.batches: list[list[int]] = []
        self.departures_ns: list[int] = []  # time.monotonic_ns() as each batch reached an executor
        self.started = asyncio.Event()

    async def acquire(self) -> GatedExecutor:
        return await self.free.get()

    def release(self, executor: GatedExecutor) -> None:
        self.free.put_nowait(executor)

    async def open_next_gate(self) -> None:
        await until(lambda: bool(self.gates))
        self.gates.pop(0).set()


def make(runner: FakeRunner, max_batch_size: int = 8, **batching: Any) -> Scheduler:
    config = DynamicBatching(**batching) if batching is not None else None
    return Scheduler(runner, ModelStatistics(), max_batch_size, config)


def submit(scheduler: Scheduler, value: int, rows: int = 1, **parameters: Any) -> asyncio.Task[Any]:
    feed = {"IN": np.full((rows, 2), value, dtype=np.int64)}
    return asyncio.ensure_future(scheduler.submit(feed, ["OUT"], rows, parameters))


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` on the event loop until it holds; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s")
        await asyncio.sleep(0.001)


async def queued(scheduler: Scheduler, count: int) -> None:
    """Wait until ``count`` requests are queued (submitted and waiting for an executor)."""
    await until(lambda: scheduler.queued == count)


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout=20))


def test_queued_requests_merge_and_each_gets_its_own_rows() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        tasks = [submit(scheduler, value, rows=value) for value in (1, 2, 3)]  # 6 rows
        await queued(scheduler, 3)
        await runner.open_next_gate()
        await runner.open_next_gate()
        results = await asyncio.gather(blocker, *tasks)
        assert runner.batches == [[0], [1, 2, 2, 3, 3, 3]]
        for value, result in zip((0, 1, 2, 3), results, strict=True):
            assert result["OUT"].shape == (max(1, value), 2) and (result["OUT"] == value).all()
        stats = scheduler.statistics
        assert (stats.execution_count, stats.inference_count) == (2, 7)
        assert sorted(stats.batch_stats) == [1, 6]
        assert stats.success.count == 4 and stats.queue.count == 4

    run(scenario())


def test_batch_never_exceeds_max_batch_size_and_requests_are_not_split() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, max_batch_size=4)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        tasks = [submit(scheduler, 1, rows=3), submit(scheduler, 2, rows=2), submit(scheduler, 3, rows=1)]
        await queued(scheduler, 3)
        for _ in range(3):
            await runner.open_next_gate()
        await asyncio.gather(blocker, *tasks)
        assert runner.batches == [[0], [1, 1, 1], [2, 2, 3]]

    run(scenario())


def test_different_shapes_are_not_merged() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        wide = asyncio.ensure_future(scheduler.submit({"IN": np.full((1, 3), 5, np.int64)}, ["OUT"], 1, {}))
        narrow = submit(scheduler, 6)
        await queued(scheduler, 2)
        for _ in range(3):
            await runner.open_next_gate()
        await asyncio.gather(blocker, wide, narrow)
        assert runner.batches == [[0], [5], [6]]

    run(scenario())


def test_preferred_size_goes_at_once_and_the_rest_waits_for_the_delay() -> None:
    async def scenario() -> None:
        runner = FakeRunner()
        scheduler = make(runner, preferred_batch_sizes=(4,), max_queue_delay_us=200_000)
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = [submit(scheduler, value) for value in range(6)]
        first = await asyncio.gather(*tasks[:4])
        first_done = loop.time() - start
        await asyncio.gather(*tasks[4:])
        rest_done = loop.time() - start
        assert runner.batches == [[0, 1, 2, 3], [4, 5]]
        assert [int(r["OUT"][0, 0]) for r in first] == [0, 1, 2, 3]
        assert first_done < 0.15, "a preferred batch must not wait for the delay"
        assert rest_done >= 0.19, "a partial batch waits for the oldest request's delay"

    run(scenario())


def test_full_queue_is_rejected_at_once() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, default_queue_policy=QueuePolicy(max_queue_size=2))
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        waiting = [submit(scheduler, 1), submit(scheduler, 2)]
        await queued(scheduler, 2)
        with pytest.raises(ShoalError, match="Exceeds maximum queue size") as caught:
            await submit(scheduler, 3)
        assert caught.value.code.name == "UNAVAILABLE"
        await runner.open_next_gate()
        await runner.open_next_gate()
        await asyncio.gather(blocker, *waiting)
        assert scheduler.statistics.fail.count == 1

    run(scenario())


def test_queue_timeout_rejects_promptly_while_executors_are_busy() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, default_queue_policy=QueuePolicy(default_timeout_us=50_000))
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ShoalError, match="Request timeout expired"):
            await submit(scheduler, 1)
        assert loop.time() - start < 1.0
        await runner.open_next_gate()
        await blocker

    run(scenario())


def test_a_request_that_leaves_the_queue_cancels_its_timeout() -> None:
    """Served requests under a 60 s queue timeout leave no live deadline behind: before, each one kept a
    timer (and the scheduler) in the clock for the whole timeout, and each later ran a pass over the queue."""

    async def scenario() -> None:
        runner = FakeRunner()
        scheduler = make(runner, default_queue_policy=QueuePolicy(default_timeout_us=60_000_000))
        await asyncio.gather(*(submit(scheduler, value) for value in range(50)))
        live = [timer for timer in deadline_clock()._heap if not timer.cancelled]
        assert live == []

    run(scenario())


def test_a_request_cancelled_while_queued_leaves_at_once_and_frees_its_place() -> None:
    """Cancelled in the middle of the queue while the executor is busy: counted as CANCELED and out
    of the queue (its place free under max_queue_size) at once; before, only when the next batch was
    formed, by a walk over the whole queue."""

    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, default_queue_policy=QueuePolicy(max_queue_size=3))
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        first, middle, last = submit(scheduler, 1), submit(scheduler, 2), submit(scheduler, 3)
        await queued(scheduler, 3)
        middle.cancel()
        await queued(scheduler, 2)
        assert scheduler.statistics.fail.count == 1
        refill = submit(scheduler, 4)
        await queued(scheduler, 3)
        await runner.open_next_gate()
        await runner.open_next_gate()
        await asyncio.gather(blocker, first, last, refill)
        assert runner.batches == [[0], [1, 3, 4]]

    run(scenario())


def test_served_requests_do_not_pile_up_as_deadlines() -> None:
    """Requests served within a 60 s queue timeout: the deadlines they leave behind are dropped once
    they are the greater part, so the scheduler holds about as many as requests are waiting."""

    async def scenario() -> None:
        runner = FakeRunner()
        scheduler = make(runner, default_queue_policy=QueuePolicy(default_timeout_us=60_000_000))
        for _ in range(10):
            await asyncio.gather(*(submit(scheduler, value) for value in range(500)))
        assert len(scheduler._deadlines) <= 2 * 1024 + 500

    run(scenario())


def test_request_timeout_override_only_when_allowed() -> None:
    async def scenario(allow: bool) -> bool:
        runner = FakeRunner(gated=True)
        policy = QueuePolicy(default_timeout_us=60_000_000, allow_timeout_override=allow)
        scheduler = make(runner, default_queue_policy=policy)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        task = submit(scheduler, 1, timeout=20_000)
        # Allowed: the 20 ms override shortens the 60 s default and expires it while the executor is
        # busy. Not allowed: the 60 s default applies, so it is still queued when the wait ends.
        done, _ = await asyncio.wait({task}, timeout=10.0 if allow else 0.2)
        expired = task in done
        if not expired:
            await runner.open_next_gate()
        await runner.open_next_gate()
        await asyncio.gather(blocker, task, return_exceptions=True)
        return expired

    assert run(scenario(allow=True)) is True
    assert run(scenario(allow=False)) is False


def test_delayed_requests_go_after_the_others() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        policy = QueuePolicy(delay_on_timeout=True, default_timeout_us=60_000_000, allow_timeout_override=True)
        scheduler = make(runner, max_batch_size=1, default_queue_policy=policy)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        late = submit(scheduler, 1, timeout=1)  # 1 µs: times out while queued, moved behind the others
        fresh = submit(scheduler, 2)  # no timeout
        await queued(scheduler, 2)
        for _ in range(3):
            await runner.open_next_gate()
        await asyncio.gather(blocker, late, fresh)
        assert runner.batches == [[0], [2], [1]]

    run(scenario())


def test_a_request_timeout_is_ignored_when_the_policy_has_no_default_timeout() -> None:
    """Triton's PolicyQueue::Enqueue (core src/scheduler_utils.cc) starts from
    ``default_timeout_us_`` and takes the request's timeout only when ``allow_timeout_override``
    and ``0 < override < default``: with the default 0 no override is ever smaller, so the request
    has no timeout (model_config.proto: an override "may not increase the timeout")."""

    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        policy = QueuePolicy(default_timeout_us=0, allow_timeout_override=True)
        scheduler = make(runner, max_batch_size=1, default_queue_policy=policy)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        task = submit(scheduler, 1, timeout=1)  # 1 µs: long past while the executor is busy
        await queued(scheduler, 1)
        done, _ = await asyncio.wait({task}, timeout=0.2)
        assert not done, "a 1 µs override of no default timeout must not expire the request"
        await runner.open_next_gate()
        await runner.open_next_gate()
        await asyncio.gather(blocker, task)
        assert runner.batches == [[0], [1]] and scheduler.statistics.fail.count == 0

    run(scenario())


def test_a_delayed_request_goes_behind_its_own_level_only_not_behind_lower_levels() -> None:
    """Triton's PriorityQueue keeps one PolicyQueue per priority level, and each PolicyQueue its own
    ``delayed_queue_``: ``PolicyQueue::At`` reads the level's queue, then its delayed queue, before
    the cursor moves to the next level (core src/scheduler_utils.cc). model_config.proto: DELAY
    delays the request "until all other requests at the same (or higher) priority levels that have
    not reached their timeouts are processed" - so it still goes before lower levels."""

    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        delay = QueuePolicy(delay_on_timeout=True, default_timeout_us=60_000_000, allow_timeout_override=True)
        scheduler = make(
            runner, max_batch_size=1, priority_levels=2, default_priority_level=2, priority_queue_policies={1: delay}
        )
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        late = submit(scheduler, 1, priority=1, timeout=1)  # level 1, expires at once: delayed
        fresh = submit(scheduler, 2, priority=1)  # level 1, no expiry: goes first
        low = submit(scheduler, 3, priority=2)  # level 2: after everything of level 1, delayed or not
        await queued(scheduler, 3)
        for _ in range(4):
            await runner.open_next_gate()
        await asyncio.gather(blocker, late, fresh, low)
        assert runner.batches == [[0], [2], [1], [3]]

    run(scenario())


def test_an_expired_queue_delay_sends_everything_queued_up_to_max_batch_size() -> None:
    """Triton's GetDynamicBatch (core src/dynamic_batch_scheduler.cc) marks a cut when the next
    request would pass the largest preferred size but keeps walking until ``max_batch_size``; the
    cut goes only while the delay has not expired - once it has, "immediately execute whatever is
    pending": here both 3-row requests (6 rows, past the preferred 4, within max_batch_size 8)."""

    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, max_batch_size=8, preferred_batch_sizes=(4,), max_queue_delay_us=1)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        tasks = [submit(scheduler, 1, rows=3), submit(scheduler, 2, rows=3), submit(scheduler, 3, rows=3)]
        await queued(scheduler, 3)  # all older than the 1 µs delay by the time the executor is free
        for _ in range(3):
            await runner.open_next_gate()
        await asyncio.gather(blocker, *tasks)
        assert runner.batches == [[0], [1, 1, 1, 2, 2, 2], [3, 3, 3]]  # 9 rows would pass max_batch_size

    run(scenario())


def test_before_the_delay_expires_the_largest_preferred_size_found_goes() -> None:
    """GetDynamicBatch sets the "saturated" cut only when no preferred size was reached
    (``best_preferred_batch_size == 0``), so a preferred size found earlier is the one that goes
    (core src/dynamic_batch_scheduler.cc; batcher.md: "a batch of the largest possible preferred
    size"). Preferred {2, 5}, rows 1+1 (=2, preferred) +2 (=4) and the next 2 would pass 5: the
    batch is the 2 rows, not the 4 walked; each 2-row request left is a preferred size of its own."""

    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, max_batch_size=8, preferred_batch_sizes=(2, 5))
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        tasks = [submit(scheduler, 1), submit(scheduler, 2), submit(scheduler, 3, rows=2), submit(scheduler, 4, rows=2)]
        await queued(scheduler, 4)
        for _ in range(4):
            await runner.open_next_gate()
        await asyncio.gather(blocker, *tasks)
        assert runner.batches == [[0], [1, 2], [3, 3], [4, 4]]

    run(scenario())


def test_high_priority_overtakes_queued_low_priority() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner, max_batch_size=1, priority_levels=2, default_priority_level=2)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        low = [submit(scheduler, value) for value in (1, 2)]
        high = submit(scheduler, 9, priority=1)
        out_of_range = submit(scheduler, 3, priority=7)  # beyond the levels: default level
        await queued(scheduler, 4)
        for _ in range(5):
            await runner.open_next_gate()
        await asyncio.gather(blocker, *low, high, out_of_range)
        assert runner.batches == [[0], [9], [1], [2], [3]]

    run(scenario())


def test_preserve_ordering_releases_in_arrival_order() -> None:
    async def scenario() -> None:
        runner = FakeRunner(count=2, gated=True)
        scheduler = make(runner, max_batch_size=1, preserve_ordering=True)
        first, second = submit(scheduler, 1), submit(scheduler, 2)
        await until(lambda: len(runner.gates) == 2)
        runner.gates[1].set()  # the second request's execution finishes first
        await until(lambda: scheduler.statistics.success.count == 1)  # executed, its outputs split
        done, _ = await asyncio.wait({second}, timeout=0.1)
        assert not done, "a later request must wait for the earlier one"
        runner.gates[0].set()
        await asyncio.gather(first, second)

    run(scenario())


def test_a_failing_batch_fails_only_its_requests() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = make(runner)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        doomed = [submit(scheduler, FAIL_VALUE), submit(scheduler, 5)]  # batched together
        await queued(scheduler, 2)
        await runner.open_next_gate()
        await runner.open_next_gate()
        results = await asyncio.gather(blocker, *doomed, return_exceptions=True)
        assert isinstance(results[1], RuntimeError) and isinstance(results[2], RuntimeError)
        runner.gated = False
        after = await submit(scheduler, 7)
        assert (after["OUT"] == 7).all()
        assert scheduler.statistics.fail.count == 2 and scheduler.statistics.success.count == 2

    run(scenario())


def test_without_dynamic_batching_each_request_runs_alone_in_fifo_order() -> None:
    async def scenario() -> None:
        runner = FakeRunner(gated=True)
        scheduler = Scheduler(runner, ModelStatistics(), 8, None)
        blocker = submit(scheduler, 0)
        await runner.started.wait()
        tasks = [submit(scheduler, value, priority=1) for value in (1, 2, 3)]
        await queued(scheduler, 3)
        for _ in range(4):
            await runner.open_next_gate()
        await asyncio.gather(blocker, *tasks)
        assert runner.batches == [[0], [1], [2], [3]]

    run(scenario())


def test_stop_finishes_queued_work_then_refuses() -> None:
    async def scenario() -> None:
        runner = FakeRunner()
        scheduler = make(runner, max_batch_size=1)
        tasks = [submit(scheduler, value) for value in range(3)]
        await until(lambda: scheduler.queued + len(runner.batches) == 3)  # all three submitted
        await scheduler.stop()
        assert all(t.done() and not t.exception() for t in tasks)
        with pytest.raises(ShoalError, match="unloading"):
            await submit(scheduler, 9)

    run(scenario())


# -- the batcher's clock: sub-millisecond delays are kept ---------------------------------------------


def test_a_sub_millisecond_delay_is_kept_not_rounded_up_to_a_millisecond() -> None:
    """A lone request departs no earlier than the delay, and not a millisecond later.

    asyncio's timers go through epoll, whose timeout is whole milliseconds: with them a 300 µs
    delay never lets a batch go before 1 ms (every run, so the median too). The deadline clock
    lets it go within tens of µs. The upper bound is on the median of 21 runs and leaves 600 µs
    for scheduling noise, so a loaded machine that delays a few runs cannot fail it; only a clock
    that rounds up (or never fires early enough) in most runs can.
    """

    async def scenario() -> None:
        delay_ns = 300_000
        runner = FakeRunner()
        scheduler = make(runner, max_batch_size=8, max_queue_delay_us=delay_ns // 1000)
        waits_ns = []
        for value in range(21):
            submitted = time.monotonic_ns()
            await submit(scheduler, value)
            waits_ns.append(runner.departures_ns[-1] - submitted)
        assert runner.batches == [[value] for value in range(21)], "each lone request is its own batch"
        assert min(waits_ns) >= delay_ns, "no batch may go before the oldest request's delay"
        assert statistics.median(waits_ns) < 900_000, f"median wait {statistics.median(waits_ns) / 1000:.0f} µs"
        await scheduler.stop()

    run(scenario())


def test_deadline_clock_runs_callbacks_in_order_never_early_and_not_when_cancelled() -> None:
    async def scenario() -> None:
        clock_ = deadline_clock()
        assert clock_ is deadline_clock(), "one clock per event loop"
        assert clock_.precise, "Linux has timerfd: deadlines are not left to asyncio's timers"
        await _check_order_and_cancel(clock_)

    run(scenario())


def test_deadline_clock_falls_back_to_asyncio_timers_without_timerfd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock, "_LIBC", None)

    async def scenario() -> None:
        fallback = DeadlineClock(asyncio.get_running_loop())
        assert not fallback.precise
        await _check_order_and_cancel(fallback)

    run(scenario())


async def _check_order_and_cancel(clock_: DeadlineClock) -> None:
    fired: list[tuple[str, int, int]] = []  # (name, deadline, when it ran)
    done = asyncio.Event()
    start = time.monotonic_ns()

    def at(name: str, offset_us: int) -> clock.Timer:
        deadline = start + offset_us * 1000
        return clock_.call_at(deadline, lambda: fired.append((name, deadline, time.monotonic_ns())))

    at("c", 3000)
    at("a", 200)
    cancelled = at("x", 100)
    at("b", 1000)
    at("past", -1000)
    clock_.call_at(start + 4_000_000, done.set)
    cancelled.cancel()
    await done.wait()
    assert [name for name, _, _ in fired] == ["past", "a", "b", "c"]
    assert all(ran >= deadline for _, deadline, ran in fired), "a callback ran before its deadline"


def test_deadline_clock_does_not_spin_while_it_waits() -> None:
    """Waiting 50 ms for a deadline costs the event loop's thread next to no CPU time (a spin costs 50 ms)."""

    async def scenario() -> float:
        done = asyncio.Event()
        cpu_before = time.thread_time()
        deadline_clock().call_at(time.monotonic_ns() + 50_000_000, done.set)
        await done.wait()
        return time.thread_time() - cpu_before

    assert run(scenario()) < 0.02


def test_a_model_that_leaves_out_an_asked_output_fails_the_batch_with_a_clean_internal_error() -> None:
    """Before the one execution contract, scatter raised a bare KeyError here (logged as unexpected)."""

    class Forgetful:
        async def execute(self, batch):  # the feed adapter, as an instance's
            return await execute_as_one_feed(self.run, batch)

        async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
            return {}

    class OneRunner:
        def __init__(self) -> None:
            self.executor = Forgetful()

        async def acquire(self) -> Forgetful:
            return self.executor

        def release(self, executor: Forgetful) -> None:
            pass

    async def scenario() -> None:
        scheduler = Scheduler(OneRunner(), ModelStatistics(), 8, DynamicBatching())
        for rows in (1, 2):  # one request (no split), and two in a batch
            tasks = [submit(scheduler, value) for value in range(rows)]  # type: ignore[arg-type]
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                assert isinstance(outcome, ShoalError), outcome
                assert outcome.message == "the model returned no output 'OUT'"
        assert scheduler.statistics.fail.count == 3
        await scheduler.stop()

    run(scenario())

"""Triton's rate limiter (issue 27 item 1), the limiter itself: pools, order, head-of-line, Triton's errors.

Every claim here is granted or not by what the limiter was told; the server-level tests (two models that
exclude each other, priorities under load, both process layouts) are in tests/scheduling/test_rate_limiter_server.py.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from shoal.errors import ErrorCode, ShoalError
from shoal.scheduling.batching import execute_as_one_feed
from shoal.scheduling.rate_limiter import EVERY_DEVICE, GLOBAL, Claim, Declared, RateLimiter, claim_for
from tests.polling import wait_until


def test_declared_resources_parse_as_triton_parses_them() -> None:
    assert Declared.parse("GPU_MEM:4:0") == Declared("GPU_MEM", 4, 0)
    assert Declared.parse("R:2") == Declared("R", 2, EVERY_DEVICE)
    for bad in ("R", "R:1:0:2", ":1", "R:x", "R:1:y", "R:-1"):
        usage = (
            "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
            f"'<resource_name>:<count>'. Got {bad}"
        )
        with pytest.raises(ValueError, match=re.escape(usage)):
            Declared.parse(bad)


def test_a_claim_counts_per_device_or_globally_and_the_last_entry_of_a_name_wins() -> None:
    claim = claim_for("m_0", 1, [("A", False, 2), ("B", True, 1), ("A", False, 3)], priority=0)
    assert claim.needs == {(1, "A"): 3, (GLOBAL, "B"): 1}
    claim.executions = 5
    assert claim.key == 5  # priority 0 counts as 1


def test_without_declared_resources_each_pool_is_the_largest_claim_on_it() -> None:
    limiter = RateLimiter()
    small, large = claim_for("a", 0, [("R", False, 1)], 1), claim_for("b", 0, [("R", False, 3)], 1)
    limiter.register("a", [small])
    limiter.register("b", [large])

    async def scenario() -> None:
        await limiter.acquire(large)  # 3 of 3
        waiting = asyncio.ensure_future(limiter.acquire(small))
        await asyncio.sleep(0)
        assert not waiting.done() and limiter.staged == 1
        limiter.release(large)
        await asyncio.wait_for(waiting, 5)
        limiter.release(small)

    asyncio.run(scenario())
    limiter.unregister("b")  # the pool shrinks back to what is left
    assert limiter._limits == {(0, "R"): 1}


def test_declared_counts_bound_claims_and_an_undeclared_resource_has_none() -> None:
    limiter = RateLimiter([Declared("R", 2, 0), Declared("R", 5), Declared("G", 1, 3)])
    limiter.register("fits", [claim_for("x", 0, [("R", False, 5)], 1), claim_for("y", 7, [("G", True, 1)], 1)])
    with pytest.raises(ShoalError) as too_many:
        limiter.register("big", [claim_for("z", 1, [("R", False, 6)], 1)])
    assert too_many.value.code is ErrorCode.INVALID_ARGUMENT
    assert too_many.value.message == (
        'Resource count for "R" is limited to 5 which will prevent scheduling of one or '
        "more model instances, the minimum required count is 6"
    )
    with pytest.raises(ShoalError, match='Resource count for "OTHER" is limited to 0 '):
        limiter.register("undeclared", [claim_for("w", 0, [("OTHER", False, 1)], 1)])
    assert set(limiter._registered) == {"fits"}  # a refused registration leaves nothing behind


def test_a_name_cannot_be_global_for_one_instance_and_per_device_for_another() -> None:
    limiter = RateLimiter()
    limiter.register("a", [claim_for("a", 0, [("R", True, 1)], 1)])
    with pytest.raises(ShoalError) as both:
        limiter.register("b", [claim_for("b", 0, [("R", False, 1)], 1)])
    assert both.value.message == (
        'Resource "R" is present as both global and device-specific resource in the model configuration.'
    )


def test_staged_claims_go_lowest_executions_times_priority_first() -> None:
    """Three instances wait on one resource; each release grants the lowest key (ties: staging order)."""
    limiter = RateLimiter()
    holder = claim_for("holder", 0, [("R", False, 1)], 1)
    high, low, fresh = (claim_for(name, 0, [("R", False, 1)], p) for name, p in (("high", 1), ("low", 4), ("new", 9)))
    high.executions, low.executions = 3, 1  # keys 3, 4, 0
    limiter.register("m", [holder, high, low, fresh])
    order: list[str] = []

    async def run(claim: Claim) -> None:
        await limiter.acquire(claim)
        order.append(claim.instance)
        limiter.release(claim)

    async def scenario() -> None:
        await limiter.acquire(holder)
        tasks = [asyncio.ensure_future(run(c)) for c in (low, high, fresh)]
        await asyncio.sleep(0)
        assert order == [] and limiter.staged == 3
        limiter.release(holder)
        await asyncio.wait_for(asyncio.gather(*tasks), 5)

    asyncio.run(scenario())
    assert order == ["new", "high", "low"]
    assert (fresh.executions, high.executions, low.executions) == (1, 4, 2)


def test_the_first_staged_claim_is_never_overtaken_by_one_that_would_fit() -> None:
    """Head-of-line: a claim for 2 waits while 1 of 2 is taken; a later claim for 1 would fit, but waits behind it."""
    limiter = RateLimiter()
    one, two, later = (claim_for(n, 0, [("R", False, k)], 1) for n, k in (("one", 1), ("two", 2), ("later", 1)))
    limiter.register("m", [one, two, later])

    async def scenario() -> list[str]:
        granted: list[str] = []
        await limiter.acquire(one)

        async def run(claim: Claim) -> None:
            await limiter.acquire(claim)
            granted.append(claim.instance)

        big = asyncio.ensure_future(run(two))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(run(later))
        await asyncio.sleep(0)
        assert granted == []  # 'later' fits in what is free, but 'two' came first
        limiter.release(one)
        await asyncio.wait_for(big, 5)
        assert granted == ["two"] and not small.done()
        limiter.release(two)
        await asyncio.wait_for(small, 5)
        limiter.release(later)
        return granted

    assert asyncio.run(scenario()) == ["two", "later"]


def test_claims_on_other_devices_and_without_resources_do_not_wait_for_each_other() -> None:
    limiter = RateLimiter()
    gpu0, gpu1 = claim_for("a", 0, [("R", False, 1)], 1), claim_for("b", 1, [("R", False, 1)], 1)
    free = claim_for("c", 0, [], 1)
    limiter.register("m", [gpu0, gpu1, free])

    async def scenario() -> None:
        for claim in (gpu0, gpu1, free, free):
            await asyncio.wait_for(limiter.acquire(claim), 5)

    asyncio.run(scenario())


def test_a_cancelled_wait_gives_back_what_it_was_granted() -> None:
    limiter = RateLimiter()
    first, second, third = (claim_for(n, 0, [("R", False, 1)], 1) for n in "abc")
    limiter.register("m", [first, second, third])

    async def scenario() -> None:
        await limiter.acquire(first)
        waiting = asyncio.ensure_future(limiter.acquire(second))
        await asyncio.sleep(0)
        limiter.release(first)  # granted to 'second' now; its waiter is cancelled before it runs
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(limiter.acquire(third), 5)  # 'second' gave its unit back
        assert second.executions == 0

    asyncio.run(scenario())


def test_a_load_thread_waits_its_turn_too() -> None:
    """Warm-up runs on a load thread: ``holding`` waits for the serving loop's executions to release."""
    import threading

    limiter = RateLimiter()
    serving, warming = claim_for("s", 0, [("R", False, 1)], 1), claim_for("w", 0, [("R", False, 1)], 1)
    limiter.register("m", [serving, warming])
    done = threading.Event()

    async def scenario() -> None:
        await limiter.acquire(serving)

        def warm_up() -> None:
            with limiter.holding(warming):
                done.set()

        thread = threading.Thread(target=warm_up)
        thread.start()
        assert await asyncio.to_thread(wait_until, lambda: limiter.staged == 1, 30, "the load thread to stage")
        assert not done.is_set()
        limiter.release(serving)
        assert await asyncio.to_thread(done.wait, 5)
        thread.join()
        assert warming.executions == 1 and limiter.staged == 0

    asyncio.run(scenario())


def test_a_loaded_instance_stages_again_before_the_freed_resources_go_to_another() -> None:
    """``release(more=True)``: its model has a batch ready, so the freed unit waits for its next claim: 'high'
    comes back with key 1 x 1 and goes before 'low' (1 x 8), staged first. ``settle`` ends such a wait."""
    limiter = RateLimiter()
    high, low = claim_for("high", 0, [("R", False, 1)], 1), claim_for("low", 0, [("R", False, 1)], 8)
    limiter.register("h", [high])
    limiter.register("l", [low])
    low.executions = 1  # key 8; 'high' after one execution: key 1

    async def scenario() -> list[str]:
        order: list[str] = []

        async def run(claim: Claim) -> None:
            await limiter.acquire(claim)
            order.append(claim.instance)

        await limiter.acquire(high)
        waiting_low = asyncio.ensure_future(run(low))
        await asyncio.sleep(0)
        limiter.release(high, more=True)  # 'low' is staged, but 'high' comes back first
        await asyncio.sleep(0)
        assert order == []
        again = asyncio.ensure_future(run(high))
        await asyncio.wait_for(again, 5)
        assert order == ["high"]
        limiter.release(high)
        await asyncio.wait_for(waiting_low, 5)
        limiter.release(low, more=True)
        limiter.settle("l")  # its scheduler found nothing to run at once after all
        await asyncio.wait_for(limiter.acquire(high), 5)
        return order

    assert asyncio.run(scenario()) == ["high", "low"]


def test_an_instance_that_staged_again_while_it_ran_is_not_waited_for() -> None:
    """The scheduler gives the executor back before the execution's end is counted: it may stage the next
    batch first. ``release(more=True)`` then must not hold the unit for a claim that is already staged."""
    limiter = RateLimiter()
    claim = claim_for("only", 0, [("R", False, 1)], 1)
    limiter.register("m", [claim])

    async def scenario() -> None:
        await limiter.acquire(claim)
        next_batch = asyncio.ensure_future(limiter.acquire(claim))
        await asyncio.sleep(0)
        limiter.release(claim, more=True)
        await asyncio.wait_for(next_batch, 5)

    asyncio.run(scenario())


@pytest.mark.parametrize("b_device", [0, 1], ids=["same-device", "other-device"])
def test_a_model_waiting_on_its_batching_delay_holds_up_no_other_model(b_device: int) -> None:
    """Model A (two instances, preferred batch 4, a 60 s delay) returns a batch of 4 while one late request
    waits for company: it has no batch to stage at once, so the freed unit is not held for it, and B's request
    runs while A's late one still waits (on A's device; on another, whose pool A never held). Before, B waited
    A's delay out."""
    from shoal.repository.config import DynamicBatching
    from shoal.scheduling.dynamic import Scheduler
    from shoal.scheduling.rate_limiter import Admission
    from shoal.statistics import ModelStatistics

    class Executor:
        def __init__(self, gate: asyncio.Event | None = None) -> None:
            self.gate = gate

        async def execute(self, batch):  # the feed adapter, as an instance's
            return await execute_as_one_feed(self.run, batch)

        async def run(self, inputs: dict, outputs: list) -> dict:
            if self.gate is not None:
                await self.gate.wait()
            return {"OUT": inputs["IN"]}

    class Pool:
        def __init__(self, executors: list[Executor]) -> None:
            self.free: asyncio.Queue[Executor] = asyncio.Queue()
            for executor in executors:
                self.free.put_nowait(executor)

        async def acquire(self) -> Executor:
            return await self.free.get()

        def release(self, executor: Executor) -> None:
            self.free.put_nowait(executor)

    async def scenario() -> float:
        limiter, gate = RateLimiter(), asyncio.Event()
        a_executors, b_executor = [Executor(gate), Executor(gate)], Executor()
        a = Admission(limiter, [claim_for(f"a{i}", 0, [("R", False, 1)], 1) for i in range(2)])
        b = Admission(limiter, [claim_for("b", b_device, [("R", False, 1)], 1)])
        a.bind(a_executors)
        b.bind([b_executor])
        limiter.register(a, a.claims)
        limiter.register(b, b.claims)
        batching = DynamicBatching(preferred_batch_sizes=(4,), max_queue_delay_us=60_000_000)
        model_a = Scheduler(Pool(a_executors), ModelStatistics(), 8, batching, a)
        model_b = Scheduler(Pool([b_executor]), ModelStatistics(), 0, None, b)
        x = {"IN": np.zeros((1, 1), np.float32)}
        first = [asyncio.ensure_future(model_a.submit(x, ["OUT"], 1, {})) for _ in range(4)]
        assert await asyncio.to_thread(wait_until, lambda: model_a.statistics.executing == 4, 30, "a batch of 4")
        late = asyncio.ensure_future(model_a.submit(x, ["OUT"], 1, {}))
        assert await asyncio.to_thread(wait_until, lambda: model_a.queued == 1, 30, "the late request to wait")
        gate.set()
        await asyncio.wait_for(asyncio.gather(*first), 30)
        await asyncio.wait_for(model_b.submit({"IN": np.zeros((1,), np.float32)}, ["OUT"], 0, {}), 30)
        waiting = not late.done()  # B ran while A's late request still waits for company
        company = [asyncio.ensure_future(model_a.submit(x, ["OUT"], 1, {})) for _ in range(3)]  # a batch of 4 now
        await asyncio.wait_for(asyncio.gather(late, *company), 30)
        await model_a.stop()
        await model_b.stop()
        return waiting

    assert asyncio.run(scenario())


def test_a_claim_whose_event_loop_closed_is_skipped_not_raised_into_the_releaser() -> None:
    """A load thread's warm-up releases while the serving loop, with a claim waiting on it, has closed (the
    server went away): the release does not raise, and the unit goes to the next claim."""
    limiter = RateLimiter()
    held, orphan, later = (claim_for(n, 0, [("R", False, 1)], 1) for n in ("held", "orphan", "later"))
    limiter.register("m", [held, orphan, later])
    with limiter.holding(held):
        loop = asyncio.new_event_loop()
        waiting = loop.create_task(limiter.acquire(orphan))
        loop.run_until_complete(asyncio.sleep(0))  # staged: it waits for 'held'
        loop.close()  # closed with the task still pending, as at a forced exit
        assert limiter.staged == 1 and not waiting.done()
    with limiter.holding(later):  # would wait forever had the unit gone to the closed loop's claim
        assert orphan.executions == 0

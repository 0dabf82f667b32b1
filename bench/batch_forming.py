"""What forming batches costs the scheduler per request, with a short queue and a long one.

    python bench/batch_forming.py [--queued 2000 32000] [--rounds 3]

In-process, no server, no model: a ``Scheduler`` over a fake runner whose one executor answers at
once. Its executor is held while ``queued`` requests (one row each, max_batch_size 8) are
submitted; then it is freed and the time until every request is answered is divided by their
number. That time is batch forming, gathering and splitting rows and completing futures; only
batch forming could depend on how long the queue is. Configurations: plain ``dynamic_batching``;
with a 60 s queue timeout (a deadline per request); with a 60 s queue timeout whose action is
DELAY, over 4 priority levels. Prints the median over ``rounds`` per configuration and queue
length, writes bench/results/batch_forming.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from shoal.repository.config import DynamicBatching, QueuePolicy  # noqa: E402
from shoal.scheduling.dynamic import Scheduler  # noqa: E402
from shoal.statistics import ModelStatistics  # noqa: E402

MAX_BATCH_SIZE = 8
CONFIGS = {
    "plain": DynamicBatching(),
    "60 s timeout": DynamicBatching(default_queue_policy=QueuePolicy(default_timeout_us=60_000_000)),
    "60 s DELAY, 4 levels": DynamicBatching(
        priority_levels=4,
        default_priority_level=2,
        default_queue_policy=QueuePolicy(default_timeout_us=60_000_000, delay_on_timeout=True),
    ),
}


class InstantExecutor:
    async def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        return {"OUT": inputs["IN"]}


class HeldRunner:
    """One executor, which the benchmark holds until the queue is full."""

    def __init__(self) -> None:
        self.free: asyncio.Queue[InstantExecutor] = asyncio.Queue()

    async def acquire(self) -> InstantExecutor:
        return await self.free.get()

    def release(self, executor: InstantExecutor) -> None:
        self.free.put_nowait(executor)


async def per_request_us(batching: DynamicBatching, queued: int) -> float:
    runner = HeldRunner()
    scheduler = Scheduler(runner, ModelStatistics(), MAX_BATCH_SIZE, batching)
    feed = {"IN": np.zeros((1, 4), dtype=np.float32)}
    levels = max(1, batching.priority_levels)
    tasks = [
        asyncio.ensure_future(scheduler.submit(feed, ["OUT"], 1, {"priority": 1 + index % levels}))
        for index in range(queued)
    ]
    while scheduler.queued < queued:
        await asyncio.sleep(0)
    start = time.perf_counter()
    runner.release(InstantExecutor())
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    await scheduler.stop()
    return elapsed / queued * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, nargs="+", default=[2_000, 32_000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name, batching in CONFIGS.items():
        for queued in args.queued:
            runs = [asyncio.run(per_request_us(batching, queued)) for _ in range(args.rounds)]
            rows.append({"config": name, "queued": queued, "per_request_us": round(statistics.median(runs), 1)})
            print(f"{name:>22}  {queued:>7} queued  {rows[-1]['per_request_us']:>8.1f} µs per request", flush=True)
    save_results(rows, "batch_forming.csv")


if __name__ == "__main__":
    main()

"""Concatenate requests into one batch and split the batch's outputs back, row-exact: the adapter
(``execute_as_one_feed``) for every executor whose model runs one feed per batch."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import numpy as np

from shoal.errors import ErrorCode, ShoalError
from shoal.scheduling.base import Executed, Outputs, QueuedRequest
from shoal.statistics import Phases

RunFeed = Callable[[Mapping[str, np.ndarray], Sequence[str]], Awaitable[Outputs]]


async def execute_as_one_feed(run: RunFeed, batch: Sequence[QueuedRequest]) -> Executed:
    """``batch`` as one execution of ``run``: the requests' inputs concatenated along the batch dimension,
    every output any of them asked for computed once, each request's rows (and only its outputs) back."""
    start = time.monotonic_ns()
    outputs = list(dict.fromkeys(name for request in batch for name in request.outputs))
    feed = gather([request.feed for request in batch]) if len(batch) > 1 else batch[0].feed
    gathered = time.monotonic_ns()
    results = await run(feed, outputs)
    executed = time.monotonic_ns()
    for name in outputs:
        if name not in results:
            raise ShoalError(ErrorCode.INTERNAL, f"the model returned no output '{name}'")
    parts = scatter(results, [request.size for request in batch], [request.outputs for request in batch])
    done = time.monotonic_ns()
    return Executed(parts, Phases(gathered - start, executed - gathered, done - executed))


def gather(feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One input dict for the batch: each input concatenated along the batch dimension."""
    if len(feeds) == 1:
        return dict(feeds[0])
    return {name: np.concatenate([feed[name] for feed in feeds], axis=0) for name in feeds[0]}


def scatter(
    results: Mapping[str, np.ndarray], sizes: Sequence[int], wanted: Sequence[Sequence[str]]
) -> list[dict[str, np.ndarray]]:
    """Split each output by the requests' batch sizes; request i gets only ``wanted[i]`` (every one of
    them in ``results``: ``execute_as_one_feed`` checked)."""
    if len(sizes) == 1:
        return [{name: results[name] for name in wanted[0]}]
    total = sum(sizes)
    checked = {}
    for name, value in results.items():
        array = np.asarray(value)
        if array.ndim == 0 or array.shape[0] != total:
            raise ShoalError(
                ErrorCode.INTERNAL,
                f"output '{name}' has shape {list(array.shape)}, not a batch of {total} rows",
            )
        checked[name] = array
    parts = []
    start = 0
    for size, names in zip(sizes, wanted, strict=True):  # views of the batch's rows (as np.split, a tenth the cost)
        stop = start + size
        parts.append({name: checked[name][start:stop] for name in names})
        start = stop
    return parts

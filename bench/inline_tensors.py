"""A process instance's tensors in its arenas or in its pipe messages: what each way costs, by size.

    python bench/inline_tensors.py [--kib 1 16 64 256 1024] [--rounds 3]

One request's FP32 input to a Python process instance's worker and its output (the input itself)
back, in one process, hot: the host's and the worker's Python for the trip, with the pipe's
messages pickled and unpickled as the pipe does, no process switch and no model. "arena": the
input packed into a REQUESTS arena (``packing.pack_feeds_at``), the worker's view of it
(``InputViews``, with its check that the model kept none), the output packed into a RESPONSES arena
and copied out by the host (``packing.unpack_copies``). "message": both tensors carried in the
messages (``shoal.dataplane.inline``), whatever their size. Per size, the median over the rounds of
µs per trip. Why ``inline.INLINE_BYTES`` is 64 KiB: up to there the message is cheaper; past it the
arena soon wins, by far at 1 MiB (each message's bytes are copied three times more, and allocated
afresh).
Prints a table, writes bench/results/inline_tensors.csv.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from shoal.dataplane import inline, packing  # noqa: E402
from shoal.dataplane.arena import Arena  # noqa: E402
from shoal.instances.worker_pipe import Answer, Done, InputViews, PipedRequest, RunRequests  # noqa: E402

ARENA_BYTES = 1 << 26


def _through_the_pipe(message: Any) -> Any:
    return pickle.loads(pickle.dumps(message, 4))


def _request(inputs: Any) -> RunRequests:
    return RunRequests([PipedRequest(inputs, ["Y"], "", 0, {}, 0, "")], 1)


def by_arena(requests: Arena, responses: Arena, x: np.ndarray) -> list[np.ndarray]:
    (slots,) = packing.pack_feeds_at(requests, 0, [{"X": x}]) or []
    run = _through_the_pipe(_request(slots))
    views = InputViews()
    ((_, y),) = views.unpack(requests, run.requests[0].inputs)
    (out,) = packing.pack_feeds_at(responses, 0, [{"Y": y}]) or []
    del y
    views.kept()
    done = _through_the_pipe(Done([Answer(out)], 1))
    return packing.unpack_copies(responses, done.answers[0].outputs)


def by_message(x: np.ndarray) -> list[np.ndarray]:
    (carried,) = inline.inline_feeds([{"X": x}], limit=1 << 40) or []
    run = _through_the_pipe(_request(carried))
    y = inline.arrays_of(run.requests[0].inputs)["X"]
    (answer,) = inline.inline_feeds([{"Y": y}], limit=1 << 40) or []
    done = _through_the_pipe(Done([Answer(answer)], 1))
    return list(inline.arrays_of(done.answers[0].outputs).values())


def per_trip_us(trip: Callable[[], object], seconds: float = 0.5) -> float:
    """µs per call of ``trip``, after a warm-up, over about ``seconds``."""
    for _ in range(50):
        trip()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        trip()
        count += 1
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kib", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    requests, responses = Arena.create("bench-requests", ARENA_BYTES), Arena.create("bench-responses", ARENA_BYTES)
    rows = []
    for round_index in range(args.rounds):
        for kib in args.kib:
            x = np.arange(kib * 256, dtype=np.float32)
            assert np.array_equal(by_arena(requests, responses, x)[0], x) and np.array_equal(by_message(x)[0], x)
            arena_us = per_trip_us(functools.partial(by_arena, requests, responses, x))
            message_us = per_trip_us(functools.partial(by_message, x))
            rows.append({"round": round_index, "kib": kib, "arena_us": arena_us, "message_us": message_us})
            print(f"round {round_index} {kib:5d} KiB: arena {arena_us:8.1f} µs, message {message_us:8.1f} µs")
    print(f"\nMedians of {args.rounds} round(s), µs per trip (host and worker, hot, one process).")
    print("| KiB | arena | in the message | message / arena |\n|---|---|---|---|")
    for kib in args.kib:
        mine = [row for row in rows if row["kib"] == kib]
        arena_us = statistics.median(row["arena_us"] for row in mine)
        message_us = statistics.median(row["message_us"] for row in mine)
        print(f"| {kib} | {arena_us:.1f} | {message_us:.1f} | {message_us / arena_us:.2f}× |")
    save_results(rows, "inline_tensors.csv")


if __name__ == "__main__":
    main()

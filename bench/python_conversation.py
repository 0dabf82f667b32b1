"""What one batch of a Python process instance costs each side of the pipe, without a server around it.

    python bench/python_conversation.py [--batch 1 8] [--batches 3000] [--rounds 2] [--before REV] [--floor]
                                        [--placements free together apart] [--label NAME]

bench/python_backend.py's ``model.py`` and config (``OUTPUT0 = tanh(INPUT0) * 2 + 1`` on FP32 [256]) in
a ``PythonProcessModel`` driven directly, as ``Instance.execute`` drives it: each batch started on a
uvloop event loop (``start_on_loop``: the loop writes the batch and reads the answer, ``LoopConversation``)
and awaited before the next, one batch at a time. Per batch: wall time, the CPU of the thread that runs the
loop (``time.thread_time``: packing, pickling, the pipe, unpacking, and the loop's own turns) and of the
worker process (utime and stime from /proc: reading, the model's ``execute`` through ``pb_utils``, packing
its outputs, its wake-ups). Nothing else runs in the process, so this is the conversation's own cost; a
server adds the request path and the wake-ups of its other threads (bench/thread_cpu.py splits those).

``--floor`` adds a bare round trip between two processes over a socket pair (the floor of any
process instance's batch), with the kernel free to place them and with both pinned to one CPU.
``--placements`` measures the batch with the kernel free to place the loop's thread and the worker
(``free``, the default and what a server does), both pinned to one CPU (``together``), or each to a
CPU of its own (``apart``): what a wake-up across CPUs costs each side on this machine.

Each measurement is a child process (so ``--before REV`` can run Shoal as it was at git revision REV,
``bench._server.checked_out_server``, beside this checkout; REV must construct ``PythonProcessModel`` as
this checkout does); ``--rounds`` alternates them. Prints the medians and, with ``--before``, this
checkout's ratios; writes bench/results/python_conversation[_<label>].csv (every round).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import CLOCK_TICKS, save_results  # noqa: E402
from bench._server import child_figures, revisions, rounds_of  # noqa: E402
from bench.python_backend import CONFIG, MODEL, MODEL_PY  # noqa: E402

WARM_UP_BATCHES = 300


def _worker_cpu(pid: int) -> tuple[float, float]:
    """A process's (user, system) CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def _place(worker_pid: int, placement: str) -> None:
    """Pin this process and the worker as ``placement`` says (``free``: as the kernel likes)."""
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "together":
        os.sched_setaffinity(0, cpus[:1])
        os.sched_setaffinity(worker_pid, cpus[:1])
    elif placement == "apart":
        if len(cpus) < 2:
            raise SystemExit("--placements apart needs two CPUs")
        os.sched_setaffinity(0, cpus[:1])
        os.sched_setaffinity(worker_pid, cpus[1:2])


def measure_here(batch_size: int, batches: int, placement: str = "free") -> dict[str, float]:
    """In a child: the model served by whichever ``shoal`` this process imports; per-batch figures in µs."""
    import numpy as np
    import uvloop

    from shoal.backends.devices import CPU
    from shoal.configuring.pipeline import configure
    from shoal.instances.process import WorkerLimits
    from shoal.instances.python_process import PythonProcessModel

    class Pending:
        """A queued request as an executor sees it."""

        def __init__(self) -> None:
            self.feed = {"INPUT0": np.zeros((1, 256), np.float32)}
            self.outputs, self.size, self.context = ("OUTPUT0",), 1, None

    with tempfile.TemporaryDirectory() as folder:
        model_folder = Path(folder) / MODEL
        (model_folder / "1").mkdir(parents=True)
        (model_folder / "config.pbtxt").write_text(textwrap.dedent(CONFIG).lstrip())
        (model_folder / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY).lstrip())
        spec = configure(model_folder, strict=False).spec
        model = PythonProcessModel(spec, model_folder / "1" / "model.py", CPU, f"{MODEL}_0", 1, WorkerLimits(0.0, 0.0))
        batch = [Pending() for _ in range(batch_size)]

        async def run(count: int) -> None:
            for _ in range(count):
                running = model.start_on_loop(batch)
                if running is None:
                    raise RuntimeError("the batch did not go on the loop")
                results = await running
                if any(not isinstance(result, dict) for result in results):
                    raise RuntimeError(f"a request failed: {results}")

        try:
            loop = uvloop.new_event_loop()
            assert model.pid is not None
            _place(model.pid, placement)
            loop.run_until_complete(run(WARM_UP_BATCHES))
            user, system = _worker_cpu(model.pid)
            wall, host = time.perf_counter(), time.thread_time()
            loop.run_until_complete(run(batches))
            wall, host = time.perf_counter() - wall, time.thread_time() - host
            user_after, system_after = _worker_cpu(model.pid)
            loop.close()
        finally:
            model.close()
    per_batch = 1e6 / batches
    return {
        "wall_us": wall * per_batch,
        "host_cpu_us": host * per_batch,
        "worker_user_us": (user_after - user) * per_batch,
        "worker_system_us": (system_after - system) * per_batch,
    }


def round_trip_floor(round_trips: int, pinned: bool) -> dict[str, float]:
    """A bare round trip between two processes over a socket pair (32 bytes each way), per round trip:
    the wall time and this side's CPU, the kernel free to place them, or both ``pinned`` to one CPU.
    What any process instance pays once per batch before it does anything."""
    here, there = socket.socketpair()
    if pinned:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # inherited by the child
    child = os.fork()
    if child == 0:  # echo until the parent closes its end
        here.close()
        while message := there.recv(64):
            there.sendall(message)
        os._exit(0)
    there.close()
    try:
        for _ in range(WARM_UP_BATCHES):
            here.sendall(b"x" * 32)
            here.recv(64)
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(round_trips):
            here.sendall(b"x" * 32)
            here.recv(64)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    finally:
        here.close()
        os.waitpid(child, 0)
    return {"wall_us": wall / round_trips * 1e6, "cpu_us_one_side": cpu / round_trips * 1e6}


def measure(batch_size: int, batches: int, placement: str, python_path: Path | None) -> dict[str, float]:
    """One child process's figures (``python_path``: a folder holding another revision's ``shoal``)."""
    return child_figures(Path(__file__).resolve(), ["--child", str(batch_size), str(batches), placement], python_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="requests per batch")
    parser.add_argument("--batches", type=int, default=3000, help="batches measured per child")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", default="", help="a git revision measured beside this checkout")
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--floor", action="store_true", help="also a bare process round trip over a socket pair, free and pinned"
    )
    parser.add_argument(
        "--placements",
        nargs="+",
        choices=("free", "together", "apart"),
        default=["free"],
        help="where the loop's thread and the worker run: as the kernel likes, on one CPU, on two",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--floor-child", choices=("free", "pinned"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        batch_size, batches, placement = args.child
        print(json.dumps(measure_here(int(batch_size), int(batches), placement)))
        return
    if args.floor_child:
        print(json.dumps(round_trip_floor(20_000, pinned=args.floor_child == "pinned")))
        return
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        sides = revisions(stack, args.before)
        for round_number, name, python_path in rounds_of(sides, args.rounds):
            for placement in args.placements:
                for batch_size in args.batch:
                    figures = measure(batch_size, args.batches, placement, python_path)
                    row = {"round": round_number, "shoal": name, "batch": batch_size, "placement": placement}
                    rows.append(row | figures)
                    print(
                        f"round {round_number} {name} batch {batch_size} {placement}: "
                        + ", ".join(f"{key} {value:.1f}" for key, value in figures.items()),
                        flush=True,
                    )
    if args.floor:
        for placement in ("free", "pinned"):
            floor = child_figures(Path(__file__).resolve(), ["--floor-child", placement])
            rows.append({"shoal": f"round trip, {placement}"} | floor)
            print(
                f"a bare process round trip, {placement}: {floor['wall_us']:.1f} µs wall, "
                f"{floor['cpu_us_one_side']:.1f} µs CPU on one side"
            )
    print(f"\nMedians of {args.rounds} round(s), µs per batch.")
    print("| shoal | batch | placement | wall | loop thread CPU | worker user | worker system |")
    print("|---|---|---|---|---|---|---|")
    medians: dict[tuple[str, int, str], dict[str, float]] = {}
    measured = [row for row in rows if "batch" in row]
    for key in dict.fromkeys((row["shoal"], row["batch"], row["placement"]) for row in measured):
        mine = [row for row in measured if (row["shoal"], row["batch"], row["placement"]) == key]
        medians[key] = {
            figure: statistics.median(row[figure] for row in mine)
            for figure in ("wall_us", "host_cpu_us", "worker_user_us", "worker_system_us")
        }
        m = medians[key]
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {m['wall_us']:.0f} | {m['host_cpu_us']:.0f} | "
            f"{m['worker_user_us']:.0f} | {m['worker_system_us']:.0f} |"
        )
    if args.before:
        for batch_size in args.batch:
            placement = args.placements[0]
            now, then = medians["this checkout", batch_size, placement], medians[args.before, batch_size, placement]
            worker_now = now["worker_user_us"] + now["worker_system_us"]
            worker_then = then["worker_user_us"] + then["worker_system_us"]
            print(
                f"batch {batch_size}: wall {now['wall_us'] / then['wall_us']:.2f}x, loop thread CPU "
                f"{now['host_cpu_us'] / then['host_cpu_us']:.2f}x, worker CPU {worker_now / worker_then:.2f}x "
                f"of {args.before}"
            )
    save_results(rows, f"python_conversation{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()

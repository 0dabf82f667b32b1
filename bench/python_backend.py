"""A Python model doing a small numpy operation: Shoal's Python backend versus Triton 2.51's, one run.

    python bench/python_backend.py [--window-ms 1500] [--rounds 1] [--before REV] [--label NAME]

The same ``model.py`` (below, a Triton Python-backend model: ``OUTPUT0 = tanh(INPUT0) * 2 + 1``
on FP32 [256]) and the same config (max_batch_size 32, dynamic_batching with a 100 µs queue delay,
one KIND_CPU instance) are served by the real Triton (``../shared/tools/triton_peer/run_triton.sh``:
tritonserver and its Python-backend stub process) and by Shoal, whose instance is a worker process
by default and, in a third column, a thread in the server (``process_instances: false``).
perf_analyzer 2.51 over gRPC with zero inputs at concurrency 1 and 16, three windows each. Columns: throughput
(inferences/s), p50 latency (µs), and CPU per request: CPU seconds (utime + stime from /proc) of
the server's whole process tree over the perf_analyzer run, divided by the requests its statistics
counted over the same span. ``--before REV`` adds Shoal as it was at git revision REV (both instance
kinds), served from the same repositories in the same run, to measure a change of the request path;
``--rounds N`` measures every server N times, taking turns (every other round in the reverse order),
and reports the median of each figure. Prints a markdown table (and, with ``--before``, each Shoal
column's ratio to its REV column) and writes bench/results/python_backend[_<label>].csv (every round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import (  # noqa: E402
    ANY_SPREAD,
    cpu_split,
    install_perf_analyzer,
    perf_analyzer,
    requests_served,
    save_results,
    tree_cpu_seconds,
)
from bench._server import checked_out_server, shoal_server  # noqa: E402
from bench._triton import triton_server  # noqa: E402

MODEL = "numpy_op"
CONFIG = """
backend: "python"
max_batch_size: 32
dynamic_batching { max_queue_delay_microseconds: 100 }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            y = (np.tanh(x) * 2 + 1).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses
"""
CONCURRENCIES = (1, 16)


def write_repository(repo: Path, extra: str = "") -> None:
    folder = repo / MODEL
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(CONFIG).lstrip() + extra)
    (folder / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY).lstrip())


def measure(url: str, pid: int, concurrency: int, window_ms: int) -> dict[str, float]:
    requests_before, cpu_before = requests_served(url, MODEL), tree_cpu_seconds(pid)
    # Three windows, whatever their spread (2 shared cores rarely give perf_analyzer's 20% band at c=16).
    figures = perf_analyzer(url, MODEL, concurrency, window_ms, max_trials=3, stability_percent=ANY_SPREAD)
    host_s, children_s = cpu_split(cpu_before, tree_cpu_seconds(pid), pid)
    requests = max(1, requests_served(url, MODEL) - requests_before)
    return {**figures, "cpu_us_per_request": 1e6 * (host_s + children_s) / requests}


@contextmanager
def triton_at(repo: Path, log_path: Path) -> Iterator[tuple[str, int]]:
    with triton_server(repo, log_path=log_path) as server:
        yield server.url, server.pid


def servers(
    root: Path, before: tuple[str, Path] | None = None
) -> Iterator[tuple[str, Callable[[], AbstractContextManager[tuple[str, int]]]]]:
    """(column, a context manager yielding (url, pid) of a ready server) for each server compared;
    ``before``: (a revision, the folder ``checked_out_server`` made of it) adds that Shoal's two columns."""
    triton_repo, process_repo, thread_repo = root / "triton", root / "shoal-process", root / "shoal-thread"
    for repo, extra in (
        (triton_repo, ""),
        (process_repo, ""),
        (thread_repo, 'parameters { key: "process_instances" value: { string_value: "false" } }\n'),
    ):
        repo.mkdir()
        write_repository(repo, extra)

    yield "Triton 2.51 (stub process)", lambda: triton_at(triton_repo, root / "triton.log")
    yield "Shoal (instance process)", lambda: shoal_server(process_repo)
    yield "Shoal (instance thread)", lambda: shoal_server(thread_repo)
    if before is not None:
        revision, python_path = before
        yield f"Shoal at {revision} (instance process)", lambda: shoal_server(process_repo, python_path=python_path)
        yield f"Shoal at {revision} (instance thread)", lambda: shoal_server(thread_repo, python_path=python_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window-ms", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--before", metavar="REV", help="also measure Shoal as it was at this git revision")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder, ExitStack() as stack:
        before = (args.before, stack.enter_context(checked_out_server(args.before))) if args.before else None
        columns = list(servers(Path(folder), before))
        for round_number in range(args.rounds):
            for column, start in columns if round_number % 2 == 0 else reversed(columns):
                with start() as (url, pid):
                    for concurrency in CONCURRENCIES:
                        figures = measure(url, pid, concurrency, args.window_ms)
                        rows.append({"server": column, "concurrency": concurrency, "round": round_number, **figures})
                        print(
                            f"round {round_number} {column} c={concurrency}: {figures['throughput']:.0f}/s "
                            f"p50 {figures['p50_us']:.0f} µs, {figures['cpu_us_per_request']:.0f} µs CPU/request",
                            flush=True,
                        )
    table = {
        (column, concurrency): {
            name: statistics.median(r[name] for r in rows if r["server"] == column and r["concurrency"] == concurrency)
            for name in ("throughput", "p50_us", "cpu_us_per_request")
        }
        for column, _ in columns
        for concurrency in CONCURRENCIES
    }
    print(f"\nMedians of {args.rounds} round(s).")
    print("| server | c | throughput (infer/s) | p50 (µs) | CPU per request (µs) |\n|---|---|---|---|---|")
    for (column, concurrency), figures in table.items():
        print(
            f"| {column} | {concurrency} | {figures['throughput']:.0f} | {figures['p50_us']:.0f} | "
            f"{figures['cpu_us_per_request']:.0f} |"
        )
    if args.before:
        for kind in ("instance process", "instance thread"):
            for concurrency in CONCURRENCIES:
                now = table[(f"Shoal ({kind})", concurrency)]
                then = table[(f"Shoal at {args.before} ({kind})", concurrency)]
                print(
                    f"{kind}, c={concurrency}: throughput {now['throughput'] / then['throughput']:.2f}x, "
                    f"CPU per request {now['cpu_us_per_request'] / then['cpu_us_per_request']:.2f}x of {args.before}"
                )
    save_results(rows, f"python_backend{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()

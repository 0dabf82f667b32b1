"""shoal-load beside Triton's perf_analyzer on the same server, model and concurrencies, one run.

    python bench/loadtest_vs_perf_analyzer.py [--concurrency 1 4 16] [--protocol grpc http] [--repeats 2]
                                              [--models simple mlp] [--window-s 1] [--ceiling] [--split-cores]

Starts Shoal on model_repository/ and, for each model, protocol and concurrency, measures it
``--repeats`` times in turn with perf_analyzer, shoal-load in 1 process and shoal-load in 2
processes, so that a machine shared with other work disturbs all three alike; prints each
throughput and the ratio of each shoal-load run to the perf_analyzer run just before it, then
the range of those ratios. Each run's client CPU per request (perf_analyzer: its process, user + system, over
the requests the server counted during it; shoal-load: its load processes' own figure) says how much of the
machine the load generator took from the server: on a machine they share, a costlier client
reads a lower throughput. With ``--ceiling``, also the load tester's own ceiling: requests/s it
drives against a model that does no work (identity backend, 4 floats) at concurrency 32. With
``--split-cores``, the server runs on the first half of the cores this process may use and every load
generator on the other half (CPU affinity, inherited by their children), so neither client's own cost
takes CPU from the server: the question the comparison asks is then what each client measures, not how
much each leaves to the server. Writes bench/results/loadtest_vs_perf_analyzer[_split].csv.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import install_perf_analyzer, perf_analyzer, save_results  # noqa: E402
from bench._server import REPO_ROOT  # noqa: E402
from shoal.clients.loadtest.http import HttpControl  # noqa: E402
from shoal.tools import local_server  # noqa: E402

NOOP_CONFIG = """
backend: "identity"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""
STABILITY_PERCENT = 20.0
MAX_WINDOWS = 10  # perf_analyzer's default --max-trials


def shoal_load(
    url: str, model: str, concurrency: int, window_s: float, processes: int, protocol: str
) -> tuple[float, float]:
    """Throughput (inferences/s) of one closed-loop shoal-load step, measured as perf_analyzer is here, and
    its load processes' CPU per request (µs, their own count: their start-up is left out)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "r.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "shoal.clients.loadtest",
                "-i",
                protocol,
                "-m",
                model,
                "-u",
                url,
                "--concurrency",
                str(concurrency),
                "--processes",
                str(processes),
                "--input-data",
                "zeros",
                "--window-s",
                str(window_s),
                "--stability",
                str(STABILITY_PERCENT),
                "--max-windows",
                str(MAX_WINDOWS),
                "--json",
                str(out),
                "--no-progress",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        step = json.loads(out.read_text())["steps"][0]
        return float(step["throughput"]), float(step["client_cpu_us"])


def served(control: HttpControl, model: str) -> int:
    """Successful requests the server counted for ``model`` so far."""
    return sum(
        int(row.get("inference_stats", {}).get("success", {}).get("count", 0)) for row in control.statistics(model)
    )


def client_cpu_s() -> float:
    """CPU (user + system) of this process's finished children and theirs: the load generators run so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def with_client_cost(control: HttpControl, model: str, run: Callable[[], float]) -> tuple[float, float]:
    """``run()``'s throughput and its load generator's CPU per request the server counted during it, in µs
    (perf_analyzer: a C++ process whose start-up is a few milliseconds)."""
    cpu, count = client_cpu_s(), served(control, model)
    throughput = run()
    requests = served(control, model) - count
    return throughput, (client_cpu_s() - cpu) / max(1, requests) * 1e6


def measure_in_turn(
    urls: dict[str, str], model: str, protocol: str, concurrency: int, window_s: float, repeats: int
) -> list[dict[str, object]]:
    """``repeats`` rounds of perf_analyzer, shoal-load 1 process, shoal-load 2 processes, one after the other."""
    rows: list[dict[str, object]] = []
    url = urls[protocol]
    control = HttpControl(urls["http"])
    for round_index in range(repeats):
        try:
            pa, pa_cpu = with_client_cost(
                control,
                model,
                lambda: perf_analyzer(
                    url,
                    model,
                    concurrency,
                    int(window_s * 1000),
                    max_trials=MAX_WINDOWS,
                    stability_percent=STABILITY_PERCENT,
                    protocol=protocol,
                )["throughput"],
            )
        except subprocess.CalledProcessError:  # no three windows within STABILITY_PERCENT: it writes no figure
            print(
                f"{model:<7} {protocol:<5} {concurrency:>4} {round_index + 1:>5} | perf_analyzer found no stable "
                "figure: round left out",
                flush=True,
            )
            continue
        one, one_cpu = shoal_load(url, model, concurrency, window_s, 1, protocol)
        two, two_cpu = shoal_load(url, model, concurrency, window_s, 2, protocol)
        row: dict[str, object] = {
            "model": model,
            "protocol": protocol,
            "concurrency": concurrency,
            "round": round_index + 1,
            "perf_analyzer": round(pa, 1),
            "shoal_load_1proc": round(one, 1),
            "shoal_load_2proc": round(two, 1),
            "ratio_1proc": round(one / pa, 2),
            "ratio_2proc": round(two / pa, 2),
            "client_cpu_us_perf_analyzer": round(pa_cpu),
            "client_cpu_us_1proc": round(one_cpu),
            "client_cpu_us_2proc": round(two_cpu),
        }
        print(
            f"{model:<7} {protocol:<5} {concurrency:>4} {round_index + 1:>5} | {pa:>8.0f} {pa_cpu:>6.0f} | "
            f"{one:>8.0f} {one_cpu:>6.0f} {one / pa:>6.2f} | {two:>8.0f} {two_cpu:>6.0f} {two / pa:>6.2f}",
            flush=True,
        )
        rows.append(row)
    return rows


def print_ranges(rows: list[dict[str, object]]) -> None:
    """Per model, protocol and concurrency: the range of each ratio over the rounds."""
    print("\nratio ranges (shoal-load / perf_analyzer, over the rounds):")
    keys = dict.fromkeys((r["model"], r["protocol"], r["concurrency"]) for r in rows)
    for model, protocol, concurrency in keys:
        mine = [r for r in rows if (r["model"], r["protocol"], r["concurrency"]) == (model, protocol, concurrency)]
        spans = []
        for column in ("ratio_1proc", "ratio_2proc"):
            values = [float(str(r[column])) for r in mine]
            spans.append(f"{min(values):.2f}–{max(values):.2f}")
        print(f"  {model:<7} {protocol:<5} c={concurrency:<3} 1 process {spans[0]}, 2 processes {spans[1]}")


def split_cores() -> tuple[set[int], set[int]]:
    """The cores this process may use, split in two halves: the server's and the load generators'."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--split-cores needs at least 2 usable cores")
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--protocol", nargs="+", choices=["grpc", "http"], default=["grpc", "http"])
    parser.add_argument("--models", nargs="+", choices=["simple", "mlp"], default=["simple"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--ceiling", action="store_true", help="also the no-op model at concurrency 32")
    parser.add_argument(
        "--split-cores", action="store_true", help="server on half the usable cores, load generators on the rest"
    )
    args = parser.parse_args()
    install_perf_analyzer()
    everything = os.sched_getaffinity(0)
    server_cores, client_cores = split_cores() if args.split_cores else (everything, everything)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        for name in args.models:
            shutil.copytree(REPO_ROOT / "model_repository" / name, repo / name)
        (repo / "noop" / "1").mkdir(parents=True)
        (repo / "noop" / "config.pbtxt").write_text(NOOP_CONFIG)
        os.sched_setaffinity(0, server_cores)  # the server and every process it starts inherit this set
        with local_server.running(repo) as server:
            os.sched_setaffinity(0, client_cores)  # perf_analyzer and shoal-load inherit this one
            print(f"server on cores {sorted(server_cores)}, load generators on cores {sorted(client_cores)}")
            urls = {"grpc": server.url, "http": server.http_url}
            print("throughput in inferences/s; cpu: the load generator's CPU per request, µs")
            print(
                f"{'model':<7} {'proto':<5} {'conc':>4} {'round':>5} | {'perf_analyzer':>15} | "
                f"{'shoal-load 1 process':>22} | {'shoal-load 2 processes':>22}"
            )
            print(
                f"{'':<7} {'':<5} {'':>4} {'':>5} | {'infer/s':>8} {'cpu':>6} | {'infer/s':>8} {'cpu':>6} "
                f"{'ratio':>6} | {'infer/s':>8} {'cpu':>6} {'ratio':>6}"
            )
            for model in args.models:
                for protocol in args.protocol:
                    for concurrency in args.concurrency:
                        rows += measure_in_turn(urls, model, protocol, concurrency, args.window_s, args.repeats)
            print_ranges(rows)
            if args.ceiling:
                ceiling = {p: shoal_load(server.url, "noop", 32, args.window_s, p, "grpc")[0] for p in (1, 2)}
                pa_noop = perf_analyzer(server.url, "noop", 32, int(args.window_s * 1000))["throughput"]
                print(
                    f"\nno-op model at concurrency 32: shoal-load 1 process {ceiling[1]:.0f}/s, 2 processes "
                    f"{ceiling[2]:.0f}/s, perf_analyzer {pa_noop:.0f}/s"
                )
    os.sched_setaffinity(0, everything)
    save_results(rows, "loadtest_vs_perf_analyzer_split.csv" if args.split_cores else "loadtest_vs_perf_analyzer.csv")


if __name__ == "__main__":
    main()

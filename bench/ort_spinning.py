"""ONNX Runtime's spinning in Shoal: the same models served with ``allow_spinning`` true and false, one run.

    python bench/ort_spinning.py [--rounds 2] [--window-ms 2000] [--label NAME]

The models and configuration of bench/side_by_side.py (tiny: add/sub INT32 [1,16]; mlp: FP32, 4 x 1024²;
max_batch_size 32, one instance, dynamic_batching { max_queue_delay_microseconds: 200 }, 2 intra-op
threads), served twice: once with ``parameters { key: "allow_spinning" value: { string_value: "true" } }``
(ONNX Runtime's own default, which Triton's ONNX model and in-process ORT keep) and once with "false". Load:
perf_analyzer 2.51 over gRPC, zero inputs: mlp at c=16, c=1 and ``-b 8`` c=16, mlp with two instances
(``mlp_x2``: 4 intra-op threads on these 2 cores) at c=16, tiny at c=16. Each round
starts both servers in turn (every other round in the reverse order). Per cell: throughput (inferences/s),
p50, and CPU per request (the server's process tree, utime + stime from /proc, over the perf_analyzer run,
divided by the requests its statistics counted). Prints the medians over rounds with spin / no-spin ratios,
writes bench/results/ort_spinning[_<label>].csv (every round).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
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
from bench.side_by_side import write_models  # noqa: E402
from shoal.tools import local_server  # noqa: E402

# model, batch (-b), concurrency; mlp_x2: mlp with two instances, 2 intra-op threads each (4 on these 2 cores)
LOADS = (("mlp", 1, 16), ("mlp", 1, 1), ("mlp", 8, 16), ("mlp_x2", 1, 16), ("tiny", 1, 16))
SETTINGS = ("true", "false")


def write_repositories(folder: Path) -> dict[str, Path]:
    """One repository per setting of ``allow_spinning``, the same models in each."""
    base = write_models(folder).shoal
    repositories = {}
    for setting in SETTINGS:
        repository = folder / f"spinning_{setting}"
        shutil.copytree(base, repository)
        shutil.copytree(repository / "mlp", repository / "mlp_x2")
        config = repository / "mlp_x2" / "config.pbtxt"
        assert "count: 1," in config.read_text(), "bench/side_by_side.py's ONE_INSTANCE changed"
        config.write_text(config.read_text().replace("count: 1,", "count: 2,"))
        for model in ("tiny", "mlp", "mlp_x2"):
            config = repository / model / "config.pbtxt"
            config.write_text(
                config.read_text()
                + f'\nparameters {{ key: "allow_spinning" value: {{ string_value: "{setting}" }} }}\n'
            )
        repositories[setting] = repository
    return repositories


def measure(url: str, pid: int, model: str, batch: int, concurrency: int, window_ms: int) -> dict[str, float]:
    perf_analyzer(url, model, concurrency, 500, batch=batch, max_trials=3, stability_percent=ANY_SPREAD)  # warm-up
    cpu_before, requests_before = tree_cpu_seconds(pid), requests_served(url, model)
    try:
        figures = perf_analyzer(url, model, concurrency, window_ms, batch=batch, max_trials=6)
    except subprocess.CalledProcessError:  # never within 20% on a shared machine: its last 3 windows
        figures = perf_analyzer(
            url, model, concurrency, window_ms, batch=batch, max_trials=3, stability_percent=ANY_SPREAD
        )
    cpu = sum(cpu_split(cpu_before, tree_cpu_seconds(pid), pid))
    requests = requests_served(url, model) - requests_before
    return {
        "throughput": figures["throughput"],
        "p50_us": figures["p50_us"],
        "cpu_us_per_request": 1e6 * cpu / max(1, requests),
    }


def table(rows: list[dict[str, Any]]) -> str:
    def median(setting: str, load: str, field: str) -> float:
        return float(statistics.median(r[field] for r in rows if (r["allow_spinning"], r["load"]) == (setting, load)))

    lines = [
        "| load | infer/s spin | infer/s no spin | ratio | p50 µs spin / no spin | CPU µs/req spin / no spin | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for load in dict.fromkeys(r["load"] for r in rows):
        on, off = median("true", load, "throughput"), median("false", load, "throughput")
        cpu_on, cpu_off = median("true", load, "cpu_us_per_request"), median("false", load, "cpu_us_per_request")
        lines.append(
            f"| {load} | {on:,.0f} | {off:,.0f} | {on / off:.2f}× | "
            f"{median('true', load, 'p50_us'):,.0f} / {median('false', load, 'p50_us'):,.0f} | "
            f"{cpu_on:,.0f} / {cpu_off:,.0f} | {cpu_on / cpu_off:.2f}× |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=2000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        repositories = write_repositories(Path(folder))
        for round_number in range(args.rounds):
            order = SETTINGS if round_number % 2 == 0 else tuple(reversed(SETTINGS))
            for setting in order:
                with local_server.running(repositories[setting]) as server:
                    for model, batch, concurrency in LOADS:
                        row: dict[str, Any] = {
                            "round": round_number,
                            "allow_spinning": setting,
                            "load": f"{model} -b {batch} c={concurrency}" if batch > 1 else f"{model} c={concurrency}",
                        }
                        row.update(measure(server.url, server.pid, model, batch, concurrency, args.window_ms))
                        rows.append(row)
                        print(
                            f"round {round_number} spinning {setting:<5} {row['load']:<14} "
                            f"{row['throughput']:>9,.0f}/s  p50 {row['p50_us']:>7,.0f} µs  "
                            f"{row['cpu_us_per_request']:>6,.0f} µs CPU/request",
                            flush=True,
                        )
    print(f"\nMedians of {args.rounds} round(s).")
    print(table(rows))
    save_results(rows, f"ort_spinning{'_' + args.label if args.label else ''}.csv")


if __name__ == "__main__":
    main()

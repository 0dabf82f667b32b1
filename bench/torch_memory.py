"""Memory of a ~400 MB TorchScript model: thread and process instances, count 1 vs 4, one run.

    python bench/torch_memory.py [--width 3200 --layers 10]

Sums RSS and PSS over the server and all its worker processes (PSS splits shared pages among
the processes that map them, so shared weights count once) after every instance has executed.
Configurations: thread instances count 1 and 4; process instances count 1 and 4 (weights in
shared memory); and, for contrast, a naive copy per process: 4 plain Python processes that each
load the model. Writes bench/results/torch_memory.csv.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from bench._server import shoal_server  # noqa: E402
from bench.memory import memory_mb  # noqa: E402
from shoal.clients import InferenceClient  # noqa: E402

NAIVE_WORKER = """
import sys, time, torch
model = torch.jit.load(sys.argv[1]).eval()
with torch.inference_mode():
    model(torch.ones(1, int(sys.argv[2])))
print("ready", flush=True)
time.sleep(600)
"""


def save_model(path: Path, width: int, layers: int) -> None:
    import warnings

    import torch

    warnings.simplefilter("ignore")
    layers_list = []
    for _ in range(layers):
        layers_list += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(torch.nn.Sequential(*layers_list[:-1]).eval()).save(str(path))  # type: ignore[no-untyped-call]


def tree_pids(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += tree_pids(int(child))
    return pids


def total_mb(pids: list[int]) -> dict[str, float]:
    total = {"rss": 0.0, "pss": 0.0}
    for pid in pids:
        values = memory_mb(pid)
        total["rss"] += values["rss"]
        total["pss"] += values["pss"]
    return total


def measure_server(repo: Path, width: int) -> dict[str, float]:
    with shoal_server(repo, timeout_s=600) as (url, pid):

        def one(_: int) -> None:
            with InferenceClient(url, timeout_s=600) as client:
                client.infer("big", {"INPUT__0": np.ones((1, width), np.float32)})

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(8)))
        time.sleep(0.5)
        return {**total_mb(tree_pids(pid)), "processes": len(tree_pids(pid))}


def measure_naive(model: Path, width: int, copies: int) -> dict[str, float]:
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", NAIVE_WORKER, str(model), str(width)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(copies)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        return {**total_mb([w.pid for w in workers]), "processes": copies}
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3200)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "model.pt"
        save_model(model, args.width, args.layers)
        for processes in ("false", "true"):
            for count in (1, 4):
                repo = Path(folder) / f"repo-{processes}-{count}"
                (repo / "big" / "1").mkdir(parents=True)
                (repo / "big" / "1" / "model.pt").hardlink_to(model)
                (repo / "big" / "config.pbtxt").write_text(
                    f'backend: "pytorch"\nmax_batch_size: 8\n'
                    f'input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {args.width} ] }} ]\n'
                    f'output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {args.width} ] }} ]\n'
                    f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n"
                    f'parameters {{ key: "process_instances" value: {{ string_value: "{processes}" }} }}\n'
                )
                label = f"{'process' if processes == 'true' else 'thread'} instances, count {count}"
                rows.append({"config": label, **measure_server(repo, args.width)})
        rows.append({"config": "naive: 4 processes, a copy each", **measure_naive(model, args.width, 4)})
    weights = args.width * (args.width + 1) * 4 * args.layers / 2**20
    print(f"TorchScript MLP, {weights:.0f} MB of weights; RSS and PSS summed over all processes")
    print(f"{'configuration':<36} {'procs':>5} {'RSS MB':>8} {'PSS MB':>8}  ratio (PSS vs count 1 of its kind)")
    base = {"thread": rows[0]["pss"], "process": rows[2]["pss"], "naive": rows[0]["pss"]}
    for row in rows:
        kind = row["config"].split()[0].rstrip(":")
        row["pss_ratio"] = row["pss"] / base[kind]
        print(
            f"{row['config']:<36} {row['processes']:>5.0f} {row['rss']:>8.0f} {row['pss']:>8.0f}  "
            f"{row['pss_ratio']:.2f}"
        )
    save_results(rows, "torch_memory.csv")


if __name__ == "__main__":
    main()

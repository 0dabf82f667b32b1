"""Server memory for a ~400 MB model: instances share one copy of the weights.

    python bench/memory.py [--width 3200 --layers 10]

Starts Shoal once per configuration on a repository holding only an FP32 MLP of
``layers`` × width×width weights (10 × 3200² × 4 B = 410 MB), runs concurrent requests so
that every instance executes, then reads the server's RSS and PSS from
/proc/PID/smaps_rollup. Configurations: count 1; count 4 (shared weights, the default);
count 4 with ``share_weights: false`` (a copy per instance, what Triton's ONNX Runtime
backend and per-worker Python servers do). Prints ratios to count 1 from this one run and
writes bench/results/memory.csv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_mlp  # noqa: E402
from bench._perf import save_results  # noqa: E402
from bench._server import shoal_server  # noqa: E402

CONFIGS = {
    "count 1": "instance_group [ { count: 1 kind: KIND_CPU } ]",
    "count 4 (shared)": "instance_group [ { count: 4 kind: KIND_CPU } ]",
    "count 4 (copy per instance)": "instance_group [ { count: 4 kind: KIND_CPU } ]\n"
    'parameters { key: "share_weights" value: { string_value: "false" } }',
}


def memory_mb(pid: int) -> dict[str, float]:
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in {"Rss", "Pss"}:
            values[key.lower()] = int(rest.split()[0]) / 1024
    return values


def exercise(url: str, width: int, requests: int) -> None:
    import tritonclient.grpc as triton

    def one(_: int) -> None:
        with triton.InferenceServerClient(url) as client:
            tensor = triton.InferInput("INPUT0", [1, width], "FP32")
            tensor.set_data_from_numpy(np.ones((1, width), dtype=np.float32))
            client.infer("big", [tensor])

    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3200)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    weights_mb = args.width * args.width * 4 * args.layers / 2**20
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        model_file = None
        for label, extra in CONFIGS.items():
            repo = Path(folder) / label.replace(" ", "_").replace("(", "").replace(")", "")
            repo.mkdir()
            if model_file is not None:  # build the model once, link it into each repository
                (repo / "big" / "1").mkdir(parents=True)
                (repo / "big" / "1" / "model.onnx").hardlink_to(model_file)
            write_mlp(repo, "big", args.width, args.layers, extra, max_batch_size=8)
            model_file = repo / "big" / "1" / "model.onnx"
            model_file = model_file.resolve()
            with shoal_server(repo, timeout_s=600) as (url, pid):
                exercise(url, args.width, requests=8)
                rows.append({"config": label, **memory_mb(pid)})
    base = rows[0]
    print(f"model weights: {weights_mb:.0f} MB ({args.layers} x {args.width}x{args.width} FP32)")
    print(f"{'configuration':<30} {'RSS MB':>8} {'PSS MB':>8} {'RSS / count 1':>14} {'PSS / count 1':>14}")
    for row in rows:
        row["rss_ratio"] = row["rss"] / base["rss"]
        row["pss_ratio"] = row["pss"] / base["pss"]
        print(
            f"{row['config']:<30} {row['rss']:>8.0f} {row['pss']:>8.0f} {row['rss_ratio']:>14.2f} "
            f"{row['pss_ratio']:>14.2f}"
        )
    save_results(rows, "memory.csv")


if __name__ == "__main__":
    main()

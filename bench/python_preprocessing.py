"""A model whose Python pre-processing holds the GIL: thread vs process instances, one run.

    python bench/python_preprocessing.py [--rounds 5000] [--concurrency 8]

The model (bench/python_model.py) hashes each row in a pure-Python loop before a small
embedding + linear layer; it is saved whole with torch.save and served with
``pickled_module: true``. Measured with shoal-load at one concurrency for thread and process
instances, count 1 and 4. Writes bench/results/python_preprocessing.csv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results, shoal_load  # noqa: E402
from bench._server import shoal_server  # noqa: E402
from bench.python_model import PythonHeavy  # noqa: E402


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "model.pt"
        torch.save(PythonHeavy(args.rounds), model)
        for processes in ("false", "true"):
            for count in (1, 4):
                repo = Path(folder) / f"repo-{processes}-{count}"
                (repo / "heavy" / "1").mkdir(parents=True)
                (repo / "heavy" / "1" / "model.pt").hardlink_to(model)
                (repo / "heavy" / "config.pbtxt").write_text(
                    'backend: "pytorch"\nmax_batch_size: 0\n'
                    'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]\n'
                    'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1, 8 ] } ]\n'
                    f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n"
                    'parameters { key: "pickled_module" value: { string_value: "true" } }\n'
                    f'parameters {{ key: "process_instances" value: {{ string_value: "{processes}" }} }}\n'
                )
                with shoal_server(repo, timeout_s=300) as (url, _):
                    label = f"{'process' if processes == 'true' else 'thread'} instances, count {count}"
                    rows.append(
                        {
                            "config": label,
                            "throughput": shoal_load(url, "heavy", args.concurrency, stability_percent=15),
                        }
                    )
    base = rows[0]["throughput"]
    print(f"Python-heavy model ({args.rounds} rounds), shoal-load concurrency {args.concurrency}")
    for row in rows:
        row["ratio"] = row["throughput"] / base
        print(f"  {row['config']:<28} {row['throughput']:>8.1f} infer/s  {row['ratio']:.2f}x thread count 1")
    save_results(rows, "python_preprocessing.csv")


if __name__ == "__main__":
    main()

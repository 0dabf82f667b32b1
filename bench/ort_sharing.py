"""Which way should N executors share an ONNX Runtime model? Measured in-process, one run.

    python bench/ort_sharing.py [--executors 4] [--width 3200 --layers 10] [--seconds 3]

Designs, each in a fresh process:
- shared-session: one InferenceSession, run concurrently by N threads (Shoal's default);
  its intra-op pool gets cores // N threads, since every calling thread also computes;
- shared-initializers: N sessions whose weights are the same numpy buffers, handed to each
  session with SessionOptions.add_initializer (ORT then cannot pre-pack them, so
  ``session.disable_prepacking`` is set to keep one copy);
- copy-per-executor: N independent sessions (Triton's ONNX Runtime backend, per-worker servers).
Reports RSS/PSS after load and a warm run, and the throughput of N threads at batch 1.
Writes bench/results/ort_sharing.csv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from bench._server import REPO_ROOT  # noqa: E402

DESIGNS = ("shared-session", "shared-initializers", "copy-per-executor")
_KEEP_ALIVE: list[object] = []


def _memory_mb() -> dict[str, float]:
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in {"Rss", "Pss"}:
            values[key.lower()] = int(rest.split()[0]) / 1024
    return values


def _sessions(design: str, model: Path, executors: int) -> list[Any]:
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    cores = os.cpu_count() or 1
    options_threads = max(1, cores // executors)
    if design == "shared-session":
        options = ort.SessionOptions()
        options.intra_op_num_threads = options_threads
        return [ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])] * executors
    if design == "copy-per-executor":
        sessions = []
        for _ in range(executors):
            options = ort.SessionOptions()
            options.intra_op_num_threads = options_threads
            sessions.append(ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"]))
        return sessions
    proto = onnx.load(str(model))
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in weights.items()}
    del proto
    # ORT refuses a graph whose initializers have no data, so each session reads the file and
    # add_initializer overrides its weights with the shared buffers.
    sessions = []
    for _ in range(executors):
        options = ort.SessionOptions()
        options.intra_op_num_threads = options_threads
        options.add_session_config_entry("session.disable_prepacking", "1")
        for name, value in values.items():
            options.add_initializer(name, value)
        sessions.append(ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"]))
    _KEEP_ALIVE.append(weights)  # the sessions point into these buffers
    return sessions


def measure(design: str, model: Path, executors: int, width: int, seconds: float) -> dict[str, float]:
    sessions = _sessions(design, model, executors)
    feed = {"INPUT0": np.ones((1, width), dtype=np.float32)}
    for session in sessions:
        session.run(None, feed)
    memory = _memory_mb()
    counts = [0] * executors
    stop_at = time.monotonic() + seconds

    def worker(index: int) -> None:
        while time.monotonic() < stop_at:
            sessions[index].run(None, feed)
            counts[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(executors)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {**memory, "throughput": sum(counts) / (time.monotonic() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", type=int, default=4)
    parser.add_argument("--width", type=int, default=3200)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--design", choices=DESIGNS, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.design:
        print(json.dumps(measure(args.design, args.model, args.executors, args.width, args.seconds)))
        return
    sys.path.insert(0, str(REPO_ROOT / "model_repository"))
    from generate import mlp_graph, save

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "model.onnx"
        save(mlp_graph(width=args.width, layers=args.layers), model)
        for design in DESIGNS:
            result = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--design",
                    design,
                    "--model",
                    str(model),
                    "--executors",
                    str(args.executors),
                    "--width",
                    str(args.width),
                    "--seconds",
                    str(args.seconds),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            rows.append({"design": design, **json.loads(result.stdout.strip().splitlines()[-1])})
    base = rows[0]
    print(f"{args.executors} executors, MLP {args.layers} x {args.width}x{args.width} FP32, batch 1")
    print(f"{'design':<22} {'RSS MB':>8} {'PSS MB':>8} {'infer/s':>9} {'PSS ratio':>10} {'speed ratio':>12}")
    for row in rows:
        print(
            f"{row['design']:<22} {row['rss']:>8.0f} {row['pss']:>8.0f} {row['throughput']:>9.1f} "
            f"{row['pss'] / base['pss']:>10.2f} {row['throughput'] / base['throughput']:>12.2f}"
        )
    save_results(rows, "ort_sharing.csv")


if __name__ == "__main__":
    main()

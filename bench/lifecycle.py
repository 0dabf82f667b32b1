"""Reload under load and memory across load/unload, one run.

    python bench/lifecycle.py [--width 3200 --layers 10]

1. A server in explicit control mode with the ~400 MB MLP of bench/memory.py: RSS and PSS
   before the load, after it, and after the unload (ONNX Runtime frees the session; whether
   the allocator hands the pages back to the OS is what this measures).
2. `simple` under shoal-load at concurrency 16 while it is reloaded three times
   (RepositoryModelLoad with a changed config): the load runs from before the first reload
   until each new configuration has served requests, then is stopped (SIGINT); its one step
   counts every request of the run, completed and failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_mlp  # noqa: E402
from bench._perf import save_results  # noqa: E402
from bench._server import REPO_ROOT, shoal_server  # noqa: E402
from bench.memory import memory_mb  # noqa: E402
from shoal.clients import InferenceClient  # noqa: E402


def memory_across_load(width: int, layers: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        write_mlp(repo, "big", width, layers, "instance_group [ { count: 4 kind: KIND_CPU } ]", max_batch_size=8)
        with shoal_server(repo, "--model-control-mode", "explicit", timeout_s=600) as (url, pid):
            before = memory_mb(pid)
            with InferenceClient(url, timeout_s=600) as client:
                client.load_model("big")
                loaded = memory_mb(pid)
                client.unload_model("big")
                time.sleep(1.0)
                unloaded = memory_mb(pid)
    weights = width * width * 4 * layers / 2**20
    print(f"memory of a {weights:.0f} MB model, count 4 (MB):   RSS    PSS")
    for label, values in (("before load", before), ("after load", loaded), ("after unload", unloaded)):
        print(f"  {label:<14} {values['rss']:>6.0f} {values['pss']:>6.0f}")


def served(client: InferenceClient, model: str) -> int:
    """Successful requests of the model's ready version (statistics restart with each reload)."""
    rows = client.statistics(model)
    return sum(int(row.get("inference_stats", {}).get("success", {}).get("count", 0)) for row in rows)


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the load")
        time.sleep(0.05)


def reload_under_load() -> None:
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        shutil.copytree(REPO_ROOT / "model_repository" / "simple", repo / "simple")
        with shoal_server(repo, "--model-control-mode", "explicit", "--load-model", "*") as (url, _):
            out = repo.parent / f"{repo.name}-load.json"
            load = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shoal.clients.loadtest",
                    "-m",
                    "simple",
                    "-u",
                    url,
                    "--concurrency",
                    "16",
                    "--warmup-s",
                    "0",
                    "--window-s",
                    "1",
                    "--max-windows",
                    "120",
                    "--stability",
                    "0.001",
                    "--max-seconds",
                    "150",
                    "--json",
                    str(out),
                    "--no-progress",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                with InferenceClient(url, timeout_s=60) as client:
                    wait_for(lambda: served(client, "simple") >= 2000)
                    counted, reload_s = [], []
                    for batch in (4, 8, 2):
                        config = client.model_config("simple")
                        config["max_batch_size"] = batch
                        counted.append(served(client, "simple"))
                        started = time.monotonic()
                        client.load_model("simple", config=config)
                        reload_s.append(time.monotonic() - started)
                        print(f"reload to max_batch_size {batch}: {reload_s[-1]:.2f} s")
                        wait_for(lambda: served(client, "simple") >= 2000)  # the new config serves the load
                    counted.append(served(client, "simple"))
                if load.poll() is not None:
                    raise RuntimeError("the load ended before the reloads did")
                load.send_signal(signal.SIGINT)  # shoal-load stops, counts the requests in flight, writes JSON
                returncode = load.wait(timeout=60)
            finally:
                load.kill()
                load.wait()
            step = json.loads(out.read_text())["steps"][0]
            out.unlink()
    print(
        f"under load at concurrency 16, one step of {step['seconds']:.1f} s spanning the three reloads: "
        f"{step['requests']} requests completed (the server counted at least {sum(counted)}), "
        f"errors {step['errors'] or 0}; shoal-load exit status {returncode} (130: stopped by SIGINT)"
    )
    save_results(
        [
            {
                "run_s": round(step["seconds"], 2),
                "requests": step["requests"],
                "server_counted_at_least": sum(counted),
                "errors": sum(step["errors"].values()),
                "reload_s": " ".join(f"{r:.3f}" for r in reload_s),
            }
        ],
        "lifecycle_reload.csv",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3200)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    memory_across_load(args.width, args.layers)
    reload_under_load()


if __name__ == "__main__":
    main()

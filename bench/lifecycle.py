"""Reload under load and memory across load/unload, one run.

    python bench/lifecycle.py [--width 3200 --layers 10]

1. A server in explicit control mode with the ~400 MB MLP of bench/memory.py: RSS and PSS
   before the load, after it, and after the unload (ONNX Runtime frees the session; whether
   the allocator hands the pages back to the OS is what this measures).
2. `simple` under shoal-load at concurrency 16 for 8 s while it is reloaded three times
   (RepositoryModelLoad with a changed config): requests completed and failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_mlp  # noqa: E402
from bench._server import REPO_ROOT, shoal_server  # noqa: E402
from bench.memory import memory_mb  # noqa: E402
from clients import InferenceClient  # noqa: E402


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


def reload_under_load() -> None:
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        shutil.copytree(REPO_ROOT / "model_repository" / "simple", repo / "simple")
        with shoal_server(repo, "--model-control-mode", "explicit", "--load-model", "*") as (url, _):
            out = repo.parent / f"{repo.name}-load.json"
            load = subprocess.Popen(
                [sys.executable, "-m", "clients.loadtest", "-m", "simple", "-u", url, "--concurrency", "16",
                 "--warmup-s", "0", "--window-s", "1", "--max-windows", "8", "--stability", "0.001",
                 "--json", str(out), "--no-progress"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            with InferenceClient(url, timeout_s=60) as client:
                time.sleep(2.0)
                for batch in (4, 8, 2):
                    config = client.model_config("simple")
                    config["max_batch_size"] = batch
                    started = time.monotonic()
                    client.load_model("simple", config=config)
                    print(f"reload to max_batch_size {batch}: {time.monotonic() - started:.2f} s")
                    time.sleep(1.0)
            load.wait(timeout=120)
            step = json.loads(out.read_text())["steps"][0]
            out.unlink()
    print(f"under load at concurrency 16 over {step['windows']} s: {step['requests']} requests in the last windows "
          f"(all windows: {int(sum(step['window_throughputs']))}), errors {step['errors'] or 0}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=3200)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args()
    memory_across_load(args.width, args.layers)
    reload_under_load()


if __name__ == "__main__":
    main()

"""shoal-load against a server that dies mid-run: how hard it retries, what it reports, how it exits.

    python bench/loadtest_dead_server.py [--concurrency 16]

Starts `simple`, runs one shoal-load step (windows of 1 s, never "stable", so it runs all of
them), kills the server with SIGKILL once it has served 500 requests, and reports the step's
totals from shoal-load's JSON: requests completed, failures, the failure rate from the kill to
the end of the step (closed-loop back-off bounds it; before it, ~70,000/s), and the exit status.
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
from bench._perf import save_results  # noqa: E402
from bench._server import REPO_ROOT  # noqa: E402
from shoal.clients import ClientError, InferenceClient  # noqa: E402
from shoal.tools import local_server  # noqa: E402


def served(client: InferenceClient) -> int:
    try:
        rows = client.statistics("simple")
    except ClientError:
        return 0
    return sum(int(row.get("inference_stats", {}).get("success", {}).get("count", 0)) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--windows", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        shutil.copytree(REPO_ROOT / "model_repository" / "simple", repo / "simple")
        out = Path(folder) / "load.json"
        with local_server.running(repo) as server:
            load = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shoal.clients.loadtest",
                    "-m",
                    "simple",
                    "-u",
                    server.url,
                    "--concurrency",
                    str(args.concurrency),
                    "--warmup-s",
                    "0",
                    "--window-s",
                    "1",
                    "--max-windows",
                    str(args.windows),
                    "--stability",
                    "0.001",
                    "--json",
                    str(out),
                    "--no-progress",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                with InferenceClient(server.url, timeout_s=10) as client:
                    deadline = time.monotonic() + 60
                    while served(client) < 500 and time.monotonic() < deadline and load.poll() is None:
                        time.sleep(0.05)
                    before_kill = served(client)
                server.process.kill()
                killed_at = time.monotonic()
                _, stderr = load.communicate(timeout=120)
                failing_s = time.monotonic() - killed_at
            finally:
                load.kill()
                load.wait()
        step = json.loads(out.read_text())["steps"][0]
    failures = sum(step["errors"].values())
    row = {
        "concurrency": args.concurrency,
        "step_s": round(step.get("seconds", 0.0), 2),
        "requests": step["requests"],
        "server_counted_before_kill": before_kill,
        "failures": failures,
        "failures_per_s_after_kill": round(failures / failing_s, 1),
        "exit_status": load.returncode,
    }
    print(
        f"concurrency {args.concurrency}, one step of {row['step_s']} s; server killed after it counted "
        f"{before_kill} requests"
    )
    print(f"  shoal-load totals: {step['requests']} completed, {failures} failed ({step['errors']})")
    print(
        f"  failure rate from the kill to the end of the run: {row['failures_per_s_after_kill']}/s "
        f"over {failing_s:.1f} s (back-off; ~70,000/s without it)"
    )
    print(f"  exit status {load.returncode}; last line: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}")
    save_results([row], "loadtest_dead_server.csv")


if __name__ == "__main__":
    main()

"""The Grafana dashboard's panels (deploy/grafana/shoal-dashboard.json), plotted with matplotlib from a real Shoal.

    python bench/dashboard_plot.py [--seconds 40] [--out docs/dashboard.png]

Not a Grafana rendering (no Grafana here): the same series the panels query, scraped from /metrics once a
second while a load runs, and each panel's expression computed from them the way Prometheus would (a rate
is the change between two scrapes over the time between them). Two models: tiny (add/sub, INT32 [1,16])
and mlp (an FP32 MLP, 4 x 1024x1024), ``--metrics-config summary_latencies=true``. The load: four client
threads on tiny and one on mlp for the first half, eight on tiny for the second; one bad request to tiny
every second (a wrong shape: an OTHER failure). Writes the PNG and bench/results/dashboard_plot.csv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import ORT_THREADS_PARAMETER, write_mlp, write_tiny  # noqa: E402
from bench._perf import save_results  # noqa: E402
from shoal.tools import local_server  # noqa: E402
from tests.prometheus_text import parse  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def sender(url: str, model: str, stop: threading.Event, bad: bool = False) -> None:
    with grpcclient.InferenceServerClient(url) as client:
        shape, dtype, name = ([1, 16], np.int32, "INPUT") if model == "tiny" else ([1, 1024], np.float32, "INPUT0")
        inputs = []
        for index in range(2 if model == "tiny" else 1):
            given = grpcclient.InferInput(
                f"{name}{index}" if model == "tiny" else name,
                [1, 15] if bad else shape,
                "INT32" if model == "tiny" else "FP32",
            )
            given.set_data_from_numpy(np.zeros([1, 15] if bad else shape, dtype=dtype))
            inputs.append(given)
        while not stop.is_set():
            try:
                client.infer(model, inputs)
            except InferenceServerException:
                if not bad:
                    raise
            if bad:
                stop.wait(1.0)


def scrape(port: int) -> dict[str, Any]:
    return parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    family = families.get(name)
    return sum(s.value for s in family.samples if labels.items() <= s.labels.items()) if family else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder)
        write_tiny(repo)
        write_mlp(repo, "mlp", 1024, 4, ORT_THREADS_PARAMETER, max_batch_size=32)
        with local_server.running(repo, "--metrics-config", "summary_latencies=true") as server:
            stops = [threading.Event() for _ in range(3)]
            first = [threading.Thread(target=sender, args=(server.url, "tiny", stops[0])) for _ in range(4)]
            first += [threading.Thread(target=sender, args=(server.url, "mlp", stops[0]))]
            second = [threading.Thread(target=sender, args=(server.url, "tiny", stops[1])) for _ in range(8)]
            bad = threading.Thread(target=sender, args=(server.url, "tiny", stops[2], True))
            for thread in (*first, bad):
                thread.start()
            started = time.monotonic()
            previous = (started, scrape(server.metrics_port))
            while time.monotonic() - started < args.seconds:
                time.sleep(1.0)
                if len(rows) == int(args.seconds / 2) and not second[0].is_alive():
                    stops[0].set()
                    for thread in second:
                        thread.start()
                now, families = time.monotonic(), scrape(server.metrics_port)
                elapsed = now - previous[0]
                row: dict[str, float] = {"t": now - started}
                for model in ("tiny", "mlp"):
                    ok = value(families, "nv_inference_request_success", model=model) - value(
                        previous[1], "nv_inference_request_success", model=model
                    )
                    queued = value(families, "nv_inference_queue_duration_us", model=model) - value(
                        previous[1], "nv_inference_queue_duration_us", model=model
                    )
                    row[f"{model}_per_s"] = ok / elapsed
                    row[f"{model}_queue_us"] = queued / ok if ok else 0.0
                    for q in ("0.5", "0.99"):
                        row[f"{model}_p{q}"] = value(
                            families, "nv_inference_request_summary_us", model=model, quantile=q
                        )
                    row[f"{model}_failed_per_s"] = (
                        value(families, "nv_inference_request_failure", model=model)
                        - value(previous[1], "nv_inference_request_failure", model=model)
                    ) / elapsed
                    row[f"{model}_memory_mb"] = value(families, "shoal_model_memory_bytes", model=model) / 2**20
                    row[f"{model}_waiting"] = value(families, "nv_inference_pending_request_count", model=model)
                rows.append(row)
                previous = (now, families)
            for stop in stops:
                stop.set()
            for thread in (*first, *second, bad):
                if thread.is_alive() or thread.ident is not None:
                    thread.join(timeout=30)
    t = [r["t"] for r in rows]
    figure, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels = [
        ("Throughput (successful requests/s)", [("tiny_per_s", "tiny"), ("mlp_per_s", "mlp")]),
        (
            "Request latency p50 / p99 (µs, last minute)",
            [("tiny_p0.5", "tiny p50"), ("tiny_p0.99", "tiny p99"), ("mlp_p0.5", "mlp p50"), ("mlp_p0.99", "mlp p99")],
        ),
        ("Queue time per request (µs)", [("tiny_queue_us", "tiny"), ("mlp_queue_us", "mlp")]),
        ("Failures by reason (requests/s)", [("tiny_failed_per_s", "tiny OTHER")]),
        ("Memory held per device (MiB)", [("tiny_memory_mb", "tiny on cpu"), ("mlp_memory_mb", "mlp on cpu")]),
        ("Requests waiting", [("tiny_waiting", "tiny"), ("mlp_waiting", "mlp")]),
    ]
    for axis, (title, series) in zip(axes.ravel(), panels, strict=True):
        for key, label in series:
            axis.plot(t, [r[key] for r in rows], label=label)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("seconds")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
        axis.set_ylim(bottom=0)
    figure.suptitle(
        "Shoal dashboard panels, plotted with matplotlib by bench/dashboard_plot.py from a real server's "
        "/metrics (not a Grafana rendering)",
        fontsize=11,
    )
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")
    save_results(rows, "dashboard_plot.csv")


if __name__ == "__main__":
    main()

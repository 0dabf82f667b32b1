"""What tracing costs: off, sampled 1 in 1000, every request to Triton's trace file, and every request as
OpenTelemetry spans to a collector on loopback; beside the server before tracing existed. One run, alternated.

    python bench/tracing.py [--rounds 2] [--window-ms 1500] [--before 5b90e97]

Model: tiny (model_repository/simple: add/sub, INT32 [1,16]), max_batch_size 32, one instance,
dynamic_batching { max_queue_delay_microseconds: 200 }, 2 ONNX Runtime threads (bench/grpc_engines.py's
configuration and measurement): perf_analyzer 2.51 over gRPC, zero input, ModelInfer at concurrency 16.
CPU per request: CPU seconds of the server's process tree over the run divided by the requests its
ModelStatistics counted. ``before`` serves the revision given (``git archive``; default the last one
before tracing), so "off" is compared with a server that has no tracing code at all. The collector
(this script's own, a thread answering 200 to every POST) runs in this process, not the server's.
Prints the median over rounds per setting and writes bench/results/tracing.csv (every round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._models import write_tiny  # noqa: E402
from bench._perf import install_perf_analyzer, save_results  # noqa: E402
from bench._server import checked_out_server, shoal_server  # noqa: E402
from bench.grpc_engines import measure  # noqa: E402

BEFORE = "5b90e97"  # the last revision without tracing


@contextmanager
def collector() -> Iterator[int]:
    """An OTLP/HTTP endpoint that takes every export and keeps nothing; its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def settings(folder: Path, otlp_port: int) -> dict[str, tuple[str, ...]]:
    file = ("--trace-config", f"triton,file={folder / 'trace.json'}", "--trace-config", "level=TIMESTAMPS")
    return {
        "off": (),
        "1/1000 file": (*file, "--trace-config", "rate=1000"),
        "every file": (*file, "--trace-config", "rate=1"),
        "every otel": (
            "--trace-config",
            "mode=opentelemetry",
            "--trace-config",
            f"opentelemetry,url=127.0.0.1:{otlp_port}/v1/traces",
            "--trace-config",
            "level=TIMESTAMPS",
            "--trace-config",
            "rate=1",
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=1500)
    parser.add_argument("--before", default=BEFORE)
    args = parser.parse_args()
    install_perf_analyzer()
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as folder,
        collector() as otlp_port,
        checked_out_server(args.before) as before_path,
    ):
        repo = Path(folder) / "repo"
        write_tiny(repo)
        variants = {
            "before tracing": ((), before_path),
            **{name: (flags, None) for name, flags in settings(Path(folder), otlp_port).items()},
        }
        for round_number in range(args.rounds):
            for name, (flags, python_path) in variants.items():
                with shoal_server(repo, *flags, python_path=python_path) as (url, pid):
                    figures = measure(url, pid, 16, (), args.window_ms)
                rows.append({"round": round_number, "setting": name, **figures})
    print("| tracing (tiny, c=16) | inferences/s | p50 µs | server CPU µs/request |")
    print("|---|---|---|---|")
    for name in variants:
        mine = [r for r in rows if r["setting"] == name]
        m = {f: statistics.median(r[f] for r in mine) for f in ("throughput", "p50_us", "cpu_us_per_request")}
        print(f"| {name} | {m['throughput']:,.0f} | {m['p50_us']:,.0f} | {m['cpu_us_per_request']:,.0f} |")
    save_results(rows, "tracing.csv")


if __name__ == "__main__":
    main()

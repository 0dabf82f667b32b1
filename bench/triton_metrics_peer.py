"""Capture a real Triton's /metrics, then diff Shoal's against it (tests/observability/test_metrics.py with the
fresh capture).

    python bench/triton_metrics_peer.py [--write] [--port 18101]

Starts tritonserver 2.51 with ../shared/tools/triton_peer/run_triton.sh (Python backend, installs itself into
/tmp/triton-venv the first time: a ~500 MB download, so it is not part of the CI suite) on 127.0.0.1, serves five
Python models, sends the requests the header below names (tritonclient gRPC), scrapes the metrics port and stops
Triton. The capture goes to /tmp/triton_metrics.txt (``--write``: to tests/data/triton_metrics.txt, the reference
the suite diffs against); then pytest runs tests/observability/test_metrics.py against it (TRITON_METRICS_CAPTURE).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from textwrap import dedent

import numpy as np
import tritonclient.grpc as triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._triton import triton_server  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE = REPO_ROOT / "tests" / "data" / "triton_metrics.txt"

HEADER = """\
# /metrics of a real Triton 2.51.0 (tritonserver of the nvidia-pytriton 0.7.0 wheel, Python backend), captured on
# {date} by bench/triton_metrics_peer.py (run_triton.sh from ../shared/tools/triton_peer, --allow-gpu-metrics
# false); unedited below this header. Its five Python models and what was sent (tritonclient gRPC):
#   identity  3 successes; then a bad shape and an unknown input (INVALID_ARGUMENT): Triton counts them nowhere
#   failing   model.py returns an error response (INTERNAL to the client): Triton counts a success
#   raising   model.py's execute raises (INTERNAL): reason BACKEND
#   slow      max_queue_size 1, 0.5 s per batch: 5 concurrent requests, those that found the queue full refused
#             "Exceeds maximum queue size" (UNAVAILABLE), counted nowhere; then a client that gave up (gRPC
#             deadline) while queued: CANCELED
#   timeout   default_timeout_microseconds 100000, timeout_action REJECT: 2 "Request timeout expired": REJECTED
# Response header: "Content-Type: text/plain; charset=utf-8".
"""

_RESPOND = """\
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({delay_s})
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                             .as_numpy())]) for r in requests]
"""
_FAIL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("the model failed")) for r in requests]
"""
_RAISE = """\
class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("execute raised")
"""
MODELS = {  # name -> (model.py, max_batch_size, dynamic_batching body)
    "identity": (_RESPOND.format(delay_s=0), 8, ""),
    "failing": (_FAIL, 8, ""),
    "raising": (_RAISE, 8, ""),
    "slow": (_RESPOND.format(delay_s=0.5), 1, "default_queue_policy { max_queue_size: 1 }"),
    "timeout": (
        _RESPOND.format(delay_s=0.5),
        1,
        "default_queue_policy { default_timeout_microseconds: 100000 timeout_action: REJECT }",
    ),
}


def write_repository(repo: Path) -> None:
    for name, (source, max_batch_size, batching) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        (repo / name / "config.pbtxt").write_text(
            dedent(f"""\
            name: "{name}"
            backend: "python"
            max_batch_size: {max_batch_size}
            input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
            output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
            dynamic_batching {{ {batching} }}
            """)
        )


def infer(url: str, model: str, rows: np.ndarray, name: str = "IN", timeout_s: float | None = None) -> str:
    """'ok', or the error the client got."""
    with triton.InferenceServerClient(url) as client:
        tensor = triton.InferInput(name, list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        try:
            client.infer(model, [tensor], client_timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return str(exc).splitlines()[0]
        return "ok"


def concurrently(count: int, call: Callable[[], str]) -> list[str]:
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(call())) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def drive(url: str) -> None:
    row = np.ones((1, 4), np.float32)
    print([infer(url, "identity", row) for _ in range(3)])
    print(infer(url, "identity", np.ones((1, 5), np.float32)), "|", infer(url, "identity", row, name="NOPE"))
    print(infer(url, "failing", row), "|", infer(url, "raising", row))
    print(concurrently(5, lambda: infer(url, "slow", row)))
    blocker = threading.Thread(target=infer, args=(url, "slow", row))
    blocker.start()
    time.sleep(0.05)  # a live server's timing, not a test: let the blocker reach the model first
    print(infer(url, "slow", row, timeout_s=0.1))
    blocker.join()
    print(concurrently(3, lambda: infer(url, "timeout", row)))


def capture(port: int) -> str:
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        write_repository(repo)
        with triton_server(repo, port) as server:
            drive(server.url)
            deadline = time.monotonic() + 60
            while True:  # the cancelled request is counted once Triton's scheduler sees it
                with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=10) as response:
                    text = str(response.read().decode())
                if 'reason="CANCELED",version="1"} 1' in text or time.monotonic() > deadline:
                    return text
                time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18101, help="Triton's gRPC port (HTTP -1, metrics +1)")
    parser.add_argument("--write", action="store_true", help=f"replace {REFERENCE.relative_to(REPO_ROOT)}")
    args = parser.parse_args()
    text = HEADER.format(date=datetime.date.today().isoformat()) + capture(args.port)
    target = REFERENCE if args.write else Path("/tmp/triton_metrics.txt")
    target.write_text(text)
    print(f"capture written to {target}")
    environment = {**os.environ, "TRITON_METRICS_CAPTURE": str(target)}
    sys.exit(
        subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "tests/observability/test_metrics.py"],
            cwd=REPO_ROOT,
            env=environment,
        )
    )


if __name__ == "__main__":
    main()

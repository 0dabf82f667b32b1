"""Start a Shoal server for a benchmark: a subprocess on loopback, port 0, readiness over RPC."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from server.pb import InferenceStub, service_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def shoal_server(repository: Path, *extra_args: str, timeout_s: float = 120.0) -> Iterator[tuple[str, int]]:
    """Yields (url, pid) of a ready server; stops it with SIGTERM afterwards."""
    with tempfile.TemporaryDirectory() as folder:
        port_file = Path(folder) / "port"
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--model-repository", str(repository),
             "--grpc-address", "127.0.0.1", "--grpc-port", "0", "--port-file", str(port_file), *extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not (port_file.exists() and port_file.read_text().strip()):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.05)
            url = f"127.0.0.1:{port_file.read_text().strip()}"
            with grpc.insecure_channel(url) as channel:
                InferenceStub(channel).ServerLive(service_pb2.ServerLiveRequest(), timeout=30)
            yield url, process.pid
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()

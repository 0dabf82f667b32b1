"""Start a Shoal server as a subprocess on a free loopback port, ready when it answers over RPC.

Used by ``shoal config tune``, the benchmarks and the tests. The port comes from the server
itself (``--grpc-port 0 --http-port 0 --port-file``), so there is no pick-a-port-then-release race.
``port``/``url`` are gRPC's; ``http_port``/``http_url`` HTTP's (0 / no URL with ``--allow-http false``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from shoal.protocol import InferenceStub, service_pb2


@dataclass
class LocalServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path | None
    metrics_port: int = 0  # 0 when metrics are off
    http_port: int = 0  # 0 when HTTP is off

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint, as tritonclient.http takes it."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM (graceful), then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start(
    repository: Path,
    *extra_args: str,
    work_dir: Path,
    log_path: Path | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    timeout_s: float = 120.0,
    python_path: Path | None = None,
) -> LocalServer:
    """Start ``python -m shoal serve`` on 127.0.0.1 and wait until ServerLive answers; with ``python_path``,
    the ``shoal`` package found there is the one served (a benchmark's earlier revision)."""
    port_file = work_dir / "port"
    port_file.unlink(missing_ok=True)
    if "--metrics-port" not in extra_args:  # never collide on Triton's default 8002
        extra_args = (*extra_args, "--metrics-port", "0", "--metrics-address", "127.0.0.1")
    if "--http-port" not in extra_args:  # nor on Triton's HTTP default 8000
        extra_args = (*extra_args, "--http-port", "0", "--http-address", "127.0.0.1")
    with open(log_path or os.devnull, "wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shoal",
                "serve",
                "--model-repository",
                str(repository),
                "--grpc-address",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--port-file",
                str(port_file),
                *extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **({"PYTHONPATH": str(python_path)} if python_path else {})},
        )
    try:
        return _wait_until_serving(process, port_file, log_path, credentials, time.monotonic() + timeout_s)
    except BaseException:  # Ctrl-C or a failure while waiting: never leave the server behind
        if process.poll() is None:
            process.kill()
            process.wait()
        raise


def _wait_until_serving(
    process: subprocess.Popen[bytes],
    port_file: Path,
    log_path: Path | None,
    credentials: grpc.ChannelCredentials | None,
    deadline: float,
) -> LocalServer:
    """The started server once it has written its ports and answers ServerLive."""
    while not (port_file.exists() and len(port_file.read_text().split()) == 3):
        if process.poll() is not None or time.monotonic() > deadline:
            detail = log_path.read_text(errors="replace") if log_path else "(no log kept)"
            raise RuntimeError(f"the server did not start:\n{detail}")
        time.sleep(0.05)
    grpc_port, metrics_port, http_port = (int(p) for p in port_file.read_text().split())
    server = LocalServer(process, grpc_port, log_path, metrics_port, http_port)
    options = [("grpc.ssl_target_name_override", "localhost")] if credentials else []
    channel = (
        grpc.secure_channel(server.url, credentials, options) if credentials else grpc.insecure_channel(server.url)
    )
    with channel:
        stub = InferenceStub(channel)
        while True:
            try:
                if stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=1).live:
                    return server
            except grpc.RpcError as error:
                if "restricted" in (error.details() or ""):
                    return server  # it answers: health is restricted (--grpc-restricted-protocol health:...)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@contextmanager
def running(
    repository: Path, *extra_args: str, timeout_s: float = 120.0, python_path: Path | None = None
) -> Iterator[LocalServer]:
    """A server for the duration of a ``with`` block, stopped gracefully afterwards."""
    with tempfile.TemporaryDirectory() as folder:
        server = start(repository, *extra_args, work_dir=Path(folder), timeout_s=timeout_s, python_path=python_path)
        try:
            yield server
        finally:
            server.stop()

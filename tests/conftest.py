"""Fixtures that start a real Shoal server (subprocess, loopback, port 0) and connect clients."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from server.pb import InferenceStub, service_pb2
from tests import models

STARTUP_TIMEOUT_S = 60.0


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    repository: Path, tmp_path: Path, *extra_args: str, credentials: grpc.ChannelCredentials | None = None
) -> RunningServer:
    """Start ``python -m server`` on a free loopback port; readiness is polled over RPC
    (through TLS with ``credentials``)."""
    port_file = tmp_path / "port"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--model-repository", str(repository),
             "--grpc-address", "127.0.0.1", "--grpc-port", "0", "--port-file", str(port_file),
             "--exit-timeout-secs", "5", *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not port_file.exists() or not port_file.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server did not start:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)
    server = RunningServer(process, int(port_file.read_text()), log_path)
    channel = (
        grpc.secure_channel(server.url, credentials, [("grpc.ssl_target_name_override", "localhost")])
        if credentials else grpc.insecure_channel(server.url)
    )
    with channel:
        stub = InferenceStub(channel)
        while True:
            try:
                if stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=1).live:
                    break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    server.stop()
                    raise
                time.sleep(0.05)
    return server


@pytest.fixture
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RunningServer]]:
    started: list[RunningServer] = []

    def factory(
        repository: Path, *extra_args: str, credentials: grpc.ChannelCredentials | None = None
    ) -> RunningServer:
        server = start_server(repository, tmp_path_factory.mktemp("server"), *extra_args, credentials=credentials)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def example_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The shipped model_repository plus identity models for every datatype and a string model."""
    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")
    models.copy_example(repo, "mlp")
    for datatype in models.ALL_DATATYPES:
        models.add_identity(repo, f"identity_{datatype.lower()}", datatype)
    models.add_onnx_strings(repo)
    server = start_server(repo, tmp_path_factory.mktemp("server"))
    yield server
    assert server.stop() == 0, server.log()


def open_channel(url: str) -> grpc.Channel:
    """A channel that, like tritonclient's, accepts messages up to INT32_MAX bytes."""
    limit = 2**31 - 1
    return grpc.insecure_channel(
        url, options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    )


@pytest.fixture
def stub(example_server: RunningServer) -> Iterator[InferenceStub]:
    with open_channel(example_server.url) as channel:
        yield InferenceStub(channel)

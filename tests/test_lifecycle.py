"""Control modes, load/unload/reload without dropping requests, graceful shutdown, overload."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients import ClientError, InferenceClient
from tests import models

A = np.arange(16, dtype=np.int32).reshape(1, 16)


def wait_until(condition, timeout_s: float = 20.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return False


def slow_model(repo: Path, name: str, delay_ms: int, extra: str = "", count: int = 2) -> None:
    models.write_config(
        repo / name,
        f"""
        backend: "identity"
        max_batch_size: 0
        input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        parameters {{ key: "execute_delay_ms" value: {{ string_value: "{delay_ms}" }} }}
        {extra}
        """,
    )
    (repo / name / "1").mkdir()


def test_explicit_mode_load_unload_and_config_override(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple", "mlp")
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "simple")
    with InferenceClient(server.url, timeout_s=60) as client:
        index = {e.name: e for e in client.repository_index()}
        assert index["simple"].state == "READY" and index["mlp"].state == ""  # present, never loaded
        assert not client.is_model_ready("mlp")
        client.load_model("mlp")
        assert client.is_model_ready("mlp") and client.model_config("mlp")["max_batch_size"] == 32
        override = client.model_config("mlp")
        override["max_batch_size"] = 4
        override["instance_group"] = [{"count": 1, "kind": "KIND_CPU"}]
        client.load_model("mlp", config=override)
        assert client.model_config("mlp")["max_batch_size"] == 4
        client.unload_model("mlp", unload_dependents=True)
        assert not client.is_model_ready("mlp")
        unloaded = [e for e in client.repository_index() if e.name == "mlp"][0]
        assert unloaded.state == "UNAVAILABLE" and unloaded.reason == "unloaded"
        for name, config, phrase in [
            ("nope", None, "no such model folder"),
            ("../simple", None, "Request for unknown model"),
            ("simple", {"name": "other"}, "names model 'other'"),
            ("simple", {"max_batch_size": "many"}, "not a valid ModelConfig"),
            ("simple", {**client.model_config("simple"), "default_model_filename": "../../mlp/1/model.onnx"},
             "must be a file name inside the version folder"),
        ]:
            with pytest.raises(ClientError) as caught:
                client.load_model(name, config=config)
            assert phrase in caught.value.message, caught.value.message
        assert client.is_model_ready("simple")  # failed loads left the serving model alone
        np.testing.assert_array_equal(client.infer("simple", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], 2 * A)


def test_poll_mode_follows_the_repository(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3")
    with InferenceClient(server.url, timeout_s=30) as client:
        with pytest.raises(ClientError, match="polling is enabled"):
            client.load_model("simple")
        models.copy_example(repo, "mlp")  # dropped-in model
        assert wait_until(lambda: client.is_model_ready("mlp"))
        shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")  # new version
        assert wait_until(lambda: client.is_model_ready("simple", "2"))
        assert client.model_metadata("simple").versions == ("2",)
        config = repo / "simple" / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))  # changed config
        assert wait_until(lambda: client.model_config("simple")["max_batch_size"] == 4)
        config.write_text("max_batch_size: [ broken")  # a failed reload keeps the old one serving
        assert wait_until(lambda: any("reload failed" in e.reason for e in client.repository_index()))
        assert client.is_model_ready("simple") and client.model_config("simple")["max_batch_size"] == 4
        shutil.rmtree(repo / "mlp")  # removed folder
        assert wait_until(lambda: not client.is_model_ready("mlp"))
        with pytest.raises(ClientError, match="Request for unknown model: 'mlp'"):
            client.model_metadata("mlp")


def test_reload_under_load_drops_no_request(tmp_path: Path, server_factory) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "*")
    out = tmp_path / "load.json"
    load = subprocess.Popen(
        [sys.executable, "-m", "clients.loadtest", "-m", "simple", "-u", server.url, "--concurrency", "16",
         "--warmup-s", "0", "--window-s", "1", "--max-windows", "6", "--stability", "0.001",
         "--json", str(out), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        with InferenceClient(server.url, timeout_s=60) as client:
            time.sleep(2.0)
            for batch in (4, 8, 2):  # three reloads while 16 requests are always in flight
                config = client.model_config("simple")
                config["max_batch_size"] = batch
                client.load_model("simple", config=config)
                assert client.model_config("simple")["max_batch_size"] == batch
                time.sleep(0.5)
        assert load.wait(timeout=120) == 0
    finally:
        load.kill()
    step = json.loads(out.read_text())["steps"][0]
    assert step["requests"] > 100
    assert step["errors"] == {}, step["errors"]


def test_graceful_shutdown_completes_every_accepted_request(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    slow_model(repo, "slow", delay_ms=400, count=2)
    server = server_factory(repo)
    results: list[object] = []

    def call(value: float) -> None:
        with InferenceClient(server.url, timeout_s=30) as client:
            try:
                results.append(client.infer("slow", {"IN": np.full((4,), value, np.float32)})["OUT"][0])
            except ClientError as error:
                results.append(error)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(call, float(i)) for i in range(6)]  # 2 run, 4 queue
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        for future in futures:
            future.result(timeout=60)
    assert server.process.wait(timeout=30) == 0
    assert sorted(results) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], results
    assert "shutting down" in server.log()


def test_overload_is_answered_promptly_while_health_stays_responsive(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    bounded_queue = "dynamic_batching { default_queue_policy { max_queue_size: 2 } }"
    slow_model(repo, "bounded", delay_ms=200, count=1, extra=bounded_queue)
    server = server_factory(repo)
    statuses: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + 3.0

    def flood() -> None:
        with InferenceClient(server.url, timeout_s=30) as client:
            while time.monotonic() < stop:
                started = time.monotonic()
                try:
                    client.infer("bounded", {"IN": np.zeros(4, np.float32)})
                    status = "OK"
                except ClientError as error:
                    status = error.status.name
                    assert time.monotonic() - started < 1.0, "a rejection must come back at once"
                with lock:
                    statuses.append(status)

    with ThreadPoolExecutor(8) as pool:
        floods = [pool.submit(flood) for _ in range(8)]
        with grpc.insecure_channel(server.url) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(10):
                started = time.monotonic()
                reply = health.Check(health_pb2.HealthCheckRequest(service="bounded"), timeout=2)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                assert time.monotonic() - started < 0.5
                time.sleep(0.2)
        for future in floods:
            future.result(timeout=60)
    assert "UNAVAILABLE" in statuses and "OK" in statuses
    assert set(statuses) == {"OK", "UNAVAILABLE"}

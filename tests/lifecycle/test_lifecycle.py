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

from shoal.clients import ClientError, InferenceClient
from shoal.settings import EXIT_FORCED
from tests import models, python_models
from tests.polling import metric, success_count, wait_until

A = np.arange(16, dtype=np.int32).reshape(1, 16)


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
            ("../simple", None, "failed to load '../simple', failed to poll from model repository"),
            ("simple", {"name": "other"}, "names model 'other'"),
            ("simple", {"max_batch_size": "many"}, "not a valid ModelConfig"),
            (
                "simple",
                {**client.model_config("simple"), "default_model_filename": "../../mlp/1/model.onnx"},
                "must be a file name inside the version folder",
            ),
        ]:
            with pytest.raises(ClientError) as caught:
                client.load_model(name, config=config)
            assert phrase in caught.value.message, caught.value.message
        assert client.is_model_ready("simple")  # failed loads left the serving model alone
        np.testing.assert_array_equal(client.infer("simple", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], 2 * A)
        # Unloading what is not loaded is done already, as Triton 2.51 answers (run here); statistics of it
        # are refused in its words; and so is inference, as of a model it does not know.
        for name in ("mlp", "nope", "../simple"):
            client.unload_model(name)
            with pytest.raises(ClientError) as caught:
                client.statistics(name)
            assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.message == f"requested model '{name}' is not available"
        with pytest.raises(ClientError) as caught:
            client.infer("mlp", {"INPUT0": np.zeros((1, 256), np.float32)})
        assert caught.value.status == grpc.StatusCode.NOT_FOUND
        assert caught.value.message == "Request for unknown model: 'mlp' has no available versions"
        with pytest.raises(ClientError) as caught:
            client.statistics("simple", "3")
        assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.message == "requested model version is not available for model 'simple'"
        assert client.statistics("simple", "1")[0]["version"] == "1"
        for name, version, words in (
            ("", "abc", "(details: stol)"),  # the version is read first, as Triton reads it
            ("nope", "-1", "invalid model version specified '-1'"),
        ):
            with pytest.raises(ClientError) as caught:
                client.statistics(name, version)
            assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.message


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
    # Runs until interrupted (at most 120 s): its one step then counts every request it sent.
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
            "16",
            "--warmup-s",
            "0",
            "--window-s",
            "0.5",
            "--max-windows",
            "240",
            "--stability",
            "0.001",
            "--max-seconds",
            "120",
            "--json",
            str(out),
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        served = []  # requests each configuration served, at least: statistics restart with each reload
        with InferenceClient(server.url, timeout_s=60) as client:
            assert wait_until(lambda: success_count(client, "simple") >= 50, timeout_s=60), "no load arrived"
            for batch in (4, 8, 2):  # three reloads while 16 requests are always in flight
                served.append(success_count(client, "simple"))
                config = client.model_config("simple")
                config["max_batch_size"] = batch
                client.load_model("simple", config=config)
                assert client.model_config("simple")["max_batch_size"] == batch
                assert wait_until(lambda: success_count(client, "simple") >= 50, timeout_s=60)
            served.append(success_count(client, "simple"))
        assert load.poll() is None, "the load ended before the reloads did"
        load.send_signal(signal.SIGINT)
        _, stderr = load.communicate(timeout=60)
    finally:
        load.kill()
        load.wait()
    assert load.returncode == 130, stderr  # interrupted, with every request so far accounted for
    step = json.loads(out.read_text())["steps"][0]
    assert step["interrupted"] and step["errors"] == {}, step["errors"]
    assert step["requests"] >= sum(served), (step["requests"], served)
    assert step["requests"] >= sum(step["window_throughputs"]) * 0.5 * 0.99  # every window, not the last three


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
        wait_until(
            lambda: metric(server, "nv_inference_pending_request_count", "slow") == 4,
            timeout_s=30,
            what="4 requests queued",
        )
        server.process.send_signal(signal.SIGTERM)
        for future in futures:
            future.result(timeout=60)
    assert server.process.wait(timeout=30) == 0
    assert sorted(results) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], results
    assert "shutting down" in server.log()


# A thread-instance model that leaves a thread running which is no daemon: Python's exit waits for it.
LINGERS = """
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        threading.Thread(target=time.sleep, args=(600,), daemon=False, name="model-lingers").start()
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""


def test_a_thread_a_model_leaves_running_does_not_hold_the_exit_for_ever(tmp_path: Path, server_factory) -> None:
    python_models.write_model(tmp_path / "repo", "lingers", python_models.FP32_4_ON_A_THREAD_CONFIG, LINGERS)
    server = server_factory(tmp_path / "repo", "--exit-timeout-secs", "5")
    with InferenceClient(server.url, timeout_s=30) as client:
        assert list(client.infer("lingers", {"IN": np.ones(4, np.float32)})["OUT"]) == [1.0] * 4
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == EXIT_FORCED  # it once never ended
    log = server.log()
    assert "stopped" in log and "held the exit past the exit timeout (model-lingers)" in log, log


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
        checks_under_overload = 0
        with grpc.insecure_channel(server.url) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while checks_under_overload < 10 and time.monotonic() < stop:  # bounded by the flood's end
                with lock:
                    overloaded = "UNAVAILABLE" in statuses
                started = time.monotonic()
                reply = health.Check(health_pb2.HealthCheckRequest(service="bounded"), timeout=2)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                assert time.monotonic() - started < 0.5
                if overloaded:
                    checks_under_overload += 1
        assert checks_under_overload >= 10, "health was not checked while the model rejected requests"
        for future in floods:
            future.result(timeout=60)
    assert "UNAVAILABLE" in statuses and "OK" in statuses
    assert set(statuses) == {"OK", "UNAVAILABLE"}


def test_an_unload_shows_unloading_while_its_requests_drain(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    slow_model(repo, "slow", delay_ms=1000, count=1)  # a window for 2 queued that a busy machine hits
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "slow")

    def states(client: InferenceClient) -> list[tuple[str, str, str]]:
        return [(e.version, e.state, e.reason) for e in client.repository_index() if e.name == "slow"]

    def call(value: float) -> float:
        with InferenceClient(server.url, timeout_s=30) as client:
            return float(client.infer("slow", {"IN": np.full((4,), value, np.float32)})["OUT"][0])

    with InferenceClient(server.url, timeout_s=30) as client, ThreadPoolExecutor(4) as pool:
        assert states(client) == [("1", "READY", "")]
        results = [pool.submit(call, float(i)) for i in range(3)]  # 1 runs, 2 queue
        wait_until(lambda: metric(server, "nv_inference_pending_request_count", "slow") == 2, what="2 queued")
        unload = pool.submit(client.unload_model, "slow")
        wait_until(lambda: states(client) == [("1", "UNLOADING", "")], what="UNLOADING during the drain")
        assert not client.is_model_ready("slow")
        unload.result(timeout=30)
        assert sorted(r.result(timeout=30) for r in results) == [0.0, 1.0, 2.0]  # the drain dropped none
        assert states(client) == [("1", "UNAVAILABLE", "unloaded")] and client.is_ready()  # unloaded on purpose


CHDIR_MODEL = """
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        os.chdir(os.path.dirname(os.path.dirname(__file__)))  # a common idiom: its own folder for relative paths

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""
CHDIR_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
parameters { key: "process_instances" value: { string_value: "false" } }
"""


def test_a_model_that_changes_the_working_folder_leaves_a_relative_repository_found(
    tmp_path: Path, server_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of session 50 (F5): a thread-instance model's ``os.chdir`` (the server's own working
    folder) made a relative ``--model-repository`` point elsewhere: every later load of every model
    failed ("no such model folder"). The repository's path is made absolute once, at start."""
    from tests.python_models import write_model

    repo = tmp_path / "repo"
    models.copy_example(repo, "simple")
    write_model(repo, "chdir", CHDIR_CONFIG, CHDIR_MODEL)
    monkeypatch.chdir(tmp_path)  # the server inherits it: "repo" is relative to it
    server = server_factory(Path("repo"), "--model-control-mode", "explicit", "--load-model", "chdir")
    with InferenceClient(server.url, timeout_s=30) as client:
        assert client.is_model_ready("chdir")
        client.load_model("simple")
        assert client.is_model_ready("simple")

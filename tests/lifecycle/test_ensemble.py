"""Ensembles (``platform: "ensemble"``) served and called through tritonclient, in both process layouts:
steps over ONNX, PyTorch and identity models, concurrent independent steps, requested outputs, failing
steps, composing models' own batching and statistics, config / metadata / index, refused configs."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import ensemble_models, models
from tests.clients.test_perf_analyzer import BINARY as PERF_ANALYZER
from tests.conftest import RunningServer, serving
from tests.polling import wait_until

pytest.importorskip("torch", reason="the chain's PyTorch step needs torch (installed by .ci/run)")

X = np.arange(8, dtype=np.float32).reshape(2, 4)


class Served(NamedTuple):
    server: RunningServer
    refused: dict[str, str]  # ensemble → the reason it must fail to load with


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[Served]:
    repo = tmp_path_factory.mktemp("repo")
    ensemble_models.add_serving_ensembles(repo)
    refused = ensemble_models.add_invalid_ensembles(repo)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout, "--exit-on-error", "false") as running:
        yield Served(running, refused)


@pytest.fixture
def client(served: Served) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(served.server.url) as connected:
        yield connected


def _input(array: np.ndarray, name: str = "IN") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def _stats(client: grpcclient.InferenceServerClient, model: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = client.get_inference_statistics(model, as_json=True)["model_stats"]
    assert len(rows) == 1
    return rows[0]


def _count(row: dict[str, Any], *path: str) -> int:
    value: Any = row
    for key in path:
        value = value.get(key, {})
    return int(value or 0)


def test_chain_over_onnx_pytorch_and_identity(client: grpcclient.InferenceServerClient) -> None:
    before = {m: _count(_stats(client, m), "inference_stats", "success", "count") for m in ("add1", "double", "pass")}
    result = client.infer("chain", [_input(X)], request_id="r-7")
    np.testing.assert_array_equal(result.as_numpy("OUT"), (X + 1) * 2)
    assert result.get_response().id == "r-7"
    assert result.get_response().model_name == "chain"
    for model, count in before.items():  # each step went through its composing model's own scheduler
        assert _count(_stats(client, model), "inference_stats", "success", "count") == count + 1, model


def test_ensemble_statistics_as_triton_reports_them(client: grpcclient.InferenceServerClient) -> None:
    """One execution per request, its rows counted; its compute phases are the sums of its steps' own
    (Triton's secondary stats aggregator), so they equal the composing models' increases exactly."""
    steps = ("add1", "double", "pass")
    before = {m: _stats(client, m) for m in ("chain", *steps)}
    client.infer("chain", [_input(X)])
    client.infer("chain", [_input(X[:1])])
    after = {m: _stats(client, m) for m in ("chain", *steps)}

    def delta(model: str, *path: str) -> int:
        return _count(after[model], *path) - _count(before[model], *path)

    assert delta("chain", "inference_count") == 3  # batch rows
    assert delta("chain", "execution_count") == 2  # one per request
    for phase in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert delta("chain", "inference_stats", phase, "count") == 2
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert delta("chain", "inference_stats", phase, "ns") == sum(
            delta(m, "inference_stats", phase, "ns") for m in steps
        ), phase
    assert delta("chain", "inference_stats", "success", "ns") > delta("chain", "inference_stats", "compute_infer", "ns")
    assert {row["batch_size"] for row in after["chain"]["batch_stats"]} >= {"1", "2"}


def test_independent_steps_run_at_once(client: grpcclient.InferenceServerClient) -> None:
    delay_s = ensemble_models.STEP_DELAY_MS / 1000
    fastest = float("inf")
    for _ in range(2):
        started = time.monotonic()
        result = client.infer("diamond", [_input(X)])
        fastest = min(fastest, time.monotonic() - started)
    np.testing.assert_array_equal(result.as_numpy("OUT"), 2 * X)
    np.testing.assert_array_equal(result.as_numpy("A"), X)
    np.testing.assert_array_equal(result.as_numpy("B"), X)
    assert fastest < 1.5 * delay_s, f"two {delay_s} s steps took {fastest:.3f} s: they ran one after the other"


def test_requested_outputs_run_only_the_steps_they_need(client: grpcclient.InferenceServerClient) -> None:
    models = ("slow_a", "slow_b", "sum")
    before = {m: _count(_stats(client, m), "inference_stats", "success", "count") for m in models}
    result = client.infer("diamond", [_input(X)], outputs=[grpcclient.InferRequestedOutput("A")])
    assert [o.name for o in result.get_response().outputs] == ["A"]
    np.testing.assert_array_equal(result.as_numpy("A"), X)
    after = {m: _count(_stats(client, m), "inference_stats", "success", "count") for m in models}
    assert after == {"slow_a": before["slow_a"] + 1, "slow_b": before["slow_b"], "sum": before["sum"]}


def test_unknown_output_and_bad_input_are_the_ensembles_own_errors(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer("chain", [_input(X)], outputs=[grpcclient.InferRequestedOutput("plus_one")])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert caught.value.message() == "unexpected inference output 'plus_one' for model 'chain'"
    with pytest.raises(InferenceServerException) as caught:
        client.infer("chain", [_input(np.ones((1, 3), np.float32))])
    assert "unexpected shape for input 'IN' for model 'chain'. Expected [-1,4], got [1,3]" in caught.value.message()


def test_a_failing_step_fails_the_ensemble_request(client: grpcclient.InferenceServerClient) -> None:
    failed_before = _count(_stats(client, "wide_chain"), "inference_stats", "fail", "count")
    with pytest.raises(InferenceServerException) as caught:  # refused by the step's model
        client.infer("wide_chain", [_input(np.ones((1, 3), np.float32))])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert caught.value.message().startswith(
        "in ensemble 'wide_chain', [request id: <id_unknown>] unexpected shape for input 'IN' for model 'add1'. "
        "Expected [-1,4], got [1,3]."
    )
    assert _count(_stats(client, "wide_chain"), "inference_stats", "fail", "count") == failed_before + 1
    with pytest.raises(InferenceServerException) as caught:  # fails inside ONNX Runtime
        client.infer("fails_in_onnx", [_input(np.ones(3, np.float32))])
    assert caught.value.status() == "StatusCode.INTERNAL"
    assert caught.value.message().startswith("in ensemble 'fails_in_onnx', model 'pick' version 1 failed")
    values = np.arange(6, dtype=np.float32)  # the same ensemble and model, then, serve on
    np.testing.assert_array_equal(client.infer("fails_in_onnx", [_input(values)]).as_numpy("OUT"), [5.0])
    np.testing.assert_array_equal(client.infer("wide_chain", [_input(X)]).as_numpy("OUT"), X + 1)


def test_composing_model_batches_ensemble_requests(client: grpcclient.InferenceServerClient) -> None:
    """The composing model's dynamic batcher (200 ms delay) merges the steps of concurrent ensemble
    requests; its statistics count them, and the ensemble counts one execution per request."""
    results: list[Any] = []
    for index in range(8):
        client.async_infer(
            "through_batcher",
            [_input(np.full((1, 4), index, np.float32))],
            callback=lambda result, error: results.append(error or result),
        )
    wait_until(lambda: len(results) == 8, what="8 answers")
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sorted(float(r.as_numpy("OUT")[0, 0]) for r in results) == [float(i) for i in range(8)]
    batched = _stats(client, "batched")
    assert _count(batched, "inference_count") == 8
    assert _count(batched, "execution_count") < 8, batched  # merged into fewer executions
    ensemble = _stats(client, "through_batcher")
    assert (_count(ensemble, "inference_count"), _count(ensemble, "execution_count")) == (8, 8)


def test_config_metadata_and_index(client: grpcclient.InferenceServerClient) -> None:
    config = client.get_model_config("chain", as_json=True)["config"]
    assert config["platform"] == "ensemble" and config["max_batch_size"] == 8
    assert "instance_group" not in config and "backend" not in config
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["add1", "double", "pass"]
    assert config["ensemble_scheduling"]["step"][1]["input_map"] == {"INPUT__0": "plus_one"}
    metadata = client.get_model_metadata("diamond", as_json=True)
    assert metadata["platform"] == "ensemble"
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
        ("OUT", "FP32", ["-1", "4"]),
        ("A", "FP32", ["-1", "4"]),
        ("B", "FP32", ["-1", "4"]),
    ]
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["chain"]["state"] == "READY" and index["chain"]["version"] == "1"
    assert client.is_model_ready("diamond")


def test_invalid_ensembles_are_refused_in_tritons_words(
    client: grpcclient.InferenceServerClient, served: Served
) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert len(served.refused) == 19
    for name, reason in served.refused.items():
        assert index[name]["state"] == "UNAVAILABLE", name
        assert reason in index[name]["reason"], (name, index[name]["reason"])
        assert not client.is_model_ready(name)
        with pytest.raises(InferenceServerException) as caught:
            client.infer(name, [_input(X)])
        assert caught.value.status() == "StatusCode.NOT_FOUND"  # no version loaded, as Triton 2.51
    assert index["chain"]["state"] == "READY"  # the valid ensembles beside them serve


def test_loading_an_ensemble_loads_its_models_and_unloading_one_unloads_it(tmp_path: Path, server_factory) -> None:
    """Explicit model control, as Triton: loading an ensemble loads the models it uses; unloading
    one of them, or reloading it with a config the steps do not fit, unloads the ensemble; loading
    it again (fitting) brings the ensemble back."""
    repo = tmp_path / "repo"
    ensemble_models.add_onnx_add1(repo)
    ensemble_models.add_torch_double(repo)
    ensemble_models.add_identity(repo, "pass")
    ensemble_models.add_ensemble(
        repo,
        "chain",
        [
            ensemble_models.step("add1", {"IN": "IN"}, {"OUT": "a"}),
            ensemble_models.step("double", {"INPUT__0": "a"}, {"OUTPUT__0": "b"}),
            ensemble_models.step("pass", {"IN": "b"}, {"OUT": "OUT"}),
        ],
    )
    running = server_factory(repo, "--model-control-mode", "explicit")
    with grpcclient.InferenceServerClient(running.url) as client:
        assert not client.is_model_ready("add1")
        client.load_model("chain")
        assert all(client.is_model_ready(m) for m in ("add1", "double", "pass", "chain"))
        np.testing.assert_array_equal(client.infer("chain", [_input(X)]).as_numpy("OUT"), (X + 1) * 2)
        client.unload_model("double")
        wait_until(lambda: not client.is_model_ready("chain"), what="the ensemble unloaded with its model")
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert (index["chain"]["state"], index["chain"]["reason"]) == ("UNAVAILABLE", "unloaded")
        with pytest.raises(InferenceServerException):
            client.infer("chain", [_input(X)])
        client.load_model("double")
        wait_until(lambda: client.is_model_ready("chain"), what="the ensemble back with its model")
        np.testing.assert_array_equal(client.infer("chain", [_input(X)]).as_numpy("OUT"), (X + 1) * 2)
        # A model reloaded with a config the ensemble's steps no longer fit unloads the ensemble ...
        five = {
            "name": "pass",
            "backend": "identity",
            "max_batch_size": 8,
            "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [5]}],
            "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [5]}],
        }
        client.load_model("pass", config=json.dumps(five))
        wait_until(lambda: not client.is_model_ready("chain"), what="the ensemble unloaded with a misfit")
        assert client.is_model_ready("pass")
        # ... and a reload that fits again brings it back
        client.load_model("pass")
        wait_until(lambda: client.is_model_ready("chain"), what="the ensemble back with a fitting model")
        np.testing.assert_array_equal(client.infer("chain", [_input(X)]).as_numpy("OUT"), (X + 1) * 2)


def test_the_shipped_pipeline_equals_its_two_calls(tmp_path: Path, server_factory) -> None:
    """model_repository/mlp_pipeline: mlp_scale (pre-processing, ONNX) feeding the shipped MLP gives what
    the client gets calling the two models itself."""
    repo = models.repository(tmp_path, "mlp", "mlp_scale", "mlp_pipeline")
    raw = np.random.default_rng(0).integers(0, 256, (3, 256), dtype=np.uint8)
    with grpcclient.InferenceServerClient(server_factory(repo).url) as client:
        raw_input = grpcclient.InferInput("RAW", [3, 256], "UINT8")
        raw_input.set_data_from_numpy(raw)
        scaled = client.infer("mlp_scale", [raw_input]).as_numpy("SCALED")
        np.testing.assert_allclose(scaled, raw / 255 - 0.5, rtol=1e-6, atol=1e-6)
        expected = client.infer("mlp", [_input(scaled, "INPUT0")]).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(client.infer("mlp_pipeline", [raw_input]).as_numpy("OUTPUT0"), expected)


def test_poll_mode_unloads_the_ensemble_of_a_removed_model(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    ensemble_models.add_onnx_add1(repo)
    ensemble_models.add_ensemble(repo, "plus_one", [ensemble_models.step("add1", {"IN": "IN"}, {"OUT": "OUT"})])
    running = server_factory(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    with grpcclient.InferenceServerClient(running.url) as client:
        np.testing.assert_array_equal(client.infer("plus_one", [_input(X)]).as_numpy("OUT"), X + 1)
        shutil.rmtree(repo / "add1")
        wait_until(lambda: not client.is_model_ready("plus_one"), what="the ensemble unloaded with its model")
        with pytest.raises(InferenceServerException) as caught:
            client.infer("plus_one", [_input(X)])
        assert caught.value.status() == "StatusCode.NOT_FOUND"  # no version loaded, as Triton 2.51


def test_a_sequence_runs_through_an_ensemble(tmp_path: Path, server_factory) -> None:
    """The request's sequence parameters reach a sequence-batched step, whose state carries over between
    the ensemble's requests; the ensemble counts that model's phases as its own."""
    from tests import sequence_models

    repo = tmp_path / "repo"
    sequence_models.add_accumulator(repo, "accumulator")
    ensemble_models.add_ensemble(
        repo,
        "running_sum",
        [ensemble_models.step("accumulator", {"INPUT": "IN"}, {"OUTPUT": "OUT"})],
        io='input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]',
    )
    with grpcclient.InferenceServerClient(server_factory(repo).url) as client:
        sums = []
        for index, value in enumerate((1.0, 2.0, 4.0)):
            result = client.infer(
                "running_sum",
                [_input(np.array([[value]], np.float32))],
                sequence_id=7,
                sequence_start=index == 0,
                sequence_end=index == 2,
            )
            sums.append(float(result.as_numpy("OUT")[0, 0]))
        assert sums == [1.0, 3.0, 7.0]
        ensemble, step_model = _stats(client, "running_sum"), _stats(client, "accumulator")
        assert _count(ensemble, "execution_count") == 3
        assert _count(ensemble, "inference_stats", "compute_infer", "ns") == _count(
            step_model, "inference_stats", "compute_infer", "ns"
        )


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(),
    reason=f"perf_analyzer not installed at {PERF_ANALYZER}: run bench/install_perf_analyzer.sh",
)
def test_perf_analyzer_reads_the_ensemble_and_its_composing_models(tmp_path: Path, server_factory) -> None:
    """perf_analyzer reads ensemble_scheduling from ModelConfig and each composing model's statistics."""
    repo = models.repository(tmp_path, "mlp", "mlp_scale", "mlp_pipeline")
    result = subprocess.run(
        [
            str(PERF_ANALYZER),
            "-m",
            "mlp_pipeline",
            "-u",
            server_factory(repo).url,
            "-i",
            "grpc",
            "--input-data",
            "zero",
            "--concurrency-range",
            "2",
            "-p",
            "500",
            "--max-trials",
            "4",
            "--stability-percentage",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=180,  # a protocol check, not a speed test
    )
    assert result.returncode == 0, result.stdout + result.stderr
    composing = result.stdout[result.stdout.index("Composing models:") :]
    assert "mlp, version: 1" in composing and "mlp_scale, version: 1" in composing
    assert "Successful request count: 0" not in result.stdout


def test_an_ensemble_over_http(served: Served) -> None:
    """The REST endpoint reaches ensembles through the same core: JSON in, the chain's result out."""
    body = {"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
    request = urllib.request.Request(
        f"http://{served.server.http_url}/v2/models/chain/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    assert answer["model_name"] == "chain"
    assert answer["outputs"][0]["data"] == [4.0, 6.0, 8.0, 10.0]


def test_a_client_that_gives_up_cancels_the_steps(client: grpcclient.InferenceServerClient) -> None:
    """Requests the client abandons (deadline 0.1 s, steps of 0.4 s) fail as the ensemble's, CANCELED; the
    steps still queued at their models leave their queues; the ensemble serves on."""
    failed = _count(_stats(client, "diamond"), "inference_stats", "fail", "count")
    for _ in range(3):
        with pytest.raises(InferenceServerException) as caught:
            client.infer("diamond", [_input(X)], client_timeout=0.1)
        assert caught.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    wait_until(
        lambda: _count(_stats(client, "diamond"), "inference_stats", "fail", "count") == failed + 3,
        what="three cancelled ensemble requests",
    )
    wait_until(
        lambda: _count(_stats(client, "slow_a"), "inference_stats", "fail", "count") >= 1,
        what="a queued step cancelled",
    )
    np.testing.assert_array_equal(client.infer("diamond", [_input(X)]).as_numpy("OUT"), 2 * X)


def test_bytes_pass_between_steps(client: grpcclient.InferenceServerClient) -> None:
    words = np.array([[b"ensemble", b"", "ünï".encode(), b"\x00\xff"]], dtype=object)
    tensor = grpcclient.InferInput("IN", [1, 4], "BYTES")
    tensor.set_data_from_numpy(words)
    result = client.infer("strings", [tensor])
    assert result.as_numpy("OUT").tolist() == words.tolist()

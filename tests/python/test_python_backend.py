"""Triton's Python backend: model.py files written as a Triton user writes them, served and called
with tritonclient in both process layouts: outputs, args, batches as lists, auto-complete, BLS
(sync and async, to an ONNX and a Python model, in process and thread mode), statistics, and the
faults (load errors, raising, None, wrong count or dtype, a crash, a hang, a killed instance)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests import python_models as pm
from tests.conftest import RunningServer, serving
from tests.polling import wait_until

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'


def _timeout(ms: int) -> str:
    return f'parameters {{ key: "execution_timeout_ms" value: {{ string_value: "{ms}" }} }}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    models.copy_example(repo, "simple")
    models.copy_example(repo, "preprocess")
    models.copy_example(repo, "mlp")
    models.copy_example(repo, "image_pipeline")  # the Python model feeding the ONNX MLP, as an ensemble
    pm.add_add_sub(repo, count=2)
    pm.add_add_sub(repo, "add_sub_thread", extra=THREADS)
    pm.write_model(repo, "echo", pm.ECHO_CONFIG, pm.ECHO)
    pm.write_model(repo, "auto", pm.AUTO_CONFIG, pm.AUTO)
    pm.write_model(repo, "bls_sync", pm.BLS_CONFIG, pm.BLS_SYNC)
    pm.write_model(repo, "bls_async", pm.BLS_CONFIG, pm.BLS_ASYNC)
    pm.write_model(repo, "bls_thread", pm.BLS_CONFIG + THREADS, pm.BLS_ASYNC)
    for fault in pm.FAULTS:
        pm.add_fault(repo, fault)
    hangs = pm.add_fault(repo, "crashes", extra=_timeout(1500))
    hangs.rename(repo / "hangs")
    pm.add_fault(repo, "crashes")
    pm.add_add_sub(repo, "threads_with_timeout", extra=THREADS + "\n" + _timeout(1000))
    pm.write_model(repo, "double", pm.DOUBLE_CONFIG, pm.DOUBLE)
    pm.write_model(repo, "bls_double", pm.DOUBLE_CONFIG, pm.BLS_DOUBLE)
    pm.write_model(repo, "bls_crossing", pm.DOUBLE_CONFIG, pm.BLS_CROSSING)
    sequence = pm.add_add_sub(repo, "sequence")
    config = (sequence / "config.pbtxt").read_text().replace("dynamic_batching", "sequence_batching")
    (sequence / "config.pbtxt").write_text(config.replace("max_queue_delay_microseconds: 0", ""))
    with serving(repo, tmp_path_factory.mktemp("server"), *layout, "--exit-on-error", "false") as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.url) as opened:
        yield opened


def _add_sub_inputs(a: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = [
        grpcclient.InferInput("INPUT0", list(a.shape), "FP32"),
        grpcclient.InferInput("INPUT1", list(a.shape), "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    return inputs


def _failure(
    client: grpcclient.InferenceServerClient, model: str, a: np.ndarray, **kwargs: Any
) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, _add_sub_inputs(a), **kwargs)
    return caught.value


def _stats(client: grpcclient.InferenceServerClient, model: str) -> dict[str, Any]:
    stats: dict[str, Any] = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return stats


def _count(stats: dict[str, Any], *path: str) -> int:
    value: Any = stats
    for key in path:
        value = value.get(key, {})
    return int(value or 0)


A = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.mark.parametrize("model", ["add_sub", "add_sub_thread"])
def test_add_sub(client: grpcclient.InferenceServerClient, model: str) -> None:
    result = client.infer(model, _add_sub_inputs(A), request_id="r-1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - 1)
    assert result.as_numpy("OUTPUT0").dtype == np.float32 and result.get_response().id == "r-1"
    only = client.infer(model, _add_sub_inputs(A), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [output.name for output in only.get_response().outputs] == ["OUTPUT1"]


def _echo(client: grpcclient.InferenceServerClient, **kwargs: Any) -> tuple[dict[str, str], dict[str, Any]]:
    tensor = grpcclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
    result = client.infer("echo", [tensor], **kwargs)
    return json.loads(result.as_numpy("ARGS")[0, 0]), json.loads(result.as_numpy("REQUEST")[0, 0])


def test_initialize_gets_args_as_triton_gives_them(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    args, seen = _echo(client, request_id="abc", parameters={"colour": "blue", "n": 3})
    assert sorted(args) == [
        "model_config",
        "model_instance_device_id",
        "model_instance_kind",
        "model_instance_name",
        "model_name",
        "model_repository",
        "model_version",
    ]
    assert (
        args["model_name"],
        args["model_version"],
        args["model_instance_kind"],
        args["model_instance_device_id"],
    ) == ("echo", "1", "CPU", "0")
    assert args["model_instance_name"] == "echo_0"
    assert Path(args["model_repository"]).name == "echo" and Path(args["model_repository"], "1", "model.py").is_file()
    config = json.loads(args["model_config"])
    assert config["name"] == "echo" and config["max_batch_size"] == 8 and config["backend"] == "python"
    assert config["input"][0]["dims"] == [1]  # numbers, as Triton's
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 200000
    # Triton hands its backends the JSON its HTTP config endpoint answers, every field printed
    # (``instance_group``'s ``kind`` and ``gpus`` too): a model reading one found it missing until session 53.
    with httpclient.InferenceServerClient(server.http_url) as http:
        assert config == http.get_model_config("echo")
    assert config["instance_group"][0]["gpus"] == [] and config["input"][0]["optional"] is False
    assert seen["id"] == "abc" and seen["parameters"] == {"colour": "blue", "n": 3}
    assert seen["requested"] == ["ARGS", "REQUEST"] and seen["dtype"] == "float32"


def test_reserved_parameters_are_properties_of_the_request(client: grpcclient.InferenceServerClient) -> None:
    """Review of session 50 (A8): ``timeout`` (and ``priority``, ``sequence_*``) are properties of a
    request, not parameters: Triton 2.51's model sees ``parameters() == {"custom": 1}`` and
    ``timeout() == 4000000`` (run on ``run_triton.sh``); Shoal's saw the timeout among the parameters
    and ``timeout() == 0``."""
    _, seen = _echo(client, parameters={"custom": 1}, timeout=4_000_000, priority=1)
    assert seen["parameters"] == {"custom": 1}
    assert seen["timeout"] == 4_000_000 and seen["flags"] == 0


def test_a_dynamic_batch_arrives_as_a_list_of_requests(server: RunningServer) -> None:
    """Four requests within echo's 200 ms queue delay: one execute gets them as four requests."""
    before = _stats(grpcclient.InferenceServerClient(server.url), "echo")

    def call(index: int) -> dict[str, Any]:
        with grpcclient.InferenceServerClient(server.url) as own:
            return _echo(own, request_id=f"req-{index}")[1]

    with ThreadPoolExecutor(4) as pool:
        seen = list(pool.map(call, range(4)))
    assert [s["id"] for s in seen] == [f"req-{i}" for i in range(4)]
    assert max(s["batch"] for s in seen) > 1
    after = _stats(grpcclient.InferenceServerClient(server.url), "echo")
    executions = _count(after, "execution_count") - _count(before, "execution_count")
    assert _count(after, "inference_count") - _count(before, "inference_count") == 4
    assert executions < 4


def test_auto_complete_config(client: grpcclient.InferenceServerClient) -> None:
    config = client.get_model_config("auto", as_json=True)["config"]
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("IN", "TYPE_FP32", ["2"])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [("OUT", "TYPE_FP32", ["2"])]
    tensor = grpcclient.InferInput("IN", [3, 2], "FP32")
    tensor.set_data_from_numpy(np.full((3, 2), 1.5, np.float32))
    np.testing.assert_array_equal(client.infer("auto", [tensor]).as_numpy("OUT"), np.full((3, 2), 3.0))


@pytest.mark.parametrize("model", ["bls_sync", "bls_async", "bls_thread"])
def test_bls_calls_an_onnx_and_a_python_model(client: grpcclient.InferenceServerClient, model: str) -> None:
    before = {name: _stats(client, name) for name in ("simple", "add_sub")}
    a = grpcclient.InferInput("A", [1, 16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    b = grpcclient.InferInput("B", [1, 4], "FP32")
    b.set_data_from_numpy(np.full((1, 4), 4.0, np.float32))
    result = client.infer(model, [a, b])
    np.testing.assert_array_equal(result.as_numpy("SUM"), np.arange(1, 17, dtype=np.int32).reshape(1, 16))
    np.testing.assert_array_equal(result.as_numpy("DIFF"), np.full((1, 4), 2.0, np.float32))
    # Triton 2.51's words (its Python backend's RequestExecutor; Shoal answered the client's "unknown model")
    assert result.as_numpy("ERROR")[0] == (
        b"Model no_such_model - Error when running inference: Failed for execute the inference request. "
        b"Model 'no_such_model' is not ready."
    )
    for name in ("simple", "add_sub"):  # each went through that model's own scheduler and statistics
        after = _stats(client, name)
        assert (
            _count(after, "inference_stats", "success", "count")
            == _count(before[name], "inference_stats", "success", "count") + 1
        )


@pytest.mark.parametrize("elements", [1_000, 1_500_000])
def test_bls_tensors_small_and_larger_than_the_arenas(client: grpcclient.InferenceServerClient, elements: int) -> None:
    """1,000 floats cross in the instance's arenas; 1.5 million (6 MB, past the 1 MiB arenas, which a
    batch never grows) cross on the pipe. Both ways, sync and async: X * 2, then twice * 2 and summed."""
    x = np.random.default_rng(elements).standard_normal(elements).astype(np.float32)
    tensor = grpcclient.InferInput("X", [elements], "FP32")
    tensor.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("bls_double", [tensor]).as_numpy("Y"), x * 8)


def test_big_bls_calls_and_replies_crossing_on_the_pipe_do_not_wait_on_each_other(
    client: grpcclient.InferenceServerClient,
) -> None:
    """A 6 MB reply written to the worker while the worker writes a 6 MB call: the server keeps reading
    (CI once hung here for good: each side blocked writing, neither reading)."""
    x = np.random.default_rng(7).standard_normal(1_500_000).astype(np.float32)
    tensor = grpcclient.InferInput("X", [x.size], "FP32")
    tensor.set_data_from_numpy(x)
    answer = client.infer("bls_crossing", [tensor], client_timeout=60).as_numpy("Y")
    np.testing.assert_array_equal(answer, x * 2 + (x + 1) * 2)


def test_load_errors_name_the_traceback_s_last_line(client: grpcclient.InferenceServerClient) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["syntax_error"]["state"] == "UNAVAILABLE"
    assert index["syntax_error"]["reason"].startswith("SyntaxError: expected ':' (model.py, line ")
    assert index["import_error"]["state"] == "UNAVAILABLE"
    assert index["import_error"]["reason"].startswith("ModuleNotFoundError: No module named 'no_such_module_xyz'")
    assert "import_error/1/model.py(2): <module>" in index["import_error"]["reason"]
    # Review of session 50: a reason holding a lone surrogate failed the whole index over gRPC (INTERNAL).
    assert index["initialize_undecodable"]["reason"].startswith("RuntimeError: cannot open w-?.bin")
    assert "process_instances: true" in index["threads_with_timeout"]["reason"]
    assert "sequence_batching for Python models" in index["sequence"]["reason"]
    assert not client.is_model_ready("syntax_error")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("raises", "Failed to process the request(s) for model 'raises_0_0', message: RuntimeError: boom\n\nAt:\n"),
        (
            "returns_none",
            "Failed to process the request(s) for model 'returns_none_0_0', message: execute returned None",
        ),
        (
            "wrong_count",
            "Failed to process the request(s) for model 'wrong_count_0_0', message: Number of "
            "InferenceResponse objects do not match the number of InferenceRequest objects. "
            "InferenceRequest(s) size is:1, and InferenceResponse(s) size is:0",
        ),
    ],
)
def test_a_failing_execute_fails_its_requests_and_the_server_keeps_serving(
    client: grpcclient.InferenceServerClient, model: str, message: str
) -> None:
    before = _stats(client, model)
    error = _failure(client, model, A)
    assert error.status() == "StatusCode.INTERNAL"
    assert error.message().startswith(message), error.message()
    if model == "raises":
        assert error.message().endswith("/raises/1/model.py(17): execute\n")
    after = _stats(client, model)
    assert _count(after, "inference_stats", "fail", "count") == _count(before, "inference_stats", "fail", "count") + 1
    assert client.is_model_ready(model)
    np.testing.assert_array_equal(client.infer("add_sub", _add_sub_inputs(A)).as_numpy("OUTPUT0"), A + 1)


def test_an_output_of_another_datatype_than_the_configs_is_answered_with_its_own(
    client: grpcclient.InferenceServerClient,
) -> None:
    """As Triton's Python backend answers it (its ``bls_decoupled`` example relies on it): an INT64 array
    for an output declared FP32 is answered INT64, its numbers as the model computed them. Shoal refused
    it until session 53."""
    result = client.infer("wrong_dtype", _add_sub_inputs(A))
    output = result.get_output("OUTPUT0")
    assert output is not None and output.datatype == "INT64"
    assert result.as_numpy("OUTPUT0").tolist() == (A + 1).astype(np.int64).tolist()


def test_an_error_message_no_encoder_takes_is_answered_over_every_transport(
    client: grpcclient.InferenceServerClient, server: RunningServer
) -> None:
    """Review of session 50: a model's error holding a lone surrogate (a non-UTF-8 file name, as
    ``os.listdir`` gives it) was never answered over gRPC (the engine could not encode the status,
    the call held its HTTP/2 stream, and a client's requests to good models queued behind 100 of
    them); over HTTP the JSON carried ``\\udcff``, which clients cannot parse. It is answered,
    INTERNAL, with the character replaced."""
    error = _failure(client, "raises_undecodable", A, client_timeout=30)
    assert error.status() == "StatusCode.INTERNAL"
    assert "RuntimeError: cannot read photo-?.jpg" in error.message(), error.message()
    with httpclient.InferenceServerClient(server.http_url, network_timeout=30) as http:
        inputs = [httpclient.InferInput(name, list(A.shape), "FP32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(A)
        with pytest.raises(InferenceServerException) as caught:
            http.infer("raises_undecodable", inputs)
        assert "cannot read photo-?.jpg" in str(caught.value.message())
    np.testing.assert_array_equal(client.infer("add_sub", _add_sub_inputs(A)).as_numpy("OUTPUT0"), A + 1)


def test_a_crashed_instance_process_fails_only_its_request_and_is_restarted(
    client: grpcclient.InferenceServerClient,
) -> None:
    error = _failure(client, "crashes", np.full((1, 4), 13, np.float32))
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert "the instance process running this request died (exit code 3); it has been restarted" in error.message()
    np.testing.assert_array_equal(client.infer("crashes", _add_sub_inputs(A)).as_numpy("OUTPUT0"), A + 1)


def test_an_instance_process_killed_mid_request(client: grpcclient.InferenceServerClient, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    errors: list[InferenceServerException] = []

    def hang() -> None:
        hanging = np.full((1, 4), 7, np.float32)
        errors.append(_failure(client, "crashes", hanging, parameters={"pid_file": str(pid_file)}))

    caller = threading.Thread(target=hang)
    caller.start()
    assert wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", what="the hanging execute")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    caller.join(timeout=60)
    assert errors and errors[0].status() == "StatusCode.UNAVAILABLE"
    assert "died (exit code -9); it has been restarted" in errors[0].message()
    np.testing.assert_array_equal(client.infer("crashes", _add_sub_inputs(A)).as_numpy("OUTPUT0"), A + 1)


def test_a_hanging_execute_is_bounded_by_the_execution_timeout(client: grpcclient.InferenceServerClient) -> None:
    error = _failure(client, "hangs", np.full((1, 4), 7, np.float32))
    assert error.status() == "StatusCode.UNAVAILABLE"
    assert "did not answer within 1500 ms (execution_timeout_ms); it was killed and restarted" in error.message()
    np.testing.assert_array_equal(client.infer("hangs", _add_sub_inputs(A)).as_numpy("OUTPUT0"), A + 1)


def test_the_example_preprocess_model(client: grpcclient.InferenceServerClient) -> None:
    """model_repository/preprocess: 16x16 uint8 images in, the mlp's standardized 256 floats out."""
    images = np.random.default_rng(3).integers(0, 256, size=(3, 16, 16), dtype=np.uint8)
    tensor = grpcclient.InferInput("IMAGE", [3, 16, 16], "UINT8")
    tensor.set_data_from_numpy(images)
    rows = client.infer("preprocess", [tensor]).as_numpy("INPUT0")
    assert rows.shape == (3, 256) and rows.dtype == np.float32
    expected = images.reshape(3, 256).astype(np.float32) / 255
    expected = (expected - expected.mean(axis=1, keepdims=True)) / expected.std(axis=1, keepdims=True)
    np.testing.assert_allclose(rows, expected, rtol=1e-5, atol=1e-5)


def test_an_ensemble_of_the_python_preprocess_model_and_the_onnx_mlp(client: grpcclient.InferenceServerClient) -> None:
    """The same answer as the client's two calls, and each step counted by its own model."""
    images = np.random.default_rng(5).integers(0, 256, size=(2, 16, 16), dtype=np.uint8)
    tensor = grpcclient.InferInput("IMAGE", [2, 16, 16], "UINT8")
    tensor.set_data_from_numpy(images)
    before = _count(_stats(client, "preprocess"), "inference_stats", "success", "count")
    through_ensemble = client.infer("image_pipeline", [tensor]).as_numpy("OUTPUT0")
    features = grpcclient.InferInput("INPUT0", [2, 256], "FP32")
    features.set_data_from_numpy(client.infer("preprocess", [tensor]).as_numpy("INPUT0"))
    np.testing.assert_allclose(through_ensemble, client.infer("mlp", [features]).as_numpy("OUTPUT0"), rtol=1e-6)
    assert _count(_stats(client, "preprocess"), "inference_stats", "success", "count") == before + 2

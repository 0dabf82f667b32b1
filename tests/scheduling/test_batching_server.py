"""Dynamic batching, priorities, queue policy and statistics through a real server and tritonclient."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningServer
from tests.polling import metric, wait_until

SLOW_MS = 400


def slow_identity(repo: Path, name: str, extra: str, max_batch_size: int = 8, count: int = 1) -> None:
    models.add_delayed_identity(repo, name, SLOW_MS, max_batch_size, count, extra)


def gather_model(repo: Path) -> None:
    """OUT = table[IN]: an index out of range makes ONNX Runtime raise at execution."""
    table = numpy_helper.from_array(np.arange(10, dtype=np.int64) * 10, "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "IN"], ["OUT"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("IN", TensorProto.INT64, [None, 1])],
        [helper.make_tensor_value_info("OUT", TensorProto.INT64, [None, 1])],
        initializer=[table],
    )
    models.save_onnx(graph, repo / "gather" / "1" / "model.onnx")
    models.write_config(
        repo / "gather",
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_INT64 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        dynamic_batching { max_queue_delay_microseconds: 100000 }
        """,
    )


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]):
    from tests.conftest import serving

    repo = tmp_path_factory.mktemp("repo")
    slow_identity(repo, "batched", "dynamic_batching { }")
    slow_identity(repo, "prioritized", "dynamic_batching { priority_levels: 2 default_priority_level: 2 }", 1)
    slow_identity(repo, "bounded", "dynamic_batching { default_queue_policy { max_queue_size: 1 } }", 1)
    models.add_identity(repo, "fast", "INT64", max_batch_size=8, dims="[ 2 ]")
    (repo / "fast" / "config.pbtxt").write_text(
        (repo / "fast" / "config.pbtxt").read_text()
        + "\ndynamic_batching { }\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n"
    )
    gather_model(repo)
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as server:
        yield server


def infer(url: str, model: str, value: int, rows: int = 1, **kwargs) -> np.ndarray:
    data = np.full((rows, 2), value, dtype=np.int64)
    with triton.InferenceServerClient(url) as client:
        tensor = triton.InferInput("IN", [rows, 2], "INT64")
        tensor.set_data_from_numpy(data)
        return client.infer(model, [tensor], **kwargs).as_numpy("OUT")


def statistics(url: str, model: str) -> dict:
    with triton.InferenceServerClient(url) as client:
        return client.get_inference_statistics(model, as_json=True)["model_stats"][0]


def wait_executing(server: RunningServer, model: str, count: int = 1) -> None:
    wait_until(
        lambda: metric(server, "shoal_model_executing_requests", model) == count,
        what=f"{count} executing request(s) of '{model}'",
    )


def wait_queued(server: RunningServer, model: str, count: int) -> None:
    wait_until(
        lambda: metric(server, "nv_inference_pending_request_count", model) == count,
        what=f"{count} queued request(s) of '{model}'",
    )


def test_responses_never_mix_rows_under_concurrency(batching_server: RunningServer) -> None:
    with ThreadPoolExecutor(16) as pool:
        futures = {value: pool.submit(infer, batching_server.url, "fast", value, 1 + value % 3) for value in range(64)}
        for value, future in futures.items():
            out = future.result(timeout=60)
            assert out.shape == (1 + value % 3, 2) and (out == value).all()
    stats = statistics(batching_server.url, "fast")
    assert int(stats["inference_stats"]["success"]["count"]) == 64
    assert int(stats["inference_count"]) == sum(1 + v % 3 for v in range(64))


def test_held_back_requests_execute_as_batches_of_2_and_6(batching_server: RunningServer) -> None:
    url = batching_server.url
    with ThreadPoolExecutor(8) as pool:
        for held in (2, 6):
            blocker = pool.submit(infer, url, "batched", 100)
            wait_executing(batching_server, "batched")  # the next ones queue behind the blocker
            queued = [pool.submit(infer, url, "batched", value) for value in range(held)]
            wait_queued(batching_server, "batched", held)
            assert (blocker.result(timeout=60) == 100).all()
            for value, future in enumerate(queued):
                assert (future.result(timeout=60) == value).all()
    stats = statistics(url, "batched")
    executions = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert executions == {1: 2, 2: 1, 6: 1}
    assert int(stats["execution_count"]) == 4 and int(stats["inference_count"]) == 10
    inference = stats["inference_stats"]
    assert int(inference["queue"]["count"]) == 10 and int(inference["compute_infer"]["count"]) == 10
    assert int(inference["compute_infer"]["ns"]) >= 10 * SLOW_MS * 1_000_000 * 0.9
    assert int(stats["last_inference"]) > 0 and stats["version"] == "1"


def test_high_priority_request_overtakes_queued_low_ones(batching_server: RunningServer) -> None:
    url = batching_server.url
    finished: list[int] = []
    lock = threading.Lock()

    def call(value: int, priority: int = 0) -> None:
        infer(url, "prioritized", value, priority=priority)
        with lock:
            finished.append(value)

    with ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(call, 0)
        wait_executing(batching_server, "prioritized")
        low = [pool.submit(call, 1)]
        wait_queued(batching_server, "prioritized", 1)
        low.append(pool.submit(call, 2))
        wait_queued(batching_server, "prioritized", 2)
        high = pool.submit(call, 9, priority=1)  # tritonclient sends it as uint64_param
        for future in (blocker, *low, high):
            future.result(timeout=60)
    assert finished == [0, 9, 1, 2]


def test_full_queue_is_rejected_at_once_while_the_server_keeps_serving(batching_server: RunningServer) -> None:
    url = batching_server.url
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(infer, url, "bounded", 1)
        wait_executing(batching_server, "bounded")
        queued = pool.submit(infer, url, "bounded", 2)
        wait_queued(batching_server, "bounded", 1)
        start = time.monotonic()
        with pytest.raises(InferenceServerException) as caught:
            infer(url, "bounded", 3)
        assert time.monotonic() - start < SLOW_MS / 1000
        assert caught.value.status() == "StatusCode.UNAVAILABLE"
        assert "Exceeds maximum queue size" in caught.value.message()
        assert (infer(url, "fast", 4) == 4).all()
        running.result(timeout=60)
        queued.result(timeout=60)


def test_a_batch_that_raises_fails_only_its_requests(batching_server: RunningServer) -> None:
    url = batching_server.url

    def gather(index: int) -> np.ndarray:
        with triton.InferenceServerClient(url) as client:
            tensor = triton.InferInput("IN", [1, 1], "INT64")
            tensor.set_data_from_numpy(np.array([[index]], dtype=np.int64))
            return client.infer("gather", [tensor]).as_numpy("OUT")

    with ThreadPoolExecutor(2) as pool:
        bad, good = pool.submit(gather, 99), pool.submit(gather, 3)  # batched together within the delay
        for future in (bad, good):
            with pytest.raises(InferenceServerException) as caught:
                future.result(timeout=60)
            assert caught.value.status() == "StatusCode.INTERNAL"
            assert "model 'gather' version 1 failed" in caught.value.message()
    assert gather(4)[0, 0] == 40
    stats = statistics(url, "gather")["inference_stats"]
    assert int(stats["fail"]["count"]) == 2 and int(stats["success"]["count"]) == 1

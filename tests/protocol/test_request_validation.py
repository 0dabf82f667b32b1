"""Requests checked before they are queued: impossible shapes, bad BYTES, and how rejections are counted."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper

from shoal.clients import ClientError, InferenceClient
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import models
from tests.conftest import RunningServer, open_channel
from tests.polling import metric, wait_until

# Shapes no array can have. Each holds no element or matches no content, so only the shape is wrong.
IMPOSSIBLE_SHAPES = {
    "zero rows, huge dim": ([0, 2**62], "larger than any array can be"),
    "huge dims around a zero": ([1, 2**40, 0, 2**40], "larger than any array can be"),
    "dims whose product overflows int64": ([1, 2**32, 2**32, 0, 2**32], "larger than any array can be"),
    "65 dims": ([1] * 65, "shape has 65 dimensions, at most 64 are supported"),
}


@pytest.fixture(scope="module")
def stub(example_server: RunningServer) -> Iterator[InferenceStub]:
    with open_channel(example_server.url) as channel:
        yield InferenceStub(channel)


def _request(model: str, shape: list[int], typed: bool) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="IN", datatype="INT32", shape=shape)
    if typed:
        tensor.contents.int_contents.extend([])
    else:
        request.raw_input_contents.append(b"")
    return request


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "contents"])
@pytest.mark.parametrize("case", list(IMPOSSIBLE_SHAPES))
def test_impossible_shapes_are_invalid_argument(
    stub: InferenceStub, example_server: RunningServer, case: str, typed: bool
) -> None:
    shape, phrase = IMPOSSIBLE_SHAPES[case]
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_request("identity_int32", shape, typed))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "input 'IN'" in caught.value.details() and phrase in caught.value.details()
    assert "Traceback" not in example_server.log()


def test_sixty_four_dims_are_still_accepted(stub: InferenceStub) -> None:
    request = pb.ModelInferRequest(model_name="identity_int32")
    request.inputs.add(name="IN", datatype="INT32", shape=[1, 1]).contents.int_contents.append(7)
    assert stub.ModelInfer(request).outputs[0].shape == [1, 1]
    with pytest.raises(grpc.RpcError) as caught:  # 64 dims decode; the model's [-1, -1] shape refuses them
        stub.ModelInfer(_request("identity_int32", [1] * 63 + [0], typed=False))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unexpected shape for input 'IN'" in caught.value.details()


def test_rejected_requests_count_as_failures_of_their_model(example_server: RunningServer) -> None:
    good = np.ones((1, 3), np.float32)
    with InferenceClient(example_server.url, timeout_s=30) as client:
        client.infer("identity_fp32", {"IN": good})
        for bad in ({"IN": good.astype(np.float64)}, {"IN": good, "EXTRA": good}, {"IN": np.ones((9, 3), np.float32)}):
            with pytest.raises(ClientError) as caught:
                client.infer("identity_fp32", bad)
            assert caught.value.status == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ClientError):  # no model to count it against
            client.infer("no_such_model", {"IN": good})
        stats = client.statistics("identity_fp32")[0]["inference_stats"]
    assert int(stats["success"]["count"]) == 1
    assert int(stats["fail"]["count"]) == 3 and int(stats["fail"]["ns"]) > 0
    assert metric(example_server, "nv_inference_request_failure", "identity_fp32") == 3


def _batched_strings(repo: Path) -> None:
    """ONNX Identity over strings, batched: three rows go at once as a preferred batch."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["IN"], ["OUT"])],
        "strings",
        [helper.make_tensor_value_info("IN", TensorProto.STRING, [None, None])],
        [helper.make_tensor_value_info("OUT", TensorProto.STRING, [None, None])],
    )
    models.save_onnx(graph, repo / "strings" / "1" / "model.onnx")
    models.write_config(
        repo / "strings",
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ { name: "IN" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 30000000 }
        """,
    )


def test_bad_bytes_never_fail_their_batch_mates(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    _batched_strings(repo)
    server = server_factory(repo)

    def call(value: bytes) -> object:
        with InferenceClient(server.url, timeout_s=60) as client:
            data = np.empty((1, 1), dtype=object)
            data[0, 0] = value
            try:
                return client.infer("strings", {"IN": data})["OUT"][0, 0]
            except ClientError as error:
                return error

    def pending_or_failed() -> float:
        return metric(server, "nv_inference_pending_request_count", "strings") + metric(
            server, "nv_inference_request_failure", "strings"
        )

    with ThreadPoolExecutor(4) as pool:
        bad = pool.submit(call, b"\xff\xfe not UTF-8")
        wait_until(lambda: pending_or_failed() == 1, what="the bad request to be queued or refused")
        good = [pool.submit(call, f"row {index}".encode()) for index in range(3)]
        results = [future.result(timeout=60) for future in good]
        refused = bad.result(timeout=60)
    assert results == [b"row 0", b"row 1", b"row 2"]
    assert isinstance(refused, ClientError) and refused.status == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'IN' for model 'strings': BYTES element 0 is not valid UTF-8" in refused.message
    with InferenceClient(server.url, timeout_s=30) as client:
        stats = client.statistics("strings")[0]
    assert {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]} == {3: 1}
    assert int(stats["inference_stats"]["success"]["count"]) == 3
    assert int(stats["inference_stats"]["fail"]["count"]) == 1

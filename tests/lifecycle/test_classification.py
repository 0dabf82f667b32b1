"""The classification extension, through tritonclient against a real server.

What Triton does, and so what these tests hold Shoal to:
- docs/protocol/extension_classification.md (triton-inference-server/server): a requested output
  with the ``classification`` parameter (int64_param, tritonclient's
  ``InferRequestedOutput(name, class_count=k)``) comes back as BYTES, shape ``[batch, k]`` (``[k]``
  without batching), each element ``"<value>:<index>[:<label>]"``, highest values first;
  ServerMetadata lists ``classification``.
- src/grpc/infer_handler.h ``InferResponseCompleteCommon``: each batch row (the whole tensor
  without batching) is ranked on its own, over all its elements; the last dim is ``min(k, n)``.
- src/classification.cc ``AddClassResults``: values print with ``std::to_string`` (``%f`` for
  FP32/FP64, decimal for integers); other types are refused: "class result not available for
  output due to unsupported type '...'". Its ``std::sort`` leaves ties unordered; Shoal orders
  equal values by index, lowest first.
- src/grpc/grpc_utils.cc ``ParseClassificationParams``: a count that is not an int64_param, or
  is not above 0, is INVALID_ARGUMENT.
- core src/label_provider.cc and src/model.cc: ``label_filename`` is a file in the model folder,
  read one label per line at load (a missing file fails the load; newer Triton also refuses a
  path outside the model folder); an empty line or an index past the last line has no label.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from shoal.lifecycle import classification
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from shoal.protocol.types import DataType
from tests import models
from tests.conftest import RunningServer, open_channel, serving

NUMERIC = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16")
FLOATS = {"FP16", "FP32", "FP64", "BF16"}
LABELS = b"cat\n\ndog\nbird\n"  # class 1 has an empty line, classes from 4 on have none
LABEL_LIST = LABELS.split(b"\n")[:-1]
SECRET = b"not for clients\n"


def _identity(repo: Path, name: str, datatype: str, max_batch_size: int, dims: str, label_filename: str = "") -> None:
    label = f'label_filename: "{label_filename}"' if label_filename else ""
    models.write_config(
        repo / name,
        f"""
        backend: "identity"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: {models.config_type(datatype)} dims: {dims} }} ]
        output [ {{ name: "OUT" data_type: {models.config_type(datatype)} dims: {dims} {label} }} ]
        """,
    )
    (repo / name / "1").mkdir()


def _doubled(repo: Path) -> None:
    """ONNX ``OUT = IN * 2`` (exact in FP32), batched through the dynamic batcher, with labels."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["IN", "TWO"], ["OUT"])],
        "doubled",
        [helper.make_tensor_value_info("IN", TensorProto.FLOAT, [None, 6])],
        [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, [None, 6])],
        initializer=[helper.make_tensor("TWO", TensorProto.FLOAT, [], [2.0])],
    )
    models.save_onnx(graph, repo / "doubled" / "1" / "model.onnx")
    models.write_config(
        repo / "doubled",
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 6 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 6 ] label_filename: "labels.txt" } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        dynamic_batching { max_queue_delay_microseconds: 20000 }
        """,
    )
    (repo / "doubled" / "labels.txt").write_bytes(LABELS)


# Models whose label file is missing or lies outside their folder: name → phrase of the reason.
REFUSED = {
    "labels_missing": "label file 'nope.txt' for output 'OUT' is missing",
    "labels_in_other_model": "label file '../labelled/labels/classes.txt' for output 'OUT' is outside the model folder",
    "labels_outside_repo": "label file '../../secret.txt' for output 'OUT' is outside the model folder",
    "labels_absolute": "for output 'OUT' is outside the model folder",
    "labels_symlink_out": "label file 'labels.txt' for output 'OUT' is outside the model folder",
}


def _refused_models(repo: Path, outside: Path) -> None:
    _identity(repo, "labels_missing", "FP32", 8, "[ -1 ]", "nope.txt")
    _identity(repo, "labels_in_other_model", "FP32", 8, "[ -1 ]", "../labelled/labels/classes.txt")
    _identity(repo, "labels_outside_repo", "FP32", 8, "[ -1 ]", f"../../{outside.name}")
    _identity(repo, "labels_absolute", "FP32", 8, "[ -1 ]", str(outside))
    _identity(repo, "labels_symlink_out", "FP32", 8, "[ -1 ]", "labels.txt")
    (repo / "labels_symlink_out" / "labels.txt").symlink_to(outside)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("classification")
    outside = base / "secret.txt"  # beside the repository, never to be read
    outside.write_bytes(SECRET)
    repo = base / "repo"
    repo.mkdir()
    for datatype in NUMERIC:
        _identity(repo, f"numeric_{datatype.lower()}", datatype, 8, "[ -1 ]")
    for datatype in ("BOOL", "BYTES"):
        _identity(repo, f"other_{datatype.lower()}", datatype, 8, "[ -1 ]")
    _identity(repo, "labelled", "FP32", 8, "[ -1 ]", "labels/classes.txt")
    (repo / "labelled" / "labels").mkdir()
    (repo / "labelled" / "labels" / "classes.txt").write_bytes(LABELS)
    _identity(repo, "plain", "FP32", 0, "[ -1 ]", "labels.txt")
    (repo / "plain" / "labels.txt").write_bytes(LABELS)
    _identity(repo, "int16_grid", "INT16", 8, "[ 2, 3 ]")
    _identity(repo, "int32_labelled", "INT32", 8, "[ 5 ]", "labels.txt")
    (repo / "int32_labelled" / "labels.txt").write_bytes(LABELS)
    _doubled(repo)
    _refused_models(repo, outside)
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    with serving(repo, tmp_path_factory.mktemp("server"), *layout, "--exit-on-error", "false") as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.url) as connected:
        yield connected


def expected(data: np.ndarray, count: int, batched: bool, labels: list[bytes] | tuple[bytes, ...] = ()) -> list:
    """Top ``count`` per row, computed here: Python's sort of the row's values (exact for every
    type), highest first, equal values by lowest index; formatted as std::to_string prints."""
    rows = data.reshape(data.shape[0], -1) if batched else data.reshape(1, -1)
    is_float = rows.dtype.kind == "f" or rows.dtype == ml_dtypes.bfloat16
    result = []
    for row in rows:
        values = row.astype(np.float64).tolist() if is_float else row.tolist()
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))[:count]
        entries = []
        for index in order:
            text = f"{values[index]:f}" if is_float else str(values[index])
            entry = f"{text}:{index}".encode()
            if index < len(labels) and labels[index]:
                entry += b":" + labels[index]
            entries.append(entry)
        result.append(entries)
    return result if batched else result[0]


def infer(
    client: triton.InferenceServerClient, model: str, data: np.ndarray, datatype: str, count: int
) -> triton.InferResult:
    tensor = triton.InferInput("IN", list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor], outputs=[triton.InferRequestedOutput("OUT", class_count=count)])


def sample(datatype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values with ties in every row (few distinct values), across the type's range."""
    rng = np.random.default_rng(seed)
    if datatype in FLOATS:
        dtype = ml_dtypes.bfloat16 if datatype == "BF16" else np.dtype(datatype.lower().replace("fp", "float"))
        return (rng.integers(-4, 5, size=shape) * 0.375).astype(dtype)
    info = np.iinfo(np.dtype(datatype.lower()))
    choices = np.array([info.min, info.min + 1, 0, 1, info.max - 1, info.max], dtype=info.dtype)
    return rng.choice(choices, size=shape)


@pytest.mark.parametrize("datatype", NUMERIC)
def test_every_numeric_datatype_batched(client: triton.InferenceServerClient, datatype: str) -> None:
    """Per batch row, the top k as "value:index", ties by index; shape [batch, k]."""
    data = sample(datatype, (3, 7), seed=len(datatype))
    result = infer(client, f"numeric_{datatype.lower()}", data, datatype, 4)
    output = result.get_output("OUT")
    assert output.datatype == "BYTES" and list(output.shape) == [3, 4]
    assert result.as_numpy("OUT").tolist() == expected(data, 4, batched=True)


def test_fp32_without_batching_with_labels(client: triton.InferenceServerClient) -> None:
    """max_batch_size 0: the whole tensor is one row; shape [k]; the docs' example values."""
    data = np.array([1.1, 3.3, 0.5, 2.4, 2.4, -1.0], dtype=np.float32)
    result = infer(client, "plain", data, "FP32", 3)
    assert list(result.get_output("OUT").shape) == [3]
    got = result.as_numpy("OUT").tolist()
    assert got == expected(data, 3, batched=False, labels=LABEL_LIST)
    assert got == [b"3.300000:1", b"2.400000:3:bird", b"2.400000:4"]  # spelled out once, from the docs


def test_fp32_batched_with_labels_from_a_subfolder(client: triton.InferenceServerClient) -> None:
    data = sample("FP32", (4, 6), seed=7)
    result = infer(client, "labelled", data, "FP32", 5)
    assert list(result.get_output("OUT").shape) == [4, 5]
    assert result.as_numpy("OUT").tolist() == expected(data, 5, batched=True, labels=LABEL_LIST)


def test_int32_output_with_labels(client: triton.InferenceServerClient) -> None:
    data = np.array([[3, -7, 3, 12, 0], [-1, -1, -1, -1, -1]], dtype=np.int32)
    result = infer(client, "int32_labelled", data, "INT32", 2)
    assert result.as_numpy("OUT").tolist() == expected(data, 2, batched=True, labels=LABEL_LIST)


def test_k_larger_than_the_class_count_is_capped(client: triton.InferenceServerClient) -> None:
    data = sample("INT32", (2, 5), seed=3)
    result = infer(client, "int32_labelled", data, "INT32", 50)
    assert list(result.get_output("OUT").shape) == [2, 5]
    assert result.as_numpy("OUT").tolist() == expected(data, 50, batched=True, labels=LABEL_LIST)


@pytest.mark.parametrize("width", [1, 3, 9])
def test_variable_size_output(client: triton.InferenceServerClient, width: int) -> None:
    """dims [-1]: each request ranks as many classes as it has; k is capped at that."""
    data = sample("FP64", (2, width), seed=width)
    result = infer(client, "numeric_fp64", data, "FP64", 4)
    assert list(result.get_output("OUT").shape) == [2, min(4, width)]
    assert result.as_numpy("OUT").tolist() == expected(data, 4, batched=True)


def test_multi_dim_rows_flatten(client: triton.InferenceServerClient) -> None:
    """A row of several dims ([2, 3]) is ranked over all its elements, indexed row-major (Triton
    strides through the row's bytes)."""
    data = sample("INT16", (2, 2, 3), seed=11)
    result = infer(client, "int16_grid", data, "INT16", 6)
    assert list(result.get_output("OUT").shape) == [2, 6]
    assert result.as_numpy("OUT").tolist() == expected(data, 6, batched=True)


def test_classification_beside_a_plain_output_and_through_the_batcher(
    client: triton.InferenceServerClient,
) -> None:
    """An ONNX model behind the dynamic batcher: concurrent requests each get their own rows."""
    inputs = [sample("FP32", (rows, 6), seed=rows) for rows in (1, 2, 3)]
    answers: list[queue.Queue[tuple[triton.InferResult | None, InferenceServerException | None]]] = []
    for data in inputs:
        tensor = triton.InferInput("IN", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        answer: queue.Queue[tuple[triton.InferResult | None, InferenceServerException | None]] = queue.Queue()
        client.async_infer(
            "doubled",
            [tensor],
            callback=lambda result, error, into=answer: into.put((result, error)),
            outputs=[triton.InferRequestedOutput("OUT", class_count=2)],
        )
        answers.append(answer)
    for data, answer in zip(inputs, answers, strict=True):
        result, error = answer.get(timeout=30)  # the callbacks run on tritonclient's threads
        assert error is None and result is not None, error
        assert result.as_numpy("OUT").tolist() == expected(data * 2, 2, batched=True, labels=LABEL_LIST)
    plain = triton.InferInput("IN", [1, 6], "FP32")
    plain.set_data_from_numpy(inputs[0])
    whole = client.infer("doubled", [plain])  # no classification: the tensor as the model made it
    np.testing.assert_array_equal(whole.as_numpy("OUT"), inputs[0] * 2)


def test_nan_ranks_last(client: triton.InferenceServerClient) -> None:
    """Triton's std::sort leaves NaN's place unspecified; Shoal ranks it below every number, -inf too."""
    data = np.array([[np.nan, 1.5, -np.inf, 2.0, np.nan, 1.5]], dtype=np.float32)
    result = infer(client, "numeric_fp32", data, "FP32", 6)
    numbers = [i for i, v in enumerate(data[0].tolist()) if not np.isnan(v)]
    order = sorted(numbers, key=lambda i: (-data[0, i], i)) + [i for i in range(data.shape[1]) if i not in numbers]
    want = [f"{data[0, i]:f}:{i}".encode() for i in order]
    assert result.as_numpy("OUT").tolist() == [want]


def test_stream_infer(client: triton.InferenceServerClient) -> None:
    """ModelStreamInfer takes the same parameter."""
    data = sample("UINT8", (2, 4), seed=5)
    tensor = triton.InferInput("IN", list(data.shape), "UINT8")
    tensor.set_data_from_numpy(data)
    answer: queue.Queue[tuple[triton.InferResult | None, InferenceServerException | None]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answer.put((result, error)))
    try:
        outputs = [triton.InferRequestedOutput("OUT", class_count=3)]
        client.async_stream_infer("numeric_uint8", [tensor], outputs=outputs)
        result, error = answer.get(timeout=30)
    finally:
        client.stop_stream()
    assert error is None and result is not None, error
    assert result.as_numpy("OUT").tolist() == expected(data, 3, batched=True)


@pytest.mark.parametrize("datatype", ["BOOL", "BYTES"])
def test_non_numeric_output_is_refused(client: triton.InferenceServerClient, datatype: str) -> None:
    data = np.array([[True, False]]) if datatype == "BOOL" else np.array([[b"a", b"b"]], dtype=object)
    with pytest.raises(InferenceServerException) as caught:
        infer(client, f"other_{datatype.lower()}", data, datatype, 1)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert (
        f"class result not available for output 'OUT' of model 'other_{datatype.lower()}' due to "
        f"unsupported type '{datatype}'" in caught.value.message()
    )


def test_negative_count_is_refused(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "numeric_fp32", np.ones((1, 3), np.float32), "FP32", -2)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid value for 'classification' parameter, expected > 0, got -2" in caught.value.message()


@pytest.fixture
def stub(server: RunningServer) -> Iterator[InferenceStub]:
    with open_channel(server.url) as channel:
        yield InferenceStub(channel)


def _raw_request(parameter: pb.InferParameter) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="numeric_fp32")
    request.inputs.add(name="IN", datatype="FP32", shape=[1, 3])
    request.raw_input_contents.append(np.ones((1, 3), np.float32).tobytes())
    request.outputs.add(name="OUT").parameters["classification"].CopyFrom(parameter)
    return request


@pytest.mark.parametrize(
    ("parameter", "phrase"),
    [
        (pb.InferParameter(int64_param=0), "invalid value for 'classification' parameter, expected > 0, got 0"),
        (
            pb.InferParameter(string_param="3"),
            "invalid value type for 'classification' parameter, expected int64_param",
        ),
        (pb.InferParameter(bool_param=True), "invalid value type for 'classification' parameter, expected int64_param"),
    ],
    ids=["zero", "string", "bool"],
)
def test_malformed_count_is_refused(stub: InferenceStub, parameter: pb.InferParameter, phrase: str) -> None:
    """tritonclient never sends class_count=0 (it means "no classification"); a raw request can."""
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(_raw_request(parameter))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in caught.value.details()


def test_huge_count_is_capped(stub: InferenceStub) -> None:
    response = stub.ModelInfer(_raw_request(pb.InferParameter(int64_param=2**63 - 1)))
    assert response.outputs[0].datatype == "BYTES" and list(response.outputs[0].shape) == [1, 3]


def test_a_nan_keeps_its_sign_as_glibc_prints_it() -> None:
    """std::to_string of a negative NaN is "-nan"; Python's %f drops the sign."""
    data = np.array([[-np.nan, 1.0, np.nan]], dtype=np.float32)
    assert np.signbit(data[0, 0])
    result = classification.top_k(data, DataType.FP32, 3, batched=True)
    assert result.tolist() == [[b"1.000000:1", b"-nan:0", b"nan:2"]]


@pytest.mark.parametrize("datatype", ["FP32", "UINT64"])
def test_wide_outputs_are_formatted_in_chunks_alike(datatype: str) -> None:
    """More classes than one formatting chunk holds, labels on some: as the one-by-one reference."""
    data = sample(datatype, (2, 40_000), seed=7)
    labels = tuple(f"class {i}".encode() if i % 3 else b"" for i in range(30_000))
    result = classification.top_k(data, DataType(datatype), 40_000, batched=True, labels=labels)
    assert result.tolist() == expected(data, 40_000, batched=True, labels=labels)


# Sends a [2, 1M] FP32 request for all its classes and checks the answer; run in its own process, so
# the client's work on the large messages never delays the test's polling.
WIDE_CLIENT = """
import sys
import numpy as np
from tests.conftest import open_channel
from shoal.protocol import InferenceStub, service_pb2 as pb
data = np.random.default_rng(0).standard_normal((2, 1_000_000)).astype(np.float32)
request = pb.ModelInferRequest(model_name="numeric_fp32")
request.inputs.add(name="IN", datatype="FP32", shape=list(data.shape))
request.raw_input_contents.append(data.tobytes())
request.outputs.add(name="OUT").parameters["classification"].int64_param = data.shape[1]
with open_channel(sys.argv[1]) as channel:
    stub = InferenceStub(channel)
    stub.ServerLive(pb.ServerLiveRequest())
    print("sending", flush=True)
    response = stub.ModelInfer(request, timeout=120)
assert list(response.outputs[0].shape) == [2, 1_000_000], response.outputs[0].shape
top = f"{float(data[0].max()):f}:{int(data[0].argmax())}".encode()
assert response.raw_output_contents[0][4:].startswith(top), response.raw_output_contents[0][:40]
"""


def test_health_is_answered_while_a_wide_output_is_classified(server: RunningServer, stub: InferenceStub) -> None:
    """All 2M classes of a [2, 1M] output: ranked and formatted on the event loop, they held it for
    seconds. ServerLive, polled while another process's request runs, now waits far less than the
    request takes."""
    with subprocess.Popen(
        [sys.executable, "-c", WIDE_CLIENT, server.url], cwd=models.REPO_ROOT, stdout=subprocess.PIPE, text=True
    ) as client:
        try:
            assert client.stdout is not None and client.stdout.readline() == "sending\n"
            start = time.perf_counter()
            waits = []
            while client.poll() is None:
                asked = time.perf_counter()
                assert stub.ServerLive(pb.ServerLiveRequest(), timeout=60).live
                waits.append(time.perf_counter() - asked)
            took = time.perf_counter() - start
        finally:
            client.kill()
    assert client.returncode == 0
    assert len(waits) >= 3 and max(waits) < took / 3, f"ServerLive waited {max(waits):.2f} s of {took:.2f} s"


def test_server_metadata_lists_classification(client: triton.InferenceServerClient) -> None:
    assert "classification" in client.get_server_metadata().extensions


def test_model_config_keeps_label_filename(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config("labelled", as_json=True)["config"]
    assert config["output"][0]["label_filename"] == "labels/classes.txt"


def test_label_file_missing_or_outside_the_model_folder_refuses_the_load(
    client: triton.InferenceServerClient, repo: Path
) -> None:
    """Refused at load (UNAVAILABLE with a reason naming only what the config said); the file
    outside is never read, whether reached by '..', an absolute path or a symlink."""
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    for name, phrase in REFUSED.items():
        assert index[name]["state"] == "UNAVAILABLE", name
        reason = index[name]["reason"]
        assert phrase in reason and f"model '{name}'" in reason, (name, reason)
        assert SECRET.decode().strip() not in reason
        if name != "labels_absolute":  # that config itself names the absolute path
            assert str(repo.parent) not in reason, reason
        assert not client.is_model_ready(name)
    assert index["labelled"]["state"] == "READY"

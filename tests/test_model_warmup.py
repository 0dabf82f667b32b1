"""Triton's model_warmup (issue 27 item 2), against a real server.

The model is a Gather on a 4-element table: an index outside it makes ONNX Runtime fail, so a
sample whose data holds one proves the sample ran, on the data the config named. A sample that
fails, or that a client could not send, fails the load with the reason (the model UNAVAILABLE,
the others READY); good samples (zero, random and file data) leave it READY and answering.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper

from shoal.lifecycle import warmup
from shoal.protocol.types import DataType
from shoal.tools import local_server

TABLE = [10.0, 20.0, 30.0, 40.0]
CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 4
input [ {{ name: "INDEX" data_type: TYPE_INT64 dims: [ 2 ] }} ]
output [ {{ name: "VALUE" data_type: TYPE_FP32 dims: [ 2 ] }} ]
{warmup}
"""


def write_gather(folder: Path, name: str, warmup: str, files: dict[str, bytes] | None = None) -> None:
    table = helper.make_tensor("table", TensorProto.FLOAT, [4], TABLE)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "INDEX"], ["VALUE"], axis=0)], "gather",
        [helper.make_tensor_value_info("INDEX", TensorProto.INT64, ["batch", 2])],
        [helper.make_tensor_value_info("VALUE", TensorProto.FLOAT, ["batch", 2])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (folder / name / "1").mkdir(parents=True)
    onnx.save(model, folder / name / "1" / "model.onnx")
    (folder / name / "config.pbtxt").write_text(CONFIG.format(name=name, warmup=warmup))
    for filename, data in (files or {}).items():
        (folder / name / "warmup").mkdir(exist_ok=True)
        (folder / name / "warmup" / filename).write_bytes(data)


def sample(name: str, data: str, batch: int = 2, dims: str = "[ 2 ]", key: str = "INDEX",
           datatype: str = "TYPE_INT64", count: int = 0) -> str:
    return (f'{{ name: "{name}" batch_size: {batch} count: {count} inputs {{ key: "{key}" value: {{ '
            f"data_type: {datatype} dims: {dims} {data} }} }} }}")


GOOD = "model_warmup [ {}, {}, {} ]".format(
    sample("zeros", "zero_data: true", count=3), sample("file", 'input_data_file: "in.bin"', batch=1),
    sample("skipped", "zero_data: true", batch=0))  # batch 0: skipped, as Triton
FAILING = {  # model → the reason its load fails with
    "out_of_range": "warm-up failed",
    "missing_file": "cannot read missing_file/warmup/absent.bin",
    "outside": "outside",
    "short_file": "input 'INDEX' needs 32 bytes, but its input_data_file holds 8",
    "wrong_dims": "unexpected shape for input 'INDEX' for model 'wrong_dims'",
    "unknown_input": "unexpected inference input 'OTHER' for model 'unknown_input'",
    "random_indices": "warm-up failed",  # random int64 indices fall outside the 4-element table
    "too_big": "batch_size 8 is more than max_batch_size 4",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("repo")
    in_range = np.array([3, 1], dtype="<i8").tobytes()
    write_gather(repo, "good", GOOD, {"in.bin": in_range})
    write_gather(repo, "plain", "")
    write_gather(repo, "out_of_range",
                 "model_warmup [ {} ]".format(sample("bad", 'input_data_file: "in.bin"', batch=1)),
                 {"in.bin": np.array([0, 9], dtype="<i8").tobytes()})
    write_gather(repo, "missing_file", "model_warmup [ {} ]".format(sample("m", 'input_data_file: "absent.bin"')))
    write_gather(repo, "outside", "model_warmup [ {} ]".format(sample("o", 'input_data_file: "../../secret.bin"')))
    (repo.parent / "secret.bin").write_bytes(in_range * 2)
    write_gather(repo, "short_file", "model_warmup [ {} ]".format(sample("s", 'input_data_file: "in.bin"')),
                 {"in.bin": in_range[:8]})
    write_gather(repo, "wrong_dims", "model_warmup [ {} ]".format(sample("d", "zero_data: true", dims="[ 3 ]")))
    write_gather(repo, "unknown_input", "model_warmup [ {} ]".format(sample("u", "zero_data: true", key="OTHER")))
    write_gather(repo, "random_indices", "model_warmup [ {} ]".format(sample("r", "random_data: true")))
    write_gather(repo, "too_big", "model_warmup [ {} ]".format(sample("b", "zero_data: true", batch=8)))
    work = tmp_path_factory.mktemp("server")
    running = local_server.start(repo, "--exit-on-error", "false", work_dir=work, log_path=work / "log")
    try:
        yield running
    finally:
        running.stop()
        (repo.parent / "secret.bin").unlink(missing_ok=True)


def test_good_samples_leave_the_model_ready_and_answering(server) -> None:
    client = grpcclient.InferenceServerClient(server.url)
    index = grpcclient.InferInput("INDEX", [1, 2], "INT64")
    index.set_data_from_numpy(np.array([[2, 0]], dtype=np.int64))
    for model in ("good", "plain"):
        assert client.is_model_ready(model)
        np.testing.assert_array_equal(client.infer(model, [index]).as_numpy("VALUE"), [[30.0, 10.0]])
    client.close()
    assert "model good version 1: warmed up with 2 sample(s), 4 run(s) per copy" in server.log()


@pytest.mark.parametrize("model", sorted(FAILING))
def test_a_sample_that_fails_fails_the_load_with_the_reason(server, model: str) -> None:
    client = grpcclient.InferenceServerClient(server.url)
    entry = {m.name: m for m in client.get_model_repository_index().models}[model]
    client.close()
    assert entry.state == "UNAVAILABLE"
    assert FAILING[model] in entry.reason
    assert entry.reason.startswith(f"model '{model}'")
    assert str(server.log_path.parent.parent) not in entry.reason  # no server path in what clients read


@pytest.mark.parametrize("datatype", [DataType.FP32, DataType.INT8, DataType.UINT64, DataType.BOOL, DataType.FP16])
def test_random_data_has_the_sample_datatype(datatype: DataType) -> None:
    values = warmup._random(datatype, 1000)
    assert values.dtype == datatype.numpy_dtype and values.shape == (1000,)
    assert len(np.unique(values)) > 1  # not a constant

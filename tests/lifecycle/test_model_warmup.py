"""Triton's model_warmup (issue 27 item 2), against a real server.

The model is a Gather on a 4-element table: an index outside it makes ONNX Runtime fail, so a
sample whose data holds one proves the sample ran, on the data the config named. A sample that
fails, or that a client could not send, fails the load with the reason (the model UNAVAILABLE,
the others READY); good samples (zero, random and file data) leave it READY and answering.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper

from shoal.lifecycle import warmup
from shoal.protocol.types import DataType
from shoal.tools import local_server
from tests.polling import metric

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
        [helper.make_node("Gather", ["table", "INDEX"], ["VALUE"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("INDEX", TensorProto.INT64, ["batch", 2])],
        [helper.make_tensor_value_info("VALUE", TensorProto.FLOAT, ["batch", 2])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    (folder / name / "1").mkdir(parents=True)
    onnx.save(model, folder / name / "1" / "model.onnx")
    (folder / name / "config.pbtxt").write_text(CONFIG.format(name=name, warmup=warmup))
    for filename, data in (files or {}).items():
        (folder / name / "warmup").mkdir(exist_ok=True)
        (folder / name / "warmup" / filename).write_bytes(data)


def sample(
    name: str,
    data: str,
    batch: int = 2,
    dims: str = "[ 2 ]",
    key: str = "INDEX",
    datatype: str = "TYPE_INT64",
    count: int = 0,
) -> str:
    return (
        f'{{ name: "{name}" batch_size: {batch} count: {count} inputs {{ key: "{key}" value: {{ '
        f"data_type: {datatype} dims: {dims} {data} }} }} }}"
    )


GOOD = "model_warmup [ {}, {}, {} ]".format(
    sample("zeros", "zero_data: true", count=3),
    sample("file", 'input_data_file: "in.bin"', batch=1),
    sample("skipped", "zero_data: true", batch=0),
)  # batch 0: skipped, as Triton
FAILING = {  # model → the reason its load fails with
    "out_of_range": "version 1: failed to run warmup sample 'bad': ",  # Triton 2.51's words
    "missing_file": "cannot read missing_file/warmup/absent.bin",
    "outside": "outside",
    "short_file": "input 'INDEX' needs 16 bytes, but its input_data_file holds 8",  # one sample: 2 INT64
    "bytes_count": "input 'INDEX': BYTES content holds 1 elements, the shape needs 2",
    "wrong_dims": "unexpected shape for input 'INDEX' for model 'wrong_dims'",
    "unknown_input": "unexpected inference input 'OTHER' for model 'unknown_input'",
    "random_indices": "failed to run warmup sample 'r': ",  # random int64 indices fall outside the 4-element table
    "too_big": "batch_size 8 is more than max_batch_size 4",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("repo")
    in_range = np.array([3, 1], dtype="<i8").tobytes()
    write_gather(repo, "good", GOOD, {"in.bin": in_range})
    write_gather(repo, "plain", "")
    write_gather(
        repo,
        "out_of_range",
        "model_warmup [ {} ]".format(sample("bad", 'input_data_file: "in.bin"', batch=1)),
        {"in.bin": np.array([0, 9], dtype="<i8").tobytes()},
    )
    write_gather(repo, "missing_file", "model_warmup [ {} ]".format(sample("m", 'input_data_file: "absent.bin"')))
    write_gather(repo, "outside", "model_warmup [ {} ]".format(sample("o", 'input_data_file: "../../secret.bin"')))
    (repo.parent / "secret.bin").write_bytes(in_range * 2)
    write_gather(
        repo,
        "short_file",
        "model_warmup [ {} ]".format(sample("s", 'input_data_file: "in.bin"')),
        {"in.bin": in_range[:8]},
    )
    write_gather(  # a file of one element where the sample's dims want two: the load fails, not the server
        repo,
        "bytes_count",
        "model_warmup [ {} ]".format(sample("c", 'input_data_file: "in.bin"', datatype="TYPE_STRING")),
        {"in.bin": struct.pack("<I", 2) + b"ab"},
    )
    write_gather(  # the file is one sample: each of the batch's two rows is the file's (as Triton reads it)
        repo,
        "one_sample_two_rows",
        "model_warmup [ {} ]".format(sample("t", 'input_data_file: "in.bin"', batch=2)),
        {"in.bin": in_range},
    )
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
    for model in ("good", "plain", "one_sample_two_rows"):
        assert client.is_model_ready(model)
        np.testing.assert_array_equal(client.infer(model, [index]).as_numpy("VALUE"), [[30.0, 10.0]])
    client.close()
    assert "model good version 1: warmed up with 2 sample(s), 4 run(s) per copy" in server.log()
    assert metric(server, "shoal_model_warmup_runs", "good") == 4
    assert metric(server, "shoal_model_warmup_duration_us", "good") > 0
    assert metric(server, "shoal_model_warmup_runs", "plain") == 0  # no samples: the zero-filled run is not one


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


# -- Python models: each sample runs as a queued request through execute ----------------------------------

TALLY = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"SEEN = 1000 x the executions before this request + the sum of every input value they held.\"\"\"

    def initialize(self, args):
        self.executions = 0
        self.total = 0
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if (values == -2).any():
                raise ValueError("execute raised on -2")
            if (values == -1).any():
                response = pb_utils.InferenceResponse(error=pb_utils.TritonError("an error response for -1"))
            else:
                seen = np.full(values.shape, 1000 * self.executions + self.total, dtype=np.int64)
                response = pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)])
            self.executions += 1
            self.total += int(values.sum())
            if self.decoupled:
                sender = request.get_response_sender()
                sender.send(response)
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(response)
        return None if self.decoupled else responses
"""
TALLY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "SEEN" data_type: TYPE_INT64 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
model_warmup [ {{ name: "w" batch_size: 2 count: 3 inputs {{ key: "IN" value: {{ data_type: TYPE_INT64 dims: [ 1 ]
  input_data_file: "in.bin" }} }} }} ]
"""
THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
DECOUPLED = "model_transaction_policy { decoupled: true }"
KINDS = {"process": "", "thread": THREADS}
PYTHON_FAILING = {"response": (-1, "an error response for -1"), "raises": (-2, "execute raised on -2")}


def write_tally(repo: Path, name: str, extra: str, values: list[int]) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(TALLY)
    (repo / name / "config.pbtxt").write_text(TALLY_CONFIG.format(name=name, extra=extra))
    (repo / name / "warmup").mkdir()
    (repo / name / "warmup" / "in.bin").write_bytes(np.array(values, dtype="<i8").tobytes())


@pytest.fixture(scope="module")
def python_server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("python_repo")
    for kind, extra in KINDS.items():
        write_tally(repo, f"tally_{kind}", extra, [7, 7])
        write_tally(repo, f"stream_{kind}", f"{extra}\n{DECOUPLED}", [7, 7])
        for failure, (value, _) in PYTHON_FAILING.items():
            write_tally(repo, f"fails_{failure}_{kind}", extra, [value, 1])
            write_tally(repo, f"stream_fails_{failure}_{kind}", f"{extra}\n{DECOUPLED}", [value, 1])
    work = tmp_path_factory.mktemp("python_server")
    running = local_server.start(repo, "--exit-on-error", "false", work_dir=work, log_path=work / "log")
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_python_model_runs_its_samples_through_execute_before_it_is_ready(python_server, kind: str) -> None:
    """Three runs of a two-row sample of 7s, on the model's one instance, before the first client's request;
    each run two requests of one row in one ``execute``, as Triton's core sends a sample (six requests)."""
    client = grpcclient.InferenceServerClient(python_server.url)
    tensor = grpcclient.InferInput("IN", [1, 1], "INT64")
    tensor.set_data_from_numpy(np.array([[5]], dtype=np.int64))
    assert client.infer(f"tally_{kind}", [tensor]).as_numpy("SEEN").tolist() == [[6 * 1000 + 3 * 14]]
    assert client.is_model_ready(f"stream_{kind}")
    client.close()
    for model in (f"tally_{kind}", f"stream_{kind}"):
        assert f"model {model} version 1: warmed up with 1 sample(s), 3 run(s) per copy" in python_server.log()


@pytest.mark.parametrize("decoupled", [False, True], ids=["returned", "streamed"])
@pytest.mark.parametrize("failure", sorted(PYTHON_FAILING))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_python_sample_that_fails_fails_the_load_with_the_models_words(
    python_server, kind: str, failure: str, decoupled: bool
) -> None:
    model = f"{'stream_' if decoupled else ''}fails_{failure}_{kind}"
    client = grpcclient.InferenceServerClient(python_server.url)
    entry = {m.name: m for m in client.get_model_repository_index().models}[model]
    client.close()
    assert entry.state == "UNAVAILABLE"
    assert entry.reason.startswith(f"model '{model}' version 1: failed to run warmup sample 'w': ")
    assert PYTHON_FAILING[failure][1] in entry.reason, entry.reason


CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"VALUE: what model 'plain' answers for this INDEX (a BLS call).\"\"\"

    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(model_name="plain", requested_output_names=["VALUE"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "INDEX")])
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(answer, "VALUE")]))
        return responses
"""


def test_a_python_models_warm_up_may_call_other_models(tmp_path: Path) -> None:
    """Its samples run as its requests do: BLS calls reach the server (here one to a model loaded before)."""
    repo = tmp_path / "repo"
    write_gather(repo, "plain", "")
    write_gather(
        repo,
        "caller",
        "model_warmup [ {} ]".format(sample("w", 'input_data_file: "in.bin"', batch=1)),
        {"in.bin": np.array([3, 1], dtype="<i8").tobytes()},
    )
    (repo / "caller" / "1" / "model.onnx").unlink()
    (repo / "caller" / "1" / "model.py").write_text(CALLER)
    config = repo / "caller" / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "onnxruntime"', 'backend: "python"'))
    server = local_server.start(
        repo, "--model-control-mode", "explicit", "--load-model", "plain", work_dir=tmp_path, log_path=tmp_path / "log"
    )
    try:
        client = grpcclient.InferenceServerClient(server.url)
        client.load_model("caller")
        index = grpcclient.InferInput("INDEX", [1, 2], "INT64")
        index.set_data_from_numpy(np.array([[0, 2]], dtype=np.int64))
        np.testing.assert_array_equal(client.infer("caller", [index]).as_numpy("VALUE"), [[10.0, 30.0]])
        statistics = client.get_inference_statistics("plain", as_json=True)["model_stats"][0]
        assert int(statistics["inference_stats"]["success"]["count"]) == 2  # the warm-up's call, then the client's
        client.close()
    finally:
        server.stop()
    assert "model caller version 1: warmed up with 1 sample(s), 1 run(s) per copy" in (tmp_path / "log").read_text()


def test_no_request_reaches_a_reloaded_version_before_its_warm_up_ends(tmp_path: Path) -> None:
    """Poll mode under load: the model's file changes (its answers gain 1,000,000), the new copy warms up (three
    runs) while the old one serves; every answer from the new copy counts those three executions before it."""
    repo = tmp_path / "repo"
    write_tally(repo, "tally", "", [7, 7])
    server = local_server.start(
        repo,
        "--model-control-mode",
        "poll",
        "--repository-poll-secs",
        "0.2",
        work_dir=tmp_path,
        log_path=tmp_path / "log",
    )
    answers: list[int] = []
    try:
        client = grpcclient.InferenceServerClient(server.url)
        tensor = grpcclient.InferInput("IN", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[0]], dtype=np.int64))

        def ask() -> int:
            return int(client.infer("tally", [tensor]).as_numpy("SEEN")[0, 0])

        answers.append(ask())
        source = repo / "tally" / "1" / "model.py"
        source.write_text(source.read_text().replace("1000 * self.executions", "1_000_000 + 1000 * self.executions"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(answers) < 20_000:
            answers.append(ask())
            if sum(answer >= 1_000_000 for answer in answers) >= 20:  # the new copy has served a while
                break
        client.close()
    finally:
        server.stop()
    new = [answer - 1_000_000 for answer in answers if answer >= 1_000_000]
    assert len(new) >= 20, f"the new copy served {len(new)} of {len(answers)} requests within 60 s"
    assert min(new) // 1000 >= 3, f"a request reached the new copy after {min(new) // 1000} warm-up runs"

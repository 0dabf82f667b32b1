"""A Python model that sums a decoupled model's stream through BLS, as Triton's ``bls_decoupled``
examples do (session 53: the sync one failed, the async one was refused).

- **Sync**: ``exec(decoupled=True)``, the responses summed into ``np.array([0])`` (INT64) and answered
  as the config's INT32 ``SUM``. Triton 2.51 answers ``"datatype":"INT64"`` with the sum (checked with
  ``run_triton.sh``): a Python model's output keeps the datatype the model gave it. Shoal refused it.
- **Async**: ``await asyncio.gather(*(call.async_exec(decoupled=True) for two calls))``, each awaited
  result an iterator of the call's responses. Shoal raised "not supported".
- An ensemble step fed such an output refuses it as its input, as Triton's does; an ensemble whose last
  step gives it answers it with the step's datatype, and a classification ranks it by that datatype
  (review of session 53, Triton 2.51 run beside it: Shoal refused both, or failed with an incident).
- A BLS call to a model that is not ready, or for one response to a decoupled model, fails in the
  words of Triton 2.51's Python backend (checked with ``run_triton.sh``; Shoal gave its clients' words).

Both instance kinds, both process layouts (the datatype crosses a front-end worker's channel).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, serving
from tests.python_models import write_model

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
KINDS = {"process": "", "thread": THREADS}

ONE_IN_ONE_OUT = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "{output}" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{extra}
"""
# N responses, each OUT = N, then FINAL alone (as Triton's decoupled ``square`` example sends them).
REPEAT_N = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            for _ in range(int(n[0])):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", n.astype(np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
SUM_SYNC = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN")
            call = pb_utils.InferenceRequest(model_name="repeat_n", inputs=[n], requested_output_names=["OUT"])
            total = np.array([0])  # INT64, answered for the config's INT32
            for response in call.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if response.output_tensors():
                    total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return responses
"""
SUM_ASYNC = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN")
            calls = [
                pb_utils.InferenceRequest(model_name="repeat_n", inputs=[n], requested_output_names=["OUT"])
                for _ in range(2)
            ]
            streams = await asyncio.gather(*(call.async_exec(decoupled=True) for call in calls))
            total = np.array([0], np.int32)
            counts = []
            for stream in streams:
                counted = 0
                for response in stream:
                    if response.has_error():
                        raise pb_utils.TritonModelException(response.error().message())
                    if response.output_tensors():
                        total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
                        counted += 1
                counts.append(counted)
            if counts != [int(n.as_numpy()[0])] * 2:
                raise pb_utils.TritonModelException(f"responses per call: {counts}")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]))
        return responses
"""
TAKES_INT32 = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)])
            for r in requests
        ]
"""
# OUT as IN says: 0, an object array of bytes; 1, INT64 (the config declares INT32 or STRING).
GIVES = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            out = np.array([b"7", b"3"], object) if n == 0 else np.array([7, 3], np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""
GIVES_CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: {datatype} dims: [ 2 ] }} ]
"""
LAST_STEP = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "E" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "sum_sync_thread" model_version: -1 input_map { key: "IN" value: "IN" }
    output_map { key: "SUM" value: "E" } }
] }
"""
CALLER = """
backend: "python"
max_batch_size: 0
input [ { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] }, { name: "VERSION" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ERROR" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
# exec() (one response, every output) on the model and version named, answering its error ("" if none).
CALLS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "NAME").as_numpy()[0].decode()
            version = int(pb_utils.get_input_tensor_by_name(request, "VERSION").as_numpy()[0])
            one = pb_utils.Tensor("IN", np.array([1], np.int32))
            call = pb_utils.InferenceRequest(
                model_name=name, model_version=version, inputs=[one], requested_output_names=[]
            )
            response = call.exec()
            error = response.error()
            text = "" if error is None else f"{error.code() == pb_utils.TritonError.INTERNAL} {error.message()}"
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ERROR", np.array([text], object))]))
        return responses
"""
CHAIN = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "sum_sync_process" model_version: -1 input_map { key: "IN" value: "IN" }
    output_map { key: "SUM" value: "S" } },
  { model_name: "takes_int32" model_version: -1 input_map { key: "X" value: "S" }
    output_map { key: "Y" value: "Y" } }
] }
"""


@pytest.fixture(scope="module", params=["one process", "workers"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    write_model(
        repo,
        "repeat_n",
        ONE_IN_ONE_OUT.format(output="OUT", extra="model_transaction_policy { decoupled: true }"),
        REPEAT_N,
    )
    for kind, extra in KINDS.items():
        write_model(repo, f"sum_sync_{kind}", ONE_IN_ONE_OUT.format(output="SUM", extra=extra), SUM_SYNC)
        write_model(repo, f"sum_async_{kind}", ONE_IN_ONE_OUT.format(output="SUM", extra=extra), SUM_ASYNC)
        write_model(repo, f"caller_{kind}", CALLER + extra, CALLS)
    takes = ONE_IN_ONE_OUT.replace('"IN"', '"X"').format(output="Y", extra="")
    write_model(repo, "takes_int32", takes, TAKES_INT32)
    for name, config in (("chain", CHAIN), ("last_step", LAST_STEP)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
    for datatype in ("TYPE_INT32", "TYPE_STRING"):
        write_model(repo, f"gives_{datatype[5:].lower()}", GIVES_CONFIG.format(datatype=datatype), GIVES)
    workers = ["--grpc-workers", "1"] if request.param == "workers" else ["--grpc-workers", "0"]
    with serving(repo, tmp_path_factory.mktemp("server"), *workers) as running:
        yield running


def _grpc_in(value: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    return tensor


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_sum_of_a_stream_keeps_the_datatype_the_model_gave_it(server: RunningServer, kind: str) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        for n in (4, 2, 0, 1):
            result = client.infer(f"sum_sync_{kind}", [_grpc_in(n)], client_timeout=60)
            output = result.get_output("SUM")
            assert output is not None and output.datatype == "INT64", result.get_response()
            assert result.as_numpy("SUM").dtype == np.int64 and result.as_numpy("SUM").tolist() == [n * n]
    with httpclient.InferenceServerClient(server.http_url, network_timeout=60) as http:
        tensor = httpclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([3], np.int32))
        for binary in (True, False):
            wanted = [httpclient.InferRequestedOutput("SUM", binary_data=binary)]
            answer = http.infer(f"sum_sync_{kind}", [tensor], outputs=wanted)
            assert answer.get_output("SUM")["datatype"] == "INT64"
            assert answer.as_numpy("SUM").tolist() == [9]


@pytest.mark.parametrize("kind", list(KINDS))
def test_async_exec_of_a_decoupled_call_resolves_to_its_responses(server: RunningServer, kind: str) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        for n in (4, 2, 0, 1):
            result = client.infer(f"sum_async_{kind}", [_grpc_in(n)], client_timeout=60)
            assert result.as_numpy("SUM").dtype == np.int32 and result.as_numpy("SUM").tolist() == [2 * n * n]


def test_an_ensemble_step_refuses_a_datatype_its_config_does_not_take(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("chain", [_grpc_in(3)], client_timeout=60)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    assert "inference input 'X' data-type is 'INT64', but model 'takes_int32' expects 'INT32'" in str(
        caught.value.message()
    ), caught.value


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bls_call_is_refused_in_tritons_words(server: RunningServer, kind: str) -> None:
    def error_of(name: str, version: int) -> str:
        tensors = [grpcclient.InferInput("NAME", [1], "BYTES"), grpcclient.InferInput("VERSION", [1], "INT32")]
        tensors[0].set_data_from_numpy(np.array([name.encode()], object))
        tensors[1].set_data_from_numpy(np.array([version], np.int32))
        with grpcclient.InferenceServerClient(server.url) as client:
            answer = client.infer(f"caller_{kind}", tensors, client_timeout=60).as_numpy("ERROR")[0]
        return bytes(answer).decode()

    failed = "True Model {0} - Error when running inference: "
    not_ready = failed + "Failed for execute the inference request. Model '{0}' is not ready."
    assert error_of("undefined_model", -1) == not_ready.format("undefined_model")
    assert error_of("takes_int32", 7) == not_ready.format("takes_int32")  # a version it does not have
    assert error_of("repeat_n", -1) == failed.format("repeat_n") + (
        "Model repeat_n is using the decoupled. The current BLS request call doesn't support models using the "
        "decoupled transaction policy. Please use 'decoupled=True' argument to the 'exec' or 'async_exec' "
        "calls for decoupled models.'"
    )
    assert error_of("sum_sync_process", -1) == ""  # answered


def test_an_ensemble_answers_its_last_steps_datatype(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        result = client.infer("last_step", [_grpc_in(3)], client_timeout=60)
    output = result.get_output("E")
    assert output is not None and output.datatype == "INT64"
    assert result.as_numpy("E").tolist() == [9]


def test_a_classification_ranks_by_the_datatype_the_model_gave(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        top = [grpcclient.InferRequestedOutput("OUT", class_count=1)]
        for model in ("gives_int32", "gives_string"):  # INT64 given: ranked, whatever the config declares
            result = client.infer(model, [_grpc_in(1)], outputs=top, client_timeout=60)
            assert result.as_numpy("OUT").tolist() == [b"7:0"], model
        with pytest.raises(InferenceServerException) as caught:  # BYTES given for an INT32 output
            client.infer("gives_int32", [_grpc_in(0)], outputs=top, client_timeout=60)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value
    assert caught.value.message() == (
        "class result not available for output 'OUT' of model 'gives_int32' due to unsupported type 'BYTES'"
    )

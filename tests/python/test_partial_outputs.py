"""Responses that carry some of a model's outputs (review of session 50, A5).

A streaming model's responses often carry one output each ({A}, then {B}). Shoal failed every such
response ("the response has no output 'B'"); through BLS ``exec(decoupled=True)`` those failures were
dropped, so the caller saw no data at all. Triton 2.51 (run by the review) passes each response on
with the outputs it has: a stream gets {A:11}, {B:12}; BLS iterates {A:11}, {B:12}, {}; a unary call
to a model that gives only A gets {A:11}, B requested or not. In both instance kinds.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, serving
from tests.python_models import write_model

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
TWO_OUTPUTS = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "A" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "B" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{extra}
"""
ONLY_A = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("A", x + 1)]))
        return responses
"""
ONE_EACH = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("A", x + 1)]))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("B", x + 2)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
SEEN_CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }} ]
{extra}
"""
# What exec(decoupled=True) on "one_each" gives, response by response.
BLS_SEEN = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN")
            call = pb_utils.InferenceRequest(
                model_name="one_each{suffix}", inputs=[x], requested_output_names=["A", "B"]
            )
            seen = []
            for response in call.exec(decoupled=True):
                if response.has_error():
                    seen.append("error: " + response.error().message())
                else:
                    seen.append({{t.name(): int(t.as_numpy()[0]) for t in response.output_tensors()}})
            seen_tensor = pb_utils.Tensor("SEEN", np.array([json.dumps(seen)], object))
            responses.append(pb_utils.InferenceResponse([seen_tensor]))
        return responses
"""
KINDS = {"process": "", "thread": THREADS}
# Ensembles over only_a: its B (left out) as an ensemble output, and as the next step's input.
ENSEMBLE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT_A" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "OUT_B" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "only_a_process" model_version: -1 input_map { key: "IN" value: "IN" }
    output_map { key: "A" value: "OUT_A" } output_map { key: "B" value: "OUT_B" } }
] }
"""
CHAIN = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "only_a_thread" model_version: -1 input_map { key: "IN" value: "IN" }
    output_map { key: "B" value: "T" } },
  { model_name: "only_a_process" model_version: -1 input_map { key: "IN" value: "T" }
    output_map { key: "A" value: "OUT" } }
] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    for kind, extra in KINDS.items():
        suffix = f"_{kind}"
        write_model(repo, f"only_a{suffix}", TWO_OUTPUTS.format(extra=extra), ONLY_A)
        decoupled = extra + "\nmodel_transaction_policy { decoupled: true }"
        write_model(repo, f"one_each{suffix}", TWO_OUTPUTS.format(extra=decoupled), ONE_EACH)
        write_model(repo, f"bls_seen{suffix}", SEEN_CONFIG.format(extra=extra), BLS_SEEN.format(suffix=suffix))
    (repo / "ensemble" / "1").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text(ENSEMBLE)
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(CHAIN)
    with serving(repo, tmp_path_factory.mktemp("server")) as running:
        yield running


def _in(value: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([value], np.int32))
    return tensor


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_unary_response_carries_the_outputs_the_model_gave(server: RunningServer, kind: str) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        for requested in (None, [grpcclient.InferRequestedOutput("A"), grpcclient.InferRequestedOutput("B")]):
            result = client.infer(f"only_a_{kind}", [_in(10)], outputs=requested)
            assert [output.name for output in result.get_response().outputs] == ["A"]
            assert result.as_numpy("A").tolist() == [11] and result.as_numpy("B") is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_streamed_responses_carry_one_output_each(server: RunningServer, kind: str) -> None:
    got: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.url) as client:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        client.async_stream_infer(f"one_each_{kind}", [_in(10)])
        answers = [got.get(timeout=30) for _ in range(2)]
        client.stop_stream()
    assert [a.get_response().outputs[0].name for a in answers] == ["A", "B"], answers
    assert [answers[0].as_numpy("A").tolist(), answers[1].as_numpy("B").tolist()] == [[11], [12]]


@pytest.mark.parametrize("kind", list(KINDS))
def test_bls_iterates_every_response_with_its_outputs(server: RunningServer, kind: str) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        seen = client.infer(f"bls_seen_{kind}", [_in(10)]).as_numpy("SEEN")[0]
    assert seen.decode() == '[{"A": 11}, {"B": 12}, {}]'


def test_an_ensemble_leaves_out_what_its_python_step_left_out(server: RunningServer) -> None:
    """Review of session 50: once a Python step could leave an output out, an ensemble answering it
    failed (INTERNAL, a KeyError), and a step reading it failed as "not written by its step". Triton
    2.51 answers the outputs it has, and runs the reading step without the tensor, whose model refuses
    the request in its own words."""
    with grpcclient.InferenceServerClient(server.url) as client:
        result = client.infer("ensemble", [_in(10)])
        assert [output.name for output in result.get_response().outputs] == ["OUT_A"]
        assert result.as_numpy("OUT_A").tolist() == [11]
        with pytest.raises(InferenceServerException) as refused:
            client.infer("chain", [_in(10)])
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "in ensemble 'chain', [request id: <id_unknown>] expected 1 inputs but got 0 inputs" in str(
        refused.value.message()
    )

"""BLS calls where things go wrong or get stateful: a caller restarted mid-call, calls into a sequence model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import python_models as pm
from tests.sequence_models import add_accumulator

CALLER_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]
"""

# Calls "target" with its input (the target takes 3 s for 1.0, past this caller's timeout, and 1.5 s for 2.0).
CALL_TARGET = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            reply = pb_utils.InferenceRequest(model_name="target", inputs=[pb_utils.Tensor("X", x)],
                                              requested_output_names=["Y"]).exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error().message())))
            else:
                y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""

SLOW_FOR_ONE = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep({1.0: 3.0, 2.0: 1.5}.get(float(x.flat[0]), 0.0))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""

# Two calls of one sequence (id 7): START with x, then END with x; the accumulator answers 2x.
CALL_SEQUENCE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            reply = None
            for flags in (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
                          pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END):
                reply = pb_utils.InferenceRequest(model_name="acc", inputs=[pb_utils.Tensor("INPUT", x)],
                                                  requested_output_names=["OUTPUT"], correlation_id=7,
                                                  flags=flags).exec()
                if reply.has_error():
                    break
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error().message())))
            else:
                y = pb_utils.get_output_tensor_by_name(reply, "OUTPUT").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""


def _x(value: float) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.full((1, 1), value, np.float32))
    return [tensor]


def test_a_restarted_caller_never_gets_the_answer_of_its_predecessors_call(tmp_path: Path, server_factory) -> None:
    """The killed worker's BLS call (call 0) ends while its replacement waits on its own call 0: the old
    answer is dropped, not given to the new call."""
    repo = tmp_path / "repo"
    timeout = 'parameters { key: "execution_timeout_ms" value: { string_value: "2000" } }'
    pm.write_model(repo, "caller", CALLER_CONFIG + timeout, CALL_TARGET)
    threads = 'parameters { key: "process_instances" value: { string_value: "false" } }'
    pm.write_model(
        repo, "target", CALLER_CONFIG + "instance_group [ { count: 2 kind: KIND_CPU } ]\n" + threads, SLOW_FOR_ONE
    )
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException, match="execution_timeout_ms"):
            client.infer("caller", _x(1.0))
        # The call for 1.0 still runs on the target and ends while the call for 2.0 waits.
        for value in (2.0, 3.0, 4.0):
            np.testing.assert_array_equal(client.infer("caller", _x(value)).as_numpy("Y"), [[value]])


def test_bls_calls_carry_the_correlation_id_and_sequence_flags(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    add_accumulator(repo, "acc", max_batch_size=8)
    pm.write_model(repo, "caller", CALLER_CONFIG, CALL_SEQUENCE)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        np.testing.assert_array_equal(client.infer("caller", _x(2.5)).as_numpy("Y"), [[5.0]])

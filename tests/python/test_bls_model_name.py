"""Triton's BLS example, as its users run it: the model to call named by a BYTES input (issue 23).

Its ``model.py`` passes ``model_name.as_numpy()[0]`` (``bytes``) to ``pb_utils.InferenceRequest``;
Shoal looked up ``"b'add_sub'"`` and answered "unknown model". Thread and process instances, both
layouts; every answer is compared with the one computed here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests import python_models as pm

BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1, 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1, 4 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
"""

# The shape of Triton's python_backend examples/bls/sync_model.py, written anew.
BLS_BY_NAME = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME")
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            answer = pb_utils.InferenceRequest(
                model_name=model_name.as_numpy()[0], requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[in_0, in_1]).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(answer, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(answer, "OUTPUT1")]))
        return responses
"""
THREADS = '\nparameters { key: "process_instances" value: { string_value: "false" } }\n'


@pytest.mark.parametrize("instances", ["threads", "processes"])
def test_a_bls_call_names_its_model_with_bytes(tmp_path: Path, server_factory: Any, instances: str) -> None:
    repo = tmp_path / "repo"
    pm.add_add_sub(repo)
    pm.write_model(repo, "bls", BLS_CONFIG + (THREADS if instances == "threads" else ""), BLS_BY_NAME)
    server = server_factory(repo)
    a, b = np.arange(4, dtype=np.float32).reshape(1, 4), np.full((1, 4), 0.5, np.float32)
    inputs = [
        grpcclient.InferInput("MODEL_NAME", [1], "BYTES"),
        grpcclient.InferInput("INPUT0", [1, 4], "FP32"),
        grpcclient.InferInput("INPUT1", [1, 4], "FP32"),
    ]
    inputs[0].set_data_from_numpy(np.array([b"add_sub"], dtype=np.object_))
    inputs[1].set_data_from_numpy(a)
    inputs[2].set_data_from_numpy(b)
    with grpcclient.InferenceServerClient(server.url) as client:
        result = client.infer("bls", inputs, client_timeout=60)
    assert result.as_numpy("OUTPUT0").tolist() == (a + b).tolist()
    assert result.as_numpy("OUTPUT1").tolist() == (a - b).tolist()

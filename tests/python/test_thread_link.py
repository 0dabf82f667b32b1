"""BLS from thread instances while another thread-instance model loads (review of session 50, A1).

Every thread instance of a server reaches the host through one process-wide link (``pb_utils``).
Building a thread instance installed a link of its own with no host yet, until ``bind_host`` gave it
one after ``initialize``: a BLS call another thread model made meanwhile failed, "BLS needs the model
to be served by a Shoal server" (76 of ~1,100 calls while another model loaded 29 times, in the
review). Here the load is held in ``initialize`` while the caller's ``execute`` makes its call.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tests import models
from tests.polling import wait_until
from tests.python_models import write_model

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
CALLER_CONFIG = f"""
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
{THREADS}
"""
# Waits, inside execute, until the other model's initialize has begun; then calls "ident" through BLS.
CALLER = """
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

MARKS = Path({marks!r})


class TritonPythonModel:
    def execute(self, requests):
        deadline = time.monotonic() + 60
        while not (MARKS / "initializing").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            called = pb_utils.InferenceRequest(
                model_name="ident", inputs=[pb_utils.Tensor("IN", x)], requested_output_names=["OUT"]
            ).exec()
            if called.has_error():
                raise pb_utils.TritonModelException(called.error().message())
            out = pb_utils.get_output_tensor_by_name(called, "OUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out + 1)]))
        return responses
"""
# Its initialize says it has begun, then waits for the test's word.
SLOW = """
import time
from pathlib import Path

MARKS = Path({marks!r})


class TritonPythonModel:
    def initialize(self, args):
        (MARKS / "initializing").touch()
        deadline = time.monotonic() + 60
        while not (MARKS / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def execute(self, requests):
        return []
"""


def test_a_bls_call_made_while_another_thread_model_initializes_is_served(tmp_path: Path, server_factory: Any) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    repo = tmp_path / "repo"
    models.add_identity(repo, "ident", "FP32", max_batch_size=0, dims="[ 2 ]")
    write_model(repo, "caller", CALLER_CONFIG, CALLER.format(marks=str(marks)))
    write_model(repo, "slow", CALLER_CONFIG, SLOW.format(marks=str(marks)))
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "ident", "--load-model", "caller")
    value = np.array([1.0, 2.0], np.float32)
    with grpcclient.InferenceServerClient(server.url) as client:
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(value)
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                answer["out"] = client.infer("caller", [tensor], client_timeout=60).as_numpy("OUT")
            except Exception as exc:  # noqa: BLE001 - asserted below
                answer["error"] = exc

        asking = threading.Thread(target=ask)
        asking.start()  # its execute waits for the slow model's initialize to begin
        loading = threading.Thread(target=lambda: client.load_model("slow", client_timeout=120))
        loading.start()
        asking.join(90)
        (marks / "go").touch()
        loading.join(90)
        assert "error" not in answer, str(answer.get("error"))
        assert answer["out"].tolist() == (value + 1).tolist()
        wait_until(lambda: client.is_model_ready("slow"), 30, "the slow model to load")

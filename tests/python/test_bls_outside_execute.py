"""A BLS call from a thread a process-instance model started, made after ``execute`` returned
(review of session 50, A4). Between batches nothing of the server reads the worker's pipe but the
liveness check, which took the call for a wrong answer to its ping and killed the healthy worker
(its state lost: "did not answer a liveness check"). The check now answers such a call at once with
an error (a process instance serves BLS calls while a batch runs; docs/python-models.md), and the
worker lives on. Triton serves the call; a thread instance does too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tests.polling import wait_until
from tests.python_models import write_model

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "liveness_check_interval_ms" value: { string_value: "200" } }
"""
CALLEE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""
CALLEE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""
# Answers its pid and starts a thread that calls "callee" once execute has returned (the test, holding
# the answer, writes the file GO), and writes what
# the call got ("ok", or "error: ...") into the file GOT: the test waits on it without a request (a
# batch would read the pipe, where the liveness check alone reads it while the server is idle).
LINGER = """
import os
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def call_later(self, x):
        deadline = time.monotonic() + 60
        while not Path({go!r}).exists() and time.monotonic() < deadline:  # the test has the answer
            time.sleep(0.01)
        response = pb_utils.InferenceRequest(
            model_name="callee", inputs=[pb_utils.Tensor("IN", x)], requested_output_names=["OUT"]
        ).exec()
        got = "error: " + response.error().message() if response.has_error() else "ok"
        Path({got!r}).write_text(got)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            threading.Thread(target=self.call_later, args=(x.copy(),), daemon=True).start()
            pid = np.array([str(os.getpid())], object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pid)]))
        return responses
"""


def test_a_call_from_a_thread_after_execute_fails_at_once_and_the_worker_lives(
    tmp_path: Path, server_factory: Any
) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "callee", CALLEE_CONFIG, CALLEE)
    got = tmp_path / "got"
    go = tmp_path / "go"
    write_model(repo, "linger", CONFIG, LINGER.replace("{got!r}", repr(str(got))).replace("{go!r}", repr(str(go))))
    server = server_factory(repo)

    def pid_of_worker(client: grpcclient.InferenceServerClient) -> str:
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.ones(2, np.float32))
        return str(client.infer("linger", [tensor], client_timeout=30).as_numpy("OUT")[0].decode())

    with grpcclient.InferenceServerClient(server.url) as client:
        pid = pid_of_worker(client)
        go.touch()
        wait_until(got.exists, 30, "the thread's call to be answered while the server is idle")
        answer = got.read_text()
        assert answer.startswith("error: ") and "outside execute" in answer, answer
        got.unlink()
        go.unlink()
        assert pid_of_worker(client) == pid, "the worker was killed and started again"
        assert "did not answer a liveness check" not in server.log()

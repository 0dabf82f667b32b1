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

from tests import python_models as pm
from tests.polling import wait_until
from tests.python_models import write_model

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "liveness_check_interval_ms" value: { string_value: "200" } }
"""
# Answers its pid and starts a thread that calls "double" once execute has returned (the test, holding
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
            model_name="double", inputs=[pb_utils.Tensor("X", x)], requested_output_names=["Y"]
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
    write_model(repo, "double", pm.DOUBLE_CONFIG, pm.DOUBLE)
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


# initialize tries a BLS call; execute answers what that raised (or "served").
BLS_IN_INITIALIZE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        try:
            x = pb_utils.Tensor("X", np.ones(2, np.float32))
            pb_utils.InferenceRequest(model_name="double", inputs=[x], requested_output_names=["Y"]).exec()
            self.said = "served"
        except pb_utils.TritonModelException as exc:
            self.said = exc.message()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([self.said], object))]) for _ in requests]
"""
IN_INITIALIZE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def test_a_bls_call_in_initialize_raises_tritons_exception(tmp_path: Path, server_factory: Any) -> None:
    """Review of session 50 (A6): Triton 2.51 raises ``TritonModelException: BLS is only supported
    during the 'execute' function.`` A process instance's load failed instead ("a worker process did not
    start": the call went down the pipe before the worker said it was ready); a thread instance's call
    was served through another thread model's link."""
    repo = tmp_path / "repo"
    write_model(repo, "double", pm.DOUBLE_CONFIG, pm.DOUBLE)
    write_model(repo, "early_process", IN_INITIALIZE_CONFIG, BLS_IN_INITIALIZE)
    threads = 'parameters { key: "process_instances" value: { string_value: "false" } }'
    write_model(repo, "early_thread", IN_INITIALIZE_CONFIG + threads, BLS_IN_INITIALIZE)
    write_model(repo, "other_thread", pm.DOUBLE_CONFIG + threads, pm.DOUBLE)  # installs a thread link first
    server = server_factory(repo, "--model-control-mode", "explicit", "--load-model", "double")
    with grpcclient.InferenceServerClient(server.url) as client:
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.ones(2, np.float32))
        client.load_model("other_thread")
        x = grpcclient.InferInput("X", [2], "FP32")
        x.set_data_from_numpy(np.ones(2, np.float32))
        client.infer("other_thread", [x])
        for model in ("early_process", "early_thread"):
            client.load_model(model)
            said = client.infer(model, [tensor]).as_numpy("OUT")[0].decode()
            assert said == "BLS is only supported during the 'execute' function.", (model, said)

"""A worker holds no write end of the fork server's "alive" pipe (review of session 50, F1).

Every process the multiprocessing fork server starts inherits the write end of the pipe by which the
fork server learns that its host is gone: a byte written on it (a model writing where it should
not) made the fork server exit, and every other model's worker died with it (PDEATHSIG), failing
their requests. A worker now closes it first thing; the fork server still ends with the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tests.python_models import write_model

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
# Answers its worker's pid; the "bad" one first writes a byte on the fork server's alive pipe, if it holds it.
MODEL = """
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        if {bad}:
            import multiprocessing.forkserver as forkserver

            alive = forkserver._forkserver._forkserver_alive_fd
            if alive is not None:
                os.write(alive, b"x")
                # Until the fork server (this worker's parent) has ended, or 10 s: then this worker is
                # killed with it (PDEATHSIG), as every other worker is.
                stat = Path(f"/proc/{{os.getppid()}}/stat")
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and stat.exists() and stat.read_text().split(") ")[1][0] != "Z":
                    time.sleep(0.01)
        pid = np.array([str(os.getpid())], object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pid)]) for _ in requests]
"""


def test_a_byte_on_the_fork_servers_pipe_harms_no_other_models_worker(tmp_path: Path, server_factory: Any) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "good", CONFIG, MODEL.format(bad=False))
    write_model(repo, "bad", CONFIG, MODEL.format(bad=True))
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        tensor = grpcclient.InferInput("IN", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, np.float32))

        def pid_of(model: str) -> str:
            return str(client.infer(model, [tensor], client_timeout=30).as_numpy("OUT")[0].decode())

        good = pid_of("good")
        for _ in range(3):
            pid_of("bad")
            assert pid_of("good") == good, "the other model's worker died"
        assert "died" not in server.log()

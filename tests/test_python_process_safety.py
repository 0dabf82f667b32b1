"""Python models' process instances under stress: SIGKILL of the host."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests import python_models as pm
from tests.polling import wait_until

X_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

# execute writes entered in its model folder (so the test knows a request is in it), then never returns.
STUCK_IN_EXECUTE = """
import os
import time


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "entered")

    def execute(self, requests):
        open(self.marker, "w").close()
        while True:
            time.sleep(1)
"""

# The same, stuck in C code that holds the GIL (no thread of the worker runs again): only the kernel ends it.
STUCK_HOLDING_THE_GIL = STUCK_IN_EXECUTE.replace("import time\n", "import ctypes\n").replace(
    "        while True:\n            time.sleep(1)\n", "        ctypes.PyDLL(None).sleep(3600)\n")

# initialize starts a thread that is not a daemon and never ends: the process cannot exit by itself.
NON_DAEMON_THREAD = """
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.forever = threading.Thread(target=threading.Event().wait, daemon=False)
        self.forever.start()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
"""

# finalize never returns (it runs when the worker is told to stop, or finds its pipe closed).
BLOCKING_FINALIZE = NON_DAEMON_THREAD.replace(
    """        self.forever = threading.Thread(target=threading.Event().wait, daemon=False)
        self.forever.start()
""", "        pass\n") + """
    def finalize(self):
        import threading
        threading.Event().wait()
"""

DESCENDANTS_GONE_TIMEOUT_S = 20.0


def _x(values: np.ndarray) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("X", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values.astype(np.float32))
    return [tensor]


# -- every child of the host dies with it (issue 22, item 6) ----------------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``: front-end workers, the fork server, instance workers, the resource tracker."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        try:
            below = _children(todo.pop())
        except FileNotFoundError:
            continue
        found.update(below)
        todo += below
    return found


def _running(pid: int) -> bool:
    """Still a process that holds memory: present and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.mark.timeout(180)
def test_sigkill_of_the_host_takes_every_instance_process_with_it(tmp_path: Path, server_factory) -> None:
    """Workers stuck in execute with a request in flight (in Python, or in C code holding the GIL), holding a
    non-daemon thread, or blocking in finalize, the fork server and the resource tracker: none outlives a
    SIGKILL of the server's main process."""
    repo = tmp_path / "repo"
    pm.write_model(repo, "stuck", X_CONFIG, STUCK_IN_EXECUTE)
    pm.write_model(repo, "stuck_in_c", X_CONFIG, STUCK_HOLDING_THE_GIL)
    pm.write_model(repo, "threaded", X_CONFIG, NON_DAEMON_THREAD)
    pm.write_model(repo, "finalizing", X_CONFIG, BLOCKING_FINALIZE)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        for name in ("threaded", "finalizing"):
            assert client.infer(name, _x(np.ones(2))).as_numpy("Y").tolist() == [1.0, 1.0]
        for name in ("stuck", "stuck_in_c"):
            client.async_infer(name, _x(np.ones(2)), callback=lambda result, error: None, client_timeout=120)
            wait_until((repo / name / "entered").exists, 60, f"{name}'s execute to start")
        descendants = _descendants(server.pid)
        assert len(descendants) >= 5, descendants  # four workers and their fork server at least
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        try:
            wait_until(lambda: not [pid for pid in descendants if _running(pid)], DESCENDANTS_GONE_TIMEOUT_S,
                       "every process the server had started to die with it")
        finally:
            left = [pid for pid in descendants if _running(pid)]
            commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left if _running(pid)}
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert not left, f"outlived the server: {commands}"

"""Python models' process instances under stress: SIGKILL of the host, BLS from many threads, BLS to itself."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests import python_models as pm
from tests.polling import wait_until

X_CONFIG = pm.X_TO_Y_CONFIG

# execute writes entered in its model folder (so the test knows a request is in it), then never returns.
STUCK_IN_EXECUTE = """
import concurrent.futures
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
    "        while True:\n            time.sleep(1)\n", "        ctypes.PyDLL(None).sleep(3600)\n"
)

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
BLOCKING_FINALIZE = (
    NON_DAEMON_THREAD.replace(
        """        self.forever = threading.Thread(target=threading.Event().wait, daemon=False)
        self.forever.start()
""",
        "        pass\n",
    )
    + """
    def finalize(self):
        import threading
        threading.Event().wait()
"""
)

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
            wait_until(
                lambda: not [pid for pid in descendants if _running(pid)],
                DESCENDANTS_GONE_TIMEOUT_S,
                "every process the server had started to die with it",
            )
        finally:
            left = [pid for pid in descendants if _running(pid)]
            commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:120] for pid in left if _running(pid)}
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert not left, f"outlived the server: {commands}"


# -- a worker whose loop ends is replaced, whatever threads the model left (issue 22, item 4) ---------

# X[0] == 13 calls sys.exit() in execute, with a non-daemon thread running since initialize.
EXITS_WITH_A_THREAD_LEFT = NON_DAEMON_THREAD.replace(
    "    def execute(self, requests):\n",
    "    def execute(self, requests):\n"
    "        import sys\n"
    '        if pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0] == 13:\n'
    "            sys.exit(3)\n",
)


@pytest.mark.timeout(180)
def test_a_worker_whose_loop_ended_is_replaced_though_a_thread_of_the_model_runs(
    tmp_path: Path, server_factory
) -> None:
    """Before, the process lingered for the model's thread, not answering: the instance hung for good.
    A ``sys.exit`` in ``execute`` no longer ends the worker's loop (it fails that batch, as in thread
    instances: tests/python/test_python_isolation.py); the instance must serve on either way."""
    repo = tmp_path / "repo"
    pm.write_model(repo, "exits", X_CONFIG, EXITS_WITH_A_THREAD_LEFT)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        with pytest.raises(InferenceServerException, match="SystemExit: 3"):
            client.infer("exits", _x(np.full(2, 13.0)), client_timeout=30)
        assert client.infer("exits", _x(np.ones(2)), client_timeout=60).as_numpy("Y").tolist() == [1.0, 1.0]


# -- BLS from several threads of one instance (issue 22, item 4) ------------------------------------

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'
TARGET_INSTANCES = "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
STREAM_CONFIG = X_CONFIG + "model_transaction_policy { decoupled: true }\n" + TARGET_INSTANCES

# The called models: an answer that depends on the input, so a reply given to the wrong call shows.
AFFINE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2 + 1)]) for r in requests]
"""

# Decoupled: 2x+1, 2x+2, 2x+3 as three responses, then the FINAL flag on its own.
AFFINE_STREAM = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            for k in (1, 2, 3):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2 + k)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Per request, 4 threads (a new pool each time, as a user writes it) each make two calls in turn and
# read the first reply only after the second came back: a reply rewritten under its caller shows too.
# HOW is how a thread makes one call; Y is every reply's Y, in call order.
THREADED_CALLER = """
import asyncio
import concurrent.futures

import numpy as np
import triton_python_backend_utils as pb_utils


def call(x, target):
    return pb_utils.InferenceRequest(model_name=target, requested_output_names=["Y"],
                                     inputs=[pb_utils.Tensor("X", x)])


def outputs(reply):
    if reply.has_error():
        raise pb_utils.TritonModelException(reply.error().message())
    return [pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()]


async def awaited(awaitable):
    return await awaitable


def exec_sync(x):
    return outputs(call(x, "affine").exec())


def exec_async(x):
    return outputs(asyncio.run(awaited(call(x, "affine").async_exec())))


def exec_stream(x):
    found = []
    for reply in call(x, "affine_stream").exec(decoupled=True):
        if reply.has_error() or pb_utils.get_output_tensor_by_name(reply, "Y") is not None:
            found += outputs(reply)
    return found


HOW = {how}


def two_calls(x):
    first = HOW(x)
    second = HOW(x + 0.5)
    return [*first, *second]


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(two_calls, [x + 1000 * k for k in range(4)]))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", np.concatenate([y for thread in replies for y in thread]))]))
        return responses
"""

# An async execute: two async_exec calls gathered on the loop while two threads call exec.
ASYNC_CALLER = """
import asyncio
import concurrent.futures

import numpy as np
import triton_python_backend_utils as pb_utils


def call(x):
    return pb_utils.InferenceRequest(model_name="affine", requested_output_names=["Y"],
                                     inputs=[pb_utils.Tensor("X", x)])


class TritonPythonModel:
    def initialize(self, args):
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    async def execute(self, requests):
        loop = asyncio.get_running_loop()
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            replies = await asyncio.gather(call(x).async_exec(), call(x + 1000).async_exec(),
                                           loop.run_in_executor(self.pool, lambda: call(x + 2000).exec()),
                                           loop.run_in_executor(self.pool, lambda: call(x + 3000).exec()))
            for reply in replies:
                if reply.has_error():
                    raise pb_utils.TritonModelException(reply.error().message())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.concatenate(
                [pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy() for reply in replies]))]))
        return responses
"""


CALLERS = {
    "threads_exec": THREADED_CALLER.replace("{how}", "exec_sync"),
    "threads_async_exec": THREADED_CALLER.replace("{how}", "exec_async"),
    "threads_stream": THREADED_CALLER.replace("{how}", "exec_stream"),
    "async_and_threads": ASYNC_CALLER,
}
CLIENT_THREADS, REQUESTS_PER_THREAD = 4, 6


def _expected(caller: str, x: np.ndarray) -> np.ndarray:
    """What ``caller`` answers for ``x``, computed here."""
    if caller == "async_and_threads":
        return np.concatenate([(x + 1000 * k) * 2 + 1 for k in range(4)])
    answers = (1, 2, 3) if caller == "threads_stream" else (1,)
    return np.concatenate([(x + 1000 * k + half) * 2 + a for k in range(4) for half in (0, 0.5) for a in answers])


def _bls_repository(repo: Path) -> list[str]:
    """The called models and every caller, each as a process instance and as a thread instance."""
    pm.write_model(repo, "affine", X_CONFIG + TARGET_INSTANCES, AFFINE)
    pm.write_model(repo, "affine_stream", STREAM_CONFIG, AFFINE_STREAM)
    names = []
    for caller, source in CALLERS.items():
        for kind, extra in (("process", ""), ("thread", THREADS)):
            names.append(f"{caller}_{kind}")
            pm.write_model(repo, names[-1], X_CONFIG + extra, source)
    return names


def _hammer(url: str, model: str, thread: int) -> list[str]:
    """Requests one after another, each with its own input; what went wrong, if anything."""
    wrong = []
    with grpcclient.InferenceServerClient(url) as client:
        for index in range(REQUESTS_PER_THREAD):
            x = np.arange(2048, dtype=np.float32) + 100_000 * thread + 10_000 * index
            try:
                y = client.infer(model, _x(x), client_timeout=60).as_numpy("Y")
            except InferenceServerException as exc:
                wrong.append(f"{model} request {thread}.{index}: {exc}")
                continue
            if y.shape != _expected(model.rsplit("_", 1)[0], x).shape or not np.array_equal(
                y, _expected(model.rsplit("_", 1)[0], x)
            ):
                wrong.append(f"{model} request {thread}.{index}: another call's answer")
    return wrong


@pytest.mark.timeout(600)
def test_bls_from_many_threads_of_one_instance_gets_every_call_its_own_answer(tmp_path: Path, server_factory) -> None:
    """exec, async_exec and exec(decoupled=True) from the threads of one instance (and async_exec on its
    loop beside exec on threads), many requests at once: each call gets its own reply, none hangs."""
    repo = tmp_path / "repo"
    names = _bls_repository(repo)
    server = server_factory(repo)
    with concurrent.futures.ThreadPoolExecutor(CLIENT_THREADS * len(names)) as pool:
        runs = [pool.submit(_hammer, server.url, name, thread) for name in names for thread in range(CLIENT_THREADS)]
        wrong = [line for run in runs for line in run.result(timeout=400)]
    assert not wrong, "\n".join(wrong[:20])


# X[0] == 1 takes 3 s; others are answered at once (by another of its instances).
SLOW_FOR_ONE = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x[0] == 1:
            time.sleep(3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
"""

# Gives up on its call after 0.5 s (asyncio.wait_for) and answers -1; the abandoned call's wait goes on.
GIVES_UP = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            call = pb_utils.InferenceRequest(model_name="slow", requested_output_names=["Y"],
                                             inputs=[pb_utils.Tensor("X", x)])
            try:
                reply = await asyncio.wait_for(call.async_exec(), 0.5)
                y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
            except asyncio.TimeoutError:
                y = np.full_like(x, -1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""


@pytest.mark.timeout(240)
def test_an_abandoned_async_exec_never_swallows_the_next_batch(tmp_path: Path, server_factory) -> None:
    """The thread still waiting for a given-up call's reply after the batch ended must not read the pipe
    in the worker's place: the next requests are answered, and the late reply goes to that thread alone."""
    repo = tmp_path / "repo"
    pm.write_model(repo, "slow", X_CONFIG + "instance_group [ { count: 4 kind: KIND_CPU } ]\n" + THREADS, SLOW_FOR_ONE)
    for kind, extra in (("process", ""), ("thread", THREADS)):
        pm.write_model(repo, f"gives_up_{kind}", X_CONFIG + extra, GIVES_UP)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        for kind in ("process", "thread"):
            assert client.infer(f"gives_up_{kind}", _x(np.ones(2)), client_timeout=30).as_numpy("Y").tolist() == [
                -1,
                -1,
            ]
            for value in range(2, 8):
                answer = client.infer(f"gives_up_{kind}", _x(np.full(2, float(value))), client_timeout=30)
                assert answer.as_numpy("Y").tolist() == [value, value]


# -- BLS to itself (issue 22, item 8) ---------------------------------------------------------------

# X[0] > 0: call this same model with zeros (a leaf call) and answer the leaf's Y + 1, or its error.
CALLS_ITSELF = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] <= 0:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
                continue
            reply = pb_utils.InferenceRequest(model_name=self.name, requested_output_names=["Y"],
                                              inputs=[pb_utils.Tensor("X", np.zeros_like(x))]).exec()
            if reply.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(reply.error().message())))
            else:
                y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y + 1)]))
        return responses
"""


@pytest.mark.timeout(240)
def test_bls_to_itself_with_one_instance_is_refused_and_the_model_keeps_serving(tmp_path: Path, server_factory) -> None:
    """With one instance the call would wait for the instance that makes it, forever (Triton 2.51 hangs so,
    timeout or not): it fails at once with a message that says why; with two instances it is served."""
    repo = tmp_path / "repo"
    for kind, extra in (("process", ""), ("thread", THREADS)):
        pm.write_model(
            repo, f"self_{kind}", X_CONFIG + "instance_group [ { count: 1 kind: KIND_CPU } ]\n" + extra, CALLS_ITSELF
        )
        pm.write_model(repo, f"self_{kind}_twice", X_CONFIG + TARGET_INSTANCES + extra, CALLS_ITSELF)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as client:
        for kind in ("process", "thread"):
            with pytest.raises(InferenceServerException, match="its only instance"):
                client.infer(f"self_{kind}", _x(np.ones(2)), client_timeout=30)
            assert client.infer(f"self_{kind}", _x(np.zeros(2)), client_timeout=30).as_numpy("Y").tolist() == [0, 0]
            answer = client.infer(f"self_{kind}_twice", _x(np.ones(2)), client_timeout=30).as_numpy("Y")
            assert answer.tolist() == [1, 1]


def test_a_feed_sent_to_a_python_models_worker_is_refused_at_once_not_waited_on() -> None:
    """A Python model's process instance runs lists of requests: its ``run`` (inherited from the feed
    models' process instance) refuses at once, and a feed's Run reaching its worker is answered Failed.
    Found by review: with ``run`` removed, the inherited one waited on the worker forever."""
    from shoal.backends.devices import CPU
    from shoal.configuring.pipeline import configure
    from shoal.errors import ErrorCode, ShoalError
    from shoal.instances.process import ProcessModel, WorkerLimits
    from shoal.instances.python_process import PythonProcessModel
    from tests.models import EXAMPLES

    folder = EXAMPLES / "preprocess"
    spec = configure(folder, strict=False).spec
    model = PythonProcessModel(spec, folder / "1" / "model.py", CPU, "preprocess_0", 1, WorkerLimits(0.0, 0.0))
    try:
        feed = {"IMAGE": np.zeros((1, 16, 16), np.uint8)}
        with pytest.raises(ShoalError) as refused:
            model.run(feed, ["INPUT0"])
        assert refused.value.code is ErrorCode.UNSUPPORTED
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the worker's own answer, bounded by the test
            sent = pool.submit(ProcessModel.run, model, feed, ["INPUT0"])
            with pytest.raises(RuntimeError, match="runs lists of requests, not Run"):
                sent.result(timeout=60)
    finally:
        model.close()

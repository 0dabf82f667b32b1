"""Every answer is the one computed here: random requests through every process layout (issue 22).

Wrong answers came from memory a request owned being read after it was reused (a front-end worker's
arena, a model's buffers) and from models reading each other's state. Such defects show only under a
mix: other clients' requests in flight through the same worker, batches that join requests, states
kept between steps. So, for each layout (one process; one front-end worker, where every client
shares one arena; two workers), client threads send a seeded random mix of requests — ONNX, PyTorch
and identity models in thread and process instances, Python models in thread and process instances
(one answering in a buffer it refills for every request), BLS, ensembles, two sequence models with
implicit state (one whose state is its input passed through), models answered from a small response
cache (an identity model, whose answer may be a view of the request's own memory, an ensemble and a
Python model, asked from a small set of values so that answers are served from the cache and evicted
from it), inputs and outputs inline, over HTTP and in system shared memory, vectors either side of
the bytes a Python process instance's batch carries in its pipe message rather than in its arena
(``shoal.dataplane.inline``) — and every answer is
compared with the value this test computes for it. The seed is printed on failure
(``SHOAL_PROPERTY_SEED`` replays one). Counts are bounded, and so is the time.
"""

from __future__ import annotations

import os
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from shoal.dataplane import inline
from tests import ensemble_models, python_models
from tests.conftest import RunningServer, serving
from tests.sequence_models import PROCESSES, add_accumulator, add_torch_passthrough_state

LAYOUTS = {"one-process": (), "one-worker": ("--grpc-workers", "1"), "two-workers": ("--grpc-workers", "2")}
CLIENTS = 5
OPERATIONS_PER_CLIENT = 30
TIMEOUT_S = 240.0  # for the whole mix of one layout; a few seconds when the machine is quiet
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"
CACHE = "response_cache { enable: true }\n"
CACHE_BYTES = 2048  # some twenty answers: the cached models' values (below) do not all fit
THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }\n'

# model -> (input name, output name, what the model computes); rows of 4 FP32 for batched models.
ROW_MODELS: dict[str, tuple[str, str, Callable[[np.ndarray], np.ndarray]]] = {
    "add1": ("IN", "OUT", lambda x: x + 1),
    "torch_double": ("INPUT__0", "OUTPUT__0", lambda x: x * 2),
    "torch_double_processes": ("INPUT__0", "OUTPUT__0", lambda x: x * 2),
    "echo": ("IN", "OUT", lambda x: x),
    "add1_then_double": ("IN", "OUT", lambda x: (x + 1) * 2),
    "echo_cached": ("IN", "OUT", lambda x: x),
    "add1_then_double_cached": ("IN", "OUT", lambda x: (x + 1) * 2),
}
# Python models: X of any length, no batching.
VECTOR_MODELS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "py_double_threads": lambda x: x * 2,
    "py_double_processes": lambda x: x * 2,
    "py_bls_threads": lambda x: x * 8,  # x to py_double twice over: 2x, then 4x + 4x
    "py_bls_processes": lambda x: x * 8,
    "py_double_cached": lambda x: x * 2,
    "py_triple_reused_threads": lambda x: x * 3,  # answered in one buffer the model refills every request
    "py_triple_reused_processes": lambda x: x * 3,
    "py_reused_then_double": lambda x: x * 6,  # that buffer's answer waits for the ensemble's next step
}
VECTOR_IO = (
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]'
)
REGION_BYTES = 64  # the largest tensor sent through shared memory: 4 rows of 4 FP32, or 8 FP32
# FP32 elements that fill the bytes a batch carries in its message: vectors of a few more or fewer
# go to a Python process instance in its arena or in the message (over gRPC or HTTP only).
AT_THE_INLINE_LIMIT = inline.INLINE_BYTES // 4


def _append(folder: Path, text: str) -> None:
    config = folder / "config.pbtxt"
    config.write_text(config.read_text() + text)


def build_repository(repo: Path) -> None:
    ensemble_models.add_onnx_add1(repo, "add1")
    _append(repo / "add1", BATCHING)
    ensemble_models.add_torch_double(repo, "torch_double")
    _append(repo / "torch_double", BATCHING)
    ensemble_models.add_torch_double(repo, "torch_double_processes")
    _append(repo / "torch_double_processes", BATCHING + PROCESSES)
    ensemble_models.add_identity(repo, "echo", extra=BATCHING)
    for suffix, extra in (("", ""), ("_cached", CACHE)):
        ensemble_models.add_ensemble(
            repo,
            f"add1_then_double{suffix}",
            [
                ensemble_models.step("add1", {"IN": "IN"}, {"OUT": "plus_one"}),
                ensemble_models.step("torch_double", {"INPUT__0": "plus_one"}, {"OUTPUT__0": "OUT"}),
            ],
            extra=extra,
        )
    ensemble_models.add_identity(repo, "echo_cached", extra=BATCHING + CACHE)
    python_models.write_model(repo, "py_double_cached", python_models.DOUBLE_CONFIG + CACHE, python_models.DOUBLE)
    python_models.write_model(repo, "py_double_threads", python_models.DOUBLE_CONFIG + THREADS, python_models.DOUBLE)
    python_models.write_model(repo, "py_double_processes", python_models.DOUBLE_CONFIG, python_models.DOUBLE)
    bls = python_models.BLS_DOUBLE.replace('model_name="double"', 'model_name="py_double_threads"')
    assert bls != python_models.BLS_DOUBLE
    python_models.write_model(repo, "py_bls_threads", python_models.DOUBLE_CONFIG + THREADS, bls)
    python_models.write_model(
        repo, "py_bls_processes", python_models.DOUBLE_CONFIG, bls.replace("py_double_threads", "py_double_processes")
    )
    for suffix, extra in (("threads", THREADS), ("processes", "")):
        python_models.write_model(
            repo,
            f"py_triple_reused_{suffix}",
            python_models.DOUBLE_CONFIG + extra,
            python_models.reuses_buffer("X", "Y", 3),
        )
    ensemble_models.add_ensemble(
        repo,
        "py_reused_then_double",
        [
            ensemble_models.step("py_triple_reused_threads", {"X": "X"}, {"Y": "tripled"}),
            ensemble_models.step("py_double_threads", {"X": "tripled"}, {"Y": "Y"}),
        ],
        io=VECTOR_IO,
        max_batch_size=0,
    )
    add_accumulator(repo, "acc", "direct { max_queue_delay_microseconds: 2000 }", instances=2)
    add_torch_passthrough_state(repo, "pass")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    build_repository(repo)
    with serving(
        repo, tmp_path_factory.mktemp("server"), *LAYOUTS[request.param], "--cache-config", f"local,size={CACHE_BYTES}"
    ) as running:
        yield running


@dataclass
class Regions:
    """One client's two system shared-memory regions (its requests are sequential: one pair serves)."""

    tag: str
    inputs: Any
    outputs: Any

    @classmethod
    def create(cls, client: grpcclient.InferenceServerClient) -> Regions:
        tag = uuid.uuid4().hex[:12]
        regions = cls(
            tag,
            shm.create_shared_memory_region(f"in_{tag}", f"/shoal_prop_in_{tag}", REGION_BYTES),
            shm.create_shared_memory_region(f"out_{tag}", f"/shoal_prop_out_{tag}", REGION_BYTES),
        )
        client.register_system_shared_memory(f"in_{tag}", f"/shoal_prop_in_{tag}", REGION_BYTES)
        client.register_system_shared_memory(f"out_{tag}", f"/shoal_prop_out_{tag}", REGION_BYTES)
        return regions

    def close(self, client: grpcclient.InferenceServerClient) -> None:
        for name, handle in ((f"in_{self.tag}", self.inputs), (f"out_{self.tag}", self.outputs)):
            client.unregister_system_shared_memory(name)
            shm.destroy_shared_memory_region(handle)


class Client:
    """One client thread's connections; ``infer`` sends one request the way ``how`` says."""

    def __init__(self, server: RunningServer) -> None:
        self.grpc = grpcclient.InferenceServerClient(server.url)
        self.http = httpclient.InferenceServerClient(server.http_url)
        self.regions = Regions.create(self.grpc)

    def close(self) -> None:
        self.regions.close(self.grpc)
        self.grpc.close()
        self.http.close()

    def infer(self, how: str, model: str, name: str, output: str, value: np.ndarray, **sequence: Any) -> np.ndarray:
        if how == "http":
            tensor = httpclient.InferInput(name, list(value.shape), "FP32")
            tensor.set_data_from_numpy(value, binary_data=bool(value.size % 2))  # JSON or binary
            result = self.http.infer(model, [tensor], **sequence)
            return np.asarray(result.as_numpy(output))
        tensor = grpcclient.InferInput(name, list(value.shape), "FP32")
        if how == "grpc":
            tensor.set_data_from_numpy(value)
            return np.asarray(self.grpc.infer(model, [tensor], **sequence).as_numpy(output))
        shm.set_shared_memory_region(self.regions.inputs, [value])
        tensor.set_shared_memory(f"in_{self.regions.tag}", value.nbytes)
        wanted = grpcclient.InferRequestedOutput(output)
        wanted.set_shared_memory(f"out_{self.regions.tag}", value.nbytes)
        self.grpc.infer(model, [tensor], outputs=[wanted], **sequence)
        answer = shm.get_contents_as_numpy(self.regions.outputs, np.float32, value.shape).copy()
        shm.set_shared_memory_region(self.regions.inputs, [np.full(value.shape, np.nan, np.float32)])  # reused
        return answer


def _values(rng: random.Random, shape: tuple[int, ...], low: int = -500, high: int = 500) -> np.ndarray:
    """Small integers as FP32: every model's answer is exact, so equality is the check."""
    return np.array([rng.randint(low, high) for _ in range(int(np.prod(shape)))], np.float32).reshape(shape)


def _one_request(client: Client, rng: random.Random) -> str | None:
    """A random stateless request; what was wrong about its answer, or None."""
    how = rng.choice(("grpc", "http", "shm"))
    if rng.random() < 0.6:
        model = rng.choice(list(ROW_MODELS))
        name, output, compute = ROW_MODELS[model]
        # a cached model is asked one of 16 rows: its answers come from the cache, or are evicted from it
        value = _values(rng, (1, 4), 0, 1) if model.endswith("_cached") else _values(rng, (rng.randint(1, 4), 4))
    else:
        model = rng.choice(list(VECTOR_MODELS))
        name, output, compute = "X", "Y", VECTOR_MODELS[model]
        if model.endswith("_cached"):
            value = _values(rng, (rng.randint(1, 2),), 0, 2)
        elif rng.random() < 0.2:
            value = _values(rng, (AT_THE_INLINE_LIMIT + rng.randint(-2, 2),))
            how = rng.choice(("grpc", "http"))
        else:
            value = _values(rng, (rng.randint(1, 8),))
    answer = client.infer(how, model, name, output, value)
    expected = compute(value)
    if answer.shape != expected.shape or not np.array_equal(answer, expected):
        return f"{model} over {how}: sent {_shown(value)}, got {_shown(answer)}, expected {_shown(expected)}"
    return None


def _shown(array: np.ndarray) -> str:
    """An array in a failure's message: whole when small, else its size and first values."""
    if array.size <= 16:
        return str(array.tolist())
    return f"{array.shape} starting {array.reshape(-1)[:8].tolist()}"


def _sequence_step(client: Client, rng: random.Random, state: dict[str, Any]) -> str | None:
    """The next step of this client's open sequence (a new one after the last step)."""
    if not state.get("steps"):
        state.update(
            model=rng.choice(("acc", "pass")),
            cid=state["next_cid"],
            steps=rng.randint(2, 6),
            previous=0.0,
            total=0.0,
            first=True,
        )
        state["next_cid"] += 1
    value = float(rng.randint(-500, 500))
    state["steps"] -= 1
    how = rng.choice(("grpc", "http", "shm"))
    answer = client.infer(
        how,
        state["model"],
        "INPUT",
        "OUTPUT",
        np.full((1, 1), value, np.float32),
        sequence_id=state["cid"],
        sequence_start=state["first"],
        sequence_end=state["steps"] == 0,
    )
    state["first"] = False
    state["total"] += value
    expected = state["total"] if state["model"] == "acc" else value - state["previous"]
    state["previous"] = value
    if answer.reshape(-1).tolist() != [expected]:
        return (
            f"{state['model']} sequence {state['cid']} over {how}: sent {value}, got {answer.tolist()}, "
            f"expected {expected}"
        )
    return None


def _client_mix(server: RunningServer, seed: int, index: int, stop: threading.Event) -> list[str]:
    rng = random.Random(seed * 1000 + index)
    client = Client(server)
    wrong: list[str] = []
    sequence: dict[str, Any] = {"next_cid": 1_000_000 * (index + 1)}
    try:
        for _ in range(OPERATIONS_PER_CLIENT):
            if stop.is_set():
                break
            problem = _sequence_step(client, rng, sequence) if rng.random() < 0.35 else _one_request(client, rng)
            if problem:
                wrong.append(problem)
        while sequence.get("steps"):  # end the open sequence, so its slot is free for the next layout's run
            if problem := _sequence_step(client, rng, sequence):
                wrong.append(problem)
    finally:
        client.close()
    return wrong


def test_every_answer_is_the_one_computed_here(server: RunningServer) -> None:
    seed = int(os.environ.get("SHOAL_PROPERTY_SEED", random.randrange(1 << 30)))
    stop = threading.Event()
    with ThreadPoolExecutor(CLIENTS) as pool:
        mixes = [pool.submit(_client_mix, server, seed, index, stop) for index in range(CLIENTS)]
        try:
            wrong = [problem for mix in mixes for problem in mix.result(timeout=TIMEOUT_S)]
        finally:
            stop.set()
    assert not wrong, f"seed {seed}: {len(wrong)} wrong answers, first: {wrong[:5]}"

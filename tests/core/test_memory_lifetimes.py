"""Nothing that outlives a request refers to memory the request owned (issue 22, item 1).

A front-end worker copies a request's inputs into its arena and the host reads them in place; a
model's state output can be its input returned as it came (a view of that arena). Such a state is
kept by the server after the request is answered, so the worker must not reuse the block while the
host still refers to it. These tests keep states that are views of requests' inputs, send other
clients' requests through the same worker meanwhile, and compare every answer with one computed here.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, serving
from tests.models import add_identity
from tests.sequence_models import add_torch_passthrough_state

# One worker: every client's requests share one arena, so a block freed too early is reused at once.
LAYOUTS = {"one-process": (), "one-worker": ("--grpc-workers", "1"), "two-workers": ("--grpc-workers", "2")}
PASSTHROUGH_MODELS = ("pass_direct", "pass_oldest", "pass_processes")
STEPS = 12
SEQUENCES = 4
INTERFERING_VALUE = 1001.0


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    add_torch_passthrough_state(repo, "pass_direct")
    add_torch_passthrough_state(
        repo, "pass_oldest", "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }"
    )
    add_torch_passthrough_state(repo, "pass_processes", processes=True)
    add_identity(repo, "identity_fp32", "FP32", dims="[ 1 ]")
    with serving(repo, tmp_path_factory.mktemp("server"), *LAYOUTS[request.param]) as running:
        yield running


def _step(
    client: grpcclient.InferenceServerClient, model: str, cid: int, value: float, start: bool, end: bool
) -> float:
    data = grpcclient.InferInput("INPUT", [1, 1], "FP32")
    data.set_data_from_numpy(np.full((1, 1), value, dtype=np.float32))
    result = client.infer(model, [data], sequence_id=cid, sequence_start=start, sequence_end=end)
    return float(result.as_numpy("OUTPUT").item())


def _run_sequence(url: str, model: str, cid: int) -> list[tuple[float, float]]:
    """(answer, expected) per step: OUTPUT = INPUT - the previous step's INPUT (0 before the first)."""
    values = [float(cid * 1000 + 7 * k) for k in range(STEPS)]
    with grpcclient.InferenceServerClient(url) as client:
        return [
            (_step(client, model, cid, value, k == 0, k == STEPS - 1), value - (values[k - 1] if k else 0.0))
            for k, value in enumerate(values)
        ]


def _interfere(url: str, done: threading.Event) -> int:
    """Another client's requests to another model, until the sequences are done (bounded)."""
    sent = 0
    with grpcclient.InferenceServerClient(url) as client:
        while not done.is_set() and sent < 2_000:
            data = grpcclient.InferInput("IN", [1, 1], "FP32")
            data.set_data_from_numpy(np.full((1, 1), INTERFERING_VALUE, dtype=np.float32))
            assert client.infer("identity_fp32", [data]).as_numpy("OUT").item() == INTERFERING_VALUE
            sent += 1
    return sent


@pytest.mark.parametrize("model", PASSTHROUGH_MODELS)
def test_a_state_that_is_the_request_input_outlives_the_request(server: RunningServer, model: str) -> None:
    done = threading.Event()
    with ThreadPoolExecutor(SEQUENCES + 1) as pool:
        interference = pool.submit(_interfere, server.url, done)
        try:
            runs = [pool.submit(_run_sequence, server.url, model, cid) for cid in range(1, SEQUENCES + 1)]
            answers = [run.result(timeout=120) for run in runs]
        finally:
            done.set()
        interference.result(timeout=60)
    wrong = [
        (cid, step, got, want)
        for cid, steps in enumerate(answers, 1)
        for step, (got, want) in enumerate(steps)
        if got != want
    ]
    assert not wrong, f"{len(wrong)} wrong answers (sequence, step, got, expected): {wrong[:8]}"


def test_the_host_releases_a_worker_block_only_when_no_view_of_it_is_left() -> None:
    """The host's side of the rule, without a server: a core that keeps a request's input (as a
    sequence keeps a passed-through state) holds the worker's block after the answer; RELEASE comes
    when the last view is gone, not before."""
    import gc
    import socket

    from shoal.core import messages
    from shoal.core.host import CoreHost
    from shoal.dataplane import packing
    from shoal.dataplane.arena import Arena, BlockAllocator
    from shoal.dataplane.channel import Channel
    from shoal.protocol.types import DataType
    from shoal.request_types import InferRequest, InferResponse, Tensor

    kept: list[np.ndarray] = []

    class KeepingCore:
        async def infer(self, request: InferRequest, origin: object = None) -> InferResponse:
            kept.append(request.inputs[0].data)  # outlives the request, as a state would
            return InferResponse(request.model_name, "1", request.id, ())

    async def scenario() -> tuple[list[object], Any]:
        host_end, worker_end = socket.socketpair()
        received: asyncio.Queue[Any] = asyncio.Queue()
        requests, responses = Arena.create("t-requests", 1 << 16), Arena.create("t-responses", 1 << 16)
        try:
            host = CoreHost(KeepingCore(), requests, responses)  # type: ignore[arg-type]
            await host.connect(host_end)
            worker = await Channel.open(worker_end, received.put_nowait, lambda: None, messages.RECORDS)
            value = Tensor("IN", DataType.FP32, (1, 4), np.arange(4, dtype=np.float32).reshape(1, 4))
            _, slots = packing.pack(requests, BlockAllocator(requests.size), [value])
            worker.send(messages.Infer(7, "m", "", "", None, {}, {}, (), {}, slots, False, []))
            answered = await asyncio.wait_for(received.get(), 10)
            # A RELEASE due at the answer would have been written with it, in the same write.
            early = [received.get_nowait() for _ in range(received.qsize())]
            assert kept[0].tolist() == [[0, 1, 2, 3]]
            kept.clear()
            gc.collect()
            released = await asyncio.wait_for(received.get(), 10)
            host.close()
            worker.close()
            return [type(answered), *map(type, early)], released
        finally:
            requests.close()
            responses.close()

    before, released = asyncio.run(scenario())
    assert before == [messages.Inferred], "the block was released while the core still held a view of it"
    assert type(released) is messages.Release and released.ids == [7]


# -- what a worker's pool gets back, and when (found by review) --------------------------------------------

POOL_MB = 8
BIG_ELEMENTS = 5 * 1024 * 1024 // 4  # 5 MiB of FP32: two at once do not fit in the pool

DECOUPLED_ECHO = """
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.answer, args=(sender, data)).start()
        return None

    def answer(self, sender, data):
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data[:4].copy())]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def _big(value: float) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [BIG_ELEMENTS], "FP32")
    tensor.set_data_from_numpy(np.full(BIG_ELEMENTS, value, dtype=np.float32))
    return [tensor]


def _until_served(call: Callable[[], object], what: str, timeout_s: float = 30.0) -> object:
    """``call()`` until it is not refused for a full pool: the block of an answered request comes back
    with the host's RELEASE, which may follow the answer by a moment, but must come."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except InferenceServerException as exc:
            if "pool is full" not in str(exc) or time.monotonic() > deadline:
                raise AssertionError(f"{what}: {exc}") from None
        time.sleep(0.05)


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from tests import python_models

    repo = tmp_path_factory.mktemp("repo")
    for name in ("big", "big_too"):
        add_identity(repo, name, "FP32", max_batch_size=0)
    python_models.write_model(
        repo,
        "stream_threads",
        """
        backend: "python"
        max_batch_size: 0
        model_transaction_policy { decoupled: true }
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        parameters { key: "process_instances" value: { string_value: "false" } }
        """,
        DECOUPLED_ECHO,
    )
    with serving(
        repo, tmp_path_factory.mktemp("server"), "--grpc-workers", "1", "--grpc-worker-pool-mb", str(POOL_MB)
    ) as running:
        yield running


def test_an_idle_model_holds_no_block_of_its_last_request(small_pool_server: RunningServer) -> None:
    """The batcher's loop kept its last batch while it waited for the next one: every model that had
    served pinned its last request's inputs in every worker's pool, so a request near the pool's size
    failed for good on an idle server."""
    with grpcclient.InferenceServerClient(small_pool_server.url) as client:
        assert client.infer("big", _big(1.0)).as_numpy("OUT")[0] == 1.0
        answer = _until_served(lambda: client.infer("big_too", _big(2.0)), "a second big request, other model")
        assert answer.as_numpy("OUT")[-1] == 2.0  # type: ignore[attr-defined]


def _stream_once(url: str, value: float) -> list[float]:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("stream_threads", _big(value))
            result, error = answers.get(timeout=60)
        finally:
            client.stop_stream()
    if error is not None:
        raise error
    return list(np.asarray(result.as_numpy("OUT")).tolist())


def test_a_decoupled_thread_models_streams_give_their_blocks_back(small_pool_server: RunningServer) -> None:
    """A thread instance's request and its response sender referred to each other: the inputs of every
    stream waited for a full garbage collection, and streams filled the worker's pool."""
    for step in range(4):
        answer = _until_served(lambda value=float(step): _stream_once(small_pool_server.url, value), f"stream {step}")
        assert answer == [float(step)] * 4


def test_a_block_packed_for_a_caller_cancelled_meanwhile_is_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Costly messages are packed on a worker thread, which a cancelled caller cannot stop: the block it
    takes used to stay taken for good (in a worker's pool for a client's deadline, in the host's for a
    cancelled request with many BYTES outputs)."""
    from shoal.dataplane import packing
    from shoal.dataplane.arena import Arena, BlockAllocator
    from shoal.protocol.types import DataType
    from shoal.request_types import Tensor

    started, go = threading.Event(), threading.Event()
    real_pack = packing.pack

    def held_pack(*args: Any) -> Any:
        started.set()
        assert go.wait(30)
        return real_pack(*args)

    monkeypatch.setattr(packing, "pack", held_pack)
    value = Tensor("IN", DataType.BYTES, (3,), np.array([b"a", b"bc", b"def"], dtype=np.object_))

    async def scenario() -> tuple[int, int]:
        arena = Arena.create("t-cancelled", 1 << 16)
        allocator = BlockAllocator(arena.size)
        try:
            in_progress = asyncio.create_task(packing.pack_off_loop(arena, allocator, [value]))
            assert await asyncio.to_thread(started.wait, 30)
            in_progress.cancel()
            with pytest.raises(asyncio.CancelledError):
                await in_progress
            go.set()
            deadline = time.monotonic() + 30
            while allocator.free_bytes != allocator.capacity and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return allocator.free_bytes, allocator.capacity
        finally:
            arena.close()

    free, capacity = asyncio.run(scenario())
    assert free == capacity


def _worker_mappings(pid: int) -> int:
    return sum("memfd:shoal-worker" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_a_dead_workers_arenas_are_unmapped_by_the_host(tmp_path: Path) -> None:
    """The host kept both arenas of every worker that died mapped: memory it never gave back."""
    from tests.core.test_frontend_workers import worker_pids
    from tests.polling import wait_until

    repo = tmp_path / "repo"
    add_identity(repo, "echo", "FP32", dims="[ 1 ]")
    with serving(repo, tmp_path, "--grpc-workers", "1") as server:
        with_one_worker = _worker_mappings(server.pid)
        for _ in range(3):
            live = worker_pids(server)
            assert len(live) == 1, f"workers {live}, expected 1:\n{server.log()}"
            [killed] = live
            os.kill(killed, signal.SIGKILL)
            # one reading of /proc: two could see the dying worker, then the zombie, and no replacement yet
            wait_until(
                lambda gone=killed: len(live := worker_pids(server)) == 1 and gone not in live,
                what="a new worker in place of the killed one",
            )
        wait_until(
            lambda: _worker_mappings(server.pid) == with_one_worker,
            timeout_s=60,
            what=f"the host to map only its live worker's arenas ({with_one_worker} mappings): "
            f"{Path(f'/proc/{server.pid}/maps').read_text().count('shoal-worker')} now",
        )

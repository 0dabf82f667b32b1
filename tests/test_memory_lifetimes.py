"""Nothing that outlives a request refers to memory the request owned (issue 22, item 1).

A front-end worker copies a request's inputs into its arena and the host reads them in place; a
model's state output can be its input returned as it came (a view of that arena). Such a state is
kept by the server after the request is answered, so the worker must not reuse the block while the
host still refers to it. These tests keep states that are views of requests' inputs, send other
clients' requests through the same worker meanwhile, and compare every answer with one computed here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import RunningServer, start_server
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
    add_torch_passthrough_state(repo, "pass_oldest",
                                "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }")
    add_torch_passthrough_state(repo, "pass_processes", processes=True)
    add_identity(repo, "identity_fp32", "FP32", dims="[ 1 ]")
    running = start_server(repo, tmp_path_factory.mktemp("server"), *LAYOUTS[request.param])
    yield running
    assert running.stop() == 0, running.log()


def _step(client: grpcclient.InferenceServerClient, model: str, cid: int, value: float, start: bool,
          end: bool) -> float:
    data = grpcclient.InferInput("INPUT", [1, 1], "FP32")
    data.set_data_from_numpy(np.full((1, 1), value, dtype=np.float32))
    result = client.infer(model, [data], sequence_id=cid, sequence_start=start, sequence_end=end)
    return float(result.as_numpy("OUTPUT").item())


def _run_sequence(url: str, model: str, cid: int) -> list[tuple[float, float]]:
    """(answer, expected) per step: OUTPUT = INPUT - the previous step's INPUT (0 before the first)."""
    values = [float(cid * 1000 + 7 * k) for k in range(STEPS)]
    with grpcclient.InferenceServerClient(url) as client:
        return [(_step(client, model, cid, value, k == 0, k == STEPS - 1), value - (values[k - 1] if k else 0.0))
                for k, value in enumerate(values)]


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
    wrong = [(cid, step, got, want) for cid, steps in enumerate(answers, 1)
             for step, (got, want) in enumerate(steps) if got != want]
    assert not wrong, f"{len(wrong)} wrong answers (sequence, step, got, expected): {wrong[:8]}"


def test_the_host_releases_a_worker_block_only_when_no_view_of_it_is_left() -> None:
    """The host's side of the rule, without a server: a core that keeps a request's input (as a
    sequence keeps a passed-through state) holds the worker's block after the answer; RELEASE comes
    when the last view is gone, not before."""
    import asyncio
    import gc
    import socket

    from shoal.core import messages
    from shoal.core.host import CoreHost
    from shoal.dataplane import tensors
    from shoal.dataplane.arena import Arena, BlockAllocator
    from shoal.dataplane.channel import Channel
    from shoal.protocol.types import DataType
    from shoal.types import InferRequest, InferResponse, Tensor

    kept: list[np.ndarray] = []

    class KeepingCore:
        async def infer(self, request: InferRequest) -> InferResponse:
            kept.append(request.inputs[0].data)  # outlives the request, as a state would
            return InferResponse(request.model_name, "1", request.id, ())

    async def scenario() -> tuple[list[object], list[object]]:
        host_end, worker_end = socket.socketpair()
        received: asyncio.Queue[tuple[object, ...]] = asyncio.Queue()
        requests, responses = Arena.create("t-requests", 1 << 16), Arena.create("t-responses", 1 << 16)
        try:
            host = CoreHost(KeepingCore(), requests, responses)  # type: ignore[arg-type]
            await host.connect(host_end)
            worker = await Channel.open(worker_end, received.put_nowait, lambda: None)
            value = Tensor("IN", DataType.FP32, (1, 4), np.arange(4, dtype=np.float32).reshape(1, 4))
            _, slots = tensors.pack(requests, BlockAllocator(requests.size), [value])
            worker.send((messages.INFER, 7, ("m", "", "", None, {}, {}, (), {}), slots))
            answered = await asyncio.wait_for(received.get(), 10)
            # A RELEASE due at the answer would have been written with it, in the same write.
            early = [received.get_nowait() for _ in range(received.qsize())]
            assert kept[0].tolist() == [[0, 1, 2, 3]]
            kept.clear()
            gc.collect()
            released = await asyncio.wait_for(received.get(), 10)
            host.close()
            worker.close()
            return [answered[0], *early], list(released)
        finally:
            requests.close()
            responses.close()

    before, released = asyncio.run(scenario())
    assert before == [messages.INFERRED], "the block was released while the core still held a view of it"
    assert released == [messages.RELEASE, [7]]

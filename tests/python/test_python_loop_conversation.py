"""A Python process instance's batch carried by the event loop (``python_process.LoopConversation``):
the worker's answer read from the pipe without a thread, and every other turn of the conversation
handed to the instance's thread at the point it reached. The model is driven directly (no server),
so each test knows which path a batch took; the whole server runs the same code in
test_python_backend.py and test_process_instances.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.backends.devices import CPU
from shoal.configuring.pipeline import configure
from shoal.errors import ErrorCode, ShoalError
from shoal.instances.pool import InstanceThread
from shoal.instances.process import WorkerLimits
from shoal.instances.python_process import PythonProcessModel
from shoal.instances.worker_pipe import FrameReader

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

# Y = 2 X. A negative first element: sleep that many seconds first (a batch that takes a while).
MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.size and x.flat[0] < 0:
                time.sleep(-float(x.flat[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
"""


NO_LIMITS = WorkerLimits(execution_timeout_s=0.0, liveness_interval_s=0.0)


@dataclass
class Pending:
    """A queued request as an executor sees it."""

    x: np.ndarray
    context: Any = None
    size: int = 1
    outputs: tuple[str, ...] = ("Y",)
    feed: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.feed = {"X": self.x.astype(np.float32)}


@dataclass
class Context:
    """What a Python model reads of its request's core request."""

    parameters: dict[str, Any]
    id: str = "request"


class CountingThread(InstanceThread):
    """An instance thread that counts the calls handed to it."""

    def __init__(self) -> None:
        super().__init__("test-instance")
        self.calls = 0

    def run_into(self, future: asyncio.Future[Any], function: Callable[..., Any], *args: Any) -> None:
        self.calls += 1
        super().run_into(future, function, *args)


@pytest.fixture
def model_of(tmp_path: Path) -> Iterator[Callable[..., PythonProcessModel]]:
    made: list[PythonProcessModel] = []

    def make(limits: WorkerLimits = NO_LIMITS) -> PythonProcessModel:
        folder = tmp_path / "doubler"
        (folder / "1").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(CONFIG)
        (folder / "1" / "model.py").write_text(MODEL)
        spec = configure(folder, strict=False).spec
        model = PythonProcessModel(spec, folder / "1" / "model.py", CPU, "d_0", 1, limits)
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()


async def _run(model: PythonProcessModel, thread: InstanceThread, batch: list[Pending]) -> Any:
    """The batch as ``Instance.execute`` runs it: on the loop when the model takes it, else on the thread."""
    running = model.start_on_loop(batch, thread)
    if running is None:
        running = thread.submit(model.run_requests, batch)
    return await running


def _doubled(results: list[Any], batch: list[Pending]) -> None:
    assert len(results) == len(batch)
    for result, pending in zip(results, batch, strict=True):
        assert not isinstance(result, ShoalError), result
        np.testing.assert_array_equal(result["Y"], pending.feed["X"] * 2)


# -- the frames of the pipe -----------------------------------------------------------------------


@pytest.fixture
def pipe() -> Iterator[tuple[Any, Any, socket.socket]]:
    """(the reading Connection, the writing one, the reader's socket as the loop reads it)."""
    reading, writing = multiprocessing.Pipe()
    sock = socket.fromfd(reading.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
    yield reading, writing, sock
    sock.close()
    reading.close()
    writing.close()


def test_the_frame_reader_reads_one_message_at_a_time_and_leaves_the_next_in_the_pipe(pipe: Any) -> None:
    """Whatever follows a message stays for the Connection: a thread that takes the conversation over
    reads the worker's next message whole."""
    reading, writing, sock = pipe
    reader = FrameReader(sock)
    assert reader.read() is None  # nothing written yet: no wait
    big = os.urandom(100_000)  # past 16 KiB: the Connection writes its header and its body apart
    for message in (b"", b"first", big, b"second"):
        writing.send_bytes(message)
    assert reader.read() == b""
    assert reader.read() == b"first"
    assert reader.read() == big
    assert reading.recv_bytes() == b"second"  # untouched by the reader
    writing.close()
    with pytest.raises(EOFError):
        reader.read()


def test_the_frame_reader_keeps_a_message_that_arrives_in_parts(pipe: Any) -> None:
    """A writer stopped mid-message: the reader answers None until the rest comes, and never blocks."""
    _, writing, sock = pipe
    reader = FrameReader(sock)
    raw = socket.socket(fileno=os.dup(writing.fileno()))
    try:
        raw.sendall(struct.pack("!i", 10)[:3])
        assert reader.read() is None
        raw.sendall(struct.pack("!i", 10)[3:] + b"01234")
        assert reader.read() is None
        raw.sendall(b"56789")
        assert reader.read() == b"0123456789"
        raw.sendall(struct.pack("!i", -1) + struct.pack("!Q", 4) + b"long")  # the framing past 2 GiB
        assert reader.read() == b"long"
    finally:
        raw.close()


# -- the batch on the loop, and what is handed to the thread --------------------------------------


@pytest.mark.timeout(120)
def test_a_plain_batch_is_sent_and_answered_on_the_loop_without_the_thread(model_of: Any) -> None:
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            for size in (1, 3, 8):
                batch = [Pending(np.arange(i, i + 5)) for i in range(size)]
                assert (running := model.start_on_loop(batch, thread)) is not None
                _doubled(await running, batch)

        asyncio.run(scenario())
        assert thread.calls == 0
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_outputs_past_the_arena_are_handed_to_the_thread_which_grows_it(model_of: Any) -> None:
    """The worker asks for a bigger arena (Grow): the thread takes over, grows it, reads the answer."""
    model, thread = model_of(), CountingThread()
    try:
        batch = [Pending(np.linspace(0, 1, 400_000))]  # 1.6 MB of outputs; the arena starts at 1 MiB
        _doubled(asyncio.run(_run(model, thread, batch)), batch)
        assert thread.calls == 1
        small = [Pending(np.ones(3))]
        _doubled(asyncio.run(_run(model, thread, small)), small)
        assert thread.calls == 1  # back on the loop
    finally:
        thread.shutdown()


class HalfSending:
    """The loop's end of the pipe, taking half of what is written at once (a pipe with little room
    left, or a worker that is not reading)."""

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock

    def send(self, data: bytes, flags: int = 0) -> int:
        return self._socket.send(data[: len(data) // 2], flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


@pytest.mark.timeout(120)
def test_what_the_pipe_does_not_take_at_once_is_written_by_the_thread(model_of: Any) -> None:
    """The loop never waits to write: the rest of the batch's message goes to the thread, which writes
    it and reads the answer."""
    model, thread = model_of(), CountingThread()
    try:
        model._loop_socket = HalfSending(model._loop_socket)
        batch = [Pending(np.arange(6.0)), Pending(np.ones(4), Context({"note": "x" * 100_000}))]
        _doubled(asyncio.run(_run(model, thread, batch)), batch)
        assert thread.calls == 1
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_a_caller_that_gives_up_leaves_the_next_batch_its_own_answer(model_of: Any) -> None:
    """Cancelling the caller ends nothing: the conversation reads its answer, so the next batch,
    queued meanwhile on the thread, never gets the first one's outputs."""
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            slow = [Pending(np.array([-0.5, 1.0, 2.0]))]
            first = model.start_on_loop(slow, thread)
            assert first is not None
            waiting = asyncio.ensure_future(first)
            await asyncio.sleep(0)
            waiting.cancel()
            following = [Pending(np.array([7.0, 8.0, 9.0]))]
            assert model.start_on_loop(following, thread) is None  # the worker is still busy with the first
            _doubled(await thread.submit(model.run_requests, following), following)
            again = [Pending(np.array([3.0]))]
            _doubled(await _run(model, thread, again), again)

        asyncio.run(scenario())
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_a_worker_killed_during_a_loop_batch_fails_it_and_is_replaced(model_of: Any) -> None:
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            first_pid = model.pid
            assert first_pid is not None
            slow = [Pending(np.array([-30.0]))]
            running = model.start_on_loop(slow, thread)
            assert running is not None
            os.kill(first_pid, signal.SIGKILL)
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 60)
            assert failed.value.code is ErrorCode.UNAVAILABLE and "died" in failed.value.message
            assert model.pid != first_pid and model.healthy
            after = [Pending(np.array([1.0, 2.0]))]
            _doubled(await _run(model, thread, after), after)

        asyncio.run(scenario())
        assert thread.calls == 1  # the end of the pipe was handed over
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_the_execution_timeout_holds_for_a_batch_on_the_loop(model_of: Any) -> None:
    """A stopped worker (SIGSTOP) never answers: at the deadline the thread takes over and replaces it."""
    model, thread = model_of(WorkerLimits(execution_timeout_s=0.5, liveness_interval_s=0.0)), CountingThread()
    try:

        async def scenario() -> None:
            first_pid = model.pid
            assert first_pid is not None
            os.kill(first_pid, signal.SIGSTOP)
            running = model.start_on_loop([Pending(np.ones(2))], thread)
            assert running is not None
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 60)
            assert failed.value.code is ErrorCode.UNAVAILABLE and "execution_timeout_ms" in failed.value.message
            assert model.pid != first_pid and model.healthy  # replaced before the batch failed
            after = [Pending(np.array([5.0]))]
            _doubled(await _run(model, thread, after), after)

        asyncio.run(scenario())
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_a_conversation_handed_over_after_the_thread_stopped_still_ends(model_of: Any) -> None:
    """The instance's thread is shut down while a loop batch runs (the pool closing): a hand-over then
    runs on a thread of its own, so the batch ends and the instance's lock is released."""
    model, thread = model_of(), CountingThread()

    async def scenario() -> None:
        running = model.start_on_loop([Pending(np.array([-0.3]))] + [Pending(np.ones(4))], thread)
        assert running is not None
        thread.shutdown()
        pid = model.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShoalError):
            await asyncio.wait_for(running, 60)

    asyncio.run(scenario())
    assert thread.calls == 1
    assert model._lock.acquire(timeout=10)
    model._lock.release()

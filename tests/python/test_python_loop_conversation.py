"""A Python process instance's batch carried by the event loop (``python_process.LoopConversation``):
the worker's answer read from the pipe without a thread, and every other turn of the conversation
handed to the instance's relay thread at the point it reached. The model is driven directly (no server),
so each test knows which path a batch took; the whole server runs the same code in
test_python_backend.py and test_process_instances.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import multiprocessing
import os
import resource
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shoal.backends.devices import CPU
from shoal.configuring.pipeline import configure
from shoal.errors import ErrorCode, ShoalError
from shoal.instances import python_process
from shoal.instances.pool import InstanceThread
from shoal.instances.process import WorkerLimits
from shoal.instances.python_process import TIMED_OUT, Handover, PythonProcessModel, _costly_answers
from shoal.instances.worker_pipe import INITIAL_ARENA_BYTES, RESPONSES, Answer, FrameReader
from tests import python_models as pm

CONFIG = pm.X_TO_Y_CONFIG

# Y = 2 X, tiled ``repeat`` times (a request parameter; 1 without). A negative first element: sleep that
# many seconds first (a batch that takes a while).
MODEL = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.size and x.flat[0] < 0:
                time.sleep(-float(x.flat[0]))
            y = np.tile(x * 2, json.loads(request.parameters()).get("repeat", 1))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
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

    def make(limits: WorkerLimits = NO_LIMITS, source: str = MODEL, config: str = CONFIG) -> PythonProcessModel:
        """A model whose hand-overs are counted (``model._relay.calls``)."""
        folder = tmp_path / f"model{len(made)}"
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(config)
        (folder / "1" / "model.py").write_text(source)
        spec = configure(folder, strict=False).spec
        model = PythonProcessModel(spec, folder / "1" / "model.py", CPU, "d_0", 1, limits)
        model._relay.shutdown()
        model._relay = CountingThread()
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()


async def _run(model: PythonProcessModel, thread: InstanceThread, batch: list[Pending]) -> Any:
    """The batch as ``Instance.execute`` runs it: on the loop when the model takes it, else on the thread."""
    running = model.start_on_loop(batch)
    if running is None:
        running = thread.submit(model.run_requests, batch)
    return await running


def _handovers(model: PythonProcessModel) -> int:
    relay = model._relay
    assert isinstance(relay, CountingThread)
    return relay.calls


async def _next_batch_answered(model: PythonProcessModel, thread: InstanceThread, *x: float) -> None:
    """The instance's next batch (on whichever path it takes) gets its own answer, in time."""
    batch = [Pending(np.array(x))]
    _doubled(await asyncio.wait_for(_run(model, thread, batch), 60), batch)


def _doubled(results: list[Any], batch: list[Pending]) -> None:
    assert len(results) == len(batch)
    for result, pending in zip(results, batch, strict=True):
        assert not isinstance(result, ShoalError), result
        repeat = pending.context.parameters.get("repeat", 1) if pending.context is not None else 1
        np.testing.assert_array_equal(result["Y"], np.tile(pending.feed["X"] * 2, repeat))


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


# -- the batch on the loop, and what is handed to the relay thread --------------------------------


@pytest.mark.timeout(120)
def test_a_plain_batch_is_sent_and_answered_on_the_loop_without_a_thread(model_of: Any) -> None:
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            for size in (1, 3, 8):
                batch = [Pending(np.arange(i, i + 5)) for i in range(size)]
                assert (running := model.start_on_loop(batch)) is not None
                _doubled(await running, batch)

        asyncio.run(scenario())
        assert thread.calls == 0 and _handovers(model) == 0
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_the_loop_watches_a_worker_once_not_once_a_batch(model_of: Any) -> None:
    """Setting the watch up and tearing it down cost some twenty system calls a batch: the loop registers
    the worker's watch with its first batch and keeps it between batches (nothing is readable then)."""
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> list[int]:
            loop = asyncio.get_running_loop()
            registered: list[int] = []
            add_reader = loop.add_reader

            def counted(fd: int, callback: Callable[..., Any], *args: Any) -> None:
                registered.append(fd)
                add_reader(fd, callback, *args)

            loop.add_reader = counted  # type: ignore[method-assign]
            for value in range(6):
                batch = [Pending(np.array([float(value)]))]
                assert (running := model.start_on_loop(batch)) is not None
                _doubled(await running, batch)
            return registered

        registered = asyncio.run(scenario())
        assert len(registered) == 1, registered
        assert thread.calls == 0 and _handovers(model) == 0
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_the_loop_stops_watching_a_pipe_the_relay_reads_and_a_replaced_worker_gets_a_new_watch(
    model_of: Any,
) -> None:
    """A batch handed to the relay thread (here: its worker dies) leaves the loop watching nothing of
    it, so the loop never wakes for what the thread reads; the next worker is watched afresh, and its
    batches are answered on the loop again."""
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            await _next_batch_answered(model, thread, 1.0)
            first = model._loop_watch
            assert first is not None and first._watching
            running = model.start_on_loop([Pending(np.array([-30.0]))])
            assert running is not None
            assert model.pid is not None
            os.kill(model.pid, signal.SIGKILL)
            with pytest.raises(ShoalError):
                await asyncio.wait_for(running, 60)
            assert not first._watching and first.conversation is None
            await _next_batch_answered(model, thread, 2.0, 3.0)
            second = model._loop_watch
            assert second is not first and second is not None and second._watching
            assert first._selector.get_map() is None  # closed: its descriptor is given back

        asyncio.run(scenario())
        assert thread.calls == 0 and _handovers(model) == 1
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_no_descriptor_for_the_watch_leaves_the_batch_to_the_thread_and_the_instance_free(
    model_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors (EMFILE) when the watch is made, the batch takes the thread's path, which needs
    none; the instance's lock was held for good before (every later batch waited for it)."""
    model, thread = model_of(), CountingThread()

    def no_descriptor(*args: Any) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    try:

        async def scenario() -> None:
            with monkeypatch.context() as patched:
                patched.setattr(python_process, "LoopWatch", no_descriptor)
                assert model.start_on_loop([Pending(np.array([1.0]))]) is None
                await _next_batch_answered(model, thread, 2.0)
            batch = [Pending(np.array([3.0]))]
            assert (running := model.start_on_loop(batch)) is not None  # descriptors again: the loop's
            _doubled(await running, batch)

        asyncio.run(scenario())
        assert thread.calls == 1
    finally:
        thread.shutdown()


def test_a_batch_on_uvloop_leaves_the_pipe_blocking_for_the_relay_and_the_outbox(model_of: Any) -> None:
    """uvloop's add_reader (libuv's uv_poll) makes a descriptor non-blocking, and the flag is the pipe's,
    shared with the relay thread and the outbox, which write large messages blocking: on the worker
    layout a 6 MB BLS reply then failed half-written and the worker waited for its rest for good. The
    loop watches the pipe through a descriptor of its own: the pipe stays blocking, and a batch too
    large for the arenas still crosses it after loop batches."""
    uvloop = pytest.importorskip("uvloop")
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            assert model._loop_socket is not None
            pipe, wake = model._loop_socket.fileno(), model._wake_read
            blocking = (os.get_blocking(pipe), os.get_blocking(wake))
            for size in (1, 3):
                batch = [Pending(np.arange(i, i + 5)) for i in range(size)]
                assert (running := model.start_on_loop(batch)) is not None
                _doubled(await running, batch)
            assert (os.get_blocking(pipe), os.get_blocking(wake)) == blocking
            large = [Pending(np.arange(2_000_000, dtype=np.float32))]  # 8 MB: on the pipe, by the thread
            _doubled(await asyncio.wait_for(_run(model, thread, large), 60), large)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(scenario())
    finally:
        thread.shutdown()


def _run_keeping_its_worker(model: PythonProcessModel, thread: InstanceThread, scenario: Callable[[], Any]) -> None:
    """Run the coroutine function ``scenario``; the model's worker is the same one afterwards, and healthy."""
    worker = model._process.pid
    try:
        asyncio.run(scenario())
        assert model._process.pid == worker and model.healthy
    finally:
        thread.shutdown()


TWO_BY_TWO_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "TWICE_B" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""
# SUM = A + its sum, TWICE_B = 2 B, each request's own lengths; B starting with -7 fails that request alone;
# B starting with 99: SUM = the reply of a BLS call ("triple": 3 A, from the test's host) + A's sum.
TWO_BY_TWO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            if b.size and b[0] == -7:
                error = pb_utils.TritonError("refused " + request.request_id())
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            base = a
            if b.size and b[0] == 99:
                call = pb_utils.InferenceRequest(
                    model_name="triple", inputs=[pb_utils.Tensor("IN", a)], requested_output_names=["OUT"]
                )
                base = pb_utils.get_output_tensor_by_name(call.exec(), "OUT").as_numpy()
            outputs = [pb_utils.Tensor("SUM", (base + a.sum()).astype(np.float32)), pb_utils.Tensor("TWICE_B", b * 2)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""


@pytest.mark.timeout(180)
def test_every_request_of_a_batch_gets_its_own_outputs_on_both_paths(model_of: Any) -> None:
    """Batches of requests with their own lengths, some asking for one output of two, some failing, some
    calling another model, a few large enough to grow the arenas: each answer, on the loop and on the
    thread, is the one computed here for that request (a batch's inputs and outputs are packed and
    unpacked for the whole batch at once; a call's reply lands after the batch's inputs)."""
    model, thread = model_of(source=TWO_BY_TWO_MODEL, config=TWO_BY_TWO_CONFIG), InstanceThread("thread-path")
    rng = np.random.default_rng(7)

    def triple(request: Any, sink: Any, caller: Any = None, trace_id: int = 0) -> concurrent.futures.Future[Any]:
        (tensor,) = request.inputs
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        reply.set_result(SimpleNamespace(outputs=[SimpleNamespace(name="OUT", data=np.array(tensor.data) * 3)]))
        return reply

    model.bind_host(triple, None)

    def request(index: int) -> SimpleNamespace:
        length = int(rng.integers(0, 9)) if rng.random() < 0.9 else 300_000  # 1.2 MB: an arena to grow
        a = rng.standard_normal(length).astype(np.float32)
        b = rng.integers(-5, 50, int(rng.integers(0, 9))).astype(np.int32)
        if (draw := rng.random()) < 0.2:
            b = np.concatenate([np.array([-7], np.int32), b])
        elif draw < 0.45:  # its outputs come after a BLS call's reply in the batch's arena
            b = np.concatenate([np.array([99], np.int32), b])
        outputs = ("SUM", "TWICE_B") if rng.random() < 0.6 else (str(rng.choice(["SUM", "TWICE_B"])),)
        return SimpleNamespace(feed={"A": a, "B": b}, outputs=outputs, context=Context({}, f"r{index}"), size=1)

    def check(results: list[Any], batch: list[SimpleNamespace]) -> None:
        assert len(results) == len(batch)
        for result, pending in zip(results, batch, strict=True):
            a, b = pending.feed["A"], pending.feed["B"]
            if b.size and b[0] == -7:
                assert isinstance(result, ShoalError) and result.message == f"refused {pending.context.id}"
                continue
            assert not isinstance(result, ShoalError), result
            expected = {"SUM": (3 * a if b.size and b[0] == 99 else a) + a.sum(), "TWICE_B": b * 2}
            assert sorted(result) == sorted(pending.outputs)
            for name in pending.outputs:
                np.testing.assert_array_equal(result[name], expected[name])
                assert result[name].dtype == expected[name].dtype

    on_loop = 0

    async def scenario() -> None:
        nonlocal on_loop
        for round_number in range(40):
            batch = [request(i) for i in range(int(rng.integers(1, 9)))]
            running = None if round_number % 2 else model.start_on_loop(batch)
            on_loop += running is not None
            check(await (running or thread.submit(model.run_requests, batch)), batch)

    try:
        asyncio.run(scenario())
        assert on_loop >= 10  # both paths were taken (large inputs take the thread's)
        assert model._arenas[RESPONSES].size > INITIAL_ARENA_BYTES  # and the outputs grew their arena
    finally:
        thread.shutdown()


STRINGS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "S" data_type: TYPE_STRING dims: [ -1 ] } ]
"""
# S: X's numbers as objects (Triton sends each as the UTF-8 of its str), written into one buffer the model
# reuses for every response; a negative number, an object whose str raises (pb_utils.Tensor encodes the
# elements when it is built, as Triton's does: execute raises, and its batch fails).
STRINGS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


class TritonPythonModel:
    def initialize(self, args):
        self.buffer = np.empty(0, dtype=np.object_)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if self.buffer.size != x.size + 1:
                self.buffer = np.empty(x.size + 1, dtype=np.object_)
            self.buffer[:] = [Unprintable() if v < 0 else int(v) for v in x] + [None]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("S", self.buffer)]))
        return responses
"""


@pytest.mark.timeout(120)
def test_bytes_outputs_are_the_text_of_their_elements_when_the_tensor_was_built(model_of: Any) -> None:
    """Numbers in a BYTES output are sent as their text (12 was twelve zero bytes), each response with the
    content its tensor had when built though the model reuses one array (every response once carried the
    last request's strings), on both paths; an element that has no text fails its batch (as Triton's
    execute would), and the worker goes on."""
    model, thread = model_of(source=STRINGS_MODEL, config=STRINGS_CONFIG), InstanceThread("thread-path")

    def request(values: list[int], name: str) -> SimpleNamespace:
        feed = {"X": np.array(values, np.int32)}
        return SimpleNamespace(feed=feed, outputs=("S",), context=Context({}, name), size=1)

    def run(batch: list[SimpleNamespace], on_loop: bool) -> Any:
        running = model.start_on_loop(batch) if on_loop else thread.submit(model.run_requests, batch)
        assert running is not None
        return running

    async def scenario() -> None:
        for on_loop in (True, False):
            answers = await run([request([12, 3], "a"), request([4, 5], "b"), request([], "c")], on_loop)
            expected = [[b"12", b"3", b"None"], [b"4", b"5", b"None"], [b"None"]]  # a and b: one array, reused
            assert [list(answer["S"]) for answer in answers] == expected
            failed = await run([request([7], "good"), request([-1], "bad")], on_loop)
            assert all(isinstance(r, ShoalError) and "RuntimeError: no text" in r.message for r in failed)

    _run_keeping_its_worker(model, thread, scenario)


# MODEL, in a worker whose arenas may hold at most 2 MiB each way (the bound patched in the worker itself).
SMALL_ARENAS_MODEL = MODEL.replace(
    "class TritonPythonModel:\n",
    "class TritonPythonModel:\n"
    "    def initialize(self, args):\n"
    "        import shoal.instances.worker_pipe as pipe\n"
    "        pipe.MAX_ARENA_BYTES = 2 << 20\n\n",
)


@pytest.mark.timeout(120)
def test_a_response_past_the_arena_bound_fails_alone(model_of: Any) -> None:
    """A response whose outputs no arena can hold fails with its own error; the batch's other requests
    are answered and the worker is not replaced (the whole batch failed and the worker was replaced).
    Two that fit alone but not together: one is answered (an arena carries one batch's answers)."""
    model, thread = model_of(source=SMALL_ARENAS_MODEL), InstanceThread("thread-path")
    assert SMALL_ARENAS_MODEL != MODEL

    async def scenario() -> None:
        for on_loop in (True, False):
            huge = Pending(np.ones(4), Context({"repeat": 200_000}))  # 3.2 MB of outputs
            batch = [Pending(np.arange(3.0)), huge, Pending(np.ones(2), Context({"repeat": 100_000}))]
            running = model.start_on_loop(batch) if on_loop else thread.submit(model.run_requests, batch)
            assert running is not None
            small, refused, middle = await running
            _doubled([small, middle], [batch[0], batch[2]])
            assert isinstance(refused, ShoalError) and "at most 2 MiB each way" in refused.message
            assert "with the other responses" not in refused.message  # past the bound on its own
            pair = [Pending(np.ones(2), Context({"repeat": 150_000})) for _ in range(2)]  # 1.2 MB each
            running = model.start_on_loop(pair) if on_loop else thread.submit(model.run_requests, pair)
            assert running is not None
            answered = [r for r in await running if not isinstance(r, ShoalError)]
            assert len(answered) == 1  # each fits alone, not both: one is answered, one fails
            _doubled(answered, pair[:1])

    _run_keeping_its_worker(model, thread, scenario)


@pytest.mark.timeout(120)
def test_large_tensors_are_copied_on_threads_never_on_the_loop(model_of: Any) -> None:
    """Inputs past off_loop's bound go to the instance's thread; outputs past it (first past the arena,
    which grows, then within the grown arena) to the relay; small ones stay on the loop."""
    model, thread = model_of(), CountingThread()
    try:
        big_inputs = [Pending(np.linspace(0, 1, 400_000))]  # 1.6 MB
        assert asyncio.run(_start(model, big_inputs)) is None
        _doubled(asyncio.run(_run(model, thread, big_inputs)), big_inputs)
        assert thread.calls == 1 and _handovers(model) == 0
        for repeat in (300_000, 200_000):  # 2.4 MB of outputs: the worker asks for an arena; then 1.6 MB
            batch = [Pending(np.array([1.0, 2.0]), Context({"repeat": repeat}))]
            _doubled(asyncio.run(_run(model, thread, batch)), batch)
        assert thread.calls == 1 and _handovers(model) == 2
        small = [Pending(np.ones(3))]
        _doubled(asyncio.run(_run(model, thread, small)), small)
        assert thread.calls == 1 and _handovers(model) == 2  # back on the loop
    finally:
        thread.shutdown()


class HalfSending:
    """The loop's end of the pipe, taking only half of the first message written (a pipe with little
    room left, or a worker that is not reading)."""

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock
        self._full = True

    def send(self, data: bytes, flags: int = 0) -> int:
        if self._full:
            self._full = False
            return self._socket.send(data[: len(data) // 2], flags)
        return self._socket.send(data, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


@pytest.mark.timeout(120)
def test_what_the_pipe_does_not_take_at_once_is_written_by_the_relay(model_of: Any) -> None:
    """The loop never waits to write: the rest of the batch's message goes to the relay thread, which
    writes it and reads the answer."""
    model = model_of()
    model._loop_socket = HalfSending(model._loop_socket)
    batch = [Pending(np.arange(6.0)), Pending(np.ones(4), Context({"note": "x" * 100_000}))]
    _doubled(asyncio.run(_run(model, InstanceThread("unused"), batch)), batch)
    assert _handovers(model) == 1


@pytest.mark.timeout(120)
def test_a_caller_that_gives_up_leaves_the_next_batch_its_own_answer(model_of: Any) -> None:
    """Cancelling the caller ends nothing: the conversation reads its answer, so the next batch, queued
    meanwhile on the instance's thread (waiting for the lock), never gets the first one's outputs. The
    first batch then needs a thread (its outputs outgrow the arena): the relay's, never the instance's,
    which waits for the lock the first batch holds (a deadlock when they were one thread)."""
    model, thread = model_of(), CountingThread()
    try:

        async def scenario() -> None:
            slow = [Pending(np.array([-0.5, 1.0, 2.0]), Context({"repeat": 300_000}))]
            first = model.start_on_loop(slow)
            assert first is not None
            waiting = asyncio.ensure_future(first)
            await asyncio.sleep(0)
            waiting.cancel()
            following = [Pending(np.array([7.0, 8.0, 9.0]))]
            assert model.start_on_loop(following) is None  # the worker is still busy with the first
            _doubled(await asyncio.wait_for(thread.submit(model.run_requests, following), 60), following)
            assert _handovers(model) == 1
            await _next_batch_answered(model, thread, 3.0)

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
            running = model.start_on_loop([Pending(np.array([-30.0]))])
            assert running is not None
            os.kill(first_pid, signal.SIGKILL)
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 60)
            assert failed.value.code is ErrorCode.UNAVAILABLE and "died" in failed.value.message
            assert model.pid != first_pid and model.healthy
            await _next_batch_answered(model, thread, 1.0, 2.0)

        asyncio.run(scenario())
        assert thread.calls == 0 and _handovers(model) == 1
    finally:
        thread.shutdown()


# execute forks a child that outlives it, holding the worker's end of the pipe (as a helper process the
# model starts may); a first element of -1 then ends the worker.
FORKS_A_CHILD = MODEL.replace(
    "import time\n",
    "import os\nimport time\n",
).replace(
    "            if x.size and x.flat[0] < 0:\n                time.sleep(-float(x.flat[0]))\n",
    """            if x.size and x.flat[0] == -1:
                child = os.fork()
                if child == 0:
                    time.sleep(60)
                    os._exit(0)
                with open(os.path.join(os.path.dirname(__file__), "children"), "a") as pids:
                    pids.write(f"{child}\\n")
                os._exit(3)
""",
)


@pytest.mark.timeout(120)
def test_a_worker_that_dies_while_a_child_holds_its_pipe_fails_its_batch(model_of: Any) -> None:
    """No end of file comes (the child holds the pipe open): the worker's process sentinel says it died."""
    model, thread = model_of(source=FORKS_A_CHILD), CountingThread()
    children = model._path.parent / "children"
    try:

        async def scenario() -> None:
            running = model.start_on_loop([Pending(np.array([-1.0]))])
            assert running is not None
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 60)
            assert failed.value.code is ErrorCode.UNAVAILABLE and "died (exit code 3)" in failed.value.message
            await _next_batch_answered(model, thread, 4.0)

        asyncio.run(scenario())
        assert children.exists()
    finally:
        thread.shutdown()
        for pid in children.read_text().split() if children.exists() else ():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.timeout(120)
def test_the_execution_timeout_holds_for_a_batch_on_the_loop(model_of: Any) -> None:
    """A stopped worker (SIGSTOP) never answers: at the deadline the relay takes over and replaces it."""
    model, thread = model_of(WorkerLimits(execution_timeout_s=0.5, liveness_interval_s=0.0)), CountingThread()
    try:

        async def scenario() -> None:
            first_pid = model.pid
            assert first_pid is not None
            os.kill(first_pid, signal.SIGSTOP)
            running = model.start_on_loop([Pending(np.ones(2))])
            assert running is not None
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 60)
            assert failed.value.code is ErrorCode.UNAVAILABLE and "execution_timeout_ms" in failed.value.message
            assert model.pid != first_pid and model.healthy  # replaced before the batch failed
            await _next_batch_answered(model, thread, 5.0)

        asyncio.run(scenario())
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_a_message_half_read_when_the_deadline_passes_is_never_read_as_a_new_one(model_of: Any, pipe: Any) -> None:
    """The relay, given a reader in the middle of a message at the execution timeout, replaces the
    worker: reading the pipe then would take the message's middle for a length (it hung so)."""
    _, writing, sock = pipe
    model = model_of(WorkerLimits(execution_timeout_s=30.0, liveness_interval_s=0.0))
    first_pid = model.pid
    raw = socket.socket(fileno=os.dup(writing.fileno()))
    try:
        raw.sendall(struct.pack("!i", 1000) + b"x" * 300)  # a message's header and the start of its body
        partial = FrameReader(sock)
        assert partial.read() is None and partial.mid_message
        assert model._lock.acquire(blocking=False)
        model._begin([Pending(np.ones(2))])
        with pytest.raises(ShoalError) as failed:
            model.continue_on_thread(Handover(partial=partial, ending=TIMED_OUT), time.monotonic() - 1)
        assert "execution_timeout_ms" in failed.value.message
        assert not model._lock.locked() and model.pid != first_pid and model.healthy
    finally:
        raw.close()


@pytest.mark.timeout(120)
def test_a_deadline_around_a_large_answer_ends_the_batch_and_the_next_gets_its_own(model_of: Any) -> None:
    """The loop is busy when the deadline passes and a large answer is on its way: whichever comes first
    (the answer, or the timeout), the batch ends promptly and the pipe stays in step."""
    slow_error = MODEL.replace(
        '            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))\n',
        """            if x.size and x.flat[0] == 0.25:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("e" * 600_000)))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
""",
    )
    model, thread = (
        model_of(WorkerLimits(execution_timeout_s=1.0, liveness_interval_s=0.0), slow_error),
        CountingThread(),
    )
    try:

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            running = model.start_on_loop([Pending(np.array([-0.7])), Pending(np.array([0.25]))])
            assert running is not None
            loop.call_later(0.5, time.sleep, 0.7)  # the loop busy from 0.5 s to 1.2 s (the deadline: 1.0 s)
            try:
                results = await asyncio.wait_for(running, 30)
            except ShoalError as failed:
                assert "execution_timeout_ms" in failed.message
            else:
                assert isinstance(results[1], ShoalError) and results[1].message == "e" * 600_000
            await _next_batch_answered(model, thread, 6.0, 7.0)

        asyncio.run(scenario())
    finally:
        thread.shutdown()


# A BLS call made in one batch (on a thread of the model) whose reply the next batch collects.
BLS_ACROSS_BATCHES = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.reply, self.caller = None, None

    def _call(self):
        call = pb_utils.InferenceRequest(
            model_name="other", requested_output_names=["Z"], inputs=[pb_utils.Tensor("A", np.ones(3, np.float32))]
        )
        self.reply = call.exec()

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x.flat[0] == 1:  # start the call and answer at once
            self.caller = threading.Thread(target=self._call, daemon=True)
            self.caller.start()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)])]
        self.caller.join(20)  # collect it
        z = pb_utils.get_output_tensor_by_name(self.reply, "Z").as_numpy() if self.reply is not None else -np.ones(1)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", z.astype(np.float32))])]
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reply_after_s", [0.0, 0.5])
def test_a_bls_reply_that_outlives_its_batch_reaches_the_next_one(model_of: Any, reply_after_s: float) -> None:
    """The reply comes before the next batch starts (it then goes to the instance's thread, which
    forwards it) or while it runs on the loop (the wake-up pipe hands the conversation to the relay)."""
    model, thread = model_of(source=BLS_ACROSS_BATCHES), CountingThread()

    def host(request: Any, sink: Any, caller: Any = None, trace_id: int = 0) -> concurrent.futures.Future[Any]:
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        outputs = SimpleNamespace(outputs=[SimpleNamespace(name="Z", data=np.full(3, 42.0, np.float32))])
        threading.Timer(0.2, reply.set_result, args=(outputs,)).start()
        return reply

    model.bind_host(host, None)
    try:

        async def scenario() -> None:
            await _run(model, thread, [Pending(np.array([1.0]))])
            await asyncio.sleep(reply_after_s)
            (result,) = await asyncio.wait_for(_run(model, thread, [Pending(np.array([2.0]))]), 30)
            assert not isinstance(result, ShoalError), result.message
            assert result["Y"].tolist() == [42.0, 42.0, 42.0]

        asyncio.run(scenario())
    finally:
        thread.shutdown()


# A first element of 13: the model's own code writes on its worker's pipe (bytes from a model, not from
# Shoal's worker), the second saying what: a header announcing a length no message has (0) or a Done that
# is no answer (5), then it hangs; a pickle that ends the process that loads it (1; 4: one past the
# loop's bound, read by the relay); a Response though it is not decoupled (2); or a message whose header
# says 4 MiB, 1000 bytes of it, and it stops itself (3).
WRITES_ON_ITS_PIPE = """
import os
import signal
import socket
import struct
import sys
import time

from shoal.instances.worker_pipe import Done, Response
import triton_python_backend_utils as pb_utils


class EndsItsReader:
    def __reduce__(self):
        return (sys.exit, (3,))


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x.flat[0] == 13:
            conn = sys.modules["shoal.backends.python.pb_utils"]._host._conn._conn  # under the worker's lock
            what = x.flat[1]
            if what == 0:
                conn.send_bytes(b"z" * 64)  # a message, then a header of the form past 2 GiB
                conn._send(struct.pack("!iQ", -1, 1 << 62) + b"z" * 64)
                time.sleep(60)
            elif what == 5:
                conn.send(Done(["no answer"]))
                time.sleep(60)
            elif what == 1:
                conn.send(EndsItsReader())
            elif what == 4:
                conn.send((EndsItsReader(), b"p" * (2 << 20)))
            elif what == 2:
                conn.send(Response(0, None, "", "", True))
            elif what == 6:  # its end of the pipe shut for writing, the process alive
                socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_WR)
                time.sleep(60)
            else:
                conn._send(struct.pack("!i", 4 << 20) + b"z" * 1000)
                os.kill(os.getpid(), signal.SIGSTOP)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)])]
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("what", "on_loop", "words"),
    [
        (0.0, True, "could not be read"),
        (0.0, False, "could not be read"),
        (5.0, True, "answered a batch it was not running"),
        (5.0, False, "answered a batch it was not running"),
        (1.0, True, "could not be read"),
        (4.0, True, "could not be read"),
        (2.0, True, None),
        (3.0, True, "execution_timeout_ms"),
        (3.0, False, "execution_timeout_ms"),
    ],
    ids=[
        "a-length-no-message-has",
        "a-length-no-message-has-on-the-thread",
        "a-done-that-is-no-answer",
        "a-done-that-is-no-answer-on-the-thread",
        "a-pickle-that-exits",
        "a-large-pickle-that-exits",
        "a-stray-response",
        "half-a-large-message",
        "half-a-large-message-on-the-thread",
    ],
)
def test_what_a_model_writes_on_its_pipe_fails_its_own_batch_only(
    model_of: Any, what: float, on_loop: bool, words: str | None
) -> None:
    """Once: the loop's reader raised on every iteration (the bytes stayed in the pipe) with the lock
    held, so unload waited for good; a SystemExit raised by unpickling on the loop stopped the server;
    the thread path left the pipe out of step, so the next batch read the model's late answer to this
    one as its own (right only because the arena's bytes had been rewritten meanwhile); a conversation
    that failed on the server's side (a stray Response) left the worker mid-batch, so the next batch
    failed too; the relay reading the rest of a message from a stopped worker waited past the execution
    timeout. Now the batch fails, the worker is replaced, and the next batch gets its own answer."""
    limits = WorkerLimits(execution_timeout_s=1.0, liveness_interval_s=0.0)
    model, thread = model_of(limits, WRITES_ON_ITS_PIPE), CountingThread()
    try:

        async def scenario() -> None:
            first_pid = model.pid
            batch = [Pending(np.array([13.0, what]))]
            running = model.start_on_loop(batch) if on_loop else thread.submit(model.run_requests, batch)
            assert running is not None
            with pytest.raises(Exception) as failed:
                await asyncio.wait_for(running, 60)
            assert not isinstance(failed.value, asyncio.TimeoutError)
            if words is not None:
                assert isinstance(failed.value, ShoalError) and words in failed.value.message
            assert model.pid != first_pid and model.healthy and not model._lock.locked()
            await _next_batch_answered(model, thread, 2.0, 3.0)

        asyncio.run(scenario())
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_loop", [True, False], ids=["begun-on-the-loop", "on-the-thread"])
def test_a_worker_that_shuts_its_pipe_fails_its_batch_within_the_execution_timeout(
    model_of: Any, on_loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipe that ended is given a grace for its worker to exit (then it is reported dead, not
    replaced); the grace never runs past the batch's execution timeout (a minute's grace here: the
    batch waited it out before)."""
    monkeypatch.setattr(python_process, "ENDED_GRACE_S", 60.0)
    model = model_of(WorkerLimits(execution_timeout_s=1.0, liveness_interval_s=0.0), WRITES_ON_ITS_PIPE)
    thread = CountingThread()
    try:

        async def scenario() -> None:
            first_pid = model.pid
            batch = [Pending(np.array([13.0, 6.0]))]
            running = model.start_on_loop(batch) if on_loop else thread.submit(model.run_requests, batch)
            assert running is not None
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 30)
            assert "closed its end of the pipe" in failed.value.message, failed.value.message
            assert model.pid != first_pid and model.healthy
            await _next_batch_answered(model, thread, 1.0)

        asyncio.run(scenario())
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_loop", [True, False], ids=["begun-on-the-loop", "on-the-thread"])
def test_the_rest_of_a_batch_message_is_never_written_into_a_stopped_worker_past_the_deadline(
    model_of: Any, on_loop: bool
) -> None:
    """The pipe takes only part of the message (a stopped worker reads nothing): the relay (or the
    instance's thread, which once blocked in the Connection's send for good) writes the rest while it
    watches the worker, and the execution timeout still holds."""
    model = model_of(WorkerLimits(execution_timeout_s=1.0, liveness_interval_s=0.0))
    thread = CountingThread()
    try:

        async def scenario() -> None:
            first_pid = model.pid
            assert first_pid is not None
            os.kill(first_pid, signal.SIGSTOP)
            batch = [Pending(np.ones(2), Context({"note": "x" * 900_000}))]
            running = model.start_on_loop(batch) if on_loop else thread.submit(model.run_requests, batch)
            assert running is not None
            with pytest.raises(ShoalError) as failed:
                await asyncio.wait_for(running, 60)
            assert "execution_timeout_ms" in failed.value.message and model.pid != first_pid
            await _next_batch_answered(model, thread, 1.0)

        asyncio.run(scenario())
        assert _handovers(model) == (1 if on_loop else 0)
    finally:
        thread.shutdown()


@pytest.mark.timeout(120)
def test_the_relay_watches_descriptors_past_1024(tmp_path: Path) -> None:
    """The server raises its descriptor limit (shoal.descriptors), so a worker's pipe may be numbered
    past select()'s 1024: writing the rest of a batch's message once raised there (ValueError) and left
    half of it in the pipe, so the next batch hung. Run in a process of its own: in the suite's, a
    descriptor another test's object frees late (a collected model's worker ending, then its metrics
    thread) gave this model's socket a number below 1024 (CI of session 53)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine allows {hard} descriptors a process")
    child = multiprocessing.get_context("spawn").Process(target=_descriptors_past_1024, args=(tmp_path,))
    child.start()
    child.join(300)
    assert child.exitcode == 0, "the scenario failed in its process: its traceback is in the output above"


def _descriptors_past_1024(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    read_end, write_end = os.pipe()
    fillers = [os.dup(read_end) for _ in range(1100)]
    thread = CountingThread()
    folder = tmp_path / "model"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(CONFIG)
    (folder / "1" / "model.py").write_text(MODEL)
    model = PythonProcessModel(
        configure(folder, strict=False).spec,
        folder / "1" / "model.py",
        CPU,
        "d_0",
        1,
        WorkerLimits(execution_timeout_s=1.0, liveness_interval_s=0.0),
    )
    try:
        assert model._loop_socket is not None and model._loop_socket.fileno() > 1024
        batch = [Pending(np.arange(3.0), Context({"note": "x" * 900_000}))]
        _doubled(asyncio.run(_run(model, thread, batch)), batch)  # the pipe takes ~200 KB at once
        pid = model.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the relay then waits for room, polling, until the deadline
        try:
            asyncio.run(_run(model, thread, batch))
        except ShoalError as failed:
            assert "execution_timeout_ms" in failed.message
        else:
            raise AssertionError("a batch to a stopped worker was answered")
        after = [Pending(np.array([1.0]))]
        _doubled(asyncio.run(_run(model, thread, after)), after)
    finally:
        model.close()
        thread.shutdown()
        for fd in [*fillers, read_end, write_end]:
            os.close(fd)


def test_the_loop_counts_a_done_s_outputs_no_further_than_its_bound() -> None:
    """A worker's message may name one output many times over (pickle keeps shared references small):
    the loop hands it over at once instead of walking it (once, 4e10 slots: 20 s of a blocked loop)."""
    slot = ("Y", "FP32", (1,), 0, 4)
    answers = [Answer([slot] * 200_000)] * 200_000
    started = time.monotonic()
    assert _costly_answers(answers)
    assert not _costly_answers([Answer([slot])] * 8)
    assert time.monotonic() - started < 5  # microseconds unbounded, not seconds: a loose bound for a shared machine


def test_bytes_elements_and_parameters_past_the_bound_stay_off_the_loop(model_of: Any) -> None:
    """Copying them and pickling the batch's message is a thread's work, as a tensor's is."""
    model = model_of()

    def pending_with(feed: dict[str, np.ndarray], parameters: dict[str, Any]) -> Pending:
        pending = Pending(np.ones(1), Context(parameters))
        pending.feed = feed
        return pending

    async def started(pending: Pending) -> Any:
        return model.start_on_loop([pending])

    one_element = np.array([b"b" * (2 << 20)], dtype=object)
    assert asyncio.run(started(pending_with({"X": one_element}, {}))) is None
    assert asyncio.run(started(pending_with({"X": np.ones(2, np.float32)}, {"note": "p" * (2 << 20)}))) is None
    assert not model._lock.locked()


@pytest.mark.timeout(120)
def test_a_conversation_handed_over_after_the_relay_stopped_still_ends(model_of: Any) -> None:
    """The relay is shut down while a loop batch runs (the instance closing): a hand-over then runs on a
    thread of its own, so the batch ends and the instance's lock is released."""
    model = model_of()

    async def scenario() -> None:
        running = model.start_on_loop([Pending(np.array([-0.3])), Pending(np.ones(4))])
        assert running is not None
        model._relay.shutdown()
        pid = model.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShoalError):
            await asyncio.wait_for(running, 60)

    asyncio.run(scenario())
    assert _handovers(model) == 1
    assert model._lock.acquire(timeout=10)
    model._lock.release()


async def _start(model: PythonProcessModel, batch: list[Pending]) -> Any:
    return model.start_on_loop(batch)


def test_a_failed_load_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """A model whose initialize raises: the instance's load fails and every descriptor it opened is
    closed (its wake-up pipe once stayed open, two descriptors a failed load)."""
    folder = tmp_path / "fails"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(CONFIG)
    (folder / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('no')\n"
    )
    spec = configure(folder, strict=False).spec

    def load() -> None:
        with pytest.raises(ShoalError):
            PythonProcessModel(spec, folder / "1" / "model.py", CPU, "f_0", 1, NO_LIMITS)

    load()  # the first load starts the fork server, whose descriptors stay
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        load()
    assert len(os.listdir("/proc/self/fd")) == before

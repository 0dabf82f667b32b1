"""The pipe and arenas between a Python process instance and the server, driven in one process:
the worker's side (``python_link``, ``python_worker.run_batch``) against a hand-played server,
for the tensor lifetimes a batch's BLS calls depend on (the whole server: test_python_backend.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing import reduction
from typing import Any

import numpy as np
import pytest

from shoal.backends.python import bls, pb_utils, runner
from shoal.dataplane import inline
from shoal.dataplane.arena import Arena
from shoal.instances import python_worker
from shoal.instances.outbox import Outbox
from shoal.instances.python_link import PipeLink
from shoal.instances.worker_pipe import (
    REQUESTS,
    RESPONSES,
    Bls,
    BlsReply,
    Done,
    InputViews,
    NewArena,
    PipedRequest,
    RunRequests,
    map_arena,
    put,
    take,
)
from tests.polling import wait_until


@pytest.fixture
def ends() -> Iterator[tuple[Any, Any, dict[str, Arena]]]:
    """(the server's end, the worker's end, the arenas both map)."""
    server, worker = multiprocessing.Pipe()
    arenas = {which: Arena.create(f"test-pipe-{which}", 1 << 20) for which in (REQUESTS, RESPONSES)}
    yield server, worker, arenas
    for arena in arenas.values():
        arena.close()
    server.close()
    worker.close()


def _call(x: np.ndarray) -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(model_name="m", requested_output_names=["Y"], inputs=[pb_utils.Tensor("X", x)])


def test_a_batch_s_outputs_never_overwrite_the_inputs_of_a_call_the_server_has_not_read(ends: Any) -> None:
    """A model fires a BLS call and returns at once: its outputs are packed before the server reads the
    call, so they go after the call's inputs (they once went at the arena's start, over them). Outputs
    too large to ride in the message (``inline``)."""
    server, worker, arenas = ends
    link = PipeLink(worker, arenas)
    x = np.arange(1000, dtype=np.float32)
    y = np.full(inline.INLINE_BYTES // 4 + 1, -1.0, np.float32)

    class FireAndForget:
        def execute(self, items: Any) -> list[runner.Outcome]:
            link.infer_async(_call(x)).close()  # sent, never awaited
            return [runner.Outcome({"Y": y})]

    done = python_worker.run_batch(FireAndForget(), link, worker, arenas, RunRequests([], 0), InputViews())
    call = server.recv()  # the server reads the call only now, after the outputs were packed
    assert isinstance(call, Bls) and isinstance(done, Done) and call.call.model_name == "m"
    np.testing.assert_array_equal(take(arenas[RESPONSES], call.inputs)["X"], x)
    ((output_slots, error, _),) = done.answers
    assert not error
    np.testing.assert_array_equal(take(arenas[RESPONSES], output_slots)["Y"], y)


def test_a_reply_is_taken_from_the_arena_only_while_its_batch_runs(ends: Any) -> None:
    """The server puts a reply's outputs in the arena of the batch running then; a caller the model left
    waiting past that batch gets an error, not what the next batch wrote there."""
    server, worker, arenas = ends
    link = PipeLink(worker, arenas)
    y = np.linspace(0, 1, 100, dtype=np.float32)

    def reply(batch: int) -> pb_utils.InferenceResponse:
        waiting = link.infer_async(_call(y))
        call = server.recv()
        slots, _ = put(arenas[REQUESTS], 4096, {"Y": y})
        server.send(BlsReply(call.call_id, bls.BlsResult(outputs={}), slots, True, batch))
        return asyncio.run(waiting)

    link.begin(7)
    answered = reply(7)
    assert not answered.has_error()
    np.testing.assert_array_equal(pb_utils.get_output_tensor_by_name(answered, "Y").as_numpy(), y)
    late = reply(6)  # put in batch 6's arena, read in batch 7
    assert late.has_error() and "came after the batch that made the call had ended" in late.error().message()
    link.end()
    assert reply(7).has_error()  # between batches no arena is any call's


def _lingering_calls(
    link: PipeLink, server: Any, count: int
) -> tuple[list[threading.Thread], list[int], dict[int, Any]]:
    """``count`` threads of a model that made a BLS call in a batch now over and wait for its reply: the
    threads, their calls' ids, and each thread's outcome once it comes (a response, or what it raised)."""
    threads: list[threading.Thread] = []
    ids: list[int] = []
    outcomes: dict[int, Any] = {}
    for index in range(count):

        def wait(index: int = index) -> None:
            try:
                outcomes[index] = link.infer(_call(np.ones(2, np.float32)))
            except BaseException as exc:  # noqa: BLE001 - the outcome the test looks at
                outcomes[index] = exc

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        ids.append(server.recv().call_id)  # the call, pickled: no batch runs
        threads.append(thread)
    return threads, ids, outcomes


@pytest.mark.parametrize("waiting_threads", [1, 2])
def test_a_reply_read_before_its_batch_begins_waits_for_it_and_its_new_arena(ends: Any, waiting_threads: int) -> None:
    """The server grows the requests arena for the next batch and sends it, the batch, then the reply to
    a call a thread of the model left waiting, its outputs in the new arena (past the old one's end). A
    waiting thread reads the reply before the main loop has mapped the arena and begun the batch: the
    reply waits for the batch to begin, then is taken from the new arena. Once it was taken at once
    from the old mapping (ValueError in whichever thread read it; with two threads waiting, the
    caller's reply lost for good), in ~1.6% of natural runs; before that, refused as an earlier
    batch's. The real order, many times over."""
    server, worker, arenas = ends
    link = PipeLink(worker, arenas)
    grown: list[Arena] = []
    threads: list[threading.Thread] = []
    try:
        for batch in range(1, 31):
            link.begin(batch - 1)
            link.end()
            arenas[REQUESTS].close()
            arenas[REQUESTS] = Arena.create("test-pipe-requests", 1 << 20)  # the old arena, small again
            waiting, ids, outcomes = _lingering_calls(link, server, waiting_threads)
            threads += waiting
            owner = waiting_threads - 1
            arena = Arena.create("test-pipe-grown", arenas[REQUESTS].size * 2)
            grown.append(arena)
            y = np.arange(8, dtype=np.float32) + batch
            slots, _ = put(arena, arenas[REQUESTS].size, {"Y": y})  # past the old arena's end
            server.send(NewArena(REQUESTS, arena.size))
            reduction.send_handle(server, arena.fd, os.getpid())
            server.send(RunRequests([], batch))
            server.send(BlsReply(ids[owner], bls.BlsResult(outputs={}), slots, True, batch))
            map_arena(arenas, link.next_message())  # the main loop, as worker_main runs it
            assert isinstance(link.next_message(), RunRequests)
            link.begin(batch)
            wait_until(lambda: owner in outcomes, timeout_s=10, what="the caller's reply")  # noqa: B023
            answered = outcomes[owner]
            assert isinstance(answered, pb_utils.InferenceResponse) and not answered.has_error(), answered
            np.testing.assert_array_equal(pb_utils.get_output_tensor_by_name(answered, "Y").as_numpy(), y)
            link.end()
            for other in range(owner):  # the other threads' calls: answered pickled, so they end
                server.send(BlsReply(ids[other], bls.BlsResult(outputs={}), None, True, batch))
            for thread in waiting:
                thread.join(10)
    finally:
        server.close()  # a thread still waiting sees the pipe's end
        for thread in threads:
            thread.join(10)
        for arena in grown:
            arena.close()


class _PausingConn:
    """The worker's pipe end; a BLS call sent from the thread named "left" pauses first, as a thread
    the scheduler takes the CPU from between reserving its arena range and sending."""

    def __init__(self, conn: Any, reserved: threading.Event) -> None:
        self._conn, self._reserved = conn, reserved
        self.recv, self.poll, self.fileno = conn.recv, conn.poll, conn.fileno

    def send(self, message: Any) -> None:
        if isinstance(message, Bls) and threading.current_thread().name == "left":
            self._reserved.set()
            threading.Event().wait(0.5)  # the pause itself: nothing to wait for
        self._conn.send(message)


def test_a_call_with_inputs_in_the_arena_is_on_the_pipe_before_its_batch_ends(ends: Any) -> None:
    """A thread of the model reserves its call's range, then loses the CPU before sending; the batch's
    end waits for it, so the server reads the call before DONE, its inputs intact (it once read the
    call in the next batch, over which that batch's outputs had been packed)."""
    server, worker, arenas = ends
    reserved = threading.Event()
    link = PipeLink(_PausingConn(worker, reserved), arenas)
    x = np.arange(1000, dtype=np.float32)

    class LeavesACallBehind:
        def execute(self, items: Any) -> list[runner.Outcome]:
            threading.Thread(target=lambda: link.infer_async(_call(x)).close(), name="left").start()
            reserved.wait(10)
            return [runner.Outcome({"Y": np.zeros(4, np.float32)})]

    done = python_worker.run_batch(LeavesACallBehind(), link, worker, arenas, RunRequests([], 0), InputViews())
    worker.send(done)
    call = server.recv()
    assert isinstance(call, Bls) and call.inputs is not None
    np.testing.assert_array_equal(take(arenas[RESPONSES], call.inputs)["X"], x)
    assert isinstance(server.recv(), Done)


def test_an_outbox_that_cannot_send_a_message_says_so_and_does_not_hang(ends: Any) -> None:
    """A message that cannot be pickled (or a MemoryError) once killed the outbox's thread: its waiters
    waited for good. Now the error is kept for the instance, which replaces its worker."""
    server, _, _ = ends
    outbox = Outbox(server, "test-outbox")
    outbox.send(("fine", 1))
    outbox.send(("unpicklable", lambda: None))
    assert outbox.wait_sent(10) and outbox.error is not None
    outbox.close()


def test_an_array_either_side_sends_pickled_arrives_writable(ends: Any) -> None:
    """What the worker pickles (a BLS call's inputs that do not fit the arena, a decoupled model's
    response) and what the server's outbox does (a BLS reply too big for the arena) arrives as a
    writable copy even when the array was read-only, as protocol 4 gives it (protocol 5 keeps it
    read-only; the worker once used it, and Python 3.14's pipes default to it): the model it goes to
    may write into it."""
    server, worker, _ = ends
    frozen = np.arange(6, dtype=np.float32)
    frozen.flags.writeable = False
    python_worker.LockedConn(worker).send(Bls(1, bls.call_of(_call(frozen), False), None))
    arrived = server.recv().call.inputs["X"]
    np.testing.assert_array_equal(arrived, frozen)
    assert arrived.flags.writeable
    outbox = Outbox(server, "test-outbox")
    try:
        outbox.send(BlsReply(1, bls.BlsResult(outputs={"Y": frozen}), None, True, 0))
        assert outbox.wait_sent(10)
        replied = worker.recv().result.outputs["Y"]
        np.testing.assert_array_equal(replied, frozen)
        assert replied.flags.writeable
    finally:
        outbox.close()


def test_a_small_batch_rides_in_its_messages_and_its_inputs_are_the_models_own(ends: Any) -> None:
    """Inputs carried in the batch's message (``inline``) reach the model as writable arrays of its own:
    it may write into them and keep them, and no arena is watched for that. Small numeric outputs go
    back in the message; a batch with a BYTES output goes back in the arena, each answer its own."""
    _, worker, arenas = ends
    link = PipeLink(worker, arenas)
    views = InputViews()
    sent = [np.arange(4, dtype=np.float32) + 10 * k for k in range(2)]
    carried = inline.inline_feeds([{"X": x} for x in sent])
    assert carried is not None
    requests = [PipedRequest(feed, ["Y"], f"r{k}", 0, {}, 0, "") for k, feed in enumerate(carried)]

    class KeepsAndWrites:
        kept: list[np.ndarray] = []

        def execute(self, items: Any) -> list[runner.Outcome]:
            outcomes = []
            for item in items:
                x = item.inputs["X"]
                x += 1  # its own array: writable, nobody else's
                self.kept.append(x)
                outcomes.append(runner.Outcome({"Y": x * 2}))
            return outcomes

    model = KeepsAndWrites()
    done = python_worker.run_batch(model, link, worker, arenas, RunRequests(requests, 0), views)
    assert isinstance(done, Done) and not views.kept()
    for answer, x in zip(done.answers, sent, strict=True):
        assert isinstance(answer.outputs, dict) and not answer.error
        np.testing.assert_array_equal(inline.arrays_of(answer.outputs)["Y"], (x + 1) * 2)
    np.testing.assert_array_equal(model.kept[1], sent[1] + 1)

    class AnswersBytes:
        def execute(self, items: Any) -> list[runner.Outcome]:
            return [runner.Outcome({"Y": np.array([item.request_id.encode()], dtype=object)}) for item in items]

    done = python_worker.run_batch(AnswersBytes(), link, worker, arenas, RunRequests(requests, 1), views)
    assert isinstance(done, Done)
    for k, answer in enumerate(done.answers):
        assert isinstance(answer.outputs, list)
        assert take(arenas[RESPONSES], answer.outputs)["Y"].tolist() == [f"r{k}".encode()]

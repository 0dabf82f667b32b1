"""The pipe and arenas between a Python process instance and the server, driven in one process:
the worker's side (``python_link``, ``python_process._run_batch``) against a hand-played server,
for the tensor lifetimes a batch's BLS calls depend on (the whole server: test_python_backend.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shoal.backends.python import bls, pb_utils, runner
from shoal.dataplane.arena import Arena
from shoal.instances import python_process
from shoal.instances.process import REQUESTS, RESPONSES
from shoal.instances.python_link import BLS, BLS_REPLY, PipeLink, put, take


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
    call, so they go after the call's inputs (they once went at the arena's start, over them)."""
    server, worker, arenas = ends
    link = PipeLink(worker, arenas)
    x = np.arange(1000, dtype=np.float32)

    class FireAndForget:
        def execute(self, items: Any) -> list[runner.Outcome]:
            link.infer_async(_call(x)).close()  # sent, never awaited
            return [runner.Outcome({"Y": np.full(4000, -1.0, np.float32)})]

    done, answers = python_process._run_batch(FireAndForget(), link, worker, arenas, [], 0)
    kind, _, call, slots = server.recv()  # the server reads the call only now, after the outputs were packed
    assert (kind, done) == (BLS, python_process.DONE) and call.model_name == "m"
    np.testing.assert_array_equal(take(arenas[RESPONSES], slots)["X"], x)
    (output_slots, error, _), = answers
    assert not error
    np.testing.assert_array_equal(take(arenas[RESPONSES], output_slots)["Y"], np.full(4000, -1.0, np.float32))


def test_a_reply_is_taken_from_the_arena_only_while_its_batch_runs(ends: Any) -> None:
    """The server puts a reply's outputs in the arena of the batch running then; a caller the model left
    waiting past that batch gets an error, not what the next batch wrote there."""
    server, worker, arenas = ends
    link = PipeLink(worker, arenas)
    y = np.linspace(0, 1, 100, dtype=np.float32)

    def reply(batch: int) -> pb_utils.InferenceResponse:
        waiting = link.infer_async(_call(y))
        _, call_id, _, _ = server.recv()
        slots, _ = put(arenas[REQUESTS], 4096, {"Y": y})
        server.send((BLS_REPLY, call_id, bls.BlsResult(outputs={}), slots, True, batch))
        return asyncio.run(waiting)

    link.begin(7)
    answered = reply(7)
    assert not answered.has_error()
    np.testing.assert_array_equal(pb_utils.get_output_tensor_by_name(answered, "Y").as_numpy(), y)
    late = reply(6)  # put in batch 6's arena, read in batch 7
    assert late.has_error() and "came after the batch that made the call had ended" in late.error().message()
    link.end()
    assert reply(7).has_error()  # between batches no arena is any call's

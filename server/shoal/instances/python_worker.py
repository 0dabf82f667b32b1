"""A Python model's worker process (Triton's stub process): initialize the model, then run the batches
the host sends over the pipe (``instances.worker_pipe``) until told to stop. Its BLS calls go back
to the host through ``python_link``; the host's side is ``instances.python_process``."""

from __future__ import annotations

import itertools
import signal
import threading
from pathlib import Path
from typing import Any

from shoal.backends.devices import Device
from shoal.backends.python import pb_utils, runner
from shoal.dataplane import inline, packing
from shoal.dataplane.arena import Arena, PoolFull
from shoal.errors import ShoalError
from shoal.instances import worker_pipe
from shoal.instances.metrics_pipe import PipeMetrics
from shoal.instances.python_link import PipeLink
from shoal.instances.worker_pipe import (
    REQUESTS,
    RESPONSES,
    Answer,
    Done,
    Failed,
    Grow,
    InputViews,
    NewArena,
    Ping,
    PipedRequest,
    Ready,
    Response,
    RunRequests,
    Stop,
    as_tensors,
    map_arena,
)
from shoal.repository.config import ModelSpec
from shoal.request_types import Tensor


def _items(arenas: dict[str, Arena], requests: list[PipedRequest], views: InputViews) -> list[runner.RequestData]:
    """The batch's requests as the model's ``execute`` reads them, their inputs arrays of their own made
    from the message (``inline``), or views of the REQUESTS arena (unpacked for the whole batch at
    once: one view of the arena, not one per request), or copies once the model kept some (``InputViews``)."""
    slots = [s for r in requests if isinstance(r.inputs, list) for s in r.inputs]
    tensors = iter(views.unpack(arenas[REQUESTS], slots) if slots else ())
    return [
        runner.RequestData(
            inline.arrays_of(request.inputs)
            if isinstance(request.inputs, dict)
            else dict(itertools.islice(tensors, len(request.inputs))),
            tuple(request.outputs),
            request.request_id,
            request.correlation_id,
            request.parameters,
            request.trace_id,
            request.trace_context,
        )
        for request in requests
    ]


def run_batch(
    model: runner.ModelRunner, link: PipeLink, conn: Any, arenas: dict[str, Arena], run: RunRequests, views: InputViews
) -> Done | None:
    """A batch's outcomes, packed after its BLS calls' inputs; None when the server went away while an arena grew."""
    items = _items(arenas, run.requests, views)
    link.begin(run.batch)
    try:
        outcomes = model.execute(items)
    finally:
        first_free = link.end()  # the outputs go after the BLS calls' inputs, which the server may not have read
    del items
    outputs = [outcome.outputs for outcome in outcomes if outcome.outputs is not None]
    if outputs and len(outputs) == len(outcomes):  # the usual batch: every request answered
        carried = inline.inline_feeds(outputs)  # small and numeric: in the message
        if carried is not None:
            return Done([Answer(tensors) for tensors in carried])
        try:  # else in the arena, a copy per name
            grouped = packing.pack_feeds_at(arenas[RESPONSES], first_free, outputs)
        except PoolFull:
            grouped = None  # the arena grows below
        if grouped is not None:
            return Done([Answer(slots) for slots in grouped])
    answers: list[Answer | None] = [None] * len(outcomes)
    tensors: list[list[Tensor]] = [[] for _ in outcomes]
    for index, outcome in enumerate(outcomes):
        if outcome.outputs is None:
            answers[index] = Answer([], outcome.error, outcome.code)
            continue
        try:
            tensors[index] = as_tensors(outcome.outputs)
        except ShoalError as exc:  # an output of no Triton datatype
            answers[index] = Answer([], exc.message, "internal")
    while True:
        try:  # the whole batch's outputs in one pass, each tensor aligned
            laid_out = iter(packing.pack_at(arenas[RESPONSES], first_free, [t for ts in tensors for t in ts]))
            break
        except PoolFull as full:
            wanted = full.wanted
        except Exception as exc:  # noqa: BLE001 - some request's outputs cannot be encoded: those requests alone fail
            if not _fail_unencodable(model.instance_name, answers, tensors):  # none alone: then every one
                for index in range(len(tensors)):
                    if answers[index] is None:
                        answers[index] = Answer([], f"the batch's outputs could not be encoded: {exc}", "internal")
                    tensors[index] = []
            continue
        if wanted > worker_pipe.MAX_ARENA_BYTES:  # no arena holds them all: some fail, the rest go
            _fail_past_bound(answers, tensors, worker_pipe.MAX_ARENA_BYTES)
            continue
        conn.send(Grow(wanted))  # the new arena is written from its start
        message = link.next_message()
        if not isinstance(message, NewArena):
            return None
        map_arena(arenas, message)
        first_free = 0  # a new arena: no BLS call's inputs in it (the server read them before Grow)
    return Done(
        [
            answer if answer is not None else Answer(list(itertools.islice(laid_out, len(outputs))))
            for answer, outputs in zip(answers, tensors, strict=True)
        ]
    )


def _fail_past_bound(answers: list[Answer | None], tensors: list[list[Tensor]], bound: int) -> None:
    """The batch's outputs need more than one arena's ``bound``: each response past it on its own fails,
    then, while the rest still do not fit together, the largest (an arena carries one batch's answers,
    so a batch of two responses that fit alone but not together loses one). Each gets its own error."""
    sizes = {index: packing.encoded_bytes(outputs) for index, outputs in enumerate(tensors) if outputs}
    total = sum(sizes.values())
    for index in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if sizes[index] <= bound and total <= bound:
            return
        total -= sizes[index]
        alone = "" if sizes[index] > bound else " with the other responses of its batch"
        answers[index] = Answer(
            [],
            f"the response's outputs need {sizes[index]} bytes of shared memory{alone}; a process "
            f"instance moves at most {bound >> 20} MiB each way per batch",
            "internal",
        )
        tensors[index] = []


def _fail_unencodable(instance: str, answers: list[Answer | None], tensors: list[list[Tensor]]) -> int:
    """Each request whose outputs cannot be encoded (a BYTES element past 4 GiB: ``pb_utils.Tensor``
    encoded the elements already) gets its own error, and no outputs to pack; how many did."""
    failed = 0
    for index, outputs in enumerate(tensors):
        try:
            packing.encoded_bytes(outputs)
        except Exception as exc:  # noqa: BLE001 - whatever encoding the model's objects raises
            answers[index] = Answer([], f"model '{instance}': an output could not be encoded: {exc}", "internal")
            tensors[index] = []
            failed += 1
    return failed


class LockedConn:
    """The worker's pipe end, safe to send on from the model's own threads (a decoupled model's sender);
    messages pickled as ``worker_pipe.pickled`` says."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.recv, self.poll, self.fileno = conn.recv, conn.poll, conn.fileno

    def send(self, message: Any) -> None:
        data = worker_pipe.pickled(message)
        with self._lock:
            self._conn.send_bytes(data)


def run_decoupled(
    model: runner.ModelRunner, link: PipeLink, conn: Any, arenas: dict[str, Arena], run: RunRequests, views: InputViews
) -> Done:
    """A decoupled model's batch: responses go to the server as they are sent, Done once all are FINAL."""
    items = _items(arenas, run.requests, views)
    lock = threading.Lock()
    batch_open = [True]  # a response sent after Done (by a cancelled request's thread) is dropped

    def emit(index: int, outcome: runner.Outcome | None, final: bool) -> None:
        with lock:
            if not batch_open[0]:
                return
            if outcome is None:
                conn.send(Response(index, None, "", "", final))
            else:
                conn.send(Response(index, outcome.outputs, outcome.error, outcome.code, final))

    link.begin(run.batch)
    try:
        model.execute_decoupled(items, emit, link.is_cancelled)
    finally:
        link.end()
        with lock:
            batch_open[0] = False
    return Done([Answer([]) for _ in run.requests])


def worker_main(spec: ModelSpec, model_path: Path, device: Device, handle: Any, threads: int, conn: Any) -> None:
    """The worker process: initialize the model, then run batches from the pipe until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the host's to handle; it stops us
    arenas: dict[str, Arena] = {}
    views = InputViews()
    conn = LockedConn(conn)
    decoupled = spec.decoupled
    link = PipeLink(conn, arenas)
    instance_name, version, metrics_conn = handle
    # Before the model is imported: a family may be made at import, and in ``initialize``, as Triton allows.
    pb_utils.set_metrics_link(PipeMetrics(metrics_conn, instance_name))
    try:
        model = runner.ModelRunner(
            spec.config_json,
            model_path,
            runner.model_args(spec.config_json, model_path, instance_name, device.kind.upper(), device.index, version),
        )
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: the load error names it, as Triton's does
        conn.send(Failed(runner.describe_error(exc).rstrip()))
        return
    # Only now: a BLS call in ``initialize`` raises Triton's exception (with the link, it went down the
    # pipe before Ready, and the load failed as "a worker process did not start").
    pb_utils.set_host_link(link)
    conn.send(Ready())
    try:
        while True:
            # The link reads the pipe (a thread of the model may be reading it) and hands this loop its share.
            match link.next_message():
                case Stop():
                    return
                case Ping():
                    conn.send(Ping())
                case NewArena() as message:
                    map_arena(arenas, message)
                case RunRequests() as run:
                    reply = (run_decoupled if decoupled else run_batch)(model, link, conn, arenas, run, views)
                    if reply is None:
                        return
                    conn.send(reply._replace(batch=run.batch, inputs_kept=views.kept()))
                case other:  # a kind this worker does not speak (a feed's Run): answered, never left waiting
                    conn.send(Failed(f"a Python model's worker runs lists of requests, not {type(other).__name__}"))
    except (EOFError, OSError):
        return
    finally:
        model.finalize()  # it logs what the model's finalize raises


# -- the server side ------------------------------------------------------------------------------

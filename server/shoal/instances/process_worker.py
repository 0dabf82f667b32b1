"""A process instance's worker: the backend attaches the model to the server's weights, then runs the
batches the host sends over the pipe (``instances.worker_pipe``), one at a time. ``entry`` starts
every worker process, a Python model's too (``instances.python_worker``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from shoal import logs
from shoal.backends.base import backend_for
from shoal.backends.devices import Device
from shoal.dataplane import inline, packing
from shoal.dataplane.arena import Arena, PoolFull
from shoal.errors import ShoalError
from shoal.instances import lifeline
from shoal.instances.worker_pipe import (
    REQUESTS,
    RESPONSES,
    Failed,
    Grow,
    InputViews,
    NewArena,
    Ping,
    Ran,
    Ready,
    Run,
    Stop,
    arena_bytes,
    as_tensors,
    map_arena,
    with_descriptor,
)
from shoal.repository.config import ModelSpec

logger = logging.getLogger(__name__)


def execute(model: Any, conn: Any, arenas: dict[str, Arena], run: Run, views: InputViews) -> Ran | Failed | None:
    """Run one batch in a worker; the reply, or None when the server went away while it grew an arena.
    Its inputs come in the message (arrays of the model's own) or as views of the REQUESTS arena, its
    outputs go back in the message when they are numeric and small (``inline``), else in the arena."""
    try:
        if isinstance(run.inputs, dict):
            inputs = inline.arrays_of(run.inputs)
        else:
            inputs = dict(views.unpack(arenas[REQUESTS], run.inputs))
        results = as_tensors(model.run(inputs, run.outputs))
        del inputs
    except Exception as exc:  # noqa: BLE001 - reported to the server, the worker goes on
        return Failed(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ShoalError) else exc.message)
    carried = inline.inline_feeds([{tensor.name: tensor.data for tensor in results}])
    if carried is not None:
        return Ran(carried[0])
    while True:
        try:
            return Ran(packing.pack_at(arenas[RESPONSES], 0, results))
        except PoolFull as full:
            try:
                arena_bytes(full.wanted, "outputs")
            except ShoalError as exc:
                return Failed(exc.message)
            conn.send(Grow(full.wanted))
            message = conn.recv()
            if not isinstance(message, NewArena):
                return None
            map_arena(arenas, with_descriptor(conn, message))


def worker_main(spec: ModelSpec, model_path: Path, device: Device, handle: Any, threads: int, conn: Any) -> None:
    """A worker process: the backend attaches the model to the server's weights, requests come from the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the host's to handle; it stops us
    try:
        model = backend_for(spec).attach(spec, model_path, device, handle, threads)
    except Exception as exc:  # noqa: BLE001 - the load error names it
        conn.send(Failed(exc.message if isinstance(exc, ShoalError) else f"{type(exc).__name__}: {exc}"))
        return
    conn.send(Ready())
    arenas: dict[str, Arena] = {}
    views = InputViews()
    while True:
        try:
            match conn.recv():
                case Stop():
                    return
                case Ping():
                    conn.send(Ping())
                case NewArena() as message:
                    map_arena(arenas, with_descriptor(conn, message))
                case Run() as run:
                    reply = execute(model, conn, arenas, run, views)
                    if reply is None:
                        return
                    conn.send(reply._replace(inputs_kept=views.kept()))
                case other:  # a kind this worker does not speak (a Python model's batch): answered, never left waiting
                    conn.send(Failed(f"a feed model's worker runs feeds, not {type(other).__name__}"))
        except (EOFError, OSError):
            return


def entry(main: Any, log_share: logs.LogShare, *args: Any) -> None:
    """A worker process starts here: it dies with the host whatever ``main`` (its loop) is doing, and
    ends as soon as ``main`` does, however (a model's ``sys.exit()`` included): a thread the model left
    running, daemon or not, never holds a worker whose loop is gone, so the server sees it die and
    replaces it instead of waiting for its answer forever. It logs as the server's settings say, now
    and after any change (``shoal.logs``)."""
    lifeline.guard_worker(args[-1])
    logs.install(log_share)
    code = 0
    try:
        main(*args)
    except BaseException:  # noqa: BLE001 - whatever ended the loop, the process ends with it
        logger.exception("the worker process's loop ended with an error")
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

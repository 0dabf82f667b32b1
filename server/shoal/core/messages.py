"""The messages a front-end worker (``RemoteCore``) and the host (``CoreHost``) exchange.

Small typed records (``NamedTuple``), which the channel sends as their kind's index in ``RECORDS``
and their fields (``dataplane.channel.Records``: as cheap to pickle as a bare tuple). Worker → host:

- ``Call``: a control-plane call of ``Core`` (one of ``CALLS``)
- ``Infer``: an inference, inputs in the worker's arena (``streaming``: a decoupled model's
  responses, answered by ``Streamed``); ``freed``: response blocks the worker is done with, as a
  ``Free`` would give them back (one message less per request)
- ``Cancel``: the client gave up on ``id``
- ``Free``: response blocks of the host's arena the worker is done with
- ``Started``: serving on its (gRPC, HTTP) ports, or why it cannot (then it exits)
- ``Pong``: the answer to a ``Ping``, from the worker's event loop
- ``Sent``: a traced response was written to its client (``Core.sent``)

Host → worker:

- ``Result``: a call's answer
- ``Error``: a call or inference failed (an ``ErrorCode`` value and the message)
- ``Inferred``: outputs in the host's arena; the worker frees ``block``; ``released``: requests
  whose inputs were let go of by then, as a ``Release`` would say (its own id, usually);
  ``trace_id``: the trace the worker reports its send to (0: none)
- ``Release``: nothing in the host refers to these requests' inputs any more
- ``Streamed``: one response of a streaming ``Infer``, its outputs in a block of their own (``names``
  None: no outputs)
- ``Health``: model or server state changed: read health again, and forget which models are decoupled
- ``Stop``: stop serving, finish what is open within ``grace_s``
- ``Ping``: the liveness check: a worker whose loop is stuck never answers

Every ``Infer`` and ``Call`` gets exactly one ``Inferred``, ``Result`` or ``Error``, cancelled or
not; a streaming ``Infer`` gets any number of ``Streamed``, then one final ``Streamed`` or an
``Error``, which plays that part. The answer does not free the request's input block: the host
reads inputs in place, and views of them can outlive the answer (a sequence's state that is an
input passed through, a batch still executing for a cancelled request, a decoupled model's thread).
Every ``Infer`` gets its id released exactly once, in a ``Release`` or an ``Inferred``'s
``released``, before, with or after its answer, once no view of its inputs is left in the host; the
worker reuses the block only then.

Tensors travel as ``dataplane.packing.Slot`` tuples; BYTES in the wire's encoding both ways, so
only the host decodes inputs and encodes outputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shoal.dataplane.channel import Records
from shoal.dataplane.packing import Slot
from shoal.request_types import RegionInput, RegionSlice
from shoal.tracing.trace import Origin

# (index among the outputs, name, datatype name, shape) of an output written into the client's
# shared memory: no bytes to move.
RegionOutput = tuple[int, str, str, tuple[int, ...]]


class Call(NamedTuple):
    id: int
    method: str
    args: tuple[Any, ...]


class Infer(NamedTuple):
    """An ``InferRequest`` but its inputs, which are ``slots`` in the worker's arena."""

    id: int
    model_name: str
    model_version: str
    request_id: str
    requested_outputs: tuple[str, ...] | None
    parameters: dict[str, Any]
    class_counts: dict[str, int]
    region_inputs: tuple[RegionInput, ...]
    output_regions: dict[str, RegionSlice]
    slots: list[Slot]
    streaming: bool
    freed: list[int]
    origin: Origin | None = None  # where the worker's transport got it (tracing)


class Cancel(NamedTuple):
    id: int


class Free(NamedTuple):
    blocks: list[int]


class Started(NamedTuple):
    ports_or_problem: tuple[int, int] | str


class Pong(NamedTuple):
    pass


class Result(NamedTuple):
    id: int
    value: Any


class Error(NamedTuple):
    id: int
    code: str
    message: str
    kind: str = ""  # ShoalError.kind: the subclass errors.rebuilt makes again in the worker


class Inferred(NamedTuple):
    id: int
    model_name: str
    model_version: str
    response_id: str
    block: int
    slots: list[Slot]
    in_regions: list[RegionOutput]
    released: list[int]
    trace_id: int = 0


class Release(NamedTuple):
    ids: list[int]


class Streamed(NamedTuple):
    id: int
    names: tuple[str, str, str] | None  # the response's model name, version and id
    block: int
    slots: list[Slot]
    final: bool
    error: str
    trace_id: int = 0


class Sent(NamedTuple):
    trace_id: int
    started_ns: int
    ended_ns: int
    last: bool


class Health(NamedTuple):
    pass


class Stop(NamedTuple):
    grace_s: float


class Ping(NamedTuple):
    pass


# Every kind of record the channel carries, both ways.
RECORDS = Records(
    [Call, Infer, Cancel, Free, Started, Pong, Sent, Result, Error, Inferred, Release, Streamed, Health, Stop, Ping]
)

# The Core methods a worker may call by name (infer has its own message).
CALLS = frozenset(
    {
        "live",
        "ready",
        "health",
        "server_metadata",
        "model_ready",
        "model_metadata",
        "model_config",
        "model_decoupled",
        "model_statistics",
        "repository_index",
        "load_model",
        "unload_model",
        "register_system_shared_memory",
        "unregister_system_shared_memory",
        "system_shared_memory_status",
        "register_cuda_shared_memory",
        "unregister_cuda_shared_memory",
        "cuda_shared_memory_status",
        "log_settings",
        "update_log_settings",
        "trace_settings",
        "update_trace_settings",
    }
)

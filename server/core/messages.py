"""The messages a front-end worker (``RemoteCore``) and the host (``CoreHost``) exchange.

Small tuples, first item the kind. Worker → host::

    (CALL, id, method, args)          a control-plane call of ``Core`` (one of CALLS)
    (INFER, id, header, slots)        an inference; inputs in the worker's arena
    (STREAM, id, header, slots)       a streaming inference (a decoupled model's responses)
    (CANCEL, id)                      the client gave up on ``id``
    (FREE, [block, ...])              response blocks of the host's arena the worker is done with
    (STARTED, port | message)         serving on ``port``, or why it cannot (then it exits)
    (PONG,)                           the answer to a PING, from the worker's event loop

Host → worker::

    (RESULT, id, value)               a call's answer
    (ERROR, id, code, message)        a call or inference failed (``ErrorCode`` value)
    (INFERRED, id, header, block, slots)   outputs in the host's arena; the worker frees ``block``
    (RELEASE, [id, ...])              nothing in the host refers to these requests' inputs any more
    (STREAMED, id, header | None, block, slots, final, error)   one response of a STREAM, its
                                      outputs in a block of their own (header None: no outputs)
    (HEALTH,)                         model or server state changed: read health again
    (STOP, grace_s)                   stop serving, finish what is open within ``grace_s``
    (PING,)                           the liveness check: a worker whose loop is stuck never answers

Every INFER and CALL gets exactly one INFERRED, RESULT or ERROR, cancelled or not. A STREAM gets
any number of STREAMED, then one final STREAMED or an ERROR, which plays that part. The answer does
not free the request's input block: the host reads inputs in place, and views of them can outlive
the answer (a sequence's state that is an input passed through, a batch still executing for a
cancelled request, a decoupled model's thread). Every INFER and STREAM gets exactly one RELEASE of
its id, before or after its answer, sent once no view of its inputs is left in the host; the worker
reuses the block only then.
"""

from __future__ import annotations

CALL, INFER, CANCEL, FREE, STARTED = "call", "infer", "cancel", "free", "started"
RESULT, ERROR, INFERRED, HEALTH, STOP = "result", "error", "inferred", "health", "stop"
PING, PONG, RELEASE = "ping", "pong", "release"
STREAM, STREAMED = "stream", "streamed"

# The Core methods a worker may call by name (infer has its own message).
CALLS = frozenset({
    "live", "ready", "health", "server_metadata", "model_ready", "model_metadata", "model_config",
    "model_statistics", "repository_index", "load_model", "unload_model", "register_system_shared_memory",
    "unregister_system_shared_memory", "system_shared_memory_status", "register_cuda_shared_memory",
    "unregister_cuda_shared_memory", "cuda_shared_memory_status",
})

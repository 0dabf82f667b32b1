"""The messages a front-end worker (``RemoteCore``) and the host (``CoreHost``) exchange.

Small tuples, first item the kind. Worker → host::

    (CALL, id, method, args)          a control-plane call of ``Core`` (one of CALLS)
    (INFER, id, header, slots)        an inference; inputs in the worker's arena
    (CANCEL, id)                      the client gave up on ``id``
    (FREE, [block, ...])              response blocks of the host's arena the worker is done with
    (STARTED, port | message)         serving on ``port``, or why it cannot (then it exits)
    (PONG,)                           the answer to a PING, from the worker's event loop

Host → worker::

    (RESULT, id, value)               a call's answer
    (ERROR, id, code, message)        a call or inference failed (``ErrorCode`` value)
    (INFERRED, id, header, block, slots)   outputs in the host's arena; the worker frees ``block``
    (HEALTH,)                         model or server state changed: read health again
    (STOP, grace_s)                   stop serving, finish what is open within ``grace_s``
    (PING,)                           the liveness check: a worker whose loop is stuck never answers

Every INFER and CALL gets exactly one INFERRED, RESULT or ERROR, cancelled or not, and the worker
reuses an input block only after that answer. For a request that finished, the host is done with
its inputs then. For one cancelled while its batch executes, the answer comes at the cancel and the
instance may still read the block while the worker reuses it: that execution's results are
discarded, so no client sees them (the memory stays mapped either way).
"""

from __future__ import annotations

CALL, INFER, CANCEL, FREE, STARTED = "call", "infer", "cancel", "free", "started"
RESULT, ERROR, INFERRED, HEALTH, STOP = "result", "error", "inferred", "health", "stop"
PING, PONG = "ping", "pong"

# The Core methods a worker may call by name (infer has its own message).
CALLS = frozenset({
    "live", "ready", "health", "server_metadata", "model_ready", "model_metadata", "model_config",
    "model_statistics", "repository_index", "load_model", "unload_model", "register_system_shared_memory",
    "unregister_system_shared_memory", "system_shared_memory_status", "register_cuda_shared_memory",
    "unregister_cuda_shared_memory", "cuda_shared_memory_status",
})

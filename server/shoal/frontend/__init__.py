"""Front-end worker processes: gRPC served by N processes on one port, models held by one host.

``worker``: the process (gRPC over a ``RemoteCore``); ``supervisor``: the host's side, which starts
them, restarts one that dies and stops them all (gunicorn's arbiter, in small); ``worker_count``: how
many ``--grpc-workers auto`` starts, from the cores the process may use.
"""

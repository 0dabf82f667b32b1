"""``shoal-load``: a load tester for any KServe v2 / Triton gRPC server (see ``cli.py``)."""

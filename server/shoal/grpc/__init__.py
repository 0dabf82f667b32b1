"""The gRPC transport: a thin servicer over ``server.core``, the tensor codec, the status table."""

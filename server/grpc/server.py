"""Build the grpc.aio server: every RPC of the table, each under the error guard.

Requests are handed to the guard as bytes and decoded there (see ``status.parse``).
"""

from __future__ import annotations

import grpc

from server.grpc.servicer import InferenceServicer
from server.grpc.status import guard_stream, guard_unary
from server.pb import METHODS, SERVICE_NAME
from server.settings import TlsSettings

# Triton and tritonclient both allow messages up to INT32_MAX; grpc's default is 4 MiB.
MAX_MESSAGE_BYTES = 2**31 - 1


def method_handlers(servicer: InferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    handlers = {}
    for method in METHODS.values():
        implementation = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                guard_stream(implementation, method.request_type),
                response_serializer=method.response_type.SerializeToString,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                guard_unary(implementation, method.request_type),
                response_serializer=method.response_type.SerializeToString,
            )
    return handlers


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    root = tls.root_cert.read_bytes() if tls.root_cert else None
    pair = (tls.server_key.read_bytes(), tls.server_cert.read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=tls.mutual)


def build_server(
    servicer: InferenceServicer, address: str, port: int, tls: TlsSettings | None = None
) -> tuple[grpc.aio.Server, int]:
    """The server and the port it bound (pass port 0 for a free one: no pick-then-release race)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, method_handlers(servicer)),)
    )
    target = f"{address}:{port}"
    bound = server.add_secure_port(target, server_credentials(tls)) if tls else server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {address}:{port}")
    return server, bound

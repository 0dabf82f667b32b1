"""Build the grpc.aio server: every RPC of the table under the error guard, plus health and reflection.

Requests are handed to the guard as bytes and decoded there (see ``status.parse``).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from server.grpc import reflection
from server.grpc.health import HealthReporter
from server.grpc.restrict import Restriction, restricted
from server.grpc.servicer import InferenceServicer
from server.grpc.status import guard_stream, guard_unary
from server.pb import METHODS, SERVICE_NAME
from server.settings import GrpcLimits, TlsSettings

HEALTH_SERVICE = "grpc.health.v1.Health"


def method_handlers(
    servicer: InferenceServicer, restrictions: tuple[Restriction, ...] = ()
) -> dict[str, grpc.RpcMethodHandler]:
    handlers = {}
    for method in METHODS.values():
        implementation = restricted(method.name, getattr(servicer, method.name), restrictions)
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
    servicer: InferenceServicer,
    health: HealthReporter,
    address: str,
    port: int,
    tls: TlsSettings | None = None,
    limits: GrpcLimits | None = None,
) -> tuple[grpc.aio.Server, int]:
    """The server and the port it bound (pass port 0 for a free one: no pick-then-release race)."""
    limits = limits or GrpcLimits()
    options: list[tuple[str, int]] = [
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
    ]
    if limits.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", limits.max_concurrent_streams))
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, method_handlers(servicer, limits.restrictions)),)
    )
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable(server, (HEALTH_SERVICE,))
    target = f"{address}:{port}"
    bound = server.add_secure_port(target, server_credentials(tls)) if tls else server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {address}:{port}")
    return server, bound

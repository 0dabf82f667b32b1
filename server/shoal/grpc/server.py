"""Build the gRPC server: every RPC of the table, and grpc.health.v1, under the error guard and the
restrictions; plus reflection. The port is never shared by accident (``grpc.so_reuseport`` off).

The engine (pygrpc-native or grpc.aio) is ``engine.choose``'s; both get the same options and the same
handlers (``register``: registered per service on pygrpc-native, which serves those natively; generic
on grpc.aio, whose ``add_registered_method_handlers`` does nothing below grpcio 1.84); reflection and
ModelStreamInfer are generic handlers, served by pygrpc-native's grpc.aio fallback.

Requests are handed to the guard as bytes and decoded there (see ``status.parse``).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from shoal.backends.devices import cpu_allowance
from shoal.errors import StartupError
from shoal.grpc import engine, reflection
from shoal.grpc.health import HealthReporter
from shoal.grpc.restrict import CATEGORIES, restricted
from shoal.grpc.servicer import InferenceServicer
from shoal.grpc.status import guard_stream, guard_unary, quiet_answers_not_sent
from shoal.protocol import METHODS, SERVICE_NAME
from shoal.settings import GrpcLimits, Restriction, TlsSettings

HEALTH_SERVICE = "grpc.health.v1.Health"


def method_handlers(
    servicer: InferenceServicer, restrictions: tuple[Restriction, ...] = ()
) -> dict[str, grpc.RpcMethodHandler]:
    handlers = {}
    for method in METHODS.values():
        implementation = restricted(CATEGORIES[method.name], getattr(servicer, method.name), restrictions)
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


def health_handlers(
    health: HealthReporter, restrictions: tuple[Restriction, ...] = ()
) -> dict[str, grpc.RpcMethodHandler]:
    """``grpc.health.v1.Health`` under the same guard, and the ``health`` restriction (it tells model state)."""
    serialize = health_pb2.HealthCheckResponse.SerializeToString
    check = restricted("health", health.servicer.Check, restrictions)
    watch = restricted("health", health.servicer.Watch, restrictions)  # writes through its context
    return {
        "Check": grpc.unary_unary_rpc_method_handler(
            guard_unary(check, health_pb2.HealthCheckRequest), response_serializer=serialize
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            guard_unary(watch, health_pb2.HealthCheckRequest), response_serializer=serialize
        ),
    }


def register(
    server: grpc.aio.Server, choice: engine.EngineChoice, services: dict[str, dict[str, grpc.RpcMethodHandler]]
) -> None:
    """Each service's handlers, so that the engine serves every one of them.

    grpc.aio's ``add_registered_method_handlers`` does nothing below grpcio 1.84 (the pinned range), so
    grpcio gets generic handlers, as before the engines. pygrpc-native serves what is registered with it
    natively, and its server (``engine.create``) hands request-streaming methods (ModelStreamInfer) to its
    grpc.aio fallback as a generic handler."""
    if choice.name != "native":
        server.add_generic_rpc_handlers(
            tuple(grpc.method_handlers_generic_handler(name, handlers) for name, handlers in services.items())
        )
        return
    for name, handlers in services.items():
        server.add_registered_method_handlers(name, handlers)


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
) -> tuple[grpc.aio.Server, int, engine.EngineChoice]:
    """The server, the port it bound (pass port 0 for a free one: no pick-then-release race) and the engine
    that serves it, with why (for the log line that starts it)."""
    limits = limits or GrpcLimits()
    choice = engine.choose(limits.engine, tls is not None).with_io_threads(
        limits.io_threads, cpu_allowance().cores(round_up=False)
    )  # whole cores, as --grpc-workers auto counts
    options: list[tuple[str, int]] = [
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        # grpc shares ports by default: a second server on this port would silently take half the
        # connections. Only on purpose (--reuse-grpc-port).
        ("grpc.so_reuseport", 1 if limits.reuse_port else 0),
    ]
    if limits.max_concurrent_streams:
        # Also grpc core's bound on stream churn: streams past the limit are refused in the
        # transport, so a client that opens and resets streams at once (HTTP/2 rapid reset) no
        # longer floods the queue of calls waiting for the server, which cancels other
        # connections' calls when it overflows (bench/rapid_reset.py). pygrpc-native reads the same
        # option (1024 without it) and also ends a connection that resets streams fast with GOAWAY.
        options.append(("grpc.max_concurrent_streams", limits.max_concurrent_streams))
    quiet_answers_not_sent()  # a client that leaves as it is answered is no server error
    server = engine.create(choice, options)
    register(
        server,
        choice,
        {
            SERVICE_NAME: method_handlers(servicer, limits.restrictions),
            HEALTH_SERVICE: health_handlers(health, limits.restrictions),
        },
    )
    reflection.enable(server, (HEALTH_SERVICE,))
    target = f"{address}:{port}"
    try:
        bound = server.add_secure_port(target, server_credentials(tls)) if tls else server.add_insecure_port(target)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise StartupError(f"cannot serve gRPC on {target}: the port is in use or the address is not this host's")
    return server, bound, choice

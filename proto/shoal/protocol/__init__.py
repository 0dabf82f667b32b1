"""The KServe v2 / Triton wire protocol: generated messages plus the service table.

The messages are generated (``grpc_service_pb2``, ``model_config_pb2``) under the
proto package ``shoal.inference``, so they never collide with tritonclient's copy
of ``inference.*`` in one Python process. The service is served and called under
its wire name ``inference.GRPCInferenceService``: method paths, field numbers and
wire types are what Triton clients see, and message type names never go on the wire.

This module builds the method table from the generated service descriptor instead
of using grpc's generated ``*_pb2_grpc`` code, whose paths would carry our package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory

from shoal.protocol import grpc_service_pb2 as service_pb2
from shoal.protocol import model_config_pb2 as config_pb2

# The package our .proto files declare, and the one Triton's (and the wire's, and users') names carry.
PROTO_PACKAGE, WIRE_PACKAGE = "shoal.inference", "inference"
SERVICE_NAME = f"{WIRE_PACKAGE}.GRPCInferenceService"
_PROTO_NAME = re.compile(rf"\b{re.escape(PROTO_PACKAGE)}\.")


def wire_names(text: str) -> str:
    """``text`` (protobuf's error about a message, say) with our type names as Triton's users know them:
    ``shoal.inference.ModelInferRequest`` becomes ``inference.ModelInferRequest``."""
    return _PROTO_NAME.sub(f"{WIRE_PACKAGE}.", text)


@dataclass(frozen=True)
class Method:
    """One RPC of the service: its name, wire path and message classes."""

    name: str
    request_type: Any
    response_type: Any
    client_streaming: bool
    server_streaming: bool

    @property
    def path(self) -> str:
        return f"/{SERVICE_NAME}/{self.name}"


def _methods() -> dict[str, Method]:
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    return {
        m.name: Method(
            name=m.name,
            request_type=message_factory.GetMessageClass(m.input_type),
            response_type=message_factory.GetMessageClass(m.output_type),
            client_streaming=m.client_streaming,
            server_streaming=m.server_streaming,
        )
        for m in service.methods
    }


METHODS: dict[str, Method] = _methods()


class InferenceStub:
    """A client stub with one callable attribute per RPC (sync or aio channel)."""

    def __init__(self, channel: grpc.Channel | grpc.aio.Channel) -> None:
        for method in METHODS.values():
            factory = {
                (False, False): channel.unary_unary,
                (False, True): channel.unary_stream,
                (True, False): channel.stream_unary,
                (True, True): channel.stream_stream,
            }[(method.client_streaming, method.server_streaming)]
            setattr(
                self,
                method.name,
                factory(
                    method.path,
                    request_serializer=method.request_type.SerializeToString,
                    response_deserializer=method.response_type.FromString,
                ),
            )

    def __getattr__(self, name: str) -> Any:  # for type checkers: attributes are set per RPC
        raise AttributeError(name)


__all__ = [
    "METHODS",
    "PROTO_PACKAGE",
    "SERVICE_NAME",
    "WIRE_PACKAGE",
    "InferenceStub",
    "Method",
    "config_pb2",
    "service_pb2",
    "wire_names",
]

"""Server reflection (grpcio-reflection) that describes the service under its wire name.

Shoal's messages live in the proto package ``shoal.inference`` (so tritonclient can share the
process), but clients such as grpcurl must see ``inference.GRPCInferenceService``. Reflection
therefore answers from a private descriptor pool holding copies of our .proto files renamed
into package ``inference``; the process's default pool is untouched.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from shoal.protocol import PROTO_PACKAGE, SERVICE_NAME, WIRE_PACKAGE, config_pb2, service_pb2

_OURS, _WIRE = PROTO_PACKAGE, WIRE_PACKAGE


def _wire_name(name: str) -> str:
    return name.replace(f".{_OURS}.", f".{_WIRE}.", 1) if name.startswith(f".{_OURS}.") else name


def _rename_message(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        if field.type_name.startswith(f".{_OURS}."):  # assigning "" would mark scalars as typed
            field.type_name = _wire_name(field.type_name)
    for nested in message.nested_type:
        _rename_message(nested)


def _renamed(file: object) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)  # type: ignore[attr-defined]
    proto.package = _WIRE
    proto.name = proto.name.replace("server/pb/", "")
    dependencies = [d.replace("server/pb/", "") for d in proto.dependency]
    del proto.dependency[:]
    proto.dependency.extend(dependencies)
    for message in proto.message_type:
        _rename_message(message)
    for service in proto.service:
        for method in service.method:
            method.input_type = _wire_name(method.input_type)
            method.output_type = _wire_name(method.output_type)
    return proto


def wire_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for module in (config_pb2, service_pb2):
        pool.Add(_renamed(module.DESCRIPTOR))
    health_file = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(health_file)
    pool.Add(health_file)
    return pool


def enable(server: grpc.aio.Server, extra_services: tuple[str, ...]) -> None:
    names = (SERVICE_NAME, *extra_services, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=wire_pool())

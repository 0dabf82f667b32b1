"""The wire contract: generated code is fresh, and every message matches Triton's field by field."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, EnumDescriptor

from shoal.protocol import METHODS, SERVICE_NAME, config_pb2, service_pb2
from tests.models import REPO_ROOT


def _load_generator():  # proto/compile_protos.py is a script, not part of the package
    spec = importlib.util.spec_from_file_location("shoal_compile_protos", REPO_ROOT / "proto" / "compile_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    written = _load_generator().generate(tmp_path)
    assert written
    for fresh in written:
        in_tree = REPO_ROOT / "proto" / "shoal" / "protocol" / fresh.relative_to(tmp_path)
        assert in_tree.read_bytes() == fresh.read_bytes(), (
            f"{in_tree} is stale: reinstall (pip install -e ./proto) to regenerate it from its .proto"
        )


def test_tritonclient_and_shoal_messages_share_one_process() -> None:
    code = (
        "import tritonclient.grpc, tritonclient.grpc.model_config_pb2\n"
        "from shoal.protocol import service_pb2, InferenceStub\n"
        "import shoal.grpc.server\n"
        "print(service_pb2.ModelInferRequest.DESCRIPTOR.full_name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "shoal.inference.ModelInferRequest"


def test_messages_name_protobuf_types_by_the_wire_package() -> None:
    """Our proto package is ``shoal.inference`` (above); messages say ``inference.``, as Triton's."""
    from shoal.configuring.pipeline import ConfigOverride
    from shoal.errors import ShoalError
    from shoal.grpc.status import parse, to_status
    from shoal.repository.config import parse_config

    failures = {
        "malformed message": (
            lambda: parse(service_pb2.ModelInferRequest, b"\xff\xff"),
            "malformed inference.ModelInferRequest message: Error parsing message with type "
            "'inference.ModelInferRequest'",
        ),
        "config override": (
            lambda: ConfigOverride.parse("m", {"input": [{"data_type": "TYPE_X"}]}),
            "Invalid enum value TYPE_X for enum type inference.DataType",
        ),
        "config.pbtxt": (
            lambda: parse_config("max_batch: 3\n"),
            'Message type "inference.ModelConfig" has no field named "max_batch"',
        ),
    }
    for case, (call, phrase) in failures.items():
        with pytest.raises(ShoalError) as caught:
            call()
        assert phrase in caught.value.message and "shoal" not in caught.value.message, (case, caught.value.message)
    _, message = to_status(TypeError("expected shoal.inference.ModelInferRequest"))
    assert message.startswith("internal error (incident ") and "shoal" not in message  # the detail: in the log


def _fields(message: Descriptor, seen: set[str]) -> dict[str, tuple]:
    """Wire-relevant shape of a message, recursively: name → (number, type, repeated, nested)."""
    if message.full_name in seen:
        return {}
    seen = seen | {message.full_name}
    result = {}
    for field in message.fields:
        nested = _fields(field.message_type, seen) if field.message_type else None
        enum = _enum(field.enum_type) if field.enum_type else None
        oneof = field.containing_oneof.name if field.containing_oneof else None
        result[field.name] = (field.number, field.type, field.is_repeated, nested, enum, oneof)
    return result


def _enum(enum: EnumDescriptor) -> dict[str, int]:
    return {v.name: v.number for v in enum.values}


def _message_names(module) -> list[str]:
    return sorted(module.DESCRIPTOR.message_types_by_name)


@pytest.mark.parametrize("module_name", ["service_pb2", "model_config_pb2"])
def test_every_message_matches_tritonclient(module_name: str) -> None:
    triton = pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import model_config_pb2 as triton_config
    from tritonclient.grpc import service_pb2 as triton_service

    ours = service_pb2 if module_name == "service_pb2" else config_pb2
    theirs = triton_service if module_name == "service_pb2" else triton_config
    assert triton is not None
    missing = set(_message_names(theirs)) - set(_message_names(ours))
    assert not missing, f"messages Triton has and Shoal lacks: {sorted(missing)}"
    for name in _message_names(theirs):
        assert _fields(ours.DESCRIPTOR.message_types_by_name[name], set()) == _fields(
            theirs.DESCRIPTOR.message_types_by_name[name], set()
        ), name


def test_service_methods_match_tritonclient() -> None:
    from tritonclient.grpc import service_pb2 as triton_service

    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert theirs.full_name == SERVICE_NAME
    expected = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming) for m in theirs.methods
    }
    ours = {
        m.name: (
            m.request_type.DESCRIPTOR.name,
            m.response_type.DESCRIPTOR.name,
            m.client_streaming,
            m.server_streaming,
        )
        for m in METHODS.values()
    }
    assert ours == expected
    assert METHODS["ModelInfer"].path == "/inference.GRPCInferenceService/ModelInfer"

"""Property-based: arbitrary bytes and arbitrary well-formed messages never crash the server or
the config parser, and never leak an error other than a clean status."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.errors import ShoalError
from shoal.protocol import METHODS, InferenceStub
from shoal.protocol import service_pb2 as pb
from shoal.repository.config import normalize, parse_config, validate
from tests.conftest import RunningServer

CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND}
DATATYPES = ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "BF16", "BYTES", "COMPLEX", ""]
MODELS = ["simple", "mlp", "identity_bytes", "identity_bf16", "strings", "nope", ""]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def channel(example_server: RunningServer):
    with grpc.insecure_channel(example_server.url) as channel:
        yield channel


def _call_raw(channel: grpc.Channel, raw: bytes) -> grpc.StatusCode:
    call = channel.unary_unary(METHODS["ModelInfer"].path, request_serializer=None, response_deserializer=None)
    try:
        call(raw, timeout=30)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@FAST
@given(raw=st.binary(max_size=512))
def test_arbitrary_bytes_get_a_clean_status(channel: grpc.Channel, raw: bytes) -> None:
    assert _call_raw(channel, raw) in CLEAN | {grpc.StatusCode.OK}


# Small shapes, shapes with huge or int64-extreme dims (zero-element ones included), and shapes
# around numpy's limit of 64 dims.
SHAPES = st.one_of(
    st.lists(st.integers(min_value=-2, max_value=20), max_size=3),
    st.lists(st.sampled_from([0, 0, 1, 3, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]), max_size=6),
    st.lists(st.sampled_from([0, 1, 1, 1, 2]), min_size=60, max_size=70),
)
tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["INPUT0", "INPUT1", "IN", "x", ""]),
        "datatype": st.sampled_from(DATATYPES),
        "shape": SHAPES,
        "raw": st.binary(max_size=200),
        "typed": st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=8),
    }
)


@FAST
@given(
    model=st.sampled_from(MODELS),
    version=st.sampled_from(["", "1", "2", "x"]),
    inputs=st.lists(tensors, max_size=3),
    raw_count_delta=st.sampled_from([0, 0, 0, -1, 1]),
    outputs=st.lists(st.sampled_from(["OUTPUT0", "OUT", "zzz"]), max_size=2),
    priority=st.integers(min_value=0, max_value=2**63),
    typed=st.booleans(),
)
def test_well_formed_but_wrong_requests_get_a_clean_status(
    channel: grpc.Channel,
    model: str,
    version: str,
    inputs: list[dict],
    raw_count_delta: int,
    outputs: list[str],
    priority: int,
    typed: bool,
) -> None:
    """Raw or typed ``contents`` inputs: any shape/dims combination gets a clean status, never INTERNAL."""
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for tensor in inputs:
        added = request.inputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        if typed:
            added.contents.int_contents.extend(tensor["typed"])
    if not typed:
        raws = [t["raw"] for t in inputs][: max(0, len(inputs) + raw_count_delta)]
        if raw_count_delta > 0:
            raws.append(b"\x00")
        request.raw_input_contents.extend(raws)
    for name in outputs:
        request.outputs.add(name=name)
    if priority:
        request.parameters["priority"].uint64_param = priority
    status = _call_raw(channel, request.SerializeToString())
    assert status in CLEAN | {grpc.StatusCode.OK}
    assert InferenceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300))
def test_config_parser_raises_only_clean_errors(text: str) -> None:
    try:
        config = parse_config(text)
        validate(normalize(config, "m"), "m")
    except ShoalError:
        pass


config_fields = st.fixed_dictionaries(
    {
        "backend": st.sampled_from(["onnxruntime", "identity", "", "tensorflow"]),
        "max_batch_size": st.integers(min_value=-3, max_value=2**31 - 1),
        "dims": st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=3),
        "data_type": st.integers(min_value=0, max_value=14),
        "preferred": st.lists(st.integers(min_value=-5, max_value=100), max_size=3),
        "levels": st.integers(min_value=0, max_value=5),
        "default_level": st.integers(min_value=0, max_value=7),
        "count": st.integers(min_value=-2, max_value=5),
        "filename": st.sampled_from(["", "model.onnx", "../x", "a/b", ".."]),
    }
)


@settings(max_examples=300, deadline=None)
@given(fields=config_fields)
def test_structurally_valid_configs_validate_cleanly(fields: dict) -> None:
    from shoal.protocol import config_pb2
    from shoal.repository.config import to_spec

    config = config_pb2.ModelConfig(
        backend=fields["backend"], max_batch_size=fields["max_batch_size"], default_model_filename=fields["filename"]
    )
    config.input.add(name="a", data_type=fields["data_type"], dims=fields["dims"])
    config.output.add(name="b", data_type=fields["data_type"], dims=fields["dims"])
    config.instance_group.add(count=fields["count"])
    config.dynamic_batching.preferred_batch_size.extend(fields["preferred"])
    config.dynamic_batching.priority_levels = fields["levels"]
    config.dynamic_batching.default_priority_level = fields["default_level"]
    try:
        normalized = normalize(config, "m")
        validate(normalized, "m")
        to_spec(normalized)
    except ShoalError:
        pass

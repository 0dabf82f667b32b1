"""Names a client sends are quoted shortened (``shoal.errors.shown``) in every message about them.

A message goes back in a gRPC trailer and is cut to ``MAX_MESSAGE_BYTES``; a name quoted whole
would fill it, and the cut would drop what the message says is wrong. Each case sends a
10,000-character name and checks that the message keeps its point and stays well under the bound.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shoal.configuring.pipeline import ConfigOverride
from shoal.errors import MAX_MESSAGE_BYTES, ShoalError
from shoal.grpc import convert
from shoal.lifecycle import request_checks
from shoal.protocol import service_pb2 as pb
from shoal.protocol.types import DataType
from shoal.repository.config import parse_config, to_spec
from shoal.request_types import InferRequest, Tensor

LONG = "n" * 10_000
SPEC = to_spec(
    parse_config("""
    name: "m" backend: "identity" max_batch_size: 8
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
""")
)


def _infer(
    datatype: str = "INT32",
    shape: tuple[int, ...] = (1,),
    model: str = LONG,
    change: Callable[[pb.ModelInferRequest], Any] = lambda r: None,
) -> Callable[[], object]:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name=LONG, datatype=datatype, shape=shape)
    change(request)
    return lambda: convert.infer_request(request)


def _classification(value: int | str) -> Callable[[], object]:
    def change(request: pb.ModelInferRequest) -> None:
        request.raw_input_contents.append(bytes(4))
        parameter = request.outputs.add(name=LONG).parameters["classification"]
        if isinstance(value, int):
            parameter.int64_param = value
        else:
            parameter.string_param = value

    return _infer(change=change)


def _load(key: str, value: str) -> Callable[[], object]:
    request = pb.RepositoryModelLoadRequest(model_name=LONG)
    request.parameters[key].string_param = value
    return lambda: convert.load_parameters(request)


def _prepare(
    names: list[str], outputs: tuple[str, ...] | None = None, class_counts: dict[str, int] | None = None
) -> Callable[[], object]:
    inputs = tuple(Tensor(name, DataType.FP32, (1, 1), np.zeros((1, 1), np.float32)) for name in names)
    request = InferRequest(
        model_name="m",
        model_version="",
        id="",
        inputs=inputs,
        requested_outputs=outputs,
        parameters={},
        class_counts=class_counts or {},
    )
    return lambda: request_checks.prepare(SPEC, request)


CASES: dict[str, tuple[Callable[[], object], str]] = {
    "unknown datatype": (_infer(datatype="X" * 10_000), "unknown datatype"),
    "negative dim": (_infer(shape=(1, -1)), "All input dimensions should be specified"),
    "negative dim among thousands": (_infer(shape=(-1,) * 10_000), "shape has 10000 dimensions, at most 64"),
    "contents beside raw": (
        _infer(change=lambda r: (r.inputs[0].contents.int_contents.append(1), r.raw_input_contents.append(bytes(4)))),
        "contents field must not be specified when using raw_input_contents",
    ),
    "no data": (_infer(), "unable to find data for input tensor"),
    "raw byte size": (
        _infer(shape=(2,), change=lambda r: r.raw_input_contents.append(bytes(4))),
        "input byte size mismatch",
    ),
    "contents of another type": (
        _infer(change=lambda r: r.inputs[0].contents.fp32_contents.append(1)),
        "of type 'FP32', expected datatype 'INT32'",
    ),
    "contents count": (
        _infer(shape=(2,), change=lambda r: r.inputs[0].contents.int_contents.append(1)),
        "Expected 8, got 4",
    ),
    "contents out of range": (
        _infer(datatype="INT8", change=lambda r: r.inputs[0].contents.int_contents.append(999)),
        "a value does not fit INT8",
    ),
    "classification type": (_classification("3"), "invalid value type for 'classification' parameter"),
    "classification value": (_classification(0), "invalid value for 'classification' parameter"),
    # A file name no file system holds: Triton's INTERNAL "failed to poll from model repository".
    "file: load parameter": (_load("file:" + LONG, "x"), "failed to poll from model repository"),
    "config not JSON": (_load("config", "{"), "the config parameter is not valid JSON"),
    "config not an object": (_load("config", "[]"), "the config parameter must be a JSON object"),
    "override names another model": (
        lambda: ConfigOverride.parse("m", {"name": LONG}),
        "the config override names model",
    ),
    "override with an unknown field": (
        lambda: ConfigOverride.parse(LONG, {"input": [{LONG: 1}]}),
        "has no field named",
    ),
    "override with a bad enum": (
        lambda: ConfigOverride.parse("m", {"input": [{"data_type": LONG}]}),
        "Invalid enum value",
    ),
    "duplicate input": (_prepare([LONG, LONG]), "already exists in request"),
    "unexpected input": (_prepare([LONG]), "unexpected inference input"),
    "thousands of inputs": (
        _prepare([f"{i}{LONG}" for i in range(1000)]),
        "expected 1 inputs but got 1000 inputs for model 'm'",
    ),
    "unexpected output": (_prepare(["IN"], outputs=(LONG,)), "unexpected inference output"),
    "classification of an output not returned": (
        _prepare(["IN"], outputs=("OUT",), class_counts={LONG: 1}),
        "classification asked for output",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_long_name_is_shortened_and_the_message_keeps_its_point(case: str) -> None:
    call, phrase = CASES[case]
    with pytest.raises(ShoalError) as caught:
        call()
    message = caught.value.message
    assert phrase in message, message[:500]
    assert len(message.encode()) < MAX_MESSAGE_BYTES, f"{len(message.encode())} bytes: {message[:300]}..."
    if "shape has" not in phrase:
        assert re.search(r"n\.\.\.\(100\d\d characters\)", message), message[:500]

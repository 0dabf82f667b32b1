"""Hostile requests over HTTP that once got a 500 or were quietly accepted: each must be a clean
400 with Triton's error body, and the server must log no traceback for a client's mistake.

Found by the review of the HTTP endpoint; each test failed before its fix.
"""

from __future__ import annotations

import json

from tests.conftest import RunningServer
from tests.test_http_errors import call, error

FP32_INFER = "/v2/models/identity_fp32/infer"
BYTES_INFER = "/v2/models/identity_bytes/infer"


def _no_traceback(server: RunningServer) -> None:
    assert "unexpected error while serving an HTTP request" not in server.log(), server.log()


def test_deeply_nested_json_is_400_not_500(example_server: RunningServer) -> None:
    """Python's JSON parser gives up on deep nesting with RecursionError, not ValueError."""
    deep = "[" * 100_000 + "]" * 100_000
    status, message = error(example_server, "POST", FP32_INFER, '{"inputs": ' + deep + "}")
    assert status == 400 and message.startswith("failed to parse the request JSON buffer"), message
    status, message = error(example_server, "POST", "/v2/repository/index", deep)
    assert status == 400 and message.startswith("failed to parse the request JSON buffer"), message
    load = json.dumps({"parameters": {"config": deep}})
    status, message = error(example_server, "POST", "/v2/repository/models/simple/load", load)
    assert status == 400 and "config parameter is not valid JSON" in message, message
    _no_traceback(example_server)


def _one_string(value: object) -> dict[str, object]:
    return {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 1], "data": [value]}]}


def test_a_lone_surrogate_in_bytes_data_is_400(example_server: RunningServer) -> None:
    """JSON's "\\ud800" parses to a str that has no UTF-8 encoding."""
    status, message = error(example_server, "POST", BYTES_INFER, json.dumps(_one_string("\ud800")))
    assert status == 400 and "not valid Unicode" in message, message
    _no_traceback(example_server)


def test_a_number_among_bytes_strings_is_refused(example_server: RunningServer) -> None:
    """numpy reads ["a", 1] as two strings; the README promises a number for BYTES is refused."""
    mixed = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [1, 2], "data": ["a", 1]}]}
    assert error(example_server, "POST", BYTES_INFER, mixed) == (
        400, "Unable to parse 'data' of input 'IN': BYTES data must be strings")
    nested = {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [2, 1], "data": [["a"], [True]]}]}
    assert error(example_server, "POST", BYTES_INFER, nested)[0] == 400


def test_a_float_too_large_for_its_type_is_refused_not_made_infinite(example_server: RunningServer) -> None:
    """1e300 does not fit FP32 or FP16: refused as an integer out of range is, not sent on as inf."""
    for model, datatype in (("identity_fp32", "FP32"), ("identity_fp16", "FP16"), ("identity_bf16", "BF16")):
        body = {"inputs": [{"name": "IN", "datatype": datatype, "shape": [1, 2], "data": [1.0, -1e300]}]}
        assert error(example_server, "POST", f"/v2/models/{model}/infer", body) == (
            400, f"input 'IN': a value does not fit {datatype}")
    infinite = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1e999]}]}  # inf as sent
    status, headers, content = call(example_server, "POST", FP32_INFER, json.dumps(infinite))
    assert status == 200 and json.loads(content)["outputs"][0]["data"] == [float("inf")], content
    assert "RuntimeWarning" not in example_server.log()


def test_binary_data_flags_must_be_booleans(example_server: RunningServer) -> None:
    """"false" is truthy in Python: it once asked for binary data. Triton's words for a non-boolean."""
    one = [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1]}]
    per_output = {"inputs": one, "outputs": [{"name": "OUT", "parameters": {"binary_data": "false"}}]}
    assert error(example_server, "POST", FP32_INFER, per_output) == (
        400, "Unable to parse 'binary_data': attempt to access JSON non-boolean as boolean")
    every_output = {"inputs": one, "parameters": {"binary_data_output": 0}}
    assert error(example_server, "POST", FP32_INFER, every_output) == (
        400, "Unable to parse 'binary_data_output': attempt to access JSON non-boolean as boolean")
    fine = {"inputs": one, "outputs": [{"name": "OUT", "parameters": {"binary_data": False}}]}
    status, headers, content = call(example_server, "POST", FP32_INFER, json.dumps(fine))
    assert status == 200 and json.loads(content)["outputs"][0]["data"] == [1.0], content

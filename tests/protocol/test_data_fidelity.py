"""Data goes through unchanged or is refused with a reason (issue 22, items 7 and 8), in both process layouts.

Compared against Triton 2.51 (``run_triton.sh``, Python-backend models, raw HTTP):

- BYTES that are not UTF-8, asked for as JSON: Triton writes the raw bytes into its JSON (a body
  that is not UTF-8, so not JSON, and most clients cannot parse it); Shoal refuses with 400 and
  names binary output as the way. JSON strings go in as their UTF-8 bytes, as Triton's.
- NaN and Infinity: Triton's JSON reads and writes ``NaN``, ``Infinity``, ``-Infinity``; so does
  Shoal. A number past a double's range (``1e400``) Triton refuses; so does Shoal (Python would
  read it as infinity).
- Bytes after the end of a gzip or deflate body: Triton ignores them; Shoal refuses (400).
- ``sequence_id`` over HTTP: an integer in [0, 2^64) or a string, else Triton's
  ``Unable to parse 'sequence_id': attempt to access JSON non-string as string``; ``priority`` and
  ``timeout`` unsigned 64-bit integers, ``sequence_start``/``sequence_end`` booleans, in Triton's
  words (Triton answers 500, Shoal 400: the client's mistake).
- Outputs a model returns are checked against the config's dims and datatype (Triton's Python
  backend checks neither; its TensorFlow and PyTorch backends word it as here).
"""

from __future__ import annotations

import gzip
import json
import queue
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from tests import ensemble_models, models, python_models, sequence_models
from tests.conftest import RunningServer, serving
from tests.http_api.test_http_errors import call, error

pytest.importorskip("torch", reason="the datatype check's model is TorchScript")

# OUT: zeros of the shape its INT64 input IN lists (for a batching model, the first row's values).
SHAPER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            shape = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            listed = shape[0] if shape.ndim == 2 else shape
            out = np.zeros([int(d) for d in listed], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'

# A decoupled model: one response of OUT with N elements, then one of a single element with FINAL.
STREAMER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full(n, n, dtype=np.int32))]))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1, dtype=np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
STREAMER_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _shaper_config(max_batch_size: int, out: str, extra: str = THREADS) -> str:
    return f"""
        backend: "python"
        max_batch_size: {max_batch_size}
        input [ {{ name: "IN" data_type: TYPE_INT64 dims: [ -1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_FP32 {out} }} ]
        {extra}
        """


def _add_models(repo: Path) -> None:
    for name, batch, out, extra in (
        ("shaper", 0, "dims: [ 4 ]", ""),  # a worker process per instance (the Python backend's default)
        ("shaper_threads", 0, "dims: [ 4 ]", THREADS),
        ("shaper_batched", 4, "dims: [ 4 ]", THREADS),
        ("shaper_reshape", 0, "dims: [ 4 ] reshape: { shape: [ 2, 2 ] }", THREADS),
        ("shaper_any", 0, "dims: [ -1, -1 ]", THREADS),
    ):
        python_models.write_model(repo, name, _shaper_config(batch, out, extra), SHAPER)
    io = (
        'input [ { name: "IN" data_type: TYPE_INT64 dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]'
    )
    ensemble_models.add_ensemble(
        repo,
        "step_declares_4",
        [ensemble_models.step("shaper_threads", {"IN": "IN"}, {"OUT": "OUT"})],
        io=io,
        max_batch_size=0,
    )
    ensemble_models.add_ensemble(
        repo,
        "ensemble_declares_4",
        [ensemble_models.step("shaper_any", {"IN": "IN"}, {"OUT": "OUT"})],
        io=io.replace("[ 4 ]", "[ 1, 4 ]"),
        max_batch_size=0,
    )
    _add_torch_float64(repo)
    python_models.write_model(repo, "streamer", STREAMER_CONFIG, STREAMER)
    sequence_models.add_accumulator(repo, "accumulator")
    models.add_identity(repo, "bytes", "BYTES", max_batch_size=0)
    models.add_identity(repo, "fp32", "FP32", max_batch_size=0)
    models.add_identity(repo, "labelled", "FP32", max_batch_size=0)


def _add_torch_float64(repo: Path) -> None:
    """A TorchScript model that returns FP64 where its config declares FP32, for inputs past 5 only (the
    backend's load-time check, with zeros, sees FP32); also behind the sequence batcher, one request at
    a time (``widen_sequence``) and in batches of its lanes (``widen_sequence_batched``)."""
    import torch

    class Widen(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.double() if bool(x.flatten()[0] > 5) else x

    for name, batch, batcher in (
        ("widen", 0, ""),
        ("widen_sequence", 0, "sequence_batching { }"),
        ("widen_sequence_batched", 2, "sequence_batching { }"),
    ):
        (repo / name / "1").mkdir(parents=True)
        torch.jit.script(Widen()).save(str(repo / name / "1" / "model.pt"))
        models.write_config(
            repo / name,
            f"""
            backend: "pytorch"
            max_batch_size: {batch}
            input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
            instance_group [ {{ count: 1 kind: KIND_CPU }} ]
            {batcher}
            """,
        )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    _add_models(repo)
    return repo


@pytest.fixture(scope="module")
def server(
    repository: Path, tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]
) -> Iterator[RunningServer]:
    with serving(
        repository, tmp_path_factory.mktemp("server"), *layout, "--model-control-mode", "explicit", "--load-model", "*"
    ) as running:
        yield running


@pytest.fixture
def http(server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(server.http_url) as client:
        yield client


def _infer_path(model: str) -> str:
    return f"/v2/models/{model}/infer"


def _request(datatype: str, data: list[Any], **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "IN", "datatype": datatype, "shape": [len(data)], "data": data}], **extra}


# -- item 7: BYTES over JSON ----------------------------------------------------------------------------------


def test_bytes_that_are_not_utf8_are_refused_as_json_and_exact_as_binary(
    http: httpclient.InferenceServerClient,
) -> None:
    value = np.array([b"\xff\xfe\x00ok", b"fine"], dtype=object)
    tensor = httpclient.InferInput("IN", [2], "BYTES")
    tensor.set_data_from_numpy(value, binary_data=True)
    as_json = httpclient.InferRequestedOutput("OUT", binary_data=False)
    with pytest.raises(InferenceServerException) as caught:
        http.infer("bytes", [tensor], outputs=[as_json])
    assert caught.value.status() == "400"
    message = caught.value.message()
    assert "output 'OUT'" in message and "not valid UTF-8" in message and '"binary_data": true' in message, message
    as_binary = httpclient.InferRequestedOutput("OUT", binary_data=True)
    assert http.infer("bytes", [tensor], outputs=[as_binary]).as_numpy("OUT").tolist() == value.tolist()


def test_json_strings_go_in_as_their_utf8_bytes(server: RunningServer) -> None:
    request = _request("BYTES", ["\u00e9t\u00e9", "a\u0000b", ""], parameters={"binary_data_output": True})
    status, headers, body = call(server, "POST", _infer_path("bytes"), request)
    assert status == 200, body
    header_length = int(headers["inference-header-content-length"])
    raw = body[header_length:]
    assert raw == b"".join(len(v).to_bytes(4, "little") + v for v in ("\u00e9t\u00e9".encode(), b"a\x00b", b""))
    status, _, body = call(server, "POST", _infer_path("bytes"), _request("BYTES", ["\u00e9", "a\u0000b"]))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == ["\u00e9", "a\u0000b"], body


# -- item 8c: NaN and Infinity ---------------------------------------------------------------------------------


def test_nan_and_infinity_round_trip_as_triton_writes_them(
    server: RunningServer, http: httpclient.InferenceServerClient
) -> None:
    body = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[4],"data":[NaN,Infinity,-Infinity,1.5]}]}'
    status, _, answer = call(server, "POST", _infer_path("fp32"), body)
    assert status == 200 and b'"data":[NaN,Infinity,-Infinity,1.5]' in answer, answer
    tensor = httpclient.InferInput("IN", [3], "FP32")
    tensor.set_data_from_numpy(np.array([np.nan, np.inf, -np.inf], dtype=np.float32), binary_data=False)
    out = http.infer("fp32", [tensor], outputs=[httpclient.InferRequestedOutput("OUT", binary_data=False)])
    values = out.as_numpy("OUT")
    assert np.isnan(values[0]) and values[1] == np.inf and values[2] == -np.inf


def test_a_number_past_a_double_is_refused_not_infinity(server: RunningServer) -> None:
    for literal in (b"1e400", b"-1e400", b"Infinity,1e400"):
        count = literal.count(b",") + 1
        body = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[%d],"data":[%s]}]}' % (count, literal)
        status, message = error(server, "POST", _infer_path("fp32"), body)
        assert status == 400 and "failed to parse the request JSON buffer" in message, message
        assert "too big to be stored in double" in message, message
    body = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1]}],"parameters":{"p":1e999}}'
    status, message = error(server, "POST", _infer_path("fp32"), body)
    assert status == 400 and "too big to be stored in double" in message, message
    # The word only in a string (the request's id, a parameter's text): numbers are judged as without it.
    for extra in (b'"id":"Infinity"', b'"parameters":{"note":"-Infinity"}'):
        data = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[%s]}],%s}'
        status, message = error(server, "POST", _infer_path("fp32"), data % (b"1e400", extra))
        assert status == 400 and "too big to be stored in double: 1e400" in message, message
        status, _, answer = call(server, "POST", _infer_path("fp32"), data % (b"2.5", extra))
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [2.5], answer


def test_a_number_past_a_double_is_refused_where_nothing_reads_it(server: RunningServer) -> None:
    """rapidjson refuses the whole document, whichever field holds the number (it was read as infinity
    and the request served, in review); a number a double holds, and one too small for it, are read."""
    data = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1]%s}]%s}'
    for unread in (
        (b"", b',"extra":1e400'),
        (b',"note":-1E+0400', b""),
        (b"", b',"extra":[' + b"9" * 400 + b"]"),
        (b"", b',"id":"Infinity","extra":1.5e999'),
        (b"", b',"extra":1' + b"0" * 250 + b"e99"),
        (b"", b',"extra":' + b"7" * 5000),  # past what Python reads as an int: rapidjson's words all the same
    ):
        status, message = error(server, "POST", _infer_path("fp32"), data % unread)
        assert status == 400 and "too big to be stored in double" in message, (unread, message)
    for unread in ((b"", b',"extra":[1e308,1e-400,1' + b"0" * 300 + b"]"), (b',"note":1e100', b"")):
        status, _, answer = call(server, "POST", _infer_path("fp32"), data % unread)
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [1.0], (unread, answer)


def test_infinity_is_read_in_every_encoding_json_reads(server: RunningServer) -> None:
    """A JSON body in UTF-16 or UTF-32 (which Python's json reads) writes its infinities as any other."""
    text = '{"inputs":[{"name":"IN","datatype":"FP32","shape":[2],"data":[Infinity,1.5]}]}'
    for encoding in ("utf-8", "utf-16", "utf-32"):
        status, _, answer = call(server, "POST", _infer_path("fp32"), text.encode(encoding))
        assert status == 200 and b'"data":[Infinity,1.5]' in answer, (encoding, answer)


def test_integers_past_64_bits_are_read_as_doubles_for_float_types(server: RunningServer) -> None:
    """As Triton reads them (numpy alone keeps them as objects); out of range for integer types they are
    refused, where Triton refuses INT64/UINT64 but wraps INT8 128 to -128."""
    status, _, body = call(server, "POST", _infer_path("fp32"), _request("FP32", [2**64 + 5, 0.5]))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [float(np.float32(2**64)), 0.5], body
    status, message = error(server, "POST", _infer_path("fp32"), _request("FP32", [10**400]))
    assert status == 400 and "too big to be stored in double" in message, message


# -- item 8d: compressed bodies --------------------------------------------------------------------------------


def test_bytes_after_a_compressed_body_are_refused(server: RunningServer) -> None:
    body = json.dumps(_request("FP32", [1.0])).encode()
    for encoding, compressed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        headers = {"Content-Encoding": encoding}
        assert call(server, "POST", _infer_path("fp32"), compressed, headers)[0] == 200
        for extra in (b"garbage", compressed):  # a second stream, too: its JSON would follow the first's
            status, message = error(server, "POST", _infer_path("fp32"), compressed + extra, headers)
            assert status == 400, message
            assert message == (
                f"the request body is not valid {encoding} data: {len(extra)} bytes follow the end "
                "of the compressed data"
            ), message


# -- item 8e: integer parameters over HTTP --------------------------------------------------------------------


def _sequence_request(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
        "parameters": {"sequence_start": True, "sequence_end": True, **parameters},
    }


def test_sequence_id_out_of_range_is_refused_not_wrapped(server: RunningServer) -> None:
    for sequence_id in (2**64 + 5, -1, 5.0, 5.5, True, 1e30):
        status, message = error(
            server, "POST", _infer_path("accumulator"), _sequence_request({"sequence_id": sequence_id})
        )
        assert (status, message) == (
            400,
            "Unable to parse 'sequence_id': attempt to access JSON non-string as string",
        ), (sequence_id, message)
    for sequence_id in (5, 2**63, 2**64 - 1):  # the whole uint64 range, as Triton's
        request = _sequence_request({"sequence_id": sequence_id})
        status, _, body = call(server, "POST", _infer_path("accumulator"), request)
        assert status == 200, body
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        assert outputs["CORRID_OUT"] == [sequence_id], outputs
    status, message = error(server, "POST", _infer_path("accumulator"), _sequence_request({"sequence_id": "5"}))
    assert (status, message) == (  # a string id for an integer CORRID, in the words of Triton from 25.01
        400,
        "[request id: <id_unknown>] sequence batching control 'CORRID' data-type is 'BYTES', but model "
        "'accumulator' expects 'UINT64'",
    )


def test_flags_priority_and_timeout_are_checked_in_tritons_words(server: RunningServer) -> None:
    unsigned = "attempt to access JSON non-unsigned-integer as unsigned-integer"
    cases: list[tuple[str, Any, str]] = [
        ("sequence_start", 1, "attempt to access JSON non-boolean as boolean"),
        ("sequence_end", "true", "attempt to access JSON non-boolean as boolean"),
        ("priority", 2**64 + 5, unsigned),
        ("priority", -1, unsigned),
        ("priority", 1.5, unsigned),
        ("priority", True, unsigned),
        ("timeout", 2**64, unsigned),
        ("timeout", -1, unsigned),
        ("timeout", "5", unsigned),
        ("timeout", 2.0, unsigned),
    ]
    for key, value, words in cases:
        for model, request in (
            ("accumulator", _sequence_request({"sequence_id": 9, key: value})),
            ("fp32", {**_request("FP32", [1.0]), "parameters": {key: value}}),
        ):
            status, message = error(server, "POST", _infer_path(model), request)
            assert (status, message) == (400, f"Unable to parse '{key}': {words}"), (model, key, value, message)
    for key, value in (("priority", 2**64 - 1), ("timeout", 2**64 - 1), ("custom", 2**64 + 5), ("custom", 0.5)):
        request = {**_request("FP32", [1.0]), "parameters": {key: value}}
        status, _, body = call(server, "POST", _infer_path("fp32"), request)
        assert status == 200, (key, value, body)


def test_grpc_a_string_id_is_not_the_integer_sequence_of_the_same_digits(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        tensor = grpcclient.InferInput("INPUT", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
        start = client.infer("accumulator", [tensor], sequence_id=5, sequence_start=True)
        assert start.as_numpy("OUTPUT").tolist() == [[1.0]]
        with pytest.raises(InferenceServerException, match="data-type is 'BYTES', but model 'accumulator'"):
            client.infer("accumulator", [tensor], sequence_id="5")  # of another kind than the CORRID control's
        end = client.infer("accumulator", [tensor], sequence_id=5, sequence_end=True)
        assert end.as_numpy("OUTPUT").tolist() == [[2.0]]


# -- item 8a: outputs checked against the config ---------------------------------------------------------------


def _shape_error(client: grpcclient.InferenceServerClient, model: str, listed: list[int], batch: bool = False) -> str:
    array = np.array([listed] if batch else listed, dtype=np.int64)
    tensor = grpcclient.InferInput("IN", list(array.shape), "INT64")
    tensor.set_data_from_numpy(array)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, [tensor])
    assert caught.value.status() == "StatusCode.INTERNAL", caught.value
    return caught.value.message()


def _shape(client: grpcclient.InferenceServerClient, model: str, listed: list[int], batch: bool = False) -> list[int]:
    array = np.array([listed] if batch else listed, dtype=np.int64)
    tensor = grpcclient.InferInput("IN", list(array.shape), "INT64")
    tensor.set_data_from_numpy(array)
    return list(client.infer(model, [tensor]).as_numpy("OUT").shape)


def test_output_shapes_are_checked_against_the_config(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        for model in ("shaper", "shaper_threads"):  # both instance kinds
            assert _shape(client, model, [4]) == [4]
            for wrong in ([3, 7], [], [5]):
                message = _shape_error(client, model, wrong)
                assert message == (
                    f"unexpected shape for output 'OUT' for model '{model}', model configuration "
                    f"shape is [4], inference shape is {json.dumps(wrong).replace(' ', '')}"
                ), message
        assert _shape(client, "shaper_batched", [1, 4], batch=True) == [1, 4]
        for wrong in ([1, 5], [4], [2, 4]):
            message = _shape_error(client, "shaper_batched", wrong, batch=True)
            assert "model configuration shape is [1,4], inference shape is" in message, message
        # the model's shape is the reshape's, or already the dims' (as Triton takes both); the answer's the dims'
        assert _shape(client, "shaper_reshape", [2, 2]) == [4] and _shape(client, "shaper_reshape", [4]) == [4]
        assert "model configuration shape is [2,2], inference shape is [1,4]" in _shape_error(
            client, "shaper_reshape", [1, 4]
        )
        assert _shape(client, "shaper_any", [3, 7]) == [3, 7]
        assert "shape is [-1,-1], inference shape is [5]" in _shape_error(client, "shaper_any", [5])


def test_ensemble_steps_and_outputs_are_checked(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        assert _shape(client, "step_declares_4", [4]) == [4]
        for wrong in ([3, 7], []):
            message = _shape_error(client, "step_declares_4", wrong)
            assert message.startswith(
                "in ensemble 'step_declares_4', unexpected shape for output 'OUT' for model "
                "'shaper_threads', model configuration shape is [4]"
            ), message
        assert _shape(client, "ensemble_declares_4", [1, 4]) == [1, 4]
        message = _shape_error(client, "ensemble_declares_4", [2, 4])  # the step's [-1,-1] allows it
        assert message == (
            "in ensemble 'ensemble_declares_4', unexpected shape for output 'OUT' for model "
            "'ensemble_declares_4', model configuration shape is [1,4], inference shape is [2,4]"
        )


def test_output_datatypes_are_checked_against_the_config(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.url) as client:
        tensor = grpcclient.InferInput("INPUT__0", [2], "FP32")
        tensor.set_data_from_numpy(np.full(2, 10, dtype=np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("widen", [tensor])
    assert caught.value.status() == "StatusCode.INTERNAL"
    assert caught.value.message() == (
        "unexpected datatype TYPE_FP64 for inference output 'OUTPUT__0' for model 'widen', expecting TYPE_FP32"
    )


def _counts(client: grpcclient.InferenceServerClient, model: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]["inference_stats"]
    return int(stats["success"].get("count", 0)), int(stats["fail"].get("count", 0))


def test_a_request_whose_outputs_break_the_config_counts_as_failed(server: RunningServer) -> None:
    """The client gets INTERNAL, and the statistics say failed, not success (the schedulers counted a
    request before its outputs were checked): Python models (a list of requests), the dynamic path,
    and the sequence batcher one request at a time and in a batch of its lanes."""
    with grpcclient.InferenceServerClient(server.url) as client:
        for model in ("shaper", "shaper_threads"):
            before = _counts(client, model)
            _shape(client, model, [4])
            _shape_error(client, model, [5])
            assert _counts(client, model) == (before[0] + 1, before[1] + 1), model
        for model, sequence in (("widen", False), ("widen_sequence", True), ("widen_sequence_batched", True)):
            before = _counts(client, model)
            for value, fails in ((1.0, False), (10.0, True)):
                shape = [1, 2] if model.endswith("batched") else [2]
                tensor = grpcclient.InferInput("INPUT__0", shape, "FP32")
                tensor.set_data_from_numpy(np.full(shape, value, dtype=np.float32))
                flags: dict[str, Any] = (
                    {"sequence_id": 77, "sequence_start": True, "sequence_end": True} if sequence else {}
                )
                if not fails:
                    assert (
                        client.infer(model, [tensor], **flags).as_numpy("OUTPUT__0").tolist()
                        == np.full(shape, value).tolist()
                    )
                    continue
                with pytest.raises(InferenceServerException, match="unexpected datatype TYPE_FP64") as caught:
                    client.infer(model, [tensor], **flags)
                assert caught.value.status() == "StatusCode.INTERNAL"
            assert _counts(client, model) == (before[0] + 1, before[1] + 1), model


def test_a_decoupled_models_responses_are_checked(server: RunningServer) -> None:
    arrived: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(server.url) as client:
        client.start_stream(callback=lambda result, error: arrived.put((result, error)))
        for n in (1, 2):
            tensor = grpcclient.InferInput("N", [1], "INT32")
            tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
            client.async_stream_infer("streamer", [tensor], request_id=str(n))
            first, last = arrived.get(timeout=60), arrived.get(timeout=60)
            assert last[1] is None and last[0].as_numpy("OUT").tolist() == [1]
            if n == 1:
                assert first[1] is None and first[0].as_numpy("OUT").tolist() == [1]
            else:
                assert first[0] is None and first[1].message() == (
                    "unexpected shape for output 'OUT' for model 'streamer', model configuration shape is [1], "
                    "inference shape is [2]"
                ), first[1]
        client.stop_stream()


# -- item 8b: NUL bytes in path fields of a config override ----------------------------------------------------


def _override(**fields: Any) -> dict[str, Any]:
    output: dict[str, Any] = {"name": "OUT", "data_type": "TYPE_FP32", "dims": [-1]}
    output.update(fields.pop("output", {}))
    return {
        "backend": "identity",
        "max_batch_size": 0,
        **fields,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [output],
    }


NUL_OVERRIDES = (
    ("label_filename of output 'OUT'", _override(output={"label_filename": "a\u0000b"})),
    ("default_model_filename", _override(default_model_filename="model\u0000.onnx")),
    (
        "data_file of initial_state 's'",
        _override(
            sequence_batching={
                "state": [
                    {
                        "input_name": "S_IN",
                        "output_name": "S_OUT",
                        "data_type": "TYPE_FP32",
                        "dims": [1],
                        "initial_state": [
                            {"name": "s", "data_type": "TYPE_FP32", "dims": [1], "data_file": "a\u0000b"}
                        ],
                    }
                ]
            }
        ),
    ),
)


def test_a_nul_byte_in_a_path_field_is_invalid_argument(server: RunningServer) -> None:
    for field, config in NUL_OVERRIDES:
        words = f"failed to load 'labelled': {field} holds a NUL byte, which no file name can hold"
        status, message = error(
            server, "POST", "/v2/repository/models/labelled/load", {"parameters": {"config": json.dumps(config)}}
        )
        assert (status, message) == (400, words), message
        with grpc.insecure_channel(server.url) as channel:
            request = pb.RepositoryModelLoadRequest(model_name="labelled")
            request.parameters["config"].string_param = json.dumps(config)
            with pytest.raises(grpc.RpcError) as caught:
                InferenceStub(channel).RepositoryModelLoad(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == words
    assert "Traceback" not in server.log()


def test_a_nul_byte_in_a_config_file_fails_the_load_naming_the_field(server: RunningServer, repository: Path) -> None:
    models.write_config(
        repository / "nul_label",
        """
        backend: "identity"
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] label_filename: "a\\000b" } ]
        """,
    )
    (repository / "nul_label" / "1").mkdir()
    try:
        status, message = error(server, "POST", "/v2/repository/models/nul_label/load")
    finally:
        shutil.rmtree(repository / "nul_label")
    assert status == 400  # a model that fails to load: INVALID_ARGUMENT, as Triton's
    assert message == (
        "load failed for model 'nul_label': model 'nul_label': label_filename of output 'OUT' holds "
        "a NUL byte, which no file name can hold"
    ), message

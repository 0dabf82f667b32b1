"""BYTES cross a front-end worker as their wire bytes: decoded once, by the host (issue 24, item 2).

The worker leaves raw BYTES inputs encoded (``EncodedTensor``) and the host checks and decodes them;
outputs come back encoded and go out as they are. Refusals must not change with it: content that
does not fit its shape is refused with the same words and status in both layouts, also where the
order of Triton's checks decides which problem is named.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from shoal.core import messages
from shoal.dataplane import packing
from shoal.dataplane.arena import Arena, BlockAllocator
from shoal.dataplane.channel import Channel
from shoal.errors import ShoalError
from shoal.grpc import convert
from shoal.protocol import codec
from shoal.protocol import service_pb2 as shoal_pb2
from shoal.protocol.types import DataType
from shoal.request_types import EncodedTensor, Tensor
from tests import models
from tests.conftest import RunningServer, serving

MIXED = """
backend: "identity"
max_batch_size: 0
input [ { name: "A" data_type: TYPE_STRING dims: [ 3 ] },
        { name: "B" data_type: TYPE_INT32 dims: [ 2 ] },
        { name: "C" data_type: TYPE_STRING dims: [ 2 ] } ]
output [ { name: "OA" data_type: TYPE_STRING dims: [ 3 ] },
         { name: "OB" data_type: TYPE_INT32 dims: [ 2 ] },
         { name: "OC" data_type: TYPE_STRING dims: [ 2 ] } ]
"""
VALUES = [b"", b"\xff\xfe not UTF-8", b"x" * 300]


def _strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, layout: tuple[str, ...]) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("repo")
    models.write_config(repo / "mixed", MIXED)
    (repo / "mixed" / "1").mkdir()
    with serving(repo, tmp_path_factory.mktemp("server"), *layout) as running:
        yield running


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(server.url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _request(a: bytes, b: bytes, c: bytes) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="mixed")
    request.inputs.add(name="A", datatype="BYTES", shape=[3])
    request.inputs.add(name="B", datatype="INT32", shape=[2])
    request.inputs.add(name="C", datatype="BYTES", shape=[2])
    request.raw_input_contents.extend([a, b, c])
    return request


def _refusal(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(refused.value.details())


GOOD_A, GOOD_B, GOOD_C = _strings(*VALUES), np.array([1, 2], dtype="<i4").tobytes(), _strings(b"c", b"")
CORE = "[request id: <id_unknown>] "  # Triton core's label of a request without an id
A_SHORT = CORE + "expected 3 string elements for inference input 'A' for model 'mixed', got 2"
B_SHORT = CORE + "input byte size mismatch for input 'B' for model 'mixed'. Expected 8, got 4"
C_LONG = CORE + "unexpected number of string elements 3 for inference input 'C' for model 'mixed', expecting 2"


def test_bytes_cross_unchanged(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    response = stub.ModelInfer(_request(GOOD_A, GOOD_B, GOOD_C))
    assert list(response.raw_output_contents) == [GOOD_A, GOOD_B, GOOD_C]
    assert [list(o.shape) for o in response.outputs] == [[3], [2], [2]]


def test_bytes_as_json_and_binary_over_http(server: RunningServer) -> None:
    """HTTP's JSON answer needs values: a worker decodes the host's encoded BYTES for it alone."""
    a = np.array(["", "é", "z" * 40], dtype=object)
    inputs = [
        httpclient.InferInput("A", [3], "BYTES"),
        httpclient.InferInput("B", [2], "INT32"),
        httpclient.InferInput("C", [2], "BYTES"),
    ]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(np.array([5, 6], dtype=np.int32), binary_data=False)
    inputs[2].set_data_from_numpy(np.array([b"c", b"\xff"], dtype=object), binary_data=True)
    outputs = [
        httpclient.InferRequestedOutput("OA", binary_data=False),
        httpclient.InferRequestedOutput("OB", binary_data=False),
        httpclient.InferRequestedOutput("OC", binary_data=True),
    ]
    with httpclient.InferenceServerClient(server.http_url.removeprefix("http://")) as client:
        result = client.infer("mixed", inputs, outputs=outputs)
    assert [o.get("data") for o in result.get_response()["outputs"][:2]] == [["", "é", "z" * 40], [5, 6]]
    assert result.as_numpy("OC").tolist() == [b"c", b"\xff"]


@pytest.mark.parametrize(
    ("a", "b", "c", "named"),
    [
        (_strings(b"1", b"2"), GOOD_B, _strings(b"1", b"2", b"3"), C_LONG),  # two BYTES unfit: the last one named
        (_strings(b"1", b"2"), GOOD_B[:4], GOOD_C, B_SHORT),  # BYTES, then fixed-size: the fixed-size one
        (GOOD_A, GOOD_B[:4], _strings(b"1", b"2", b"3"), C_LONG),  # fixed-size, then BYTES: the BYTES one
        (_strings(b"1", b"2"), GOOD_B, GOOD_C, A_SHORT),
    ],
    ids=["bytes-bytes", "bytes-fixed", "fixed-bytes", "bytes"],
)
def test_unfit_content_is_refused_in_the_same_words(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, a: bytes, b: bytes, c: bytes, named: str
) -> None:
    assert _refusal(stub, _request(a, b, c)) == named


def test_unfit_bytes_come_before_a_requested_outputs_problem(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """Triton's front end reads the outputs' parameters after the inputs' content was checked."""
    request = _request(_strings(b"1", b"2"), GOOD_B, GOOD_C)
    request.outputs.add(name="OA").parameters["classification"].string_param = "three"
    assert _refusal(stub, request) == A_SHORT
    good = _request(GOOD_A, GOOD_B, GOOD_C)
    good.outputs.add(name="OA").parameters["classification"].string_param = "three"
    assert "invalid value type for 'classification' parameter" in _refusal(stub, good)


def _http_refusal(server: RunningServer, a: bytes, outputs: list[dict[str, object]]) -> tuple[int, str]:
    header = json.dumps(
        {
            "inputs": [
                {"name": "A", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(a)}},
                {"name": "B", "datatype": "INT32", "shape": [2], "data": [1, 2]},
                {"name": "C", "datatype": "BYTES", "shape": [2], "data": ["c", ""]},
            ],
            "outputs": outputs,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/mixed/infer",
        data=header + a,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    return refused.value.code, json.loads(refused.value.read())["error"]


def test_unfit_binary_bytes_over_http_are_refused_in_the_same_words(server: RunningServer) -> None:
    assert _http_refusal(server, _strings(b"1", b"2"), []) == (400, A_SHORT)
    bad_class_count = [{"name": "OA", "parameters": {"classification": "three"}}]
    assert _http_refusal(server, _strings(b"1", b"2"), bad_class_count) == (400, A_SHORT)
    assert _http_refusal(server, GOOD_A, bad_class_count)[1] != A_SHORT


def test_the_server_still_serves(stub: service_pb2_grpc.GRPCInferenceServiceStub, server: RunningServer) -> None:
    test_bytes_cross_unchanged(stub)
    with triton.InferenceServerClient(server.url) as client:
        assert client.is_model_ready("mixed")


# -- the pieces, without a server ------------------------------------------------------------------------


def _shoal_request(a: bytes, b: bytes, c: bytes) -> shoal_pb2.ModelInferRequest:
    return shoal_pb2.ModelInferRequest.FromString(_request(a, b, c).SerializeToString())


def test_the_worker_leaves_raw_bytes_encoded(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object) -> None:
        raise AssertionError("BYTES were decoded in the front end")

    monkeypatch.setattr(codec, "deserialize_bytes", never)
    request = convert.infer_request_encoded(_shoal_request(GOOD_A, GOOD_B, GOOD_C))
    a, b, c = request.inputs
    assert isinstance(a, EncodedTensor) and isinstance(c, EncodedTensor) and not isinstance(b, EncodedTensor)
    assert (a.raw(), a.shape, c.raw()) == (GOOD_A, (3,), GOOD_C)
    assert b.data.tolist() == [1, 2]


def test_a_refusal_is_found_as_the_decoding_path_finds_it() -> None:
    request = _shoal_request(_strings(b"1", b"2"), GOOD_B, GOOD_C)
    request.outputs.add(name="OA").parameters["classification"].string_param = "three"
    with pytest.raises(ShoalError) as encoded:
        convert.infer_request_encoded(request)
    with pytest.raises(ShoalError) as decoded:
        convert.infer_request(request)
    assert encoded.value.message == decoded.value.message == A_SHORT


def test_encoded_bytes_cross_an_arena_as_they_are() -> None:
    arena = Arena.create("t-wire", 1 << 16)
    try:
        encoded = EncodedTensor("A", DataType.BYTES, (3,), np.frombuffer(GOOD_A, np.uint8))
        fixed = Tensor("B", DataType.INT32, (2,), np.array([1, 2], dtype=np.int32))
        _, slots = packing.pack(arena, BlockAllocator(arena.size), [encoded, fixed])
        assert not packing.costly([EncodedTensor("A", DataType.BYTES, (10**6,), np.zeros(4 * 10**6, np.uint8))])
        views = packing.unpack(arena, slots, encoded_bytes=True)
        assert isinstance(views[0], EncodedTensor) and views[0].raw() == GOOD_A
        assert views[0].decoded().data.tolist() == VALUES and views[1].data.tolist() == [1, 2]
        decoded = packing.unpack(arena, slots)  # the host's reading: BYTES decoded once
        assert not isinstance(decoded[0], EncodedTensor) and decoded[0].data.tolist() == VALUES
        short = EncodedTensor("A", DataType.BYTES, (3,), np.frombuffer(_strings(b"1"), np.uint8))
        _, bad = packing.pack(arena, BlockAllocator(arena.size), [short])
        with pytest.raises(codec.StringCountMismatch):
            packing.unpack(arena, bad)
        noted: list[str] = []
        assert packing.unpack(arena, bad, on_unfit=lambda name, exc: noted.append(name))[0].data.size == 0
        assert noted == ["A"]
        del views, decoded
    finally:
        arena.close()


def test_every_message_crosses_the_channel_as_its_own_typed_record() -> None:
    records = [
        messages.Call(1, "live", ()),
        messages.Infer(2, "m", "", "", None, {}, {}, (), {}, [], False, [4]),
        messages.Cancel(2),
        messages.Free([3]),
        messages.Started((1, 2)),
        messages.Pong(),
        messages.Sent(7, 1, 2, True),
        messages.Result(1, True),
        messages.Error(2, "invalid_argument", "why"),
        messages.Inferred(2, "m", "1", "", -1, [], [], [2]),
        messages.Release([2]),
        messages.Streamed(2, None, -1, [], True, ""),
        messages.Health(),
        messages.Stop(1.0),
        messages.Ping(),
    ]
    assert {type(record) for record in records} == set(messages.RECORDS.kinds)

    async def scenario() -> list[Any]:
        one, other = socket.socketpair()
        received: list[Any] = []
        done = asyncio.Event()

        def got(message: Any) -> None:
            received.append(message)
            if len(received) == len(records):
                done.set()

        sender = await Channel.open(one, lambda message: None, lambda: None, messages.RECORDS)
        receiver = await Channel.open(other, got, lambda: None, messages.RECORDS)
        for record in records:
            sender.send(record)
        await asyncio.wait_for(done.wait(), 10)
        sender.close()
        receiver.close()
        return received

    received = asyncio.run(scenario())
    assert [type(r) for r in received] == [type(r) for r in records] and received == records


def test_an_answer_carries_its_release_and_a_request_the_freed_blocks() -> None:
    """One message each way per request: inputs let go of by the answer are released in it, and the
    response blocks the worker is done with go back in its next request."""
    from shoal.core.host import CoreHost
    from shoal.request_types import InferRequest, InferResponse

    class EchoCore:
        async def infer(self, request: InferRequest, origin: object = None) -> InferResponse:
            return InferResponse(request.model_name, "1", request.id, request.inputs)

    async def scenario() -> tuple[list[Any], int]:
        host_end, worker_end = socket.socketpair()
        received: asyncio.Queue[Any] = asyncio.Queue()
        requests, responses = Arena.create("t-requests", 1 << 16), Arena.create("t-responses", 1 << 16)
        host = CoreHost(EchoCore(), requests, responses)  # type: ignore[arg-type]
        await host.connect(host_end)
        worker = await Channel.open(worker_end, received.put_nowait, lambda: None, messages.RECORDS)
        value = EncodedTensor("IN", DataType.BYTES, (3,), np.frombuffer(GOOD_A, np.uint8))
        _, slots = packing.pack(requests, BlockAllocator(requests.size), [value])
        worker.send(messages.Infer(7, "m", "", "", None, {}, {}, (), {}, slots, False, []))
        first = await asyncio.wait_for(received.get(), 10)
        out = packing.unpack(responses, first.slots, encoded_bytes=True)
        assert out[0].raw() == GOOD_A  # decoded by the host, encoded again for the worker
        del out
        worker.send(messages.Infer(8, "m", "", "", None, {}, {}, (), {}, slots, False, [first.block]))
        second = await asyncio.wait_for(received.get(), 10)
        left = received.qsize()
        host.close()
        worker.close()
        requests.close()
        responses.close()
        return [first, second], left

    (first, second), left = asyncio.run(scenario())
    assert type(first) is messages.Inferred and first.released == [7]
    assert type(second) is messages.Inferred and second.released == [8]
    assert second.block == first.block  # the freed block was given back with request 8, and taken again
    assert left == 0  # no Release or anything else besides the answers

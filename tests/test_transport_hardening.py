"""The transport under abuse: large rejected requests, echoed input, shared ports, stream churn, shutdown."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from server.errors import MAX_MESSAGE_BYTES
from server.pb import InferenceStub
from server.pb import service_pb2 as pb
from tests import models
from tests.conftest import open_channel

PAYLOAD_BYTES = 32 * 2**20


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.parametrize(("model", "datatype"), [("nope", "UINT8"), ("identity", "FP32")])
def test_rejected_large_requests_do_not_pile_up(tmp_path: Path, server_factory, model: str, datatype: str) -> None:
    """Each rejected request's payload is freed with it, not when the cyclic collector runs."""
    repo = tmp_path / "repo"
    repo.mkdir()
    models.add_identity(repo, "identity", "UINT8")
    server = server_factory(repo)
    request = pb.ModelInferRequest(model_name=model)  # unknown model, or a datatype the model refuses
    request.inputs.add(name="IN", datatype=datatype, shape=[1, PAYLOAD_BYTES // 4])
    request.raw_input_contents.append(bytes(PAYLOAD_BYTES))
    count = 12
    with open_channel(server.url) as channel:
        stub = InferenceStub(channel)
        before_mb = resident_mb(server.pid)
        for _ in range(count):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request, timeout=30)
            assert caught.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT}
        growth_mb = resident_mb(server.pid) - before_mb
    # Kept alive, 12 payloads would be 384 MB; freed, a couple are in flight at a time.
    assert growth_mb < 4 * PAYLOAD_BYTES / 2**20, f"RSS grew {growth_mb:.0f} MB over {count} rejected requests"


def test_long_client_input_is_shortened_in_errors(tmp_path: Path, server_factory) -> None:
    """A 100 KB name gets the real error back, not 'metadata size exceeds hard limit'."""
    repo = models.repository(tmp_path, "simple")
    server = server_factory(repo)
    long_name = "m" * 100_000
    with open_channel(server.url) as channel:
        stub = InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelMetadata(pb.ModelMetadataRequest(name=long_name, version="9" * 50_000))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details().startswith("Request for unknown model: 'mmmm")
        assert "(100000 characters)" in caught.value.details()
        request = pb.ModelInferRequest(model_name="simple")
        request.inputs.add(name="é" * 100_000, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(bytes(64))
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(caught.value.details().encode()) <= MAX_MESSAGE_BYTES
        assert "message truncated" in caught.value.details()
    with triton.InferenceServerClient(server.url) as client:
        inputs = [triton.InferInput("INPUT0", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(np.zeros((1, 16), np.int32))
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.infer(long_name, inputs)

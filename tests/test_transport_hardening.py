"""The transport under abuse: large rejected requests, echoed input, shared ports, stream churn, shutdown."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

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


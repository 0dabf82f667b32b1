"""Run by tests/deploy/test_kserve_serving.py in .kserve-venv's interpreter (KServe's ``kserve`` package),
never imported by the suite: kserve's ``inference`` protos would collide with tritonclient's in one
process. Asks a Shoal server through KServe's own InferenceRESTClient and InferenceGRPCClient and
prints what they got as JSON: ``python kserve_clients.py HTTP_HOST:PORT GRPC_HOST:PORT MODEL``."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


def _request(model: str, binary: bool) -> InferRequest:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", np.ones_like(a))):
        tensor = InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
    return InferRequest(model_name=model, infer_inputs=inputs, request_id="kserve-client")


def _outputs(response: object) -> dict[str, list[int]]:
    return {out.name: out.as_numpy().reshape(-1).tolist() for out in response.outputs}  # type: ignore[attr-defined]


async def main(http_url: str, grpc_url: str, model: str) -> dict[str, object]:
    found: dict[str, object] = {}
    rest = InferenceRESTClient(RESTConfig(protocol="v2", retries=1, timeout=30))
    try:
        base = f"http://{http_url}"
        # Not is_server_ready/is_model_ready: they read a JSON body ({"ready": true}) that Triton,
        # and so Shoal, does not send (200 with an empty body; docs/deploying-on-kubernetes.md).
        found["rest_json"] = _outputs(await rest.infer(base, _request(model, binary=False), model_name=model))
        found["rest_binary"] = _outputs(await rest.infer(base, _request(model, binary=True), model_name=model))
    finally:
        await rest.close()
    grpc_client = InferenceGRPCClient(grpc_url, timeout=30)
    try:
        found["grpc_server_ready"] = await grpc_client.is_server_ready()
        found["grpc_model_ready"] = await grpc_client.is_model_ready(model)
        found["grpc"] = _outputs(await grpc_client.infer(_request(model, binary=True)))
    finally:
        await grpc_client.close()
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))

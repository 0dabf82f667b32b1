"""shoal-load over KServe v2 HTTP/REST (``-i http``): the control calls and the request it sends.

The request is built once, as perf_analyzer sends it: a JSON header followed by the input bytes
(Triton's binary tensor data extension, ``Inference-Header-Content-Length``), so the server does
no JSON number parsing and the load is comparable with gRPC's. Outputs are asked for as binary
too. Control calls (metadata, config, statistics) are plain blocking HTTP from the parent process,
with the same return types as the gRPC ``InferenceClient`` so the rest of the load tester does not
know which protocol it drives.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.protocol.types import DataType, ModelMetadata, ServerMetadata, TensorMetadata

HEADER_LENGTH = "Inference-Header-Content-Length"


class HttpError(Exception):
    """A control call failed: the HTTP status (0: no answer) and the server's ``{"error": ...}`` text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"[HTTP {status}] {message}" if status else message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HttpRequest:
    """One inference request, serialized once and sent as is by every load coroutine."""

    path: str
    body: bytes
    header_length: int  # bytes of JSON before the binary input data

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(self.header_length)}


def model_path(model: str, version: str) -> str:
    quoted = urllib.parse.quote(model, safe="")
    return f"/v2/models/{quoted}/versions/{urllib.parse.quote(version, safe='')}" if version else f"/v2/models/{quoted}"


def infer_request(model: str, version: str, inputs: Mapping[str, np.ndarray]) -> HttpRequest:
    """The infer body: JSON naming each input's binary size, then the inputs' bytes in the same order."""
    described = []
    chunks = []
    for name, array in inputs.items():
        datatype = DataType.from_numpy(array.dtype)
        data = _tensor_bytes(datatype, array)
        described.append({"name": name, "shape": list(array.shape), "datatype": datatype.value,
                          "parameters": {"binary_data_size": len(data)}})
        chunks.append(data)
    header = json.dumps({"inputs": described, "parameters": {"binary_data_output": True}},
                        separators=(",", ":")).encode()
    return HttpRequest(f"{model_path(model, version)}/infer", header + b"".join(chunks), len(header))


def _tensor_bytes(datatype: DataType, array: np.ndarray) -> bytes:
    if datatype is not DataType.BYTES:
        return np.ascontiguousarray(array).tobytes()
    parts = []
    for item in array.reshape(-1):
        value = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(len(value).to_bytes(4, "little") + value)
    return b"".join(parts)


class HttpControl:
    """Metadata, config and statistics over HTTP, shaped as ``InferenceClient`` returns them."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.base = (url if "://" in url else f"http://{url}").rstrip("/")  # paths below start with /
        self.timeout_s = timeout_s

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.base + path, timeout=self.timeout_s) as answer:  # noqa: S310 (http only)
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            body = error.read()
            try:
                message = str(json.loads(body).get("error", body.decode(errors="replace")))
            except ValueError:
                message = body.decode(errors="replace")
            raise HttpError(error.code, message) from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise HttpError(0, f"{self.base}{path}: {getattr(error, 'reason', error)}") from None

    def server_metadata(self) -> ServerMetadata:
        answer = self._get("/v2")
        return ServerMetadata(answer.get("name", ""), answer.get("version", ""), tuple(answer.get("extensions", [])))

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        answer = self._get(model_path(model, version))

        def tensors(items: list[dict[str, Any]]) -> tuple[TensorMetadata, ...]:
            return tuple(TensorMetadata(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in items)

        return ModelMetadata(answer["name"], tuple(answer.get("versions", [])), answer.get("platform", ""),
                             tensors(answer.get("inputs", [])), tensors(answer.get("outputs", [])))

    def model_config(self, model: str, version: str = "") -> dict[str, Any]:
        config: dict[str, Any] = self._get(f"{model_path(model, version)}/config")
        return config

    def statistics(self, model: str = "", version: str = "") -> list[dict[str, Any]]:
        path = f"{model_path(model, version)}/stats" if model else "/v2/models/stats"
        return list(self._get(path).get("model_stats", []))

    def close(self) -> None:
        pass  # one connection per call: nothing held

"""The parent's calls besides the load (metadata, config, statistics), over either protocol."""

from __future__ import annotations

from typing import Any, Protocol

from shoal.clients import ClientError, InferenceClient
from shoal.clients.loadtest.http import HttpControl, HttpError
from shoal.protocol.types import ModelMetadata, ServerMetadata

# What a control call raises when the server refuses or cannot be reached.
CONTROL_ERRORS = (ClientError, HttpError)


class Control(Protocol):
    def server_metadata(self) -> ServerMetadata: ...

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata: ...

    def model_config(self, model: str, version: str = "") -> dict[str, Any]: ...

    def statistics(self, model: str = "", version: str = "") -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def connect(protocol: str, url: str, timeout_s: float = 10.0) -> Control:
    """``grpc``: Shoal's gRPC client; ``http``: plain HTTP/JSON calls."""
    if protocol == "http":
        return HttpControl(url, timeout_s)
    return InferenceClient(url, timeout_s=timeout_s)

"""Sync and asyncio clients for any KServe v2 / Triton gRPC server, numpy in and out.

    from shoal.clients import InferenceClient
    with InferenceClient("localhost:8001") as client:
        outputs = client.infer("simple", {"INPUT0": a, "INPUT1": b})

Every failure is a ``ClientError`` carrying the gRPC status and the server's message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from shoal.clients import messages
from shoal.clients.messages import ModelIndexEntry
from shoal.protocol import InferenceStub
from shoal.protocol import service_pb2 as pb
from shoal.protocol.types import ModelMetadata, ServerMetadata

MAX_MESSAGE_BYTES = 2**31 - 1


class ClientError(Exception):
    """An RPC failed: ``status`` is the gRPC status code, ``message`` the server's text."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(f"[{status.name}] {message}")
        self.status = status
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ClientError:
        return cls(error.code(), error.details() or "")


@dataclass(frozen=True)
class TlsOptions:
    """PEM bytes: the CA to trust (None: system roots), and a client key and chain for mTLS."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    # Override the name checked against the server certificate (e.g. "localhost" for tests).
    server_name: str | None = None


def _channel_options(tls: TlsOptions | None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    if tls and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def _credentials(tls: TlsOptions) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)


class InferenceClient:
    """``headers`` go with every call (e.g. the key of a server's restricted protocol)."""

    def __init__(
        self,
        url: str,
        *,
        tls: TlsOptions | None = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        options = _channel_options(tls)
        self.metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
        self._channel = (
            grpc.secure_channel(url, _credentials(tls), options) if tls else grpc.insecure_channel(url, options)
        )
        self._stub = InferenceStub(self._channel)
        self.timeout_s = timeout_s

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as error:
            raise ClientError.from_rpc_error(error) from None

    def is_live(self) -> bool:
        return bool(self._call("ServerLive", pb.ServerLiveRequest()).live)

    def is_ready(self) -> bool:
        return bool(self._call("ServerReady", pb.ServerReadyRequest()).ready)

    def is_model_ready(self, model: str, version: str = "") -> bool:
        return bool(self._call("ModelReady", pb.ModelReadyRequest(name=model, version=version)).ready)

    def server_metadata(self) -> ServerMetadata:
        return messages.server_metadata(self._call("ServerMetadata", pb.ServerMetadataRequest()))

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        request = pb.ModelMetadataRequest(name=model, version=version)
        return messages.model_metadata(self._call("ModelMetadata", request))

    def model_config(self, model: str, version: str = "") -> dict[str, Any]:
        response = self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version))
        return messages.to_dict(response.config)

    def statistics(self, model: str = "", version: str = "") -> list[dict[str, Any]]:
        response = self._call("ModelStatistics", pb.ModelStatisticsRequest(name=model, version=version))
        return list(messages.to_dict(response).get("model_stats", []))

    def repository_index(self, ready_only: bool = False) -> list[ModelIndexEntry]:
        return messages.repository_index(self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready_only)))

    def load_model(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        self._call("RepositoryModelLoad", messages.load_request(model, config))

    def unload_model(self, model: str, unload_dependents: bool = False) -> None:
        self._call("RepositoryModelUnload", messages.unload_request(model, unload_dependents))

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] | None = None,
        *,
        version: str = "",
        request_id: str = "",
        priority: int = 0,
        timeout_us: int = 0,
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one inference; ``priority`` and ``timeout_us`` are the schedule-policy parameters."""
        request = messages.infer_request(model, inputs, outputs, version, request_id, priority, timeout_us, parameters)
        return messages.infer_outputs(self._call("ModelInfer", request))


class AsyncInferenceClient:
    """The asyncio twin of ``InferenceClient``: the same methods, awaited."""

    def __init__(
        self,
        url: str,
        *,
        tls: TlsOptions | None = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        options = _channel_options(tls)
        self.metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
        self._channel = (
            grpc.aio.secure_channel(url, _credentials(tls), options) if tls else grpc.aio.insecure_channel(url, options)
        )
        self._stub = InferenceStub(self._channel)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as error:
            raise ClientError.from_rpc_error(error) from None

    async def is_live(self) -> bool:
        return bool((await self._call("ServerLive", pb.ServerLiveRequest())).live)

    async def is_ready(self) -> bool:
        return bool((await self._call("ServerReady", pb.ServerReadyRequest())).ready)

    async def is_model_ready(self, model: str, version: str = "") -> bool:
        return bool((await self._call("ModelReady", pb.ModelReadyRequest(name=model, version=version))).ready)

    async def server_metadata(self) -> ServerMetadata:
        return messages.server_metadata(await self._call("ServerMetadata", pb.ServerMetadataRequest()))

    async def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        request = pb.ModelMetadataRequest(name=model, version=version)
        return messages.model_metadata(await self._call("ModelMetadata", request))

    async def model_config(self, model: str, version: str = "") -> dict[str, Any]:
        response = await self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version))
        return messages.to_dict(response.config)

    async def statistics(self, model: str = "", version: str = "") -> list[dict[str, Any]]:
        response = await self._call("ModelStatistics", pb.ModelStatisticsRequest(name=model, version=version))
        return list(messages.to_dict(response).get("model_stats", []))

    async def repository_index(self, ready_only: bool = False) -> list[ModelIndexEntry]:
        request = pb.RepositoryIndexRequest(ready=ready_only)
        return messages.repository_index(await self._call("RepositoryIndex", request))

    async def load_model(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        await self._call("RepositoryModelLoad", messages.load_request(model, config))

    async def unload_model(self, model: str, unload_dependents: bool = False) -> None:
        await self._call("RepositoryModelUnload", messages.unload_request(model, unload_dependents))

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        outputs: Sequence[str] | None = None,
        *,
        version: str = "",
        request_id: str = "",
        priority: int = 0,
        timeout_us: int = 0,
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> dict[str, np.ndarray]:
        request = messages.infer_request(model, inputs, outputs, version, request_id, priority, timeout_us, parameters)
        return messages.infer_outputs(await self._call("ModelInfer", request))

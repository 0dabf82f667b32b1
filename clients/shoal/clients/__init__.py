"""Shoal's clients: a small sync/asyncio client library and the ``shoal-load`` load tester.

They speak the KServe v2 / Triton gRPC protocol and work against any such server. The
generated protocol messages and a stub are importable alone: ``from shoal.clients.stubs import
InferenceStub, service_pb2, model_config_pb2``.
"""

from shoal.clients.client import AsyncInferenceClient, ClientError, InferenceClient, TlsOptions

__all__ = ["AsyncInferenceClient", "ClientError", "InferenceClient", "TlsOptions"]

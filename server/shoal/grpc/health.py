"""The standard ``grpc.health.v1`` service (grpcio-health-checking), kept in step with the core.

Service ``""`` (the server) and ``inference.GRPCInferenceService`` are SERVING while the server
is ready; each model name is SERVING while a version of it is ready.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from shoal.core import Core
from shoal.protocol import SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthReporter:
    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._known: set[str] = set()

    async def sync(self, core: Core) -> None:
        snapshot = await core.health()
        for service in ("", SERVICE_NAME):
            await self.servicer.set(service, SERVING if snapshot.ready else NOT_SERVING)
        for name in set(snapshot.models) | self._known:
            serving = snapshot.models.get(name, False)
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)
        self._known |= set(snapshot.models)

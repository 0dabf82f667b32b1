"""A KServe v2 gRPC server on grpc.aio that does no work: the installed grpcio's own cost per call.

    python -m bench._grpc_floor --port-file FILE

Registered the way Shoal's server registers its service (a generic handler over the same method
table, ``shoal.grpc.server``), on a free loopback port written to FILE. It answers what
perf_analyzer asks (live, ready, metadata and config of one model, ``numpy_op``: FP32 [256] in and
out, max_batch_size 32, the model of bench/python_backend.py), ModelStatistics (the requests counted,
so CPU per request can be divided), and ModelInfer with a reply built once. No Python server on
this grpcio can cost less per request: bench/python_path.py compares Shoal against it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from shoal.protocol import SERVICE_NAME, config_pb2, service_pb2

MODEL = "numpy_op"
WIDTH = 256


def _config() -> config_pb2.ModelConfig:
    config = config_pb2.ModelConfig(name=MODEL, backend="python", max_batch_size=32)
    config.input.add(name="INPUT0", data_type=config_pb2.TYPE_FP32, dims=[WIDTH])
    config.output.add(name="OUTPUT0", data_type=config_pb2.TYPE_FP32, dims=[WIDTH])
    return config


class Floor:
    """The method table's answers; ``served`` counts ModelInfer calls."""

    def __init__(self) -> None:
        self.served = 0
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        self.metadata = service_pb2.ModelMetadataResponse(
            name=MODEL,
            versions=["1"],
            platform="python",
            inputs=[tensor(name="INPUT0", datatype="FP32", shape=[-1, WIDTH])],
            outputs=[tensor(name="OUTPUT0", datatype="FP32", shape=[-1, WIDTH])],
        )
        self.config = service_pb2.ModelConfigResponse(config=_config())
        self.reply = service_pb2.ModelInferResponse(model_name=MODEL, model_version="1")
        self.reply.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, WIDTH])
        self.reply.raw_output_contents.append(bytes(4 * WIDTH))

    def infer(self, request: Any) -> service_pb2.ModelInferResponse:
        self.served += 1
        return self.reply

    def statistics(self, request: Any) -> service_pb2.ModelStatisticsResponse:
        answer = service_pb2.ModelStatisticsResponse()
        row = answer.model_stats.add(name=MODEL, version="1", inference_count=self.served, execution_count=self.served)
        row.inference_stats.success.count = self.served
        return answer

    def table(self) -> dict[str, tuple[Any, Callable[[Any], Any]]]:
        return {
            "ServerLive": (service_pb2.ServerLiveRequest, lambda r: service_pb2.ServerLiveResponse(live=True)),
            "ServerReady": (service_pb2.ServerReadyRequest, lambda r: service_pb2.ServerReadyResponse(ready=True)),
            "ModelReady": (service_pb2.ModelReadyRequest, lambda r: service_pb2.ModelReadyResponse(ready=True)),
            "ServerMetadata": (
                service_pb2.ServerMetadataRequest,
                lambda r: service_pb2.ServerMetadataResponse(name="floor", version="0"),
            ),
            "ModelMetadata": (service_pb2.ModelMetadataRequest, lambda r: self.metadata),
            "ModelConfig": (service_pb2.ModelConfigRequest, lambda r: self.config),
            "ModelStatistics": (service_pb2.ModelStatisticsRequest, self.statistics),
            "ModelInfer": (service_pb2.ModelInferRequest, self.infer),
        }


def _handler(answer: Callable[[Any], Any]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handle(request: Any, context: Any) -> Any:
        return answer(request)

    return handle


async def serve(port_file: Path) -> None:
    server = grpc.aio.server()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _handler(answer),
            request_deserializer=request_type.FromString,
            response_serializer=lambda message: message.SerializeToString(),
        )
        for name, (request_type, answer) in Floor().table().items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port-file", type=Path, required=True)
    asyncio.run(serve(parser.parse_args().port_file))

"""The generated KServe v2 / Triton protocol: messages, config schema, and a stub for any channel.

    import grpc
    from shoal.clients.stubs import InferenceStub, service_pb2
    stub = InferenceStub(grpc.insecure_channel("localhost:8001"))
    stub.ServerLive(service_pb2.ServerLiveRequest())

The messages are generated under the proto package ``shoal.inference`` so they load beside
tritonclient's; the stub calls ``/inference.GRPCInferenceService/<Rpc>`` like Triton's.
"""

from shoal.protocol import METHODS, SERVICE_NAME, InferenceStub, service_pb2
from shoal.protocol import config_pb2 as model_config_pb2

__all__ = ["METHODS", "SERVICE_NAME", "InferenceStub", "model_config_pb2", "service_pb2"]

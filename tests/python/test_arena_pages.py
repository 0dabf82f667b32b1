"""A Python process instance gives back the pages of its arenas past their resident part after each
batch, whatever way the batch answered.

Found by the review of session 52: a batch whose BLS call's inputs lay in the responses arena, and
which then answered in its pipe message (``shoal.dataplane.inline``) or with an error, left those
inputs' pages resident: the host gave back pages up to the end of the outputs' slots only, and there
were none.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from shoal.dataplane.arena import RESIDENT_BYTES
from tests import python_models as pm

MIB = 1 << 20
# X = (elements to answer, elements to send the callee): a big answer grows the responses arena; a big
# BLS input then lies in it, and the answer is the callee's one FP32 (small: in the message).
CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            answer, sent = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "X").as_numpy())
            if sent:
                call = pb_utils.InferenceRequest(
                    model_name="total", requested_output_names=["Y"],
                    inputs=[pb_utils.Tensor("X", np.ones(sent, np.float32))],
                )
                y = pb_utils.get_output_tensor_by_name(call.exec(), "Y").as_numpy()
            else:
                y = np.full(answer, 2.0, np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
TOTAL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([x.sum()], np.float32))]))
        return responses
"""
CONFIG = """
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: {input} dims: [ -1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{extra}
"""
THREAD = 'parameters { key: "process_instances" value: { string_value: "false" } }'


def _responses_arena_resident(pid: int) -> int:
    """Bytes resident in the server's mappings of its process instances' responses arenas."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = "memfd:shoal-instance-responses" in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_the_pages_of_a_bls_calls_inputs_are_given_back_after_a_small_answer(tmp_path: Path, server_factory) -> None:
    repo = tmp_path / "repo"
    pm.write_model(repo, "caller", CONFIG.format(input="TYPE_INT64", extra=""), CALLER)
    pm.write_model(repo, "total", CONFIG.format(input="TYPE_FP32", extra=THREAD), TOTAL)
    server = server_factory(repo)

    def call(client: grpcclient.InferenceServerClient, answer: int, sent: int) -> np.ndarray:
        data = grpcclient.InferInput("X", [2], "INT64")
        data.set_data_from_numpy(np.array([answer, sent], np.int64))
        return client.infer("caller", [data], client_timeout=120).as_numpy("Y")

    with grpcclient.InferenceServerClient(server.url) as client:
        grown = call(client, (40 * MIB) // 4, 0)  # 40 MiB of outputs: the responses arena grows to 64 MiB
        assert grown.shape == ((40 * MIB) // 4,) and float(grown[0]) == 2.0
        assert _responses_arena_resident(server.pid) <= RESIDENT_BYTES + MIB
        for _ in range(2):  # 32 MiB to the callee through the arena, one FP32 back
            assert call(client, 0, (32 * MIB) // 4).tolist() == [float((32 * MIB) // 4)]
            assert _responses_arena_resident(server.pid) <= RESIDENT_BYTES + MIB

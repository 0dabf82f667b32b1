"""A Python process instance gives back the pages of its arenas past their resident part after each
batch, whatever way the batch answered.

Found by the reviews of session 52: a batch whose BLS call's inputs lay in the responses arena, and
which then answered in its pipe message (``shoal.dataplane.inline``) or with an error, left those
inputs' pages resident: the host gave back pages up to the end of the outputs' slots only, and there
were none; a batch whose worker died (or passed its execution timeout) left them too. Giving back up
to the end of those inputs then failed a batch whose outputs had been moved to a new, smaller arena
meanwhile (past its end: "madvise start out of bounds").
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from shoal.dataplane.arena import RESIDENT_BYTES, Arena
from shoal.instances.python_process import PythonProcessModel
from shoal.instances.worker_pipe import RESPONSES, Answer
from tests import python_models as pm

MIB = 1 << 20
# X = (elements to send the callee, elements to answer, whether to exit after the call): a big answer
# grows the responses arena; a big BLS input then lies in it; the answer is that many 2.0, or with none
# asked the callee's one FP32 (small: in the message); or the worker exits (the batch fails).
CALLER = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            sent, answer, exits = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "X").as_numpy())
            y = np.full(answer, 2.0, np.float32)
            if sent:
                call = pb_utils.InferenceRequest(
                    model_name="total", requested_output_names=["Y"],
                    inputs=[pb_utils.Tensor("X", np.ones(sent, np.float32))],
                )
                total = pb_utils.get_output_tensor_by_name(call.exec(), "Y").as_numpy()
                if exits:
                    os._exit(1)
                y = y if answer else total
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


def _responses_arenas(pid: int) -> int:
    """Bytes of the server's mappings of its process instances' responses arenas."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = "memfd:shoal-instance-responses" in line
        elif inside and line.startswith("Size:"):
            total += int(line.split()[1]) * 1024
    return total


def _responses_arena_resident(pid: int) -> int:
    """Bytes of memory the server's responses arenas hold, whoever wrote them (the memfds' allocated
    blocks, each memfd counted once: the host holds a descriptor of each, and its mapping another)."""
    blocks: dict[int, int] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if "memfd:shoal-instance-responses" in os.readlink(fd):
                found = fd.stat()
                blocks[found.st_ino] = found.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return sum(blocks.values())


def _call(client: grpcclient.InferenceServerClient, sent: int, answer: int, exits: bool = False) -> np.ndarray:
    data = grpcclient.InferInput("X", [3], "INT64")
    data.set_data_from_numpy(np.array([sent, answer, exits], np.int64))
    return client.infer("caller", [data], client_timeout=120).as_numpy("Y")


def _grown(client: grpcclient.InferenceServerClient, pid: int) -> None:
    """40 MiB of outputs: the caller's responses arena grows to 64 MiB; then only its first 16 stay."""
    grown = _call(client, 0, (40 * MIB) // 4)
    assert grown.shape == ((40 * MIB) // 4,) and float(grown[0]) == 2.0 and float(grown[-1]) == 2.0
    assert _responses_arena_resident(pid) <= RESIDENT_BYTES + MIB


def _serve(tmp_path: Path, server_factory) -> object:
    repo = tmp_path / "repo"
    pm.write_model(repo, "caller", CONFIG.format(input="TYPE_INT64", extra=""), CALLER)
    pm.write_model(repo, "total", CONFIG.format(input="TYPE_FP32", extra=THREAD), TOTAL)
    return server_factory(repo)


def test_the_pages_of_a_bls_calls_inputs_are_given_back_after_a_small_answer(tmp_path: Path, server_factory) -> None:
    server = _serve(tmp_path, server_factory)
    with grpcclient.InferenceServerClient(server.url) as client:
        _grown(client, server.pid)
        for _ in range(2):  # 32 MiB to the callee through the arena, one FP32 back
            assert _call(client, (32 * MIB) // 4, 0).tolist() == [float((32 * MIB) // 4)]
            assert _responses_arena_resident(server.pid) <= RESIDENT_BYTES + MIB


def test_the_pages_of_a_bls_calls_inputs_are_given_back_when_its_worker_dies(tmp_path: Path, server_factory) -> None:
    server = _serve(tmp_path, server_factory)
    with grpcclient.InferenceServerClient(server.url) as client:
        _grown(client, server.pid)
        with pytest.raises(InferenceServerException, match="instance process"):
            _call(client, (32 * MIB) // 4, 0, exits=True)
        assert _responses_arena_resident(server.pid) <= RESIDENT_BYTES + MIB
        assert _call(client, 4, 0).tolist() == [4.0]  # the replacement serves


def test_outputs_moved_to_a_new_arena_after_a_bls_calls_inputs_are_answered(tmp_path: Path, server_factory) -> None:
    """60 MiB to the callee fill the 64 MiB arena: the 8 MiB answer asks for a new arena, no smaller
    than the one it leaves (it asked for 8 MiB: the next big BLS input would have gone pickled), and
    the batch is answered, its pages given back within the new arena's bounds."""
    server = _serve(tmp_path, server_factory)
    with grpcclient.InferenceServerClient(server.url) as client:
        _grown(client, server.pid)
        assert _responses_arenas(server.pid) == 64 * MIB
        answer = _call(client, (60 * MIB) // 4, (8 * MIB) // 4)
        assert answer.shape == ((8 * MIB) // 4,) and bool(np.all(answer == 2.0))
        assert _responses_arena_resident(server.pid) <= RESIDENT_BYTES + MIB
        assert _responses_arenas(server.pid) == 64 * MIB


def test_outputs_that_cannot_be_read_leave_no_pages_behind() -> None:
    """The host fails to copy a batch's outputs (here a slot that names more bytes than it holds; a
    MemoryError would do the same): the batch fails, and the arena's pages go all the same (they stayed
    resident until a later batch reached that far)."""
    arena = Arena.create("test-responses", 64 * MIB)
    try:
        np.frombuffer(arena.map, np.uint8, 40 * MIB)[:] = 1  # a batch's 40 MiB of outputs and BLS inputs
        instance = SimpleNamespace(_arenas={RESPONSES: arena}, _calls_end=40 * MIB)
        instance._trim_responses = functools.partial(PythonProcessModel._trim_responses, instance)
        unreadable = [Answer([("Y", "FP32", (10,), 32 * MIB, 39)])]  # ten FP32 in 39 bytes
        with pytest.raises(ValueError):
            PythonProcessModel._unpack_outputs(instance, unreadable)  # type: ignore[arg-type]
        assert os.fstat(arena.fd).st_blocks * 512 <= RESIDENT_BYTES + MIB
    finally:
        arena.close()

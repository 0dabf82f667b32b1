"""Python models (``backend: "python"``) written as a Triton user writes them, for the tests and the bench.

Each ``add_*`` writes ``<repo>/<name>/config.pbtxt`` and ``<repo>/<name>/1/model.py``; the same
files load unchanged on the real Triton (``/work/shared/tools/triton_peer/run_triton.sh``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# One FP32 input X of any length, one output Y, no batching.
X_TO_Y_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

ADD_SUB_CONFIG = """
backend: "python"
max_batch_size: 8
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
         {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
{extra}
"""

# Triton's add_sub example, plus what the tests look at: the batch each execute saw (BATCH:
# how many requests it was given) and the request's own id and parameters.
ADD_SUB = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        self.model_config = json.loads(args["model_config"])
        output0 = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0["data_type"])
        self.logger = pb_utils.Logger
        self.logger.log_info("add_sub initialized as " + args["model_instance_name"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            a, b = in_0.as_numpy(), in_1.as_numpy()
            out_0 = pb_utils.Tensor("OUTPUT0", (a + b).astype(self.output0_dtype))
            out_1 = pb_utils.Tensor("OUTPUT1", (a - b).astype(self.output0_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses

    def finalize(self):
        self.logger.log_info("add_sub finalized")
"""

# One FP32 [4] input and output, unbatched, on one thread instance.
FP32_4_ON_A_THREAD_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "process_instances" value: { string_value: "false" } }
"""

ECHO_CONFIG = """
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 200000 }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] }, { name: "REQUEST" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

# Returns initialize's args and, per request, what the request knows of itself and its batch.
ECHO = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = json.dumps(args)

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().shape[0]
            seen = {"id": request.request_id(), "parameters": json.loads(request.parameters()),
                    "requested": sorted(request.requested_output_names()), "batch": len(requests),
                    "timeout": request.timeout(), "flags": request.flags(),
                    "dtype": pb_utils.triton_to_numpy_type(pb_utils.numpy_to_triton_type(np.float32)).__name__}
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ARGS", np.array([[self.args.encode()]] * rows, dtype=np.object_)),
                pb_utils.Tensor("REQUEST", np.array([[json.dumps(seen).encode()]] * rows, dtype=np.object_)),
            ]))
        return responses
"""

AUTO_CONFIG = 'backend: "python"\n'

AUTO = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]})
        auto_complete_model_config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]})
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(request, "IN").as_numpy() * 2)]) for request in requests]
"""

BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "A" data_type: TYPE_INT32 dims: [ 1, 16 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1, 16 ] }, { name: "DIFF" data_type: TYPE_FP32 dims: [ 1, 4 ] },
         { name: "ERROR" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

# BLS, synchronous: the ONNX model "simple" and the Python model "add_sub", then a missing model.
BLS_SYNC = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            simple = pb_utils.InferenceRequest(
                model_name="simple", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", np.ones_like(a))]).exec()
            if simple.has_error():
                raise pb_utils.TritonModelException(simple.error().message())
            add_sub = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT1"],
                inputs=[pb_utils.Tensor("INPUT0", b), pb_utils.Tensor("INPUT1", b * 0.5)]).exec()
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=["X"], inputs=[pb_utils.Tensor("X", b)]).exec()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(simple, "OUTPUT0").as_numpy()),
                pb_utils.Tensor("DIFF", pb_utils.get_output_tensor_by_name(add_sub, "OUTPUT1").as_numpy()),
                pb_utils.Tensor("ERROR", np.array([missing.error().message().encode()], dtype=np.object_)),
            ]))
        return responses
"""

# BLS, asynchronous: the same two calls in flight together, from an async execute.
BLS_ASYNC = (
    BLS_SYNC.replace("import numpy as np", "import asyncio\n\nimport numpy as np")
    .replace("    def execute(self, requests):", "    async def execute(self, requests):")
    .replace(
        """                inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", np.ones_like(a))]).exec()
            if simple.has_error():
                raise pb_utils.TritonModelException(simple.error().message())
            add_sub = pb_utils.InferenceRequest(""",
        """                inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", np.ones_like(a))]).async_exec()
            add_sub = pb_utils.InferenceRequest(""",  # noqa: E501 - the model source, as written
    )
    .replace(
        """                inputs=[pb_utils.Tensor("INPUT0", b), pb_utils.Tensor("INPUT1", b * 0.5)]).exec()
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=["X"], inputs=[pb_utils.Tensor("X", b)]).exec()""",
        """                inputs=[pb_utils.Tensor("INPUT0", b), pb_utils.Tensor("INPUT1", b * 0.5)]).async_exec()
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=["X"], inputs=[pb_utils.Tensor("X", b)]
            ).async_exec()
            simple, add_sub, missing = await asyncio.gather(simple, add_sub, missing)""",
    )
)

# Faults: each a change of add_sub's execute.
FAULTS = {
    "raises": ("        responses = []\n", "        raise RuntimeError('boom')\n"),
    # a message no UTF-8 encoder takes (a file name read from a non-UTF-8 listing, surrogateescape'd)
    "raises_undecodable": (
        "        responses = []\n",
        "        raise RuntimeError('cannot read ' + b'photo-\\xff.jpg'.decode('utf-8', 'surrogateescape'))\n",
    ),
    "returns_none": ("        return responses\n", "        return None\n"),
    "wrong_count": ("        return responses\n", "        return responses[1:]\n"),
    "wrong_dtype": ("(a + b).astype(self.output0_dtype)", "(a + b).astype(np.int64)"),
    # INPUT0[0] == 13 ends the process (a crash), == 7 hangs (writing its pid to the request's
    # parameter pid_file, if any); others are answered
    "crashes": (
        "            a, b = in_0.as_numpy(), in_1.as_numpy()\n",
        "            a, b = in_0.as_numpy(), in_1.as_numpy()\n"
        "            if a.flat[0] == 13:\n                import os\n                os._exit(3)\n"
        "            if a.flat[0] == 7:\n                import os, time\n"
        "                pid_file = json.loads(request.parameters()).get('pid_file')\n"
        "                if pid_file:\n                    open(pid_file, 'w').write(str(os.getpid()))\n"
        "                time.sleep(600)\n",
    ),
    "syntax_error": ("    def execute(self, requests):", "    def execute(self, requests)"),
    # a load error whose text no UTF-8 encoder takes (a surrogateescape'd file name)
    "initialize_undecodable": (
        "        self.args = args\n",
        "        raise RuntimeError('cannot open ' + b'w-\\xff.bin'.decode('utf-8', 'surrogateescape'))\n",
    ),
    "import_error": ("import json\n", "import json\nimport no_such_module_xyz\n"),
}


def write_model(repo: Path, name: str, config: str, source: str) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(config).lstrip())
    (folder / "1" / "model.py").write_text(textwrap.dedent(source).lstrip())
    return folder


def add_add_sub(
    repo: Path, name: str = "add_sub", count: int = 1, delay_us: int = 0, extra: str = "", source: str = ADD_SUB
) -> Path:
    return write_model(repo, name, ADD_SUB_CONFIG.format(delay_us=delay_us, count=count, extra=extra), source)


def add_fault(repo: Path, fault: str, extra: str = "") -> Path:
    old, new = FAULTS[fault]
    assert old in ADD_SUB, fault
    return add_add_sub(repo, fault, extra=extra, source=ADD_SUB.replace(old, new))


DOUBLE_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

DOUBLE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(request, "X").as_numpy() * 2)]) for request in requests]
"""

# BLS with tensors of any size: X goes to "double" twice, synchronously then asynchronously.
BLS_DOUBLE = """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            first = pb_utils.InferenceRequest(model_name="double", requested_output_names=["Y"],
                                              inputs=[pb_utils.Tensor("X", x)]).exec()
            y = pb_utils.get_output_tensor_by_name(first, "Y").as_numpy()
            calls = [pb_utils.InferenceRequest(model_name="double", requested_output_names=["Y"],
                                               inputs=[pb_utils.Tensor("X", y)]).async_exec() for _ in range(2)]
            second, third = await asyncio.gather(*calls)
            total = (pb_utils.get_output_tensor_by_name(second, "Y").as_numpy()
                     + pb_utils.get_output_tensor_by_name(third, "Y").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", total)]))
        return responses
"""

# Two BLS calls with tensors too big for the arenas (they travel pickled on the pipe), crossing: the
# first call's reply is ready, and being written to the worker, when the model writes the second call.
# The server's thread once wrote that reply while the worker wrote its call, each waiting for the other
# to read, and the request never ended. The pause makes that order the likely one; it proves nothing alone.
BLS_CROSSING = """
import asyncio
import time

import triton_python_backend_utils as pb_utils


def call(x):
    return pb_utils.InferenceRequest(model_name="double", requested_output_names=["Y"],
                                     inputs=[pb_utils.Tensor("X", x)]).async_exec()


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            first = call(x)
            time.sleep(0.5)  # "double" answers the first call meanwhile (no thread of this worker reads)
            second = call(x + 1)
            a, b = await asyncio.gather(first, second)
            total = pb_utils.get_output_tensor_by_name(a, "Y").as_numpy() + pb_utils.get_output_tensor_by_name(
                b, "Y").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", total)]))
        return responses
"""


def reuses_buffer(input_name: str = "IN", output_name: str = "OUT", factor: int = 1) -> str:
    """A model that answers input * ``factor`` in one buffer of its own that every request refills
    (Triton's stub copies a returned response's outputs when execute returns: a model may)."""
    return f"""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.buf = np.zeros(0)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "{input_name}").as_numpy()
            if self.buf.dtype != x.dtype or self.buf.size < x.size:
                self.buf = np.zeros(max(64, x.size), x.dtype)
            answer = self.buf[: x.size].reshape(x.shape)
            answer[...] = x * {factor}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("{output_name}", answer)]))
        return responses
"""

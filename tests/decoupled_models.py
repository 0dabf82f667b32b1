"""Decoupled Python models written as a Triton user writes them, for tests/python/test_decoupled.py.

``repeat`` is the shipped example (model_repository/repeat); ``square`` is Triton's other
decoupled example (n responses of n for an input n, then a FINAL flag on its own), and the
faulty ones send an error response mid-stream or return responses from ``execute``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests import models, python_models

THREADS = 'parameters { key: "process_instances" value: { string_value: "false" } }'

SQUARE_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# n responses of n, sent from execute itself, then the FINAL flag alone (no response with it).
SQUARE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for _ in range(n):
                out = pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Two responses, an error response, one more response with FINAL; a send after FINAL is refused.
FAILS_MIDWAY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for n in (1, 2):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))]))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("the third one failed")))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([4], dtype=np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            try:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([5], dtype=np.int32))]))
            except pb_utils.TritonModelException as exc:
                pb_utils.Logger.log_info("refused after FINAL: " + str(exc))
        return None
"""

# A decoupled model whose execute returns responses, as a model that is not decoupled does.
RETURNS_RESPONSES = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], dtype=np.int32))])
                for _ in requests]
"""


# One response, and no FINAL flag unless the input is 1 (after a first request that never ends).
NEVER_FINAL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if n == 1 else 0)
        return None
"""
EXECUTION_TIMEOUT = 'parameters { key: "execution_timeout_ms" value: { string_value: "1000" } }'


BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "VALUES" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "ERRORS" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# BLS into a decoupled model: square for N >= 0, fails_midway for N < 0; every value it streamed
# back and how many responses were errors (the last response may be empty: the FINAL flag alone).
BLS_DECOUPLED = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="fails_midway" if n[0] < 0 else "square", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", np.abs(n).astype(np.int32))])
            values, errors = [], 0
            for response in call.exec(decoupled=True):
                if response.has_error():
                    errors += 1
                    continue
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    values.append(int(out.as_numpy()[0]))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("VALUES", np.array(values, dtype=np.int32)),
                pb_utils.Tensor("ERRORS", np.array([errors], dtype=np.int32))]))
        return responses
"""


# IN 1: the response with FINAL at once, then execute lingers (its cleanup); IN 2: the response from a
# thread after execute returned, as Triton's repeat example sends. One instance: both run at position 0.
LINGERS = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", np.array([n], np.int32))])
            if n == 1:
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                time.sleep(0.3)
            else:

                def later(sender=sender, response=response):
                    time.sleep(0.3)  # as Triton's repeat example's delay: the runner checks for cancellations
                    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

                threading.Thread(target=later).start()
        return None
"""


# Batched (requests wait 300 ms for company): OUT = IN * 2, one response with FINAL per request.
BATCHED_CONFIG = """
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
dynamic_batching { max_queue_delay_microseconds: 300000 }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
DOUBLES = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value * 2)]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
"""
# A model that is not decoupled calling TARGET (decoupled) with exec(): refused, as Triton refuses it.
PLAIN_CALLER_CONFIG = BATCHED_CONFIG.replace("model_transaction_policy { decoupled: true }\n", "").replace(
    "dynamic_batching { max_queue_delay_microseconds: 300000 }\n", ""
)
PLAIN_CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            called = pb_utils.InferenceRequest(
                model_name="TARGET", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")]).exec()
            if called.has_error():
                responses.append(pb_utils.InferenceResponse(error=called.error()))
            else:
                responses.append(pb_utils.InferenceResponse(called.output_tensors()))
        return responses
"""
# Streams a response every 20 ms until its request is cancelled (at most 20 s), as Triton's cancellation
# example does, and logs that it saw the cancellation: from a thread of its own or within execute, asking
# the request or (looked up each time, as a model's helper may) its sender.
UNTIL_CANCELLED = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            if WITHIN_EXECUTE:
                self._stream(request)
            else:
                threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return None

    def _stream(self, request):
        deadline = time.monotonic() + 20
        while not CANCELLED and time.monotonic() < deadline:
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
            time.sleep(0.02)
        if CANCELLED:
            pb_utils.Logger.log_info(f"request {request.request_id()} saw its cancellation")
        request.get_response_sender().send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
UNTIL_CANCELLED_KINDS = {
    "until_cancelled": ("False", "request.is_cancelled()"),
    "until_cancelled_in_execute": ("True", "request.is_cancelled()"),
    "until_sender_cancelled": ("False", "request.get_response_sender().is_cancelled()"),
}


def add_models(repo: Path) -> None:
    """repeat (process instances, as shipped, and thread instances), square, and the faulty models."""
    models.copy_example(repo, "repeat")
    shutil.copytree(repo / "repeat", repo / "repeat_thread")
    config = repo / "repeat_thread" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "repeat"', 'name: "repeat_thread"') + THREADS + "\n")
    python_models.write_model(repo, "square", SQUARE_CONFIG, SQUARE)
    python_models.write_model(repo, "square_thread", SQUARE_CONFIG + THREADS, SQUARE)
    python_models.write_model(repo, "fails_midway", SQUARE_CONFIG, FAILS_MIDWAY)
    python_models.write_model(repo, "returns_responses", SQUARE_CONFIG, RETURNS_RESPONSES)
    python_models.write_model(repo, "bls_decoupled", BLS_CONFIG, BLS_DECOUPLED)
    python_models.write_model(repo, "bls_decoupled_thread", BLS_CONFIG + THREADS, BLS_DECOUPLED)
    one_instance = SQUARE_CONFIG.replace("count: 2", "count: 1")
    python_models.write_model(repo, "never_final", one_instance + EXECUTION_TIMEOUT, NEVER_FINAL)
    python_models.write_model(repo, "lingers", one_instance, LINGERS)
    for suffix, extra in (("", ""), ("_thread", THREADS)):
        python_models.write_model(repo, f"doubles{suffix}", BATCHED_CONFIG + extra, DOUBLES)
        python_models.write_model(
            repo, f"plain_caller{suffix}", PLAIN_CALLER_CONFIG, PLAIN_CALLER.replace("TARGET", f"doubles{suffix}")
        )
        models.write_config(
            repo / f"doubles_step{suffix}",
            f"""
            platform: "ensemble"
            max_batch_size: 8
            input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
            output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
            ensemble_scheduling {{ step [ {{ model_name: "doubles{suffix}" model_version: -1
              input_map {{ key: "IN" value: "IN" }} output_map {{ key: "OUT" value: "OUT" }} }} ] }}
            """,
        )
        (repo / f"doubles_step{suffix}" / "1").mkdir()
        for name, (within, cancelled) in UNTIL_CANCELLED_KINDS.items():
            source = UNTIL_CANCELLED.replace("WITHIN_EXECUTE", within).replace("CANCELLED", cancelled)
            python_models.write_model(
                repo, f"{name}{suffix}", SQUARE_CONFIG.replace("count: 2", "count: 1") + extra, source
            )

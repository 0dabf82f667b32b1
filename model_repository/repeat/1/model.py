"""A decoupled model: every element of IN comes back as its own response, then the FINAL flag.

``execute`` only starts one thread per request and returns None at once; the thread sends the
responses through the request's response sender, DELAY[i] milliseconds apart, and closes it
with TRITONSERVER_RESPONSE_COMPLETE_FINAL. The same file runs on Triton's Python backend.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            name = args["model_name"]
            raise pb_utils.TritonModelException(
                f"model {name} must be decoupled (model_transaction_policy {{ decoupled: true }})"
            )
        self.threads = []
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            if values.shape != delays.shape:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(
                            f"IN and DELAY must have the same shape, got {values.shape} and {delays.shape}"
                        )
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            thread = threading.Thread(
                target=self.respond, args=(request.get_response_sender(), values, delays), daemon=True
            )
            with self.lock:
                self.threads.append(thread)
            thread.start()
        return None

    def respond(self, sender, values, delays):
        try:
            for index, (value, delay) in enumerate(zip(values, delays, strict=True)):
                if sender.is_cancelled():
                    break
                time.sleep(int(delay) / 1000)
                out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
                idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
        finally:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=5)

"""Pre-processing for the mlp model, as a Triton Python-backend model (runs unchanged on Triton).

Each request's images (a batch of 16x16 uint8) become rows of 256 floats: scaled to [0, 1], then
standardized per image, so the mlp sees zero-mean, unit-variance inputs whatever the exposure.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        output = pb_utils.get_output_config_by_name(config, "INPUT0")
        self.output_dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        pb_utils.Logger.log_info(f"preprocess: instance {args['model_instance_name']} ready")

    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            rows = images.reshape(images.shape[0], -1).astype(np.float32) / 255.0
            mean = rows.mean(axis=1, keepdims=True)
            std = rows.std(axis=1, keepdims=True)
            standardized = (rows - mean) / np.maximum(std, 1e-6)
            output = pb_utils.Tensor("INPUT0", standardized.astype(self.output_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses

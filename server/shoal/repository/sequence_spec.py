"""The spec a backend loads for a sequence-batched model: the config's tensors, plus the control inputs
and the implicit state the sequence batcher feeds and reads (a client never sends nor sees them)."""

from __future__ import annotations

from dataclasses import replace

from shoal.repository.config import ModelSpec, TensorSpec
from shoal.repository.sequence_config import backend_inputs, backend_outputs


def backend_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the sequence batcher's own tensors appended (unchanged without ``sequence_batching``)."""
    batching = spec.sequence_batching
    if batching is None:
        return spec
    inputs = spec.inputs + tuple(TensorSpec(name, datatype, dims) for name, datatype, dims in backend_inputs(batching))
    outputs = spec.outputs + tuple(
        TensorSpec(name, datatype, dims) for name, datatype, dims in backend_outputs(batching)
    )
    return replace(spec, inputs=inputs, outputs=outputs)

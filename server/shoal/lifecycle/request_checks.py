"""Check a request against a model's config, build the backend feed, and shape the outputs.

Every rule here answers INVALID_ARGUMENT with a message that names the model and the
tensor, in Triton's words where Triton answers the same case (clients match on them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from shoal import off_loop
from shoal.backends.base import outputs_as_returned
from shoal.errors import ErrorCode, ShoalError, invalid, request_label, shown
from shoal.lifecycle import classification
from shoal.protocol.types import DataType
from shoal.repository.config import ModelSpec, TensorSpec
from shoal.request_types import InferRequest, Tensor

# Triton appends this to a shape mismatch when the model batches (core infer_request.cc Normalize).
IMPLICIT_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
    "prepended to each input shape. If you want to specify the full shape including the batch dim in "
    "your input dims config, try setting max_batch_size to zero. See the model configuration docs for "
    "more info on max_batch_size."
)


# Names of a request listed in one message: a request may send thousands (each shortened by ``shown``).
MAX_NAMES_SHOWN = 4


@dataclass(frozen=True)
class Prepared:
    feed: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    batch_size: int  # 0 when the model does not batch
    # Outputs returned as classifications: name → how many classes per batch row.
    class_counts: Mapping[str, int] = field(default_factory=dict)


def prepare(spec: ModelSpec, request: InferRequest) -> Prepared:
    """Check a request in Triton's order, with its words (core infer_request.cc ``Normalize``,
    ``ValidateRequestInputs``; model.cc ``GetInput``, ``GetOutput``): requested outputs, the
    number of inputs, unknown inputs, batch sizes, then each input's datatype and shape. The core's
    refusals begin with the request's label (``request_label``), as Triton's; the others do not."""
    given = {}
    for tensor in request.inputs:
        if tensor.name in given:  # Triton: InferenceRequest::AddOriginalInput
            raise invalid(f"{request_label(request.id)}input '{shown(tensor.name)}' already exists in request")
        given[tensor.name] = tensor
    outputs = _requested_outputs(spec, request)
    _check_input_count(spec, given, request.id)
    unexpected = [name for name in given if spec.input(name) is None]
    if unexpected:
        raise invalid(f"unexpected inference input '{shown(unexpected[0])}' for model '{spec.name}'")
    batch_size = _batch_size(spec, list(given.values()), request.id)
    feed = {}
    for tensor in given.values():
        tensor_spec = spec.input(tensor.name)
        assert tensor_spec is not None
        _check_input(spec, tensor_spec, tensor, request.id)
        data = tensor.data
        if tensor_spec.reshape is not None:
            lead = list(tensor.shape[:1]) if spec.max_batch_size > 0 else []
            try:
                data = data.reshape(lead + list(tensor_spec.reshape))
            except ValueError:  # load-time validation of reshape against dims should make this unreachable
                raise invalid(
                    f"input '{shown(tensor.name)}' for model '{spec.name}': shape {list(tensor.shape)} cannot be "
                    f"reshaped to {lead + list(tensor_spec.reshape)}"
                ) from None
        feed[tensor.name] = data
    _check_classifications(spec, request, outputs)
    return Prepared(feed, outputs, batch_size, request.class_counts)


def _check_input_count(spec: ModelSpec, given: Mapping[str, Tensor], request_id: str) -> None:
    """Triton's ValidateRequestInputs: more inputs than the config lists, or fewer than it requires.
    Lists print as Triton prints them: ``['A','B']``."""
    required = [t for t in spec.inputs if not t.optional]
    if len(required) <= len(given) <= len(spec.inputs):
        return
    missing = [t.name for t in required if t.name not in given]
    expected = (
        f"expected {len(spec.inputs)} inputs"
        if len(required) == len(spec.inputs)
        else f"expected number of inputs between {len(required)} and {len(spec.inputs)}"
    )
    raise invalid(
        f"{request_label(request_id)}{expected} but got {len(given)} inputs for model '{spec.name}'. "
        f"Got input(s) {_names(given)}, "
        f"but missing required input(s) {_names(missing)}. Please provide all required input(s)."
    )


def _names(names: Iterable[str]) -> str:
    """Names as Triton prints them, each shortened (``shown``); past ``MAX_NAMES_SHOWN``, a count of the rest."""
    listed = list(names)
    shown_names = [f"'{shown(name)}'" for name in listed[:MAX_NAMES_SHOWN]]
    rest = len(listed) - len(shown_names)
    return "[" + ",".join(shown_names) + (f",...({rest} more)" if rest else "") + "]"


def _dims(shape: Iterable[int]) -> str:
    """A shape as Triton's DimsListToString prints it: ``[-1,16]``."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def _batch_size(spec: ModelSpec, tensors: list[Tensor], request_id: str) -> int:
    """The request's batch size (0 when the model does not batch), checked as Triton's Normalize."""
    if spec.max_batch_size == 0:
        return 0
    batch = 0
    for tensor in tensors:
        if not tensor.shape:
            raise invalid(
                f"{request_label(request_id)}input '{shown(tensor.name)}' has no shape but model requires "
                f"batch dimension for '{spec.name}'"
            )
        if tensor.shape[0] < 1:  # Shoal's own rule: Triton takes a 0 as "no batch size yet"
            raise invalid(f"input '{shown(tensor.name)}' for model '{spec.name}' has batch size 0")  # Shoal's words
        if batch == 0:
            batch = tensor.shape[0]
        elif tensor.shape[0] != batch:
            raise invalid(
                f"{request_label(request_id)}input '{shown(tensor.name)}' batch size does not match other "
                f"inputs for '{spec.name}'"
            )
    if batch > spec.max_batch_size:
        raise invalid(
            f"{request_label(request_id)}inference request batch-size must be <= {spec.max_batch_size} "
            f"for '{spec.name}'"
        )
    return batch


def _check_input(spec: ModelSpec, tensor_spec: TensorSpec, tensor: Tensor, request_id: str) -> None:
    if (
        tensor.datatype is tensor_spec.datatype
        and (tensor.shape[1:] if spec.max_batch_size > 0 else tensor.shape) == tensor_spec.dims
    ):
        return  # the usual case, exact: every dim fixed and equal (a -1 in dims never equals a size)
    if tensor.datatype is not tensor_spec.datatype:
        raise invalid(
            f"{request_label(request_id)}inference input '{shown(tensor.name)}' data-type is "
            f"'{tensor.datatype.value}', but model '{spec.name}' expects '{tensor_spec.datatype.value}'"
        )
    dims = list(tensor_spec.dims)
    shape = list(tensor.shape)
    batched = spec.max_batch_size > 0
    shape_to_check = shape[1:] if batched else shape
    if len(shape_to_check) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape_to_check, strict=True)):
        expected = [-1, *dims] if batched else dims
        raise invalid(
            f"{request_label(request_id)}unexpected shape for input '{shown(tensor.name)}' for model '{spec.name}'. "
            f"Expected {_dims(expected)}, got {_dims(shape)}. {IMPLICIT_BATCH_NOTE if batched else ''}"
        )


def _requested_outputs(spec: ModelSpec, request: InferRequest) -> tuple[str, ...]:
    if request.requested_outputs is None:
        return spec.output_names
    seen = set()
    for name in request.requested_outputs:
        if spec.output(name) is None:
            raise invalid(f"unexpected inference output '{shown(name)}' for model '{spec.name}'")
        if name in seen:
            raise invalid(f"output '{shown(name)}' is requested twice for model '{spec.name}'")
        seen.add(name)
    return request.requested_outputs


def _check_classifications(spec: ModelSpec, request: InferRequest, outputs: tuple[str, ...]) -> None:
    for name, count in request.class_counts.items():
        tensor_spec = spec.output(name)
        if tensor_spec is None or name not in outputs:
            raise invalid(
                f"classification asked for output '{shown(name)}', which model '{spec.name}' "
                f"does not return for this request; requested outputs are: {list(outputs)}"
            )
        if count < 1:
            raise invalid(
                f"output '{shown(name)}': invalid value for 'classification' parameter, expected > 0, got {count}"
            )
        if not keeps_datatype(spec):  # else checked on the datatype the model gave (``respond``), as Triton
            classification.check_datatype(spec.name, name, tensor_spec.datatype)


def keeps_datatype(spec: ModelSpec) -> bool:
    """Whether the model's outputs keep the datatype they come with, as Triton answers them: a Python
    model's (``outputs_as_returned``), and an ensemble's, whose steps answered them already (its last
    step may be a Python model). Every other model's are held to its config's datatypes."""
    return spec.ensemble is not None or outputs_as_returned(spec.backend)


# Ranking an output for a classification costs up to ~0.15 µs per element, formatting ~0.3 µs per class
# returned: past off_loop.OFF_LOOP_ELEMENTS elements in the outputs to classify, ``finish`` runs off the loop.


def finish_is_costly(prepared: Prepared, results: Mapping[str, np.ndarray]) -> bool:
    """Whether ``respond`` would hold the event loop for long: a classification of a wide output."""
    classified = sum(np.size(results[name]) for name in prepared.class_counts if name in results)
    return off_loop.costly(elements=classified)


def finish(spec: ModelSpec, prepared: Prepared, results: Mapping[str, np.ndarray]) -> tuple[Tensor, ...]:
    """Turn backend results into response tensors, each checked against the config's datatype and
    dims (``checked_output``); an output requested as a classification becomes its top classes per
    batch row (BYTES)."""
    return respond(spec, prepared, output_check(spec, prepared)(results))


def output_check(spec: ModelSpec, prepared: Prepared) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
    """One request's outputs, each through ``checked_output``: what the scheduler applies to the
    request's part before it counts the request (a failure, when the model broke its config)."""
    own_datatype = keeps_datatype(spec)

    def check(results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        found = {}
        for name in prepared.outputs:
            tensor_spec = spec.output(name)
            assert tensor_spec is not None
            if name not in results:
                # Only a Python model's response lacks one (the batch's feed runner refuses a feed model's
                # that does): it is answered with the outputs it has, as Triton answers it.
                continue
            data = checked_output(spec, tensor_spec, np.asarray(results[name]), prepared.batch_size, own_datatype)
            if own_datatype and name in prepared.class_counts:  # ranked by the datatype the model gave it
                classification.check_datatype(spec.name, name, _datatype_of(data))
            found[name] = data
        return found

    return check


def respond(spec: ModelSpec, prepared: Prepared, checked: Mapping[str, np.ndarray]) -> tuple[Tensor, ...]:
    """Response tensors of outputs ``output_check`` passed; classifications become their top classes."""
    tensors = []
    for name in prepared.outputs:
        tensor_spec = spec.output(name)
        assert tensor_spec is not None
        data = checked.get(name)
        if data is None:  # a Python model's response without it (``output_check``)
            continue
        # The config's datatype, which ``checked_output`` held the data to, or a Python model's own.
        wanted = tensor_spec.datatype
        datatype = (
            wanted if data.dtype is wanted.numpy_dtype or data.dtype == wanted.numpy_dtype else _datatype_of(data)
        )
        count = prepared.class_counts.get(name)
        if count is None:
            tensors.append(Tensor(name, datatype, tuple(data.shape), data))
            continue
        batched = spec.max_batch_size > 0
        classes = classification.top_k(data, datatype, count, batched, tensor_spec.labels)
        tensors.append(Tensor(name, DataType.BYTES, tuple(classes.shape), classes))
    return tuple(tensors)


def checked_output(
    spec: ModelSpec, tensor_spec: TensorSpec, data: np.ndarray, batch_size: int, own_datatype: bool = False
) -> np.ndarray:
    """An output as the model returned it, refused (INTERNAL: the model broke its config, not the
    client) unless its datatype is the config's and its shape the config's dims, ``-1`` matching any
    size, after the request's own batch size when the model batches; with ``reshape`` the model's
    shape is the reshape's (or already the dims'), and the answer's the dims'. Every backend and
    instance kind, and every ensemble step, answers through here, so a model that returns [3,7] for
    dims [4] fails its request instead of sending it on; these are the words of Triton's TensorFlow
    and PyTorch backends. ``own_datatype`` (a Python model's, ``outputs_as_returned``): the output
    keeps the datatype the model gave it, as Triton's Python backend answers (an INT64 array for an
    output declared INT32 answers INT64: the datatype travels with the data, so a client reads the
    model's numbers, never bytes reinterpreted); strings become BYTES' object arrays."""
    name = tensor_spec.name
    if data.dtype is tensor_spec.datatype.numpy_dtype and data.shape == (
        (batch_size, *tensor_spec.dims) if spec.max_batch_size > 0 else tensor_spec.dims
    ):
        return data  # the usual case, exact: the config's dtype object and every dim equal (-1 never equals)
    if own_datatype:
        if data.dtype.kind in "SU":
            data = data.astype(np.object_)
    elif tensor_spec.datatype is DataType.BYTES:
        if data.dtype.kind not in "OSU":
            raise _unexpected_datatype(spec, name, data, tensor_spec.datatype)
        data = data.astype(np.object_, copy=False)
    elif data.dtype != tensor_spec.datatype.numpy_dtype:
        raise _unexpected_datatype(spec, name, data, tensor_spec.datatype)
    lead = [batch_size] if spec.max_batch_size > 0 else []
    dims = lead + list(tensor_spec.dims)
    if data.ndim == 0 and not lead and all(d == 1 for d in tensor_spec.dims):
        return data.reshape(dims)  # a scalar for dims of 1s: reported with the dims, as Triton's ORT backend does
    if tensor_spec.reshape is None or _fits(data.shape, dims):
        expected = dims
    else:
        expected = lead + list(tensor_spec.reshape)
    if not _fits(data.shape, expected):
        raise _unexpected_shape(spec, name, expected, data.shape)
    if expected is dims:
        return data
    try:
        return data.reshape(dims)
    except ValueError:  # a -1 numpy cannot infer (no elements)
        raise _unexpected_shape(spec, name, dims, data.shape) from None


def _unexpected_shape(spec: ModelSpec, name: str, expected: list[int], shape: tuple[int, ...]) -> ShoalError:
    return ShoalError(
        ErrorCode.INTERNAL,
        f"unexpected shape for output '{name}' for model '{spec.name}', "
        f"model configuration shape is {_dims(expected)}, inference shape is "
        f"{_dims(shape)}",
    )


def streamed_outputs(spec: ModelSpec, request: InferRequest, arrays: Mapping[str, np.ndarray]) -> tuple[Tensor, ...]:
    """One response of a decoupled model, its outputs checked as ``finish`` checks a reply's (against
    the request's own batch size); an output its config does not list goes on as the model sent it."""
    batch_size = 0
    if spec.max_batch_size > 0:
        shapes = [t.shape for t in request.inputs] + [t.shape for t in request.region_inputs]
        batch_size = shapes[0][0] if shapes and shapes[0] else 0
    outputs = []
    own_datatype = keeps_datatype(spec)
    for name, array in arrays.items():
        tensor_spec = spec.output(name)
        if tensor_spec is None:
            outputs.append(Tensor(name, DataType.from_numpy(array.dtype), tuple(array.shape), array))
            continue
        data = checked_output(spec, tensor_spec, np.asarray(array), batch_size, own_datatype)
        datatype = tensor_spec.datatype if data.dtype == tensor_spec.datatype.numpy_dtype else _datatype_of(data)
        outputs.append(Tensor(name, datatype, tuple(data.shape), data))
    return tuple(outputs)


def _datatype_of(data: np.ndarray) -> DataType:
    try:
        return DataType.from_numpy(data.dtype)
    except ValueError:  # no Triton datatype (a numpy complex): the model broke more than its config
        raise ShoalError(ErrorCode.INTERNAL, f"an output of numpy dtype {data.dtype} has no Triton datatype") from None


def _fits(shape: tuple[int, ...], expected: list[int]) -> bool:
    return len(shape) == len(expected) and all(e in (-1, s) for e, s in zip(expected, shape, strict=True))


def _unexpected_datatype(spec: ModelSpec, name: str, data: np.ndarray, wanted: DataType) -> ShoalError:
    try:
        returned = DataType.from_numpy(data.dtype).config_name
    except ValueError:  # no Triton datatype at all (a numpy complex, a datetime)
        returned = f"numpy {data.dtype}"
    return ShoalError(
        ErrorCode.INTERNAL,
        f"unexpected datatype {returned} for inference output '{name}' for model "
        f"'{spec.name}', expecting {wanted.config_name}",
    )


def zeros_feed(spec: ModelSpec) -> dict[str, np.ndarray]:
    """A batch-1 feed of zeros (empty BYTES) in the backend's shapes; variable dims become 1."""
    feed = {}
    for tensor in spec.inputs:
        dims = [1 if d == -1 else d for d in (tensor.reshape if tensor.reshape is not None else tensor.dims)]
        shape = ([1] if spec.max_batch_size > 0 else []) + dims
        if tensor.datatype is DataType.BYTES:
            array = np.empty(shape, dtype=object)
            array.reshape(-1)[:] = [b""] * array.size
            feed[tensor.name] = array
        else:
            feed[tensor.name] = np.zeros(shape, dtype=tensor.datatype.numpy_dtype)
    return feed

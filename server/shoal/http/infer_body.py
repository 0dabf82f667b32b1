"""Inference over HTTP: the JSON request and its binary tensor data in, the response out.

Triton's binary tensor data extension: a request body is ``Inference-Header-Content-Length``
bytes of JSON, then the binary data of the inputs that declare ``binary_data_size``, one after
another in input order (each in the raw wire format: little-endian, BYTES as 4-byte length
prefixed elements). A response does the same for the outputs asked for with ``binary_data``
(and those not listed, with the request parameter ``binary_data_output``); the others carry ``data``,
a flat JSON list (BYTES as strings). A request's ``data`` may be flat or nested.

JSON as Triton's rapidjson reads and writes it: ``NaN``, ``Infinity`` and ``-Infinity`` are read
and written (not strict JSON, but what Triton and tritonclient exchange); a number past a double's
range (``1e400``) is refused, not read as infinity. A JSON string holds Unicode: BYTES data goes in
as its UTF-8, and an output whose bytes are not UTF-8 is refused as JSON (binary data carries it).

Two JSON libraries, for cost: orjson (Rust) reads a usual header in under a third of the time ``json``
takes and writes an answer's in a fifteenth (``bench/http_loop.py``); ``json`` reads and writes
what orjson does not as Triton does (``NaN`` and the infinities, integers past 64 bits, a byte order
mark, UTF-16), so whatever orjson refuses, or could read or write otherwise, goes to ``json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from typing import Any

import numpy as np
import orjson

from shoal.core.wire import UnfitContents, region_slice
from shoal.errors import ShoalError, invalid, shown
from shoal.protocol import codec
from shoal.protocol.types import BY_NAME, DataType
from shoal.request_types import EncodedTensor, InferRequest, InferResponse, RegionInput, RegionSlice, Tensor

HEADER_LENGTH = "inference-header-content-length"
# JSON as every answer writes it, without spaces: one encoder for all (``json.dumps`` with any argument
# makes a new one per call, which cost more than encoding a small answer).
COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_DATA_FIELDS = "'data', 'binary_data_size' in 'parameters', 'shared_memory_region' in 'parameters'"
_REGION_KEYS = frozenset(("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"))
_INTEGER = {int}
_BYTES = DataType.BYTES.value
# 19 digits in a row: perhaps an integer past 64 bits, which orjson would read as a double (json
# reads it whole, and Triton refuses it where it wants an integer), so such a header goes to json.
# Found by turning every digit into 0 (a regular expression took 3 µs for a usual header, this 0.4).
_DIGITS_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_NINETEEN_DIGITS = b"0" * 19
# Where json reads a header, a number past a double's range has an exponent of 100 or more or 100
# digits in a row (one of 309 with no exponent; one of 209 with an exponent under 100): a header
# with neither holds no such number and is read as it is; one with either is read checking each number.
# Two scans of the UTF-8 bytes (one regular expression with both took ten times a 4 MB header's parse).
_BIG_EXPONENT = re.compile(rb"[eE]\+?0*[1-9][0-9][0-9]")
_HUNDRED_DIGITS = b"0" * 100


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary data after it, checked as Triton checks the header length."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        length = int(header_length)
    except ValueError:
        raise invalid(
            f"invalid Inference-Header-Content-Length '{shown(header_length)}': expected an integer"
        ) from None
    if not 0 < length <= len(body):
        raise invalid(f"inference header size should be in range (0, {len(body)}), got: {length}")
    view = memoryview(body)
    return body[:length], view[length:]


def infer_request_encoded(
    model: str, version: str, header: bytes, binary: memoryview
) -> tuple[InferRequest, dict[str, bool]]:
    """``infer_request`` for a core that decodes BYTES inputs itself (a front-end worker's ``RemoteCore``):
    binary BYTES inputs go on as ``EncodedTensor``, and the host refuses content that does not fit its
    shape in the same words. A refusal is looked for again by ``infer_request``, decoding everything, so
    it is the one the one-process layout gives, whatever Triton's order of checks (as the gRPC path's
    ``convert.infer_request_encoded``)."""
    try:
        return infer_request(model, version, header, binary, encoded_bytes=True)
    except ShoalError:
        return infer_request(model, version, header, binary)


def infer_request(
    model: str, version: str, header: bytes, binary: memoryview, encoded_bytes: bool = False
) -> tuple[InferRequest, dict[str, bool]]:
    """The core's request, and for each requested output whether it goes back as binary data.
    ``encoded_bytes``: binary BYTES inputs are left as the wire carries them, unchecked."""
    document = _parse_header(header)
    if not isinstance(document, dict):
        raise invalid("Unable to parse 'inputs': the inference request must be a JSON object")
    inputs_json = document.get("inputs")
    if not isinstance(inputs_json, list):
        raise invalid("Unable to parse 'inputs': attempt to access non-existing object member 'inputs'")
    parameters = _object(document.get("parameters", {}), "parameters")
    binary_default = False
    if parameters:  # most requests have none
        binary_default = _boolean(parameters.pop("binary_data_output", False), "binary_data_output")
        _check_reserved(parameters)
        for key, value in parameters.items():  # as Triton's SetTritonParameterFromJsonParameter
            if not isinstance(value, str | int | float):  # bool is an int
                raise invalid(
                    f"parameter '{shown(key)}' has invalid type. It should be either 'int', 'bool', or 'string'."
                )
    _check_bytes_cost(model, inputs_json)
    inputs: list[Tensor] = []
    region_inputs: list[RegionInput] = []
    offset = 0
    labelled = document.get("id", "")  # the request's label in refusals (checked below, in Triton's order)
    unfit = UnfitContents(model, labelled if isinstance(labelled, str) else "")
    for entry in inputs_json:
        tensor, used = _input(unfit, _object(entry, "inputs"), binary[offset:], encoded_bytes)
        offset += used
        if isinstance(tensor, RegionInput):
            region_inputs.append(tensor)
        else:
            inputs.append(tensor)
    if offset != len(binary):
        raise invalid(
            f"the request body holds {len(binary) - offset} bytes of binary data past the inputs that "
            "declare binary_data_size"
        )
    unfit.check()
    outputs_json = document.get("outputs")
    requested, class_counts, output_regions, binary_outputs = _outputs(outputs_json, binary_default)
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise invalid("Unable to parse 'id': expected a string")
    return InferRequest(
        model_name=model,
        model_version=version,
        id=request_id,
        inputs=tuple(inputs),
        requested_outputs=requested,
        parameters=parameters,
        class_counts=class_counts,
        region_inputs=tuple(region_inputs),
        output_regions=output_regions,
    ), binary_outputs


# As the gRPC path (grpc/convert.py check_bytes_cost): a decoded BYTES element costs about 56 bytes of
# Python objects and at least 4 on the wire, so binary BYTES inputs of many short elements are refused
# before decoding unless those objects stay within 4 times their payload or 128 MiB.
BYTES_OBJECT_BYTES = 56
MAX_BYTES_OBJECTS_PER_PAYLOAD = 4
BYTES_OBJECTS_FLOOR = 128 * 2**20


RESERVED_PREFIX = "triton_"  # request parameters Triton keeps for itself


def _check_reserved(parameters: dict[str, Any]) -> None:
    """The parameters Triton's HTTP front end reads itself, in its words: JSON numbers carry any
    integer, so a ``sequence_id`` of 2^64+5 must be refused, not wrapped to sequence 5. Keys that
    start with ``triton_`` are Triton's own, refused over HTTP (Triton 2.51 answers 400 so)."""
    if any(key.startswith(RESERVED_PREFIX) for key in parameters):
        raise invalid(
            f"parameter keys starting with '{RESERVED_PREFIX}' are reserved for Triton usage and should not be "
            "specified."
        )
    for key in ("sequence_start", "sequence_end"):
        if key in parameters and not isinstance(parameters[key], bool):
            raise invalid(f"Unable to parse '{key}': attempt to access JSON non-boolean as boolean")
    for key in ("priority", "timeout"):
        if key in parameters and not _is_uint64(parameters[key]):
            raise invalid(f"Unable to parse '{key}': attempt to access JSON non-unsigned-integer as unsigned-integer")
    sequence_id = parameters.get("sequence_id", "")
    if not isinstance(sequence_id, str) and not _is_uint64(sequence_id):
        raise invalid("Unable to parse 'sequence_id': attempt to access JSON non-string as string")


def _is_uint64(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64  # not a bool, not 5.0


def _parse_header(header: bytes | str) -> Any:
    """The JSON header, read as Triton's rapidjson reads it: ``NaN`` and both infinities are read, and
    a number past a double's range is refused (where Python would read it as infinity), wherever it
    is in the document, read or not.

    The usual header (UTF-8, no 19-digit run) is read by orjson, which refuses everything it does not
    read as ``json`` does (``NaN``, a number past a double's range, a lone surrogate, a byte order mark,
    nesting past 1,024): those are read again by ``json``, whose reading is the reference. (Nesting
    just under 1,024 levels, where json's recursion ran out, is read now, as rapidjson reads it.)"""
    if type(header) is not bytes:
        return _parse_with_json(header)
    digits_as_zeros = header.translate(_DIGITS_AS_ZEROS)
    if _NINETEEN_DIGITS not in digits_as_zeros:
        with contextlib.suppress(orjson.JSONDecodeError):  # else json reads it: its document, or its refusal
            return orjson.loads(header)
    return _parse_with_json(header, digits_as_zeros)


def _parse_with_json(header: bytes | str, digits_as_zeros: bytes | None = None) -> Any:
    """``_parse_header`` by ``json`` alone: the reference reading. Each number is checked only in a
    header that may hold one past a double's range (``_BIG_EXPONENT``, ``_HUNDRED_DIGITS``): any
    argument to ``json.loads`` makes a decoder per call, which costs more than a small header's parse.
    ``digits_as_zeros``: the bytes ``header``'s translation, when ``_parse_header`` made it already."""
    try:
        # As json.loads reads bytes (UTF-8, -16 or -32), decoded once here; looked at as UTF-8.
        if isinstance(header, str):
            text, utf8 = header, header.encode("utf-8", "surrogatepass")
        else:
            encoding = json.detect_encoding(header)
            text = header.decode(encoding, "surrogatepass")
            utf8 = header if encoding == "utf-8" else text.encode("utf-8", "surrogatepass")
        if utf8 is not header or digits_as_zeros is None:
            digits_as_zeros = utf8.translate(_DIGITS_AS_ZEROS)
        if _BIG_EXPONENT.search(utf8) is None and _HUNDRED_DIGITS not in digits_as_zeros:
            return json.loads(text)
        return json.loads(text, parse_float=_double, parse_int=_integer)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise invalid(f"failed to parse the request JSON buffer: {exc}") from None


def _double(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _too_big(text)
    return value


def _integer(text: str) -> int:
    """An integer, refused past a double's range (rapidjson reads one past 64 bits as a double)."""
    if len(text) <= 308:  # under 1e308 (a double ends at ~1.8e308)
        return int(text)
    try:
        value = int(text)  # past 4,300 digits Python refuses to read it (ValueError): far past a double
        float(value)
    except (ValueError, OverflowError):
        raise _too_big(text) from None
    return value


def _too_big(text: str) -> ShoalError:
    return invalid(f"failed to parse the request JSON buffer: Number too big to be stored in double: {shown(text)}")


def _check_bytes_cost(model: str, inputs_json: list[Any]) -> None:
    elements = payload = 0
    for entry in inputs_json:
        if not isinstance(entry, dict) or entry.get("datatype") != _BYTES:
            continue
        parameters, shape = entry.get("parameters"), entry.get("shape")
        size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
        if isinstance(size, int) and size > 0 and isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            elements += min(max(0, math.prod(shape)), size // 4)
            payload += size
    cost = elements * BYTES_OBJECT_BYTES
    allowed = max(BYTES_OBJECTS_FLOOR, MAX_BYTES_OBJECTS_PER_PAYLOAD * payload)
    if cost > allowed:
        raise invalid(
            f"the BYTES inputs of this request for model '{shown(model)}' hold up to {elements} elements in "
            f"{payload} bytes: decoded, they would take about {cost // 2**20} MiB, more than the "
            f"{allowed // 2**20} MiB allowed; send fewer, longer elements, or split the request"
        )


def _boolean(value: Any, what: str) -> bool:
    """A flag that must be a JSON boolean ("false" would be truthy), in Triton's words."""
    if not isinstance(value, bool):
        raise invalid(f"Unable to parse '{what}': attempt to access JSON non-boolean as boolean")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"Unable to parse '{what}': expected a JSON object")
    return value


def _input(
    unfit: UnfitContents, entry: dict[str, Any], binary: memoryview, encoded_bytes: bool = False
) -> tuple[Tensor | RegionInput, int]:
    """One input and the binary bytes it took (binary content that does not fit its shape is noted
    in ``unfit``, binary BYTES left encoded with ``encoded_bytes``)."""
    name, datatype_name, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
    if (
        not isinstance(name, str)
        or not isinstance(datatype_name, str)
        or not isinstance(shape, list)
        or not set(map(type, shape)) <= _INTEGER  # JSON's integers, not its booleans
    ):
        raise invalid(
            "Unable to parse 'inputs': each input needs 'name' and 'datatype' (strings) and 'shape' "
            "(a list of integers)"
        )
    datatype = BY_NAME.get(datatype_name)
    if datatype is None:
        raise invalid(f"input '{shown(name)}': unknown datatype '{shown(datatype_name)}'")
    dims = tuple(shape)
    try:
        codec.check_shape(datatype, dims)
    except codec.WireFormatError as exc:
        raise invalid(f"input '{shown(name)}': {exc}") from None
    parameters = _object(entry.get("parameters", {}), "parameters")
    region = shared_memory_slice(name, parameters)
    in_data, in_binary = "data" in entry, "binary_data_size" in parameters
    if in_data + in_binary + (region is not None) != 1:
        sources = {"data": in_data, "binary_data_size": in_binary, "shared_memory_region": region is not None}
        which = (
            "no field is set"
            if not any(sources.values())
            else "set " + " ".join(f"'{field}'" for field, given in sources.items() if given)
        )  # Triton's words
        raise invalid(f"Input must set only one of the following fields: {_DATA_FIELDS}. But {which}")
    if region is not None:
        return RegionInput(name, datatype, dims, region), 0
    if in_data:
        return Tensor(name, datatype, dims, json_data(name, datatype, dims, entry["data"])), 0
    size = parameters["binary_data_size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise invalid(f"input '{shown(name)}': 'binary_data_size' must be a non-negative integer")
    if size > len(binary):
        raise invalid(f"unexpected size {len(binary)} for binary data of input '{shown(name)}', expecting {size}")
    if encoded_bytes and datatype is DataType.BYTES:
        return EncodedTensor(name, datatype, dims, np.frombuffer(binary[:size], np.uint8)), size
    return Tensor(name, datatype, dims, unfit.decode(name, datatype, dims, binary[:size], shape_checked=True)), size


# numpy kind of the datatype -> kinds of JSON values it takes: integers for floats, never the reverse.
_KINDS_ACCEPTED = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "V": "iuf"}  # V: ml_dtypes' bfloat16


def json_data(name: str, datatype: DataType, shape: tuple[int, ...], data: Any) -> np.ndarray:
    """``data``, flat or nested, as an array of ``shape``; values of the wrong kind are refused
    (a float for an integer type, a number for BYTES), never silently converted. An infinite value
    was written so (``_parse_header`` refuses a number past a double's range)."""
    try:
        values = np.asarray(data)
    except ValueError:
        values = np.asarray(None, dtype=object)  # ragged nesting
    if values.size != math.prod(shape) or values.dtype == object and values.ndim == 0:
        raise invalid(
            f"Unable to parse 'data' of input '{shown(name)}': Shape does not match true shape of 'data' field"
        )
    flat = values.reshape(-1)
    kind = flat.dtype.kind
    if datatype is DataType.BYTES:
        # numpy turns a number among strings into a string ("1"): the JSON values are checked, not its kind
        items = np.asarray(data, dtype=object).reshape(-1).tolist() if flat.size else []
        if not all(type(item) is str for item in items):
            raise invalid(f"Unable to parse 'data' of input '{shown(name)}': BYTES data must be strings")
        array = np.empty(flat.size, dtype=object)
        try:
            array[:] = [item.encode("utf-8") for item in items]
        except UnicodeEncodeError:  # JSON's "\ud800": a lone surrogate has no UTF-8
            raise invalid(
                f"Unable to parse 'data' of input '{shown(name)}': a string is not valid Unicode (a lone surrogate)"
            ) from None
        return array.reshape(shape)
    target = datatype.numpy_dtype
    if target.kind in "iu" and kind in "fO" and flat.size:
        return _large_integers(name, datatype, shape, data)
    if target.kind in "fV" and kind == "O" and flat.size:
        flat, kind = _integers_as_doubles(name, datatype, flat), "f"
    if flat.size and target.kind != "b" and kind in "iuf" and _has_booleans(data):
        kind = "b"  # numpy reads true and false among numbers as 1 and 0: refused as booleans alone are
    if flat.size and kind not in _KINDS_ACCEPTED[target.kind]:
        raise invalid(
            f"Unable to parse 'data' of input '{shown(name)}': expected {datatype.value} values, got {_kind_name(kind)}"
        )
    with np.errstate(over="ignore"):  # a float past the type's range becomes inf: refused below
        converted = flat.astype(target)
    if kind in "iu" and target.kind in "iu" and not np.array_equal(converted, flat):
        raise invalid(f"input '{shown(name)}': a value does not fit {datatype.value}")
    if (
        target.kind in "fV"
        and flat.size
        and not np.array_equal(np.isfinite(converted.astype(np.float64)), np.isfinite(flat.astype(np.float64)))
    ):
        raise invalid(f"input '{shown(name)}': a value does not fit {datatype.value}")
    return converted.reshape(shape)


def _has_booleans(data: Any) -> bool:
    """Whether JSON ``data``, flat or nested, holds a true or false (one scan of each innermost list)."""
    if isinstance(data, list):
        if data and isinstance(data[0], list):
            return any(_has_booleans(item) for item in data)
        return bool in set(map(type, data))
    return type(data) is bool


def _large_integers(name: str, datatype: DataType, shape: tuple[int, ...], data: Any) -> np.ndarray:
    """Integers numpy did not read as integers: past INT64 (UINT64's upper half), or mixed with others."""
    items = np.asarray(data, dtype=object).reshape(-1).tolist()
    if not all(type(item) is int for item in items):
        raise invalid(
            f"Unable to parse 'data' of input '{shown(name)}': expected {datatype.value} values, "
            "got numbers with a fraction or values of mixed types"
        )
    try:
        return np.array(items, dtype=datatype.numpy_dtype).reshape(shape)
    except OverflowError:
        raise invalid(f"input '{shown(name)}': a value does not fit {datatype.value}") from None


def _integers_as_doubles(name: str, datatype: DataType, flat: np.ndarray) -> np.ndarray:
    """Numbers for a float type among which numpy found integers past 64 bits (it keeps them as
    objects): read as doubles, as Triton reads them (none is past a double's range: ``_parse_header``)."""
    items = flat.tolist()
    if not all(type(item) in (int, float) for item in items):  # not a bool, a string or a list
        raise invalid(
            f"Unable to parse 'data' of input '{shown(name)}': expected {datatype.value} values, "
            "got values of mixed types"
        )
    return np.array([float(item) for item in items])


def _kind_name(kind: str) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers with a fraction", "U": "strings"}.get(
        kind, "values of mixed types"
    )


def shared_memory_slice(name: str, parameters: dict[str, Any]) -> RegionSlice | None:
    """Where a tensor's shared-memory parameters place it, checked as Triton's front end does; None
    when it is not in shared memory."""
    if _REGION_KEYS.isdisjoint(parameters):
        return None  # the usual tensor: nothing of shared memory to check
    located = region_slice(
        name,
        parameters.get("shared_memory_region"),
        parameters.get("shared_memory_offset"),
        parameters.get("shared_memory_byte_size"),
    )
    if located is None:
        return None
    # JSON carries any type: the values must be what gRPC's typed parameters guarantee.
    for key, value, kind in (
        ("shared_memory_region", located.region, str),
        ("shared_memory_offset", located.offset, int),
        ("shared_memory_byte_size", located.byte_size, int),
    ):
        if not isinstance(value, kind) or isinstance(value, bool):
            raise invalid(
                f"invalid value type for '{key}' parameter for tensor '{shown(name)}', expected "
                f"{'string' if kind is str else 'integer'}."
            )
    return located


def _outputs(
    outputs_json: Any, binary_default: bool
) -> tuple[tuple[str, ...] | None, dict[str, int], dict[str, RegionSlice], dict[str, bool]]:
    """Requested names, classification counts, shared-memory outputs, and binary choice per output.
    ``"outputs": []`` asks for every output, as no ``outputs`` does (Triton's; gRPC cannot tell them apart)."""
    if outputs_json is None or (isinstance(outputs_json, list) and not outputs_json):
        return None, {}, {}, {"": binary_default}  # "": every output
    if not isinstance(outputs_json, list):
        raise invalid("Unable to parse 'outputs': expected a list")
    names, counts, regions, binary = [], {}, {}, {"": binary_default}
    for entry in outputs_json:
        name = _object(entry, "outputs").get("name")
        if not isinstance(name, str):
            raise invalid("Unable to parse 'outputs': each output needs a 'name' (a string)")
        parameters = _object(entry.get("parameters", {}), "parameters")
        names.append(name)
        # A listed output is JSON unless it asks for binary itself: ``binary_data_output`` is for the
        # outputs not listed (Triton's http_server.cc: CheckBinaryOutputData defaults a listed one to false).
        binary[name] = _boolean(parameters.get("binary_data", False), "binary_data")
        if "shared_memory_region" in parameters:  # as Triton's ValidateOutputParameter
            for conflict in ("classification", "binary_data"):
                if parameters.get(conflict, False) is not False:
                    raise invalid(f"Output can't set both 'shared_memory_region' and '{conflict}'")
        if "classification" in parameters:
            count = parameters["classification"]
            if not isinstance(count, int) or isinstance(count, bool):
                raise invalid(
                    f"output '{shown(name)}': invalid value type for 'classification' parameter, expected an integer"
                )
            if count <= 0:
                raise invalid(
                    f"output '{shown(name)}': invalid value for 'classification' parameter, expected > 0, got {count}"
                )
            counts[name] = count
        if (where := shared_memory_slice(name, parameters)) is not None:
            regions[name] = where
    return tuple(names), counts, regions, binary


def infer_response(response: InferResponse, binary_outputs: dict[str, bool]) -> tuple[bytes, int | None]:
    """The body, and the JSON header's length when binary data follows it (else None)."""
    outputs = []
    chunks: list[bytes] = []
    floats_written = False
    for tensor in response.outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype.value, "shape": list(tensor.shape)}
        if tensor.name in response.in_regions:
            pass  # written into the client's shared memory
        elif binary_outputs.get(tensor.name, binary_outputs[""]):
            # BYTES a front-end worker got encoded by the host go out as they are
            raw = tensor.raw() if isinstance(tensor, EncodedTensor) else codec.to_raw(tensor.datatype, tensor.data)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = _json_values(tensor.decoded() if isinstance(tensor, EncodedTensor) else tensor)
            floats_written = floats_written or tensor.datatype.numpy_dtype.kind in "fV"  # V: bfloat16
        outputs.append(entry)
    document: dict[str, Any] = {"id": response.id} if response.id else {}
    document.update(model_name=response.model_name, model_version=response.model_version, outputs=outputs)
    header = _response_json(document, floats_written)
    if not chunks:
        return header, None
    return b"".join((header, *chunks)), len(header)


def _response_json(document: dict[str, Any], floats_written: bool) -> bytes:
    """The response's JSON: orjson's where it writes what ``json`` would (names, shapes, integers,
    strings), ``json``'s where floats are written (orjson writes ``NaN`` and the infinities as
    ``null``; Triton and ``json`` write them as such) or orjson refuses (an integer past 64 bits, a
    lone surrogate in an id)."""
    if floats_written:
        return COMPACT_JSON.encode(document).encode()
    try:
        return orjson.dumps(document)
    except orjson.JSONEncodeError:  # an integer past 64 bits, a lone surrogate in an id: as json writes them
        return COMPACT_JSON.encode(document).encode()


def _json_values(tensor: Tensor) -> list[Any]:
    flat = tensor.data.reshape(-1)
    if tensor.datatype is DataType.BYTES:
        return _json_strings(tensor.name, flat.tolist())
    if tensor.datatype is DataType.BF16:
        return flat.astype(np.float32).tolist()
    return flat.tolist()


def _json_strings(name: str, values: list[Any]) -> list[str]:
    """BYTES elements as JSON strings, which hold Unicode only: bytes that are not UTF-8 are refused
    rather than changed (Triton writes them raw, which makes the body invalid JSON)."""
    strings = []
    for index, value in enumerate(values):
        if isinstance(value, str):
            strings.append(value)
            continue
        value = codec.element_bytes(value)  # what the binary and gRPC answers carry for it
        try:
            strings.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid(
                f"output '{shown(name)}' holds bytes that are not valid UTF-8 (element {index}), which a JSON "
                'string cannot carry unchanged; ask for it as binary data: "binary_data": true in the '
                "output's parameters (for an output not listed: \"binary_data_output\": true in the request's)"
            ) from None
    return strings

"""The classification extension: an output returned as its top-k classes, as Triton returns it.

For each batch row (the whole tensor when the model does not batch), the row's elements are
flattened, ranked by value (highest first; equal values by index, lowest first) and the first
``k`` become BYTES strings ``"<value>:<index>"``, or ``"<value>:<index>:<label>"`` when the
output's label file has a non-empty line ``index``. The result has shape ``[batch, min(k, n)]``
(``[min(k, n)]`` without batching), n being the elements of one row.

As Triton (server ``src/classification.cc``, ``AddClassResults``): values print as C++
``std::to_string`` does, ``%f`` (six decimals) for floating point and plain decimal for
integers (``nan``, ``-nan``, ``inf`` as glibc prints them). Triton orders equal values with
``std::sort``, which leaves their order (and NaN's place) unspecified; Shoal's order is stable
(lower index first) and NaN ranks last. Triton refuses FP16, BF16, BOOL and BYTES outputs;
Shoal ranks FP16 and BF16 as well (printed as ``%f`` of their value) and refuses BOOL and BYTES
(``check_datatype``), before the request is queued.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shoal.errors import invalid, shown
from shoal.protocol.types import DataType

_FLOATS = frozenset({DataType.FP16, DataType.BF16, DataType.FP32, DataType.FP64})
_INTEGERS = frozenset(
    {
        DataType.UINT8,
        DataType.UINT16,
        DataType.UINT32,
        DataType.UINT64,
        DataType.INT8,
        DataType.INT16,
        DataType.INT32,
        DataType.INT64,
    }
)
_CHUNK = 1 << 14  # entries formatted per C call (a few ms holding the GIL)


def check_datatype(model: str, output: str, datatype: DataType) -> None:
    """Refuse an output that has no order to rank by (Triton's wording, INVALID_ARGUMENT)."""
    if datatype not in _FLOATS and datatype not in _INTEGERS:
        raise invalid(
            f"class result not available for output '{shown(output)}' of model '{model}' due to "
            f"unsupported type '{datatype.value}'"
        )


def top_k(data: np.ndarray, datatype: DataType, count: int, batched: bool, labels: Sequence[bytes] = ()) -> np.ndarray:
    """The ``count`` highest-valued classes of each row of ``data`` as an object array of ``bytes``.

    Ranking is numpy's (a partition of each row, then a sort of the few that remain); the entries
    are formatted by one C-level ``%`` per chunk of them: one f-string per entry made all 2M classes
    of a [2, 1M] output take 2.0-2.4 s (0.8-0.9 s now, on the same machine). Wide outputs are still
    costly: ``lifecycle.request_checks.finish_is_costly`` sends them to a worker thread.
    """
    rows = data.reshape(data.shape[0] if batched else 1, math.prod(data.shape[1:] if batched else data.shape))
    width = min(count, rows.shape[1])
    keys = _descending_keys(rows, datatype)
    order = np.empty((rows.shape[0], width), dtype=np.intp)
    for row_index in range(rows.shape[0]):
        order[row_index] = _first(keys[row_index], width)
    values = np.take_along_axis(rows, order, axis=1).reshape(-1)
    entries = _entries(values, order.reshape(-1), datatype in _FLOATS, labels)
    return entries.reshape(rows.shape[0], width) if batched else entries


def _entries(values: np.ndarray, indexes: np.ndarray, floats: bool, labels: Sequence[bytes]) -> np.ndarray:
    """``b"<value>:<index>[:<label>]"`` for each pair, values as ``std::to_string`` prints them, as an
    object array.

    A chunk at a time: each C call holds the GIL, so a worker thread doing this gives it back to
    the event loop every few milliseconds."""
    entries = np.empty(values.size, dtype=object)
    for start in range(0, values.size, _CHUNK):
        stop = start + _CHUNK
        entries[start:stop] = _chunk_entries(values[start:stop], indexes[start:stop], floats, labels)
    return entries


def _chunk_entries(values: np.ndarray, indexes: np.ndarray, floats: bool, labels: Sequence[bytes]) -> list[bytes]:
    as_float = values.astype(np.float64) if floats else values  # FP16 and BF16 exactly
    pairs: list[float | int] = [0] * (2 * values.size)
    pairs[0::2] = as_float.tolist()  # Python floats, or ints (exact for UINT64 too)
    pairs[1::2] = indexes.tolist()
    text = ((b"%f:%d\n" if floats else b"%d:%d\n") * values.size) % tuple(pairs)
    entries = text.split(b"\n")[:-1]  # neither a number nor an index holds a newline
    if floats:  # glibc's %f keeps a NaN's sign; Python's drops it
        for position in np.flatnonzero(np.isnan(as_float) & np.signbit(as_float)).tolist():
            entries[position] = b"-" + entries[position]
    if labels:
        for position in np.flatnonzero(indexes < len(labels)).tolist():
            label = labels[int(indexes[position])]
            if label:
                entries[position] += b":" + label
    return entries


def _first(keys: np.ndarray, width: int) -> np.ndarray:
    """Indexes of the ``width`` smallest ``keys`` in stable order, without sorting the whole row:
    every key below the width-th smallest, and the lowest indexes among those equal to it."""
    if width == 0:
        return np.empty(0, dtype=np.intp)
    if width < keys.size:
        kth = np.partition(keys, width - 1)[width - 1]
        candidates = np.flatnonzero(~(keys > kth))  # NaN beyond a number stays out; a NaN kth keeps all
    else:
        candidates = np.arange(keys.size)
    order: np.ndarray = candidates[np.argsort(keys[candidates], kind="stable")[:width]]
    return order


def _descending_keys(rows: np.ndarray, datatype: DataType) -> np.ndarray:
    """Keys whose ascending stable sort ranks ``rows`` highest first, equal values by lowest index."""
    if datatype in _INTEGERS:
        # ~x = -x - 1 reverses the order of signed and unsigned alike, without overflow.
        inverted: np.ndarray = np.invert(rows)
        return inverted
    return -rows.astype(np.float64)  # FP16 and BF16 too, exactly; NaN stays NaN and sorts last

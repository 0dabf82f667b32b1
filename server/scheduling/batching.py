"""Concatenate requests into one batch and split the batch's outputs back, row-exact."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from shoal.errors import ErrorCode, ShoalError


def gather(feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One input dict for the batch: each input concatenated along the batch dimension."""
    if len(feeds) == 1:
        return dict(feeds[0])
    return {name: np.concatenate([feed[name] for feed in feeds], axis=0) for name in feeds[0]}


def scatter(
    results: Mapping[str, np.ndarray], sizes: Sequence[int], wanted: Sequence[Sequence[str]]
) -> list[dict[str, np.ndarray]]:
    """Split each output by the requests' batch sizes; request i gets only ``wanted[i]``."""
    if len(sizes) == 1:
        return [{name: results[name] for name in wanted[0]}]
    total = sum(sizes)
    checked = {}
    for name, value in results.items():
        array = np.asarray(value)
        if array.ndim == 0 or array.shape[0] != total:
            raise ShoalError(
                ErrorCode.INTERNAL,
                f"output '{name}' has shape {list(array.shape)}, not a batch of {total} rows",
            )
        checked[name] = array
    parts = []
    start = 0
    for size, names in zip(sizes, wanted, strict=True):  # views of the batch's rows (as np.split, a tenth the cost)
        stop = start + size
        parts.append({name: checked[name][start:stop] for name in names})
        start = stop
    return parts

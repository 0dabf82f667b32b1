"""shoal-load's --input-data values of the wrong kind are a clear InputError (exit 2), never a
traceback, and never converted into something else (a number for BYTES once became that many
zero bytes: 100000000 allocated 100 MB per element)."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.clients.loadtest.inputs import InputError, _from_values
from shoal.protocol.types import DataType


def test_a_string_for_a_numeric_input_is_an_input_error() -> None:
    with pytest.raises(InputError, match="input 'IN'"):
        _from_values("IN", DataType.INT32, ["a"], [1])


@pytest.mark.parametrize("value", [100_000_000, 1.5, None, True])
def test_a_non_string_for_a_bytes_input_is_an_input_error(value: object) -> None:
    with pytest.raises(InputError, match="input 'IN'.*strings"):
        _from_values("IN", DataType.BYTES, ["ok", value], [2])


def test_good_values_still_load() -> None:
    assert _from_values("IN", DataType.BYTES, ["a", "bc"], [1, 2]).tolist() == [[b"a", b"bc"]]
    assert _from_values("IN", DataType.FP32, [1, 2.5], [2]).tolist() == [1.0, 2.5]
    assert _from_values("IN", DataType.INT32, [[1, 2]], [2, 2]).dtype == np.int32  # one sample, repeated

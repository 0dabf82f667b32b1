"""Plain types both sides of the protocol share: datatypes and the metadata the server reports.

The server builds them and the client library reads them; numpy dtypes for each protocol
datatype live here too, since the wire codec (``shoal.protocol.codec``) needs them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


class DataType(enum.Enum):
    """A tensor datatype: value is the protocol name (``FP32``); ``config_name`` the config's."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"
    BYTES = "BYTES"
    BF16 = "BF16"

    # Members are singletons compared by identity, so identity hashing is consistent with equality; Enum's
    # own __hash__ is Python code (hash of the name), and every request looks datatypes up in dicts.
    __hash__ = object.__hash__

    @property
    def config_name(self) -> str:
        """``TYPE_*`` spelling used in config.pbtxt (BYTES is ``TYPE_STRING`` there)."""
        return "TYPE_STRING" if self is DataType.BYTES else f"TYPE_{self.value}"

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return _NUMPY[self]

    @property
    def item_size(self) -> int:
        """Bytes per element; 0 for BYTES, whose elements vary in length."""
        return 0 if self is DataType.BYTES else self.numpy_dtype.itemsize

    @classmethod
    def from_config_name(cls, name: str) -> DataType:
        if name == "TYPE_STRING":
            return cls.BYTES
        if name.startswith("TYPE_") and name[5:] in cls.__members__:
            return cls[name[5:]]
        raise ValueError(f"unsupported data type {name}")

    @classmethod
    def from_numpy(cls, dtype: np.dtype[Any]) -> DataType:
        found = _FROM_NUMPY.get(dtype)  # the usual case, once per output; equal dtypes hash alike
        if found is not None:
            return found
        for datatype, candidate in _NUMPY.items():
            if candidate == dtype:
                return datatype
        if dtype.kind in "OSU":
            return cls.BYTES
        raise ValueError(f"no protocol datatype for numpy dtype {dtype}")


_NUMPY: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.BYTES: np.dtype(np.object_),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
}
_FROM_NUMPY: dict[np.dtype[Any], DataType] = {dtype: datatype for datatype, dtype in _NUMPY.items()}
# Each datatype by its protocol name: a dict lookup, where ``DataType(name)`` runs Enum's Python code per call.
BY_NAME: dict[str, DataType] = {datatype.value: datatype for datatype in DataType}


@dataclass(frozen=True)
class TensorMetadata:
    name: str
    datatype: str  # protocol name, e.g. "FP32"
    shape: tuple[int, ...]  # -1 for variable dimensions (and the batch dimension)


@dataclass(frozen=True)
class ModelMetadata:
    """What ModelMetadata answers; the server builds it, the clients read it."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]

"""What both transports read off the wire the same way: tensor content as the wire carries it,
decoded with Triton's messages for content that does not fit its shape (the host uses it too, for
shared-memory regions), and the model files a load may send."""

from __future__ import annotations

import numpy as np

from shoal.errors import invalid, poll_failed, request_label, shown
from shoal.protocol import codec
from shoal.protocol.types import DataType
from shoal.repository.scanner import MAX_NAME_BYTES
from shoal.request_types import RegionSlice


def decode_raw(
    name: str,
    datatype: DataType,
    shape: tuple[int, ...],
    raw: bytes | memoryview,
    model: str = "",
    request_id: str = "",
) -> np.ndarray:
    """Raw content as an array; a size that does not fit the shape is refused in Triton's words."""
    unfit = UnfitContents(model, request_id)
    data = unfit.decode(name, datatype, shape, raw)
    unfit.check()
    return data


class UnfitContents:
    """Content that does not fit its shape, refused as Triton's core refuses it: once the front end
    has read every input (its own errors, such as an input without data, come first), naming the
    input Triton's checks reach first. Triton walks a request's inputs in its map's order, which was
    the reverse of the request's in every order of two to four inputs tried on Triton 2.51: so the
    last unfit input noted is the one refused."""

    def __init__(self, model: str, request_id: str = "") -> None:
        self.model, self.request_id = model, request_id
        # The message, not an exception: one kept here would hold its context's traceback, whose frames
        # hold the request's payload, in a cycle through this object (freed only by the cyclic collector).
        self._refusal = ""

    def decode(
        self,
        name: str,
        datatype: DataType,
        shape: tuple[int, ...],
        raw: bytes | memoryview,
        shape_checked: bool = False,
    ) -> np.ndarray:
        """Raw content as an array; when it does not fit, noted, and an empty stand-in returned
        (``shape_checked``: see ``codec.from_raw``)."""
        try:
            return codec.from_raw(datatype, shape, raw, shape_checked)
        except codec.WireFormatError as exc:
            self.note(name, exc)
            return np.empty(0, dtype=datatype.numpy_dtype)

    def note(self, name: str, exc: codec.WireFormatError) -> None:
        self._refusal = content_error(name, self.model, exc, self.request_id)

    def check(self) -> None:
        """Refuse the request if any of its contents did not fit."""
        if self._refusal:
            raise invalid(self._refusal)


def refuse_model_files(model: str, keys: list[str]) -> None:
    """A load's ``file:<path>`` parameters, refused: Shoal loads no model files sent with a request.
    One whose path has a part longer than a file name can be is INTERNAL, in Triton's words (its
    model-control example asserts them: Triton cannot write that file into the repository)."""
    files = [key for key in keys if key.startswith("file:")]
    for key in files:
        if any(len(part.encode()) > MAX_NAME_BYTES for part in key.removeprefix("file:").split("/")):
            raise poll_failed(
                model,
                f"a part of the path of load parameter '{shown(key)}' is longer than {MAX_NAME_BYTES} bytes (NAME_MAX)",
            )
    if files:
        raise invalid(f"loading model files sent with the request ({shown(files[0])}) is not supported")


def content_error(name: str, model: str, exc: codec.WireFormatError, request_id: str = "") -> str:
    """Triton's message for tensor content that does not fit its shape (core infer_request.cc
    ``Normalize`` and ``ValidateBytesInputs``, led by the request's label); Shoal's own for the cases
    Triton has none."""
    name, model, label = shown(name), shown(model), request_label(request_id)
    where = f"for inference input '{name}' for model '{model}'"
    if isinstance(exc, codec.ByteSizeMismatch):
        return (
            f"{label}input byte size mismatch for input '{name}' for model '{model}'. "
            f"Expected {exc.expected}, got {exc.got}"
        )
    if isinstance(exc, codec.StringCountMismatch):
        if exc.too_many:
            return f"{label}unexpected number of string elements {exc.got} {where}, expecting {exc.expected}"
        return f"{label}expected {exc.expected} string elements {where}, got {exc.got}"
    if isinstance(exc, codec.IncompleteLengthPrefix):
        return (
            f"{label}incomplete string length indicator {where}, expecting 4 bytes but only {exc.available} "
            "bytes available. Please make sure the string length indicator is in one buffer."
        )
    return f"input '{name}' for model '{model}': {exc}"


def region_slice(name: str, region: str | None, offset: int | None, byte_size: int | None) -> RegionSlice | None:
    """Where a tensor's shared-memory parameters (already read from either transport) place it, with
    Triton's front-end rules and messages; None when the tensor is not in shared memory."""
    if region is None:
        for key, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", byte_size)):
            if value is not None:
                raise invalid(
                    f"'{key}' can not be specified without 'shared_memory_region' parameter for tensor '{shown(name)}'"
                )
        return None
    if byte_size is None:
        raise invalid(
            f"'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter "
            f"for tensor '{shown(name)}'"
        )
    return RegionSlice(region, offset or 0, byte_size)

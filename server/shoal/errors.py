"""Shoal's errors: one closed set of codes that knows nothing of transports.

Exception tree::

    ShoalError(code, message)
      raised with an ErrorCode:
        INVALID_ARGUMENT   bad request: shape, datatype, missing/extra tensor, bad sizes
        NOT_FOUND          unknown requested output and other missing named things
        MODEL_NOT_FOUND    unknown model or version, or none ready (Triton's wording; gRPC NOT_FOUND, HTTP 404)
        UNAVAILABLE        a model that is not ready, unloading, or a server shutting down
        UNSUPPORTED        a feature Shoal does not implement
        ALREADY_EXISTS     a name that is taken
        INTERNAL           a backend failed while executing; a load not read from the repository
        LOAD_FAILED        a model could not be loaded (config, model file, device); a load that
                           ends so is answered INVALID_ARGUMENT, as Triton's (lifecycle.manager)
        PERMISSION_DENIED  a restricted call without the configured header (gRPC: UNAVAILABLE, as Triton)
      DecoupledRefused     a one-response call (ModelInfer, HTTP infer) to a decoupled model: UNSUPPORTED,
                           told apart by type so each transport words it as Triton does
    StartupError(message)  the server cannot start (a port in use): a clear line and exit 1

Each transport maps every code to its status in one table (server/shoal/grpc/status.py,
server/shoal/http/status.py).

An unexpected exception (a bug, not one of the codes) reaches a client only as ``internal_error``'s
generic message with an incident id; its type, text and traceback are in the log under that id.

Messages go back to clients in a header (grpc's ``grpc-message`` trailer, under a metadata
limit of a few KiB), so names a client sent are echoed shortened (``shown``) and a whole
message is cut to ``MAX_MESSAGE_BYTES`` (``bounded``) on its way out.
"""

from __future__ import annotations

import enum
import logging
import secrets
from typing import ClassVar

logger = logging.getLogger(__name__)

MAX_ECHO_CHARS = 200  # of a name or other text a client sent, quoted back in a message
# UTF-8 bytes of a message sent back; percent-encoding in the trailer can triple it.
MAX_MESSAGE_BYTES = 2048


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    UNAVAILABLE = "unavailable"
    UNSUPPORTED = "unsupported"
    ALREADY_EXISTS = "already_exists"
    INTERNAL = "internal"
    LOAD_FAILED = "load_failed"
    PERMISSION_DENIED = "permission_denied"


class ShoalError(Exception):
    """An error with a code from the closed set above and a message for the caller.

    ``kind`` names a subclass a caller tells apart by type; it crosses a process boundary (a front-end
    worker's channel) with the code and message, and ``rebuilt`` makes the same subclass again there."""

    kind: ClassVar[str] = ""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Triton's words (grpc infer_handler.cc) for a one-response inference of a decoupled model.
GRPC_DECOUPLED_REFUSED = "ModelInfer RPC doesn't support models with decoupled transaction policy"


class DecoupledRefused(ShoalError):
    """A call that wants one response (gRPC ModelInfer, HTTP infer) to a decoupled model, whose responses
    stream. Triton words it per endpoint; the message is its gRPC words, the HTTP front end uses its own."""

    kind = "decoupled_refused"

    def __init__(self, message: str = GRPC_DECOUPLED_REFUSED) -> None:
        super().__init__(ErrorCode.UNSUPPORTED, message)


_KINDS: dict[str, type[DecoupledRefused]] = {DecoupledRefused.kind: DecoupledRefused}


def rebuilt(code: str, message: str, kind: str = "") -> ShoalError:
    """The error another process sent as its code's value, message and ``kind``: of the same subclass."""
    subclass = _KINDS.get(kind)
    return subclass(message) if subclass is not None else ShoalError(ErrorCode(code), message)


class StartupError(Exception):
    """The server cannot start as asked; the message says why, for the command line."""


def shown(text: str) -> str:
    """Client input to quote in a message: whole when short, else its start and its length."""
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return f"{text[:MAX_ECHO_CHARS]}...({len(text)} characters)"


def request_label(request_id: str) -> str:
    """How Triton's core begins its refusals of a request's inputs (``InferenceRequest::LogRequest``, run
    here on Triton 2.51: every check of its ``Normalize``), so a client or a log reader sees which request."""
    return f"[request id: {shown(request_id) if request_id else '<id_unknown>'}] "


def valid_utf8(text: str) -> str:
    """``text`` as a wire may carry it: a lone surrogate (a non-UTF-8 file name decodes so, with
    ``surrogateescape``) becomes ``?``; protobuf cannot encode it, and JSON parsers refuse it."""
    return text if text.isascii() else text.encode("utf-8", errors="replace").decode("utf-8")


def bounded(message: str) -> str:
    """``message`` as a status may carry it: valid UTF-8 (a lone surrogate, as a non-UTF-8 file name
    decodes with ``surrogateescape``, becomes ``?``: no engine could encode it, and a gRPC status it
    failed to send left the call unanswered), cut to ``MAX_MESSAGE_BYTES``, saying so."""
    message = valid_utf8(message)
    encoded = message.encode("utf-8")
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return message
    suffix = f"...(message truncated, {len(encoded)} bytes)"
    return encoded[: MAX_MESSAGE_BYTES - len(suffix)].decode("utf-8", errors="ignore") + suffix


def internal_error(exc: BaseException, while_doing: str) -> str:
    """An unexpected error's answer for the client: generic, with an incident id it can quote; the
    detail (type, message, traceback) goes to the log under the same id, never to the client."""
    incident = secrets.token_hex(6)
    logger.error("unexpected error while %s (incident %s)", while_doing, incident, exc_info=exc)
    return f"internal error (incident {incident}): the server's log has the detail"


def invalid(message: str) -> ShoalError:
    return ShoalError(ErrorCode.INVALID_ARGUMENT, message)


def load_failed(message: str) -> ShoalError:
    return ShoalError(ErrorCode.LOAD_FAILED, message)


def poll_failed(model: str, why: str) -> ShoalError:
    """Triton's answer to a load it could not even read from the repository (core
    model_repository_manager.cc ``LoadModel``: a missing folder, a file override it cannot write):
    INTERNAL, in its words, which clients match; Shoal adds why after them."""
    return ShoalError(
        ErrorCode.INTERNAL, f"failed to load '{shown(model)}', failed to poll from model repository: {why}"
    )


def unsupported(what: str) -> ShoalError:
    return ShoalError(ErrorCode.UNSUPPORTED, f"{what} is not supported by this server")


def unknown_model(name: str, version: str = "") -> ShoalError:
    """Triton's wording, which tritonclient users match on (NOT_FOUND over gRPC, 404 over HTTP, as Triton 2.51)."""
    name, version = shown(name), shown(version)
    if version:
        return ShoalError(
            ErrorCode.MODEL_NOT_FOUND, f"Request for unknown model: '{name}' version {version} is not found"
        )
    return ShoalError(ErrorCode.MODEL_NOT_FOUND, f"Request for unknown model: '{name}' is not found")

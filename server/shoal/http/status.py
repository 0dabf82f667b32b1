"""THE table from Shoal's error codes to HTTP status, and Triton's JSON error body.

Triton's HTTP front end (server src/http_server.cc ``HttpCodeFromError``) answers most errors with
400 and a body ``{"error": "..."}``; an unknown model is 404, a server or model that cannot serve
now 503, an internal failure 500, an unsupported feature 501. Errors of the transport itself
(an unknown path, a wrong method, a body too large, an encoding it cannot read) are
``HttpError`` with their own status.
"""

from __future__ import annotations

import json

from shoal.errors import ErrorCode, ShoalError, bounded, internal_error

STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,  # a shared-memory region
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.INTERNAL: 500,
    ErrorCode.LOAD_FAILED: 400,
    ErrorCode.PERMISSION_DENIED: 403,
}


class HttpError(Exception):
    """A request the HTTP layer refuses before any core call: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def to_http(exc: BaseException) -> tuple[int, str]:
    """Status and a bounded message for any exception; unexpected ones are logged once with traceback."""
    if isinstance(exc, HttpError):
        return exc.status, bounded(exc.message)
    if isinstance(exc, ShoalError):
        return STATUS_BY_CODE[exc.code], bounded(exc.message)
    return 500, internal_error(exc, "serving an HTTP request")


def error_body(message: str) -> bytes:
    """Triton's error body."""
    return json.dumps({"error": message}, separators=(",", ":")).encode()

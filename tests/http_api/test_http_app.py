"""Every HTTP route runs under the one guard and the restriction check: called in process, over a
core whose every call fails, each answers Triton's error body with the status from the one table.

(The endpoints' behaviour is tested against real servers in test_http.py and test_http_errors.py;
this checks the property over the whole route table, which no list of requests can keep up with.)
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from shoal.errors import ErrorCode, ShoalError
from shoal.http.app import HttpApp
from shoal.http.handlers import ROUTES
from shoal.http.status import STATUS_BY_CODE
from shoal.settings import RESTRICTION_CATEGORIES, Restriction


def _body(path: str) -> bytes:
    """A body each POST route accepts, so the call reaches the core."""
    if path.endswith("/infer"):
        return b'{"inputs": []}'
    if path.startswith("/v2/cudasharedmemory") and path.endswith("/register"):
        return b'{"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 8}'
    if path.endswith("/register"):
        return b'{"key": "/k", "offset": 0, "byte_size": 8}'
    return b"{}"


class FailingCore:
    """A ``Core`` whose every call raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise self.error

        return call


def _concrete(pattern: re.Pattern[str]) -> str:
    """A path the pattern matches, every named part filled in."""
    path = re.sub(r"\(\?:/versions/\(\?P<version>\[0-9\]\+\)\)\?", "/versions/1", pattern.pattern)
    path = re.sub(r"\(\?:/region/\(\?P<region>\[\^/\]\+\)\)\?", "/region/r", path)
    path = re.sub(r"\(\?P<(\w+)>\[\^/\]\+\)", lambda m: m[1], path)
    assert pattern.fullmatch(path), (pattern.pattern, path)
    return path


def _request(
    app: HttpApp, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    answer = asyncio.run(app.respond(method, path, {k.lower(): v for k, v in (headers or {}).items()}, body, 0))
    assert answer.content_type == "application/json"
    return answer.status, json.loads(answer.body)


CASES = [(pattern, method) for pattern, methods, _, _ in ROUTES for method in sorted(methods)]


@pytest.mark.parametrize(("pattern", "method"), CASES, ids=[f"{m} {p.pattern}" for p, m in CASES])
def test_an_unexpected_error_is_500_with_triton_s_body(
    pattern: re.Pattern[str], method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The client gets a generic message and an incident id; the detail is in the log under that id."""
    core = FailingCore(RuntimeError("boom"))
    path = _concrete(pattern)
    status, body = _request(HttpApp(core, 1 << 20), method, path, _body(path))
    assert core.calls  # every route asks the core
    incident = re.fullmatch(
        r"internal error \(incident ([0-9a-f]{12})\): the server's log has the detail", body["error"]
    )
    assert status == 500 and incident is not None and "boom" not in body["error"], body
    logged = [r for r in caplog.records if incident.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info is not None and "boom" in str(logged[0].exc_info[1])


@pytest.mark.parametrize("code", list(ErrorCode))
def test_each_error_code_has_its_status(code: ErrorCode) -> None:
    core = FailingCore(ShoalError(code, "why"))
    assert _request(HttpApp(core, 1 << 20), "GET", "/v2/models/m/config") == (STATUS_BY_CODE[code], {"error": "why"})


@pytest.mark.parametrize(
    ("pattern", "method", "category"), [(p, m, c) for p, methods, _, c in ROUTES for m in sorted(methods)]
)
def test_every_route_is_in_a_restriction_category(pattern: re.Pattern[str], method: str, category: str) -> None:
    assert category in RESTRICTION_CATEGORIES
    core = FailingCore(RuntimeError("never called"))
    app = HttpApp(core, 1 << 20, (Restriction(frozenset({category}), "k", "v"),))
    assert _request(app, method, _concrete(pattern), _body(_concrete(pattern))) == (
        403,
        {"error": "This API is restricted, expecting header 'k'"},
    )
    assert core.calls == []


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        ("gzip", "gzip"),
        ("deflate;q=0, gzip", "gzip"),
        ("gzip;q=0, deflate", "deflate"),
        ("gzip;q=0.0", None),
        ("identity", None),
        ("br, deflate;q=0.5", "deflate"),
        ("gzip;q=abc", None),
        ("GZIP ; q=1", "gzip"),
    ],
)
def test_accept_encoding_weights(accept: str, chosen: str | None) -> None:
    from shoal.http.app import _accepted_encoding

    assert _accepted_encoding(accept) == chosen

"""The thin handlers: JSON in on the first line, one core call, JSON out on the last.

One handler per endpoint of Triton's HTTP API; ``ROUTES`` says which path and method reach it and
which ``--http-restricted-api`` category it is in. ``http.app`` runs each under the error guard.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from shoal import off_loop
from shoal.core import Core
from shoal.errors import DecoupledRefused
from shoal.http import convert, infer_body
from shoal.http.status import HttpError
from shoal.protocol.types import DataType
from shoal.repository import config_json
from shoal.request_types import EncodedTensor, InferResponse
from shoal.tracing.trace import Origin

# Past off_loop's thresholds (body bytes, or answer elements that cost Python work each: BYTES, JSON
# values), decoding and encoding run on a worker thread, off the event loop.
#
# Request and Reply (and http.app's Answer) live for one request on the loop and are never shared:
# plain slotted classes, made in 0.35 µs where a frozen dataclass took 0.9 (``object.__setattr__``
# per field), three per request.


@dataclass(slots=True)
class Request:
    path: dict[str, str]  # the path's named parts: model, version, region
    headers: dict[str, str]  # lower-case names
    body: bytes
    # The core decodes BYTES inputs itself (a front-end worker's RemoteCore): binary ones are left encoded.
    encoded_bytes: bool = False
    started_ns: int = 0  # time.monotonic_ns() when its head was read: a trace's HTTP_RECV_START


@dataclass(slots=True)
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    # Only a successful inference answer may be compressed (Triton's http_server.cc compresses nothing
    # else): tritonclient reads every other answer as it comes, and aiohttp asks for gzip on its own.
    compressible: bool = False
    trace_id: int = 0  # a traced inference's: the app reports its send to the core (``Core.sent``)


def _json(document: Any) -> Reply:
    return Reply(body=infer_body.COMPACT_JSON.encode(document).encode())


def _flag(value: bool, message: str) -> Reply:
    """Health and readiness: 200 with no body, or Triton's 400 with a reason."""
    if value:
        return Reply(content_type="text/plain")
    raise HttpError(400, message)


def _model(request: Request) -> tuple[str, str]:
    return request.path["model"], request.path.get("version") or ""


async def live(core: Core, request: Request) -> Reply:
    return _flag(await core.live(), "Server is not live")


async def ready(core: Core, request: Request) -> Reply:
    return _flag(await core.ready(), "Server is not ready")


async def server_metadata(core: Core, request: Request) -> Reply:
    return _json(convert.server_metadata(await core.server_metadata()))


async def model_metadata(core: Core, request: Request) -> Reply:
    return _json(convert.model_metadata(await core.model_metadata(*_model(request))))


async def model_ready(core: Core, request: Request) -> Reply:
    return _flag(await core.model_ready(*_model(request)), "Model version not ready")


async def model_config(core: Core, request: Request) -> Reply:
    return _json(config_json.model_config(await core.model_config(*_model(request))))


async def model_statistics(core: Core, request: Request) -> Reply:
    name, version = (request.path.get("model") or "", request.path.get("version") or "")
    return _json(convert.model_statistics(await core.model_statistics(name, version)))


async def infer(core: Core, request: Request) -> Reply:
    """Decoding and encoding run off the loop for large bodies, as the gRPC path does."""
    headers = request.headers
    origin = Origin(
        "HTTP", time.monotonic_ns(), headers.get("traceparent", ""), headers.get("tracestate", ""), request.started_ns
    )
    header, binary = infer_body.split_body(request.body, request.headers.get(infer_body.HEADER_LENGTH))
    costly = off_loop.costly(len(request.body))
    convert_request = infer_body.infer_request_encoded if request.encoded_bytes else infer_body.infer_request
    if costly:
        inference, binary_outputs = await asyncio.to_thread(convert_request, *_model(request), header, binary)
    else:  # called here, not through a coroutine: the usual request pays for none
        inference, binary_outputs = convert_request(*_model(request), header, binary)
    try:
        response = await core.infer(inference, origin)
    except DecoupledRefused:  # in Triton's HTTP words (http_server.cc)
        raise DecoupledRefused("HTTP end point doesn't support models with decoupled transaction policy") from None
    try:
        if costly or _costly_answer(response, binary_outputs):
            body, header_length = await asyncio.to_thread(infer_body.infer_response, response, binary_outputs)
        else:
            body, header_length = infer_body.infer_response(response, binary_outputs)
    except BaseException:
        if response.trace_id:  # its answer is an error now: the trace ends without the response's send
            core.sent(response.trace_id, 0, 0)
        raise
    if header_length is None:
        return Reply(body=body, compressible=True, trace_id=response.trace_id)
    return Reply(
        body=body,
        content_type="application/octet-stream",
        headers={"inference-header-content-length": str(header_length)},
        compressible=True,
        trace_id=response.trace_id,
    )


def _costly_answer(response: InferResponse, binary_outputs: dict[str, bool]) -> bool:
    """Many bytes, or many elements that cost Python work each: BYTES, and every value sent as JSON
    (~0.6 µs each: 1 MiB of FP32 as a JSON list took ~0.15 s)."""
    per_element = sum(
        t.data.size
        for t in response.outputs
        if (t.name not in response.in_regions and not binary_outputs.get(t.name, binary_outputs[""]))
        or (t.datatype is DataType.BYTES and not isinstance(t, EncodedTensor))
    )
    return off_loop.costly(sum(t.data.nbytes for t in response.outputs), per_element)


async def repository_index(core: Core, request: Request) -> Reply:
    ready_only = convert.index_ready_only(convert.parse_object(request.body, "repository index"))
    return _json(convert.repository_index(await core.repository_index(ready_only=ready_only)))


async def load(core: Core, request: Request) -> Reply:
    name = request.path["model"]
    await core.load_model(name, convert.load_config(name, convert.parse_object(request.body, "load")))
    return Reply()


async def unload(core: Core, request: Request) -> Reply:
    body = convert.parse_object(request.body, "unload")
    await core.unload_model(request.path["model"], convert.unload_dependents(body))
    return Reply()


async def shared_memory_status(core: Core, request: Request) -> Reply:
    regions = await core.system_shared_memory_status(request.path.get("region") or "")
    return _json(convert.shared_memory_status(regions))


async def shared_memory_register(core: Core, request: Request) -> Reply:
    key, offset, byte_size = convert.shared_memory_register(convert.parse_object(request.body, "register"))
    await core.register_system_shared_memory(request.path["region"], key, offset, byte_size)
    return Reply()


async def shared_memory_unregister(core: Core, request: Request) -> Reply:
    await core.unregister_system_shared_memory(request.path.get("region") or "")
    return Reply()


async def cuda_shared_memory_status(core: Core, request: Request) -> Reply:
    regions = await core.cuda_shared_memory_status(request.path.get("region") or "")
    return _json(convert.cuda_shared_memory_status(regions))


async def cuda_shared_memory_register(core: Core, request: Request) -> Reply:
    raw_handle, device_id, byte_size = convert.cuda_shared_memory_register(
        convert.parse_object(request.body, "register")
    )
    await core.register_cuda_shared_memory(request.path["region"], raw_handle, device_id, byte_size)
    return Reply()


async def cuda_shared_memory_unregister(core: Core, request: Request) -> Reply:
    await core.unregister_cuda_shared_memory(request.path.get("region") or "")
    return Reply()


async def trace_settings(core: Core, request: Request) -> Reply:
    return _json(await core.trace_settings(request.path.get("model") or ""))


async def update_trace_settings(core: Core, request: Request) -> Reply:
    """The model's (or global) settings after the change, as Triton answers."""
    model = request.path.get("model") or ""
    if model:
        await core.trace_settings(model)  # an unknown model is refused before its body is read, as Triton
    changes = convert.trace_settings_changes(convert.parse_object(request.body, "trace settings"))
    return _json(await core.update_trace_settings(model, changes))


async def log_settings(core: Core, request: Request) -> Reply:
    return _json(await core.log_settings())


async def update_log_settings(core: Core, request: Request) -> Reply:
    """Every setting after the change, as Triton answers (JSON types are the settings' own)."""
    return _json(await core.update_log_settings(convert.parse_object(request.body, "log settings")))


Handler = Callable[[Core, Request], Awaitable[Reply]]
# A version is digits, as in Triton's routes: /versions/abc/ready is no route (404 "Not Found").
_MODEL = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[0-9]+))?"
_REGION = r"(?:/region/(?P<region>[^/]+))?"

# (pattern, methods, handler, restriction category), matched in order; methods written separated by |.
ROUTES: list[tuple[re.Pattern[str], frozenset[str], Handler, str]] = [
    (re.compile(pattern), frozenset(method.split("|")), handler, category)
    for pattern, method, handler, category in (
        # First: every request walks the list until its pattern matches (no two patterns match one path).
        (_MODEL + "/infer", "POST", infer, "inference"),
        ("/v2/health/live", "GET", live, "health"),
        ("/v2/health/ready", "GET", ready, "health"),
        ("/v2", "GET", server_metadata, "metadata"),
        ("/v2/models/stats", "GET", model_statistics, "statistics"),
        (_MODEL, "GET", model_metadata, "metadata"),
        (_MODEL + "/ready", "GET", model_ready, "health"),
        (_MODEL + "/config", "GET", model_config, "model-config"),
        (_MODEL + "/stats", "GET", model_statistics, "statistics"),
        ("/v2/repository/index", "POST", repository_index, "model-repository"),
        ("/v2/repository/models/(?P<model>[^/]+)/load", "POST", load, "model-repository"),
        ("/v2/repository/models/(?P<model>[^/]+)/unload", "POST", unload, "model-repository"),
        ("/v2/systemsharedmemory" + _REGION + "/status", "GET", shared_memory_status, "shared-memory"),
        ("/v2/systemsharedmemory/region/(?P<region>[^/]+)/register", "POST", shared_memory_register, "shared-memory"),
        ("/v2/systemsharedmemory" + _REGION + "/unregister", "POST", shared_memory_unregister, "shared-memory"),
        ("/v2/cudasharedmemory" + _REGION + "/status", "GET", cuda_shared_memory_status, "shared-memory"),
        (
            "/v2/cudasharedmemory/region/(?P<region>[^/]+)/register",
            "POST",
            cuda_shared_memory_register,
            "shared-memory",
        ),
        ("/v2/cudasharedmemory" + _REGION + "/unregister", "POST", cuda_shared_memory_unregister, "shared-memory"),
        ("/v2/trace/setting", "GET", trace_settings, "trace"),
        ("/v2/trace/setting", "POST", update_trace_settings, "trace"),
        ("/v2/models/(?P<model>[^/]+)/trace/setting", "GET", trace_settings, "trace"),
        ("/v2/models/(?P<model>[^/]+)/trace/setting", "POST", update_trace_settings, "trace"),
        ("/v2/logging", "GET", log_settings, "logging"),
        ("/v2/logging", "POST", update_log_settings, "logging"),
    )
]

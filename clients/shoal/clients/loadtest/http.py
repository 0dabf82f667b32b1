"""shoal-load over KServe v2 HTTP/REST (``-i http``): the control calls and the request it sends.

The request is built once, as perf_analyzer sends it: a JSON header followed by the input bytes
(Triton's binary tensor data extension, ``Inference-Header-Content-Length``), so the server does
no JSON number parsing and the load is comparable with gRPC's. Outputs are asked for as binary
too. Control calls (metadata, config, statistics) are plain blocking HTTP from the parent process,
with the same return types as the gRPC ``InferenceClient`` so the rest of the load tester does not
know which protocol it drives.

The load itself goes through ``ConnectionPool``: keep-alive HTTP/1.1 connections on asyncio
transports, each carrying one request at a time (HTTP/1.1 cannot multiplex, perf_analyzer also
holds one connection per request in flight), the whole request written as one prebuilt byte
string and the answer parsed by httptools (the C parser the server already uses). A general
client (aiohttp) cost 5x the CPU per request here (~700 µs against ~140 µs, 2 cores): on a
machine the server shares, that CPU was taken from the server and shoal-load read 0.3-0.5x of
perf_analyzer's throughput at c=4 and c=16 (``bench/loadtest_vs_perf_analyzer.py``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httptools
import numpy as np

from shoal.protocol import codec
from shoal.protocol.types import DataType, ModelMetadata, ServerMetadata, TensorMetadata

HEADER_LENGTH = "Inference-Header-Content-Length"


class HttpError(Exception):
    """A control call failed: the HTTP status (0: no answer) and the server's ``{"error": ...}`` text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"[HTTP {status}] {message}" if status else message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HttpRequest:
    """One inference request, serialized once and sent as is by every load coroutine."""

    path: str
    body: bytes
    header_length: int  # bytes of JSON before the binary input data

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(self.header_length)}

    def wire(self, host: str, prefix: str = "") -> bytes:
        """The whole HTTP/1.1 request as it goes on the connection: written once per request, as is."""
        lines = [
            f"POST {prefix}{self.path} HTTP/1.1",
            f"Host: {host}",
            f"Content-Length: {len(self.body)}",
            *(f"{name}: {value}" for name, value in self.headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


class ConnectionLost(ConnectionError):
    """The connection closed (or sent what is not HTTP) before the answer was complete."""

    def __init__(self, message: str, answer_started: bool) -> None:
        super().__init__(message)
        self.answer_started = answer_started


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time; httptools parses each answer.

    The body of an answer is not kept (the load tester counts answers, it does not read them):
    httptools hands it to ``on_body``, which this class does not define.
    """

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._answer: asyncio.Future[int] | None = None
        self._answer_started = False
        self.reusable = True

    # -- asyncio.Protocol ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._answer_started = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(ConnectionLost(f"not an HTTP answer: {error}", answer_started=True))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(ConnectionLost(f"connection closed: {exc or 'by the server'}", self._answer_started))

    # -- httptools callbacks -------------------------------------------------------------------------

    def on_message_complete(self) -> None:
        self.reusable = self.reusable and self._parser.should_keep_alive()
        answer, self._answer = self._answer, None
        if answer is None:  # an answer nobody asked for (e.g. a 408 on an idle connection)
            self.reusable = False
        elif not answer.done():
            answer.set_result(self._parser.get_status_code())

    # -- use -----------------------------------------------------------------------------------------

    async def exchange(self, request: bytes) -> int:
        """Send ``request`` and wait for the whole answer; returns its HTTP status."""
        if self._transport is None or self._transport.is_closing():
            raise ConnectionLost("connection closed", answer_started=False)
        self._answer_started = False
        self._answer = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return await self._answer

    def close(self) -> None:
        self.reusable = False
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: Exception) -> None:
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(error)


class ConnectionPool:
    """Keep-alive connections to one server for one prebuilt request; one connection per request in flight.

    ``send`` reuses the connection used last (the others may idle) and opens one when none is idle.
    A reused connection the server closed while it idled (keep-alive timeout) fails before any byte
    of the answer: that request is sent again, once, on a new connection — as browsers and aiohttp do.
    """

    def __init__(self, url: str, request: HttpRequest) -> None:
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an HTTP URL: {url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._wire = request.wire(parts.netloc, parts.path.rstrip("/"))
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def connect(self, count: int) -> None:
        """Open up to ``count`` connections ahead of the load (failures are left to the load to report)."""
        opened = await asyncio.gather(
            *(self._connect() for _ in range(count - len(self._idle))), return_exceptions=True
        )
        self._idle += [c for c in opened if isinstance(c, _Connection)]

    async def send(self, timeout_s: float) -> str | None:
        """None on a 200 answer, else ``HTTP_<status>``, ``DEADLINE_EXCEEDED`` or ``CONNECTION_ERROR``."""
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                for attempt in (1, 2):
                    reused = bool(self._idle)
                    connection = self._idle.pop() if reused else await self._connect()
                    try:
                        status = await connection.exchange(self._wire)
                        break
                    except ConnectionLost as lost:
                        self._discard(connection)
                        if lost.answer_started or not reused or attempt == 2:
                            raise
        except TimeoutError:
            if connection is not None:
                self._discard(connection)  # its answer may still come: the connection cannot carry another request
            return "DEADLINE_EXCEEDED"
        except OSError:  # ConnectionLost, refused, reset
            return "CONNECTION_ERROR"
        assert connection is not None  # the loop either answered or raised
        if connection.reusable:
            self._idle.append(connection)
        else:
            self._discard(connection)
        return None if status == 200 else f"HTTP_{status}"

    async def close(self) -> None:
        for connection in self._open:
            connection.close()
        self._open.clear()
        self._idle.clear()

    async def _connect(self) -> _Connection:
        _, connection = await asyncio.get_running_loop().create_connection(
            _Connection, self._host, self._port, ssl=self._ssl
        )
        self._open.add(connection)
        return connection

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        self._open.discard(connection)


def model_path(model: str, version: str) -> str:
    quoted = urllib.parse.quote(model, safe="")
    return f"/v2/models/{quoted}/versions/{urllib.parse.quote(version, safe='')}" if version else f"/v2/models/{quoted}"


def infer_request(model: str, version: str, inputs: Mapping[str, np.ndarray]) -> HttpRequest:
    """The infer body: JSON naming each input's binary size, then the inputs' bytes in the same order."""
    described = []
    chunks = []
    for name, array in inputs.items():
        datatype = DataType.from_numpy(array.dtype)
        data = _tensor_bytes(datatype, array)
        described.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype.value,
                "parameters": {"binary_data_size": len(data)},
            }
        )
        chunks.append(data)
    header = json.dumps(
        {"inputs": described, "parameters": {"binary_data_output": True}}, separators=(",", ":")
    ).encode()
    return HttpRequest(f"{model_path(model, version)}/infer", header + b"".join(chunks), len(header))


def _tensor_bytes(datatype: DataType, array: np.ndarray) -> bytes:
    if datatype is not DataType.BYTES:
        return np.ascontiguousarray(array).tobytes()
    return codec.serialize_bytes(array)


class HttpControl:
    """Metadata, config and statistics over HTTP, shaped as ``InferenceClient`` returns them."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.base = (url if "://" in url else f"http://{url}").rstrip("/")  # paths below start with /
        self.timeout_s = timeout_s

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(self.base + path, timeout=self.timeout_s) as answer:  # noqa: S310 (http only)
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            body = error.read()
            try:
                message = str(json.loads(body).get("error", body.decode(errors="replace")))
            except ValueError:
                message = body.decode(errors="replace")
            raise HttpError(error.code, message) from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise HttpError(0, f"{self.base}{path}: {getattr(error, 'reason', error)}") from None

    def server_metadata(self) -> ServerMetadata:
        answer = self._get("/v2")
        return ServerMetadata(answer.get("name", ""), answer.get("version", ""), tuple(answer.get("extensions", [])))

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        answer = self._get(model_path(model, version))

        def tensors(items: list[dict[str, Any]]) -> tuple[TensorMetadata, ...]:
            return tuple(TensorMetadata(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in items)

        return ModelMetadata(
            answer["name"],
            tuple(answer.get("versions", [])),
            answer.get("platform", ""),
            tensors(answer.get("inputs", [])),
            tensors(answer.get("outputs", [])),
        )

    def model_config(self, model: str, version: str = "") -> dict[str, Any]:
        config: dict[str, Any] = self._get(f"{model_path(model, version)}/config")
        return config

    def statistics(self, model: str = "", version: str = "") -> list[dict[str, Any]]:
        path = f"{model_path(model, version)}/stats" if model else "/v2/models/stats"
        return list(self._get(path).get("model_stats", []))

    def close(self) -> None:
        pass  # one connection per call: nothing held

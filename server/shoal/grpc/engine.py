"""Which gRPC engine serves the listener: pygrpc-native or grpcio's ``grpc.aio``.

``--grpc-engine``:

- ``native``: pygrpc-native's ``aio.server()`` (HTTP/2 and gRPC framing in Rust, outside the GIL;
  handlers on this event loop). It serves the unary and server-streaming methods itself; what it
  cannot serve natively (ModelStreamInfer, a bidirectional stream, and server reflection, added as
  a generic handler) goes to the grpc.aio server it runs behind itself on a Unix socket. It has no
  TLS: asking for it with TLS is a startup error.
- ``grpcio``: ``grpc.aio.server()``, every method, TLS and mTLS.
- ``auto`` (the default): ``native`` wherever it can serve the configuration (an insecure listener
  and a pygrpc-native in the tested range that imports on this platform), ``grpcio`` otherwise. The
  line that starts the listener names the engine and why.

Both are given the same options and the same handlers (``server.build_server``): what the suite
checks holds on both.

pygrpc-native runs HTTP/2 on threads of its own (``--grpc-io-threads``; its default is 2). With 0
(the default) the count follows the cores this process may use (``io_threads_for``): one below 4
cores, else 2. On 2 cores a second I/O thread only competes with the event loop and the model's
threads for the same cores: ``python bench/grpc_engines.py --compare-io-threads`` measured one
thread against two (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import grpc

from shoal.errors import StartupError

ENGINES = ("auto", "native", "grpcio")
# The pygrpc-native releases the suite ran on; pyproject.toml pins the same range.
TESTED_NATIVE = ((0, 5), (0, 6))  # [0.5, 0.6)


@dataclass(frozen=True)
class EngineChoice:
    name: str  # "native" or "grpcio"
    reason: str  # for the log line that starts the listener
    io_threads: int = 0  # native: pygrpc-native's HTTP/2 threads (set by ``with_io_threads``)

    def describe(self) -> str:
        threads = f"; {self.io_threads} I/O thread{'s' if self.io_threads != 1 else ''}" if self.io_threads else ""
        return f"engine {self.name}: {self.reason}{threads}"

    def with_io_threads(self, requested: int, cores: int) -> EngineChoice:
        """This choice with its I/O thread count: ``requested``, or from ``cores`` when 0 (grpcio: none of its own)."""
        if self.name != "native":
            return self
        return replace(self, io_threads=requested or io_threads_for(cores))


# Below this many usable cores pygrpc-native gets one I/O thread, from it two (pygrpc-native's default).
TWO_IO_THREADS_FROM_CORES = 4


def io_threads_for(cores: int) -> int:
    """pygrpc-native's I/O threads on ``cores`` usable cores (the rule in the module's docstring)."""
    return 1 if cores < TWO_IO_THREADS_FROM_CORES else 2


def _native_unusable() -> str | None:
    """Why pygrpc-native cannot serve here, or None when it can."""
    try:
        import pygrpc_native
        import pygrpc_native.aio  # noqa: F401 - the server itself, which needs grpcio
    except ImportError as exc:  # no wheel for this platform, or not installed
        return f"pygrpc-native does not import here ({exc})"
    version = getattr(pygrpc_native, "__version__", "0")
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"pygrpc-native {version} is not a release this server was tested with"
    low, high = TESTED_NATIVE
    if not low <= release < high:
        return (
            f"pygrpc-native {version} is outside the tested range {'.'.join(map(str, low))} to "
            f"{'.'.join(map(str, high))}"
        )
    return None


def choose(requested: str, tls: bool) -> EngineChoice:
    """The engine for ``requested`` (one of ``ENGINES``); StartupError if ``native`` cannot serve as asked."""
    if requested == "grpcio":
        return EngineChoice("grpcio", "--grpc-engine grpcio")
    if tls:
        if requested == "native":
            raise StartupError(
                "--grpc-engine native cannot serve TLS (pygrpc-native has none); use --grpc-engine auto or grpcio"
            )
        return EngineChoice("grpcio", "TLS is on, which pygrpc-native cannot serve")
    unusable = _native_unusable()
    if unusable is not None:
        if requested == "native":
            raise StartupError(f"--grpc-engine native: {unusable}; use --grpc-engine auto or grpcio")
        return EngineChoice("grpcio", unusable)
    if requested == "native":
        return EngineChoice("native", "--grpc-engine native")
    return EngineChoice(
        "native",
        "insecure listener, pygrpc-native serves it (ModelStreamInfer and reflection through its grpc.aio fallback)",
    )


def create(choice: EngineChoice, options: list[tuple[str, Any]]) -> grpc.aio.Server:
    """An unstarted server of the chosen engine, with ``options`` (grpcio's names; pygrpc-native reads the
    message limits, keepalive, max concurrent streams and SO_REUSEPORT the same way)."""
    if choice.name == "native":
        return _native_server_class()(options=options, io_threads=choice.io_threads or 2)
    return grpc.aio.server(options=options)


class _StreamedMethods(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Request-streaming methods by path, for pygrpc-native's grpc.aio fallback. Not a
    ``grpc.ServiceRpcHandler``: pygrpc-native drops those of services also registered with it."""

    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._handlers = handlers

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._handlers.get(handler_call_details.method)


def _native_server_class() -> type:
    """pygrpc-native's aio server, whose request-streaming methods reach its grpc.aio fallback.

    pygrpc-native 0.5 registers them on the fallback with ``add_registered_method_handlers``, which grpc.aio
    does not implement below grpcio 1.84 (the pinned range): ModelStreamInfer and reflection (whose
    generated code registers both ways, and whose generic handler pygrpc-native then drops) answered
    UNIMPLEMENTED. Here they go to the fallback as a generic handler; the rest is served natively."""
    import pygrpc_native.aio

    class NativeServer(pygrpc_native.aio.Server):
        def add_registered_method_handlers(
            self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
        ) -> None:
            streamed = {
                f"/{service_name}/{name}": handler
                for name, handler in method_handlers.items()
                if handler.request_streaming
            }
            super().add_registered_method_handlers(
                service_name, {name: h for name, h in method_handlers.items() if not h.request_streaming}
            )
            if streamed:
                self.add_generic_rpc_handlers((_StreamedMethods(streamed),))

    return NativeServer

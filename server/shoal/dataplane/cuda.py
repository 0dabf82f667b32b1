"""CUDA shared-memory regions that clients register: Triton's CUDA shared-memory extension.

A client allocates device memory, exports it with ``cudaIpcGetMemHandle`` and registers the
64-byte handle with a device id and a size (``tritonclient.utils.cuda_shared_memory``). The host
process opens the handle once (``cudaIpcOpenMemHandle``, lazy peer access) and copies inputs out
of it and outputs into it on a stream of its own per device, waiting for each copy to land before
it answers: the client reads the outputs from another process the moment the reply arrives. The
models still get host tensors (one copy each way, through host memory).

Nothing CUDA-related is imported or loaded until the first registration, so a CPU-only install
never loads it. The runtime is cuda-python's ``cuda.bindings`` where it is importable (what
tritonclient's helpers use), else ``libcudart`` through ctypes (the one torch's CUDA wheels ship,
found without importing torch). Where neither works, or no device is visible, registration is
refused as Triton built without GPU support refuses it.

A mapping is closed (``cudaIpcCloseMemHandle``) when the region is unregistered and the last
request that located it lets go of it: windows hold the mapping, as system windows hold the
segment's descriptor, so a request never touches memory the server no longer maps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shoal.errors import ErrorCode, ShoalError, shown

logger = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: copies never wait for the models' kernels


@dataclass(frozen=True)
class CudaRegionStatus:
    name: str
    device_id: int
    byte_size: int


class CudaError(Exception):
    """A CUDA runtime call failed; the message names the call and CUDA's error string."""


class Runtime(Protocol):
    """The few CUDA runtime calls the server makes; addresses are plain ints."""

    def device_count(self) -> int: ...

    def open(self, handle: bytes, device_id: int) -> int: ...

    def allocation_size(self, address: int) -> int: ...  # bytes from ``address`` to its allocation's end

    def close(self, address: int, device_id: int) -> None: ...

    def copy(self, target: int, source: int, byte_size: int, device_id: int) -> None: ...  # waits for it


class _CudaPython:
    """The runtime through cuda-python's ``cuda.bindings``."""

    def __init__(self) -> None:
        import cuda.bindings.driver as driver  # type: ignore[import-not-found, unused-ignore]
        import cuda.bindings.runtime as cudart  # type: ignore[import-not-found, unused-ignore]

        self.cudart, self.driver = cudart, driver
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _check(self, call: str, result: Any) -> Any:
        """The values a cuda-python call returns after its error code, which must be success."""
        err, *values = result if isinstance(result, tuple) else (result,)
        code: Any = getattr(err, "value", err)
        if int(code) != 0:  # cudaError_t or CUresult: their names say what failed
            raise CudaError(f"{call}: {getattr(err, 'name', err)}")
        return values[0] if len(values) == 1 else values

    def device_count(self) -> int:
        return int(self._check("cudaGetDeviceCount", self.cudart.cudaGetDeviceCount()))

    def open(self, handle: bytes, device_id: int) -> int:
        self._check("cudaSetDevice", self.cudart.cudaSetDevice(device_id))
        ipc = self.cudart.cudaIpcMemHandle_t()
        ctypes.memmove(ipc.getPtr(), handle, IPC_HANDLE_BYTES)  # cuda-bindings 13 has no field to set
        return int(self._check("cudaIpcOpenMemHandle", self.cudart.cudaIpcOpenMemHandle(ipc, _LAZY_PEER_ACCESS)))

    def allocation_size(self, address: int) -> int:
        base, size = self._check("cuMemGetAddressRange", self.driver.cuMemGetAddressRange(address))
        return int(base) + int(size) - address

    def close(self, address: int, device_id: int) -> None:
        self._check("cudaSetDevice", self.cudart.cudaSetDevice(device_id))
        self._check("cudaIpcCloseMemHandle", self.cudart.cudaIpcCloseMemHandle(address))

    def copy(self, target: int, source: int, byte_size: int, device_id: int) -> None:
        self._check("cudaSetDevice", self.cudart.cudaSetDevice(device_id))
        with self._lock:
            stream = self._streams.get(device_id)
            if stream is None:
                stream = self._check(
                    "cudaStreamCreateWithFlags", self.cudart.cudaStreamCreateWithFlags(_STREAM_NON_BLOCKING)
                )
                self._streams[device_id] = stream
        self._check(
            "cudaMemcpyAsync",
            self.cudart.cudaMemcpyAsync(
                target, source, byte_size, self.cudart.cudaMemcpyKind.cudaMemcpyDefault, stream
            ),
        )
        self._check("cudaStreamSynchronize", self.cudart.cudaStreamSynchronize(stream))


class _IpcHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array takes its value as a C string and stops at the first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


class _Ctypes:
    """The runtime through ctypes on ``libcudart`` (and ``libcuda`` for the allocation's range)."""

    def __init__(self, cudart: ctypes.CDLL, driver: ctypes.CDLL) -> None:
        self.cudart, self.driver = cudart, driver
        cudart.cudaGetErrorString.restype = ctypes.c_char_p
        cudart.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        cudart.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        cudart.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        cudart.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        driver.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self._streams: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def _check(self, call: str, err: int) -> None:
        if err != 0:
            text = self.cudart.cudaGetErrorString(err) if call != "cuMemGetAddressRange" else b""
            raise CudaError(f"{call}: {(text or b'').decode()} (error {err})")

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        self._check("cudaGetDeviceCount", self.cudart.cudaGetDeviceCount(ctypes.byref(count)))
        return count.value

    def open(self, handle: bytes, device_id: int) -> int:
        self._check("cudaSetDevice", self.cudart.cudaSetDevice(device_id))
        address = ctypes.c_void_p()
        ipc = _IpcHandle.from_buffer_copy(handle)
        self._check(
            "cudaIpcOpenMemHandle", self.cudart.cudaIpcOpenMemHandle(ctypes.byref(address), ipc, _LAZY_PEER_ACCESS)
        )
        return int(address.value or 0)

    def allocation_size(self, address: int) -> int:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(
            "cuMemGetAddressRange", self.driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address)
        )
        return base.value + size.value - address

    def close(self, address: int, device_id: int) -> None:
        self._check("cudaSetDevice", self.cudart.cudaSetDevice(device_id))
        self._check("cudaIpcCloseMemHandle", self.cudart.cudaIpcCloseMemHandle(address))

    def copy(self, target: int, source: int, byte_size: int, device_id: int) -> None:
        self._check("cudaSetDevice", self.cudart.cudaSetDevice(device_id))
        with self._lock:
            stream = self._streams.get(device_id)
            if stream is None:
                stream = ctypes.c_void_p()
                self._check(
                    "cudaStreamCreateWithFlags",
                    self.cudart.cudaStreamCreateWithFlags(ctypes.byref(stream), _STREAM_NON_BLOCKING),
                )
                self._streams[device_id] = stream
        self._check("cudaMemcpyAsync", self.cudart.cudaMemcpyAsync(target, source, byte_size, _MEMCPY_DEFAULT, stream))
        self._check("cudaStreamSynchronize", self.cudart.cudaStreamSynchronize(stream))


def _libcudart_candidates() -> list[str]:
    """libcudart from the nvidia wheels torch depends on, or from torch itself, then the system's."""
    found: list[str] = []
    for package, pattern in (("nvidia", "**/lib/libcudart.so*"), ("torch", "lib/libcudart*.so*")):
        spec = importlib.util.find_spec(package)  # finds the package without running it
        for folder in (spec.submodule_search_locations or []) if spec else []:
            found += sorted(glob.glob(f"{folder}/{pattern}", recursive=True), reverse=True)
    return [*found, ctypes.util.find_library("cudart") or "libcudart.so"]


def _load_ctypes() -> _Ctypes:
    problems = []
    for candidate in _libcudart_candidates():
        try:
            cudart = ctypes.CDLL(candidate)
            return _Ctypes(cudart, ctypes.CDLL("libcuda.so.1"))
        except OSError as exc:
            problems.append(str(exc))
    raise CudaError("no CUDA runtime library could be loaded: " + "; ".join(problems))


_loaded: Runtime | str | None = None  # the runtime, or why there is none (after the first try)
_loading = threading.Lock()


def runtime() -> Runtime | str:
    """The CUDA runtime, loaded on first use; a string says why there is none (logged once)."""
    global _loaded
    with _loading:
        if _loaded is None:
            _loaded = _first_working()
            if isinstance(_loaded, str):
                logger.warning("CUDA shared memory is unavailable: %s", _loaded)
            else:
                logger.info("CUDA shared memory through %s", type(_loaded).__name__.strip("_"))
        return _loaded


def _first_working() -> Runtime | str:
    """cuda-python, else ctypes: also when cuda-python is there but cannot work (built for a newer
    CUDA than the driver offers, say) while the runtime that torch ships can."""
    problems = []
    makers: tuple[Callable[[], Runtime], ...] = (_CudaPython, _load_ctypes)
    for make in makers:
        try:
            found = make()
            if found.device_count() > 0:
                return found
            problems.append(f"{make.__name__.strip('_')}: no CUDA device is visible")
        except Exception as exc:  # noqa: BLE001 - whatever fails to load, this way has no usable CUDA
            problems.append(f"{make.__name__.strip('_')}: {type(exc).__name__}: {exc}")
    return "; ".join(problems)


class _Mapping:
    """An opened IPC handle; closed once nothing refers to it (the registry and windows hold it)."""

    def __init__(self, cuda: Runtime, address: int, device_id: int) -> None:
        self.cuda, self.address, self.device_id = cuda, address, device_id
        self.close = weakref.finalize(self, _close, cuda, address, device_id)  # runs once, now or when unused


def _close(cuda: Runtime, address: int, device_id: int) -> None:
    try:
        cuda.close(address, device_id)
    except CudaError as exc:
        logger.error("failed to close a CUDA IPC handle: %s", exc)


@dataclass(frozen=True)
class CudaRegion:
    status: CudaRegionStatus
    mapping: _Mapping


@dataclass(frozen=True)
class CudaWindow:
    """``byte_size`` bytes of a CUDA region from ``position``; holds the mapping open."""

    name: str
    mapping: _Mapping
    position: int
    byte_size: int

    def read(self) -> np.ndarray:
        """A host copy of the window's bytes (uint8). Blocks until the copy is done: call off the loop."""
        data = np.empty(self.byte_size, np.uint8)
        if self.byte_size:
            self._copy(data.ctypes.data, self.mapping.address + self.position, self.byte_size)
        return data

    def write(self, data: bytes) -> None:
        if len(data) > self.byte_size:
            raise ValueError("the data is larger than the window")
        if data:
            source = np.frombuffer(data, np.uint8)
            self._copy(self.mapping.address + self.position, source.ctypes.data, len(data))

    def _copy(self, target: int, source: int, byte_size: int) -> None:
        try:
            self.mapping.cuda.copy(target, source, byte_size, self.mapping.device_id)
        except CudaError as exc:
            raise ShoalError(
                ErrorCode.INTERNAL, f"failed to copy CUDA shared memory region '{shown(self.name)}': {exc}"
            ) from None


def open_region(name: str, handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
    """Open a client's IPC handle as Triton does (server src/shared_memory_manager.cc), with its
    codes and words; the size registered must fit in the client's allocation."""
    cuda = require_runtime(name)
    if len(handle) != IPC_HANDLE_BYTES:
        raise ShoalError(
            ErrorCode.INVALID_ARGUMENT,
            (
                f"failed to register shared memory region '{shown(name)}': raw_handle must be the "
                f"{IPC_HANDLE_BYTES} bytes of a cudaIpcMemHandle_t, got {len(handle)}"
            ),
        )
    if byte_size <= 0 or not 0 <= device_id < cuda.device_count():
        raise ShoalError(
            ErrorCode.INVALID_ARGUMENT, f"failed to register shared memory region '{shown(name)}': invalid args"
        )
    try:
        address = cuda.open(handle, device_id)
    except CudaError as exc:
        logger.error("failed to open CUDA IPC handle of region '%s': %s", shown(name), exc)
        raise ShoalError(ErrorCode.INVALID_ARGUMENT, "failed to register shared memory region: invalid args") from None
    mapping = _Mapping(cuda, address, device_id)
    try:
        fits = cuda.allocation_size(address) >= byte_size
    except CudaError as exc:
        logger.error("failed to read the size of CUDA shared memory region '%s': %s", shown(name), exc)
        fits = False
    if not fits:
        mapping.close()  # now: the exception's traceback would keep the mapping alive
        raise ShoalError(
            ErrorCode.INVALID_ARGUMENT, f"failed to register shared memory region '{shown(name)}': invalid args"
        )
    return CudaRegion(CudaRegionStatus(name, device_id, byte_size), mapping)


def require_runtime(name: str) -> Runtime:
    """The runtime, or the refusal of Triton built without GPU support (INVALID_ARGUMENT)."""
    cuda = runtime()
    if isinstance(cuda, str):
        raise ShoalError(
            ErrorCode.INVALID_ARGUMENT,
            f"failed to register CUDA shared memory region: '{shown(name)}', GPUs not supported",
        )
    return cuda

"""Triton's system shared-memory extension, through tritonclient's own shared-memory utilities.

Regions are registered, used for inputs and outputs (alone and mixed with inline tensors),
listed and unregistered; errors carry Triton's codes and words (server src/shared_memory_manager.cc,
src/grpc/infer_handler.cc). Runs in both process layouts (the ``example_server`` fixture).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, serialize_byte_tensor, triton_to_np_dtype

from tests import models
from tests.conftest import RunningServer
from tests.polling import metric, wait_until

Region = shm.SharedMemoryRegion


@pytest.fixture
def client(example_server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(example_server.url) as triton:
        yield triton
        triton.unregister_system_shared_memory()


@pytest.fixture
def regions() -> Iterator[Callable[[int], tuple[str, str, Region]]]:
    """Makes segments (name, key, handle) and destroys them after the test."""
    made: list[Region] = []

    def make(byte_size: int) -> tuple[str, str, Region]:
        tag = uuid.uuid4().hex[:12]
        handle = shm.create_shared_memory_region(f"region_{tag}", f"/shoal_test_{tag}", byte_size)
        made.append(handle)
        return f"region_{tag}", f"/shoal_test_{tag}", handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def registered(
    client: grpcclient.InferenceServerClient,
    make: Callable[[int], tuple[str, str, Region]],
    values: np.ndarray | None,
    byte_size: int = 0,
) -> tuple[str, Region]:
    name, key, handle = make(byte_size or _byte_size(values))
    if values is not None:  # BYTES go in as tritonclient serializes them: a 4-byte length per element
        shm.set_shared_memory_region(handle, [serialize_byte_tensor(values) if values.dtype == np.object_ else values])
    client.register_system_shared_memory(name, key, byte_size or _byte_size(values))
    return name, handle


def _byte_size(values: np.ndarray | None) -> int:
    assert values is not None
    if values.dtype == np.object_:
        return len(serialize_byte_tensor(values).item())
    return int(values.nbytes)


def test_inputs_and_outputs_in_shared_memory(client: grpcclient.InferenceServerClient, regions) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    in0, _ = registered(client, regions, a)
    in1, _ = registered(client, regions, b)
    out0, out0_handle = registered(client, regions, None, 64)
    out1, out1_handle = registered(client, regions, None, 64)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(in0, 64)
    inputs[1].set_shared_memory(in1, 64)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out0, 64)
    outputs[1].set_shared_memory(out1, 64)
    result = client.infer("simple", inputs, outputs=outputs)
    assert result.get_output("OUTPUT0").shape == [1, 16]
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out0_handle, np.int32, [1, 16]), a + b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out1_handle, np.int32, [1, 16]), a - b)
    assert result.get_response().raw_output_contents == [b"", b""]  # the outputs travelled in memory


def test_mixed_regions_and_inline_tensors(client: grpcclient.InferenceServerClient, regions) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 5, dtype=np.int32)
    in1, _ = registered(client, regions, b)
    out0, out0_handle = registered(client, regions, None, 64)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_shared_memory(in1, 64)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(out0, 64)
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out0_handle, np.int32, [1, 16]), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)  # inline, after the empty entry


@pytest.mark.parametrize("datatype", ["INT32", "FP32", "FP16", "BYTES"])
def test_each_datatype_round_trips_through_regions(
    client: grpcclient.InferenceServerClient, regions, datatype: str
) -> None:
    if datatype == "BYTES":
        values = np.array([[b"ab", b"", b"\x00\xffz"]], dtype=np.object_)
    else:
        values = (np.arange(6).reshape(1, 6) * 1.5).astype(triton_to_np_dtype(datatype))
    size = _byte_size(values)
    source, _ = registered(client, regions, values)
    target, target_handle = registered(client, regions, None, size)
    tensor = grpcclient.InferInput("IN", list(values.shape), np_to_triton_dtype(values.dtype))
    tensor.set_shared_memory(source, size)
    output = grpcclient.InferRequestedOutput("OUT")
    output.set_shared_memory(target, size)
    client.infer(f"identity_{datatype.lower()}", [tensor], outputs=[output])
    back = shm.get_contents_as_numpy(target_handle, values.dtype, list(values.shape))
    np.testing.assert_array_equal(back, values)


def test_status_lists_one_or_every_region_and_unregister_removes_them(
    client: grpcclient.InferenceServerClient, regions
) -> None:
    first, first_key, _ = regions(128)
    second, second_key, _ = regions(256)
    client.register_system_shared_memory(first, first_key, 64, offset=32)
    client.register_system_shared_memory(second, second_key, 256)
    status = client.get_system_shared_memory_status(first, as_json=True)["regions"]
    assert status == {first: {"name": first, "key": first_key, "offset": "32", "byte_size": "64"}}
    assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {first, second}
    client.unregister_system_shared_memory(first)
    client.unregister_system_shared_memory("never registered")  # not an error, as in Triton
    assert set(client.get_system_shared_memory_status(as_json=True)["regions"]) == {second}
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    assert "system_shared_memory" in client.get_server_metadata().extensions


def expect_error(status: str, text: str, call: Callable[[], object]) -> None:
    with pytest.raises(InferenceServerException) as failure:
        call()
    assert failure.value.status() == f"StatusCode.{status}", failure.value
    assert text in failure.value.message(), failure.value.message()


def test_registration_errors_in_tritons_words(client: grpcclient.InferenceServerClient, regions, tmp_path) -> None:
    name, key, _ = regions(64)
    client.register_system_shared_memory(name, key, 64)
    expect_error(
        "ALREADY_EXISTS",
        f"shared memory region '{name}' already in manager",
        lambda: client.register_system_shared_memory(name, key, 64),
    )
    expect_error(
        "INTERNAL",
        "Unable to open shared memory region: '/shoal_no_such_segment'",
        lambda: client.register_system_shared_memory("x", "/shoal_no_such_segment", 64),
    )
    expect_error(
        "INVALID_ARGUMENT",
        "failed to register shared memory region 'y': invalid args",
        lambda: client.register_system_shared_memory("y", key, 64, offset=8),
    )
    expect_error(
        "NOT_FOUND",
        "Unable to find system shared memory region: 'nope'",
        lambda: client.get_system_shared_memory_status("nope"),
    )
    for path_like in ("/../etc/passwd", "/a/b", "/", "/.."):  # only a segment's own name is ever opened
        expect_error(
            "INTERNAL",
            "Unable to open shared memory region",
            lambda key=path_like: client.register_system_shared_memory("z", key, 1),
        )
    link = Path("/dev/shm") / f"shoal_test_link_{uuid.uuid4().hex[:8]}"
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link.symlink_to(target)
    try:
        expect_error(
            "INTERNAL",
            "Unable to open shared memory region",
            lambda: client.register_system_shared_memory("link", f"/{link.name}", 64),
        )
    finally:
        link.unlink()


def test_inference_errors_in_tritons_words(client: grpcclient.InferenceServerClient, regions) -> None:
    a = np.zeros((1, 16), dtype=np.int32)
    in0, _ = registered(client, regions, a)
    small, _ = registered(client, regions, None, 32)

    def infer(input_region: str, input_size: int, output_size: int = 64, offset: int = 0) -> object:
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory(input_region, input_size, offset)
        inputs[1].set_data_from_numpy(a)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(small, output_size)
        return client.infer("simple", inputs, outputs=[output])

    expect_error("NOT_FOUND", "Unable to find shared memory region: 'gone'", lambda: infer("gone", 64))
    expect_error(
        "INVALID_ARGUMENT",
        "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 32",
        lambda: infer(in0, 32, 32),
    )
    expect_error(
        "INVALID_ARGUMENT",
        f"Invalid offset + byte size for shared memory region: '{in0}'",
        lambda: infer(in0, 64, offset=8),
    )
    expect_error(
        "INVALID_ARGUMENT", f"Invalid offset for shared memory region: '{in0}'", lambda: infer(in0, 64, offset=64)
    )
    expect_error(
        "INTERNAL",
        "shared memory size specified with the request for output 'OUTPUT0' (32 bytes) should "
        "be at least 64 bytes to hold the results",
        lambda: infer(in0, 64, 32),
    )


def test_a_region_unregistered_while_a_request_waits_still_serves_it(server_factory, tmp_path: Path, regions) -> None:
    repo = tmp_path / "repo"
    models.add_delayed_identity(repo, "slow", delay_ms=800)
    server = server_factory(repo)
    with grpcclient.InferenceServerClient(server.url) as triton:
        values = np.array([[7, 8]], dtype=np.int64)
        name, _ = registered(triton, regions, values)
        results: list[np.ndarray] = []

        def call(source: str | None) -> None:
            tensor = grpcclient.InferInput("IN", [1, 2], "INT64")
            if source is None:
                tensor.set_data_from_numpy(np.zeros((1, 2), np.int64))
            else:
                tensor.set_shared_memory(source, 16)
            results.append(triton.infer("slow", [tensor], client_timeout=20).as_numpy("OUT"))

        threads = [threading.Thread(target=call, args=(None,)), threading.Thread(target=call, args=(name,))]
        for thread in threads:
            thread.start()
        # One instance: one request runs for 0.8 s while the other waits; either way the region's is in flight.
        wait_until(
            lambda: metric(server, "nv_inference_pending_request_count", "slow") == 1,
            what="one request running and one waiting",
        )
        triton.unregister_system_shared_memory(name)
        for thread in threads:
            thread.join(timeout=20)
        assert sorted(r.tolist() for r in results) == [[[0, 0]], [[7, 8]]]


def test_registration_is_restricted_and_bounded(server_factory, tmp_path: Path, regions) -> None:
    repo = models.repository(tmp_path, "simple")
    server = server_factory(
        repo, "--grpc-restricted-protocol", "shared-memory:admin=yes", "--shared-memory-max-mb", "0.0625"
    )  # 64 KiB
    name, key, _ = regions(128 << 10)
    with grpcclient.InferenceServerClient(server.url) as triton:
        expect_error(
            "UNAVAILABLE", "This protocol is restricted", lambda: triton.register_system_shared_memory(name, key, 4096)
        )
        allowed = {"triton-grpc-protocol-admin": "yes"}
        triton.register_system_shared_memory(name, key, 64 << 10, headers=allowed)
        expect_error(
            "INVALID_ARGUMENT",
            "--shared-memory-max-mb",
            lambda: triton.register_system_shared_memory("more", key, 1, headers=allowed),
        )
    assert server.stop() == 0
    assert Path("/dev/shm", key.lstrip("/")).exists()  # the client's segment: the server never unlinks it
    assert os.stat(Path("/dev/shm", key.lstrip("/"))).st_size == 128 << 10


def test_a_segment_truncated_after_registration_fails_only_that_request(
    client: grpcclient.InferenceServerClient, regions, example_server: RunningServer
) -> None:
    """A mapped page past a shrunk segment's end would kill the server (SIGBUS): it reads with preadv."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    name, handle = registered(client, regions, a)
    key = f"/{name.replace('region_', 'shoal_test_')}"  # as the regions fixture names them
    os.truncate(Path("/dev/shm") / key.lstrip("/"), 0)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(name, 64)
    inputs[1].set_data_from_numpy(a)
    expect_error(
        "INTERNAL",
        f"shared memory region '{name}' is smaller than when it was registered",
        lambda: client.infer("simple", inputs),
    )
    inputs[0].set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a + a)
    assert example_server.process.poll() is None


def test_an_unnamed_region_is_refused(client: grpcclient.InferenceServerClient, regions) -> None:
    _, key, _ = regions(64)
    expect_error("INVALID_ARGUMENT", "needs a name", lambda: client.register_system_shared_memory("", key, 64))


def test_large_region_copies_leave_the_event_loop() -> None:
    """Region bytes past OFF_LOOP_BYTES are read and written on a thread (256 MiB on the loop stalled it ~0.9 s)."""
    from shoal.core import shared_memory
    from shoal.dataplane.regions import RegionRegistry, Window
    from shoal.off_loop import OFF_LOOP_BYTES
    from shoal.protocol.types import DataType
    from shoal.request_types import InferRequest, RegionInput, RegionSlice

    def request(byte_size: int) -> InferRequest:
        where = RegionSlice("r", 0, byte_size)
        return InferRequest("m", "", "", (), region_inputs=(RegionInput("IN", DataType.UINT8, (byte_size,), where),))

    registry = RegionRegistry(max_total_bytes=1 << 30)
    assert not shared_memory.costly(registry, request(4096))
    assert shared_memory.costly(registry, request(OFF_LOOP_BYTES + 1))
    with open(os.devnull, "rb") as file:
        small = {"OUT": Window("r", file, 0, 4096)}  # type: ignore[arg-type]
        large = {"OUT": Window("r", file, 0, OFF_LOOP_BYTES + 1)}  # type: ignore[arg-type]
        assert not shared_memory.costly_outputs(small)  # type: ignore[arg-type]
        assert shared_memory.costly_outputs(large)  # type: ignore[arg-type]
    registry.close()

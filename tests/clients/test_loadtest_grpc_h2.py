"""shoal-load's prebuilt HTTP/2 gRPC sender (clients/shoal/clients/loadtest/grpc_h2.py).

Against a real Shoal on loopback: every outcome is the one grpc.aio reports for the same bytes, on both
gRPC engines, and more requests than the server's stream limit queue instead of being refused. Against a
scripted HTTP/2 peer (below) the parts of the protocol a server may use but Shoal's does not: padded,
prioritised and continued header blocks, a dynamic table that answers to abandoned streams keep in step,
a stream limit of 1, a small stream window (grpc.aio takes over), GOAWAY, a lost connection, deadlines.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
from collections.abc import Awaitable, Callable

import grpc
import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from shoal.clients.loadtest import engine, grpc_h2
from shoal.clients.loadtest.engine import INFER_PATH
from shoal.clients.loadtest.grpc_h2 import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    PrebuiltGrpcChannel,
    frame,
)
from shoal.tools import local_server
from tests.models import REPO_ROOT

SIMPLE = REPO_ROOT / "model_repository" / "simple"


def infer_request(model: str = "simple", elements: int = 16) -> bytes:
    message = service_pb2.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        tensor = message.inputs.add(name=name, datatype="INT32", shape=[1, elements])
        del tensor
        message.raw_input_contents.append(np.arange(elements, dtype=np.int32).tobytes())
    return message.SerializeToString()


async def aio_outcome(url: str, request: bytes, timeout_s: float = 30) -> str | None:
    async with grpc.aio.insecure_channel(url) as channel:
        try:
            await channel.unary_unary(INFER_PATH)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
    return None


def run(coroutine: Awaitable[object]) -> object:
    return asyncio.run(asyncio.wait_for(coroutine, 60))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["native", "grpcio"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(SIMPLE, repo / "simple")
    with local_server.running(repo, "--grpc-engine", request.param) as running:
        yield running


@pytest.mark.parametrize(
    "request_bytes",
    [infer_request(), infer_request(model="no_such_model"), infer_request(elements=15), b"\xff\xff not a message"],
    ids=["ok", "unknown-model", "wrong-shape", "garbage"],
)
def test_outcomes_are_the_ones_grpc_aio_reports(server, request_bytes: bytes) -> None:
    async def both() -> tuple[str | None, str | None]:
        channel = PrebuiltGrpcChannel(server.url, INFER_PATH, request_bytes)
        try:
            return await channel.call(30), await aio_outcome(server.url, request_bytes)
        finally:
            await channel.close()

    mine, theirs = run(both())  # type: ignore[misc]
    assert mine == theirs
    if request_bytes == infer_request():
        assert mine is None


def test_more_requests_than_the_stream_limit_queue_on_one_connection(server) -> None:
    """Shoal allows 100 streams per connection; 300 at once all succeed (none refused), on one connection."""

    async def burst() -> list[str | None]:
        channel = PrebuiltGrpcChannel(server.url, INFER_PATH, infer_request())
        try:
            await channel.connect()
            first = channel.connection
            outcomes = await asyncio.gather(*(channel.call(30) for _ in range(300)))
            assert channel.connection is first
            return list(outcomes)
        finally:
            await channel.close()

    assert run(burst()) == [None] * 300


def test_a_server_that_is_not_there_is_unavailable() -> None:
    async def call() -> str | None:
        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        channel = PrebuiltGrpcChannel(f"127.0.0.1:{port}", INFER_PATH, infer_request())
        try:
            return await channel.call(5)
        finally:
            await channel.close()

    assert run(call()) == "UNAVAILABLE"


def test_a_request_past_one_frame_goes_through_grpc_aio(server) -> None:
    small, large = infer_request(), infer_request(elements=4096)
    assert grpc_h2.fits(small) and not grpc_h2.fits(large)

    async def both() -> tuple[type, type, str | None]:
        senders = {r: engine._Senders(server.url, r, 1, 8) for r in (small, large)}
        try:
            outcome = await senders[large].send(0, 30)
            return type(senders[small].channels[0]), type(senders[large].channels[0]), outcome
        finally:
            for sender in senders.values():
                await sender.close()

    assert run(both()) == (PrebuiltGrpcChannel, engine._AioChannel, "INVALID_ARGUMENT")  # 4096 ≠ [1,16]


# -- a scripted HTTP/2 peer

Respond = Callable[["ScriptedPeer", int], Awaitable[None]]


class ScriptedPeer:
    """An HTTP/2 server on loopback that reads requests and answers each as ``respond`` says."""

    def __init__(self, respond: Respond, settings: bytes = b"", settings_after_s: float | None = 0.0) -> None:
        self.respond, self.settings, self.settings_after_s = respond, settings, settings_after_s
        self.client_settings: list[bytes] = []
        self.hung_up = 0  # connections the client closed
        self.encoder = hpack.Encoder()  # per connection; it indexes what it sends: the client's decoder must keep up
        self.writer: asyncio.StreamWriter | None = None  # the newest connection's
        self.writers: list[asyncio.StreamWriter] = []
        self.requests: list[int] = []
        self.resets: list[int] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ScriptedPeer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.target = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer, self.encoder = writer, hpack.Encoder()
        self.writers.append(writer)
        await reader.readexactly(len(grpc_h2.PREFACE))
        if self.settings_after_s is not None:
            asyncio.get_running_loop().call_later(
                self.settings_after_s, writer.write, frame(SETTINGS, 0, 0, self.settings)
            )
        try:
            while True:
                head = await reader.readexactly(9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                stream = int.from_bytes(head[5:], "big")
                payload = await reader.readexactly(length)
                if kind == SETTINGS and not flags & grpc_h2.ACK:
                    self.client_settings.append(payload)
                if kind == DATA and flags & END_STREAM:
                    self.requests.append(stream)
                    task = asyncio.ensure_future(self.respond(self, stream))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                elif kind == RST_STREAM:
                    self.resets.append(stream)
        except asyncio.IncompleteReadError:
            self.hung_up += 1
        except ConnectionError:
            return

    def headers(self, stream: int, headers: list[tuple[str, str]], flags: int = 0) -> bytes:
        return frame(HEADERS, END_HEADERS | flags, stream, self.encoder.encode(headers))

    async def answer(self, stream: int, status: int = 0) -> None:
        assert self.writer is not None
        message = b"\x00\x00\x00\x00\x02ok"
        self.writer.write(
            self.headers(stream, [(":status", "200"), ("content-type", "application/grpc")])
            + frame(DATA, 0, stream, message)
            + self.headers(stream, [("grpc-status", str(status)), ("grpc-message", "m")], END_STREAM)
        )


async def answer_at_once(peer: ScriptedPeer, stream: int) -> None:
    await peer.answer(stream)


def test_padded_prioritised_and_continued_header_blocks_are_read() -> None:
    async def awkward(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        start = peer.encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
        padded = bytes([3]) + b"\x00\x00\x00\x00\x10" + start + b"\x00" * 3  # pad length, priority, block, padding
        trailers = peer.encoder.encode([("grpc-status", "5"), ("grpc-message", "not here")])
        peer.writer.write(
            frame(HEADERS, END_HEADERS | PADDED | PRIORITY, stream, padded)
            + frame(DATA, PADDED, stream, bytes([2]) + b"\x00\x00\x00\x00\x00" + b"\x00\x00")
            + frame(HEADERS, END_STREAM, stream, trailers[:3])
            + frame(CONTINUATION, END_HEADERS, stream, trailers[3:])
        )

    async def go() -> list[str | None]:
        async with ScriptedPeer(awkward) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = [await channel.call(10) for _ in range(3)]
            await channel.close()
            return outcomes

    assert run(go()) == ["NOT_FOUND"] * 3


def test_an_abandoned_streams_answer_still_feeds_the_header_table() -> None:
    """The first request times out; its answer comes later and indexes headers the next answer refers to."""
    held: list[int] = []

    async def late_then_prompt(peer: ScriptedPeer, stream: int) -> None:
        if not held:
            held.append(stream)
            return
        await peer.answer(held[0], status=0)  # the abandoned stream's answer, read only for its headers
        await peer.answer(stream, status=3)

    async def go() -> tuple[str | None, str | None, list[int]]:
        async with ScriptedPeer(late_then_prompt) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            first = await channel.call(0.2)
            second = await channel.call(10)
            await channel.close()
            return first, second, peer.resets

    first, second, resets = run(go())  # type: ignore[misc]
    assert (first, second) == ("DEADLINE_EXCEEDED", "INVALID_ARGUMENT")
    assert resets == [1]  # the client reset the stream it gave up on


def test_a_stream_limit_of_one_serialises_requests() -> None:
    in_flight: list[int] = []
    most: list[int] = [0]

    async def slow(peer: ScriptedPeer, stream: int) -> None:
        in_flight.append(stream)
        most[0] = max(most[0], len(in_flight))
        await asyncio.sleep(0.01)
        in_flight.remove(stream)
        await peer.answer(stream)

    async def go() -> list[str | None]:
        settings = struct.pack(">HI", grpc_h2.SETTINGS_MAX_CONCURRENT_STREAMS, 1)
        async with ScriptedPeer(slow, settings) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = await asyncio.gather(*(channel.call(10) for _ in range(5)))
            await channel.close()
            return list(outcomes)

    assert run(go()) == [None] * 5
    assert most[0] == 1


def test_goaway_sends_what_the_server_did_not_process_on_a_new_connection() -> None:
    """Stream 3, above the GOAWAY's last id, was not processed: it goes to a new connection, as grpc's client's
    transparent retry sends it, instead of failing UNAVAILABLE."""

    async def go_away_after_first(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if stream == 3 and len(peer.writers) == 1:
            peer.writer.write(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
            return
        await peer.answer(stream)

    async def go() -> tuple[list[str | None], list[int], int]:
        async with ScriptedPeer(go_away_after_first) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = [await channel.call(10), await channel.call(10), await channel.call(10)]
            await channel.close()
            return outcomes, peer.requests, len(peer.writers)

    outcomes, requests, connections = run(go())  # type: ignore[misc]
    assert outcomes == [None, None, None]
    assert (requests, connections) == ([1, 3, 1, 3], 2)  # the second connection's streams start at 1 again


def test_after_goaway_a_stream_it_kept_is_answered_and_then_the_old_connection_is_closed() -> None:
    async def go_away_then_answer(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if stream == 1 and len(peer.writers) == 1:
            peer.writer.write(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0)))  # stream 1 is still processed
        await peer.answer(stream)

    async def go() -> tuple[list[str | None], int]:
        async with ScriptedPeer(go_away_then_answer) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = [await channel.call(10), await channel.call(10)]
            while peer.hung_up < 1:  # the client closes the drained connection without being asked
                await asyncio.sleep(0.005)
            hung_up_before_close = peer.hung_up
            await channel.close()
            return outcomes, hung_up_before_close

    assert run(go()) == ([None, None], 1)


def test_a_refused_stream_is_sent_again_when_another_stream_is_reset() -> None:
    """Stream 1 is refused while stream 3 is open; stream 3 then ends by RST_STREAM (not an answer), which
    frees a stream just as well: stream 1's request goes again as stream 5."""

    async def refuse_then_reset(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if stream == 1:
            peer.writer.write(frame(RST_STREAM, 0, 1, struct.pack(">I", grpc_h2.REFUSED_STREAM)))
        elif stream == 3:  # written after stream 1's refusal: the tasks answer in the order the requests came
            peer.writer.write(frame(RST_STREAM, 0, 3, struct.pack(">I", 0x2)))  # INTERNAL_ERROR
        else:
            await peer.answer(stream)

    async def go() -> tuple[list[str | None], list[int]]:
        async with ScriptedPeer(refuse_then_reset) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            await channel.connect()
            outcomes = await asyncio.gather(channel.call(20), channel.call(20))
            await channel.close()
            return list(outcomes), peer.requests

    outcomes, requests = run(go())  # type: ignore[misc]
    assert outcomes == [None, "INTERNAL"]
    assert requests == [1, 3, 5]


def test_a_server_that_never_finishes_the_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the deadline: DEADLINE_EXCEEDED, as grpc.aio says for the same server. The handshake is bounded
    (HANDSHAKE_S, 1 s here): past it the connection is given up as UNAVAILABLE, and the next request opens a
    new one instead of waiting on the stuck one for ever."""
    monkeypatch.setattr(grpc_h2, "HANDSHAKE_S", 1.0)

    async def go() -> tuple[str | None, str | None, str | None, str | None, int]:
        async with ScriptedPeer(answer_at_once, settings_after_s=None) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            mine = await channel.call(0.3)
            theirs = await aio_outcome(peer.target, b"x", timeout_s=0.3)
            stuck = await channel.call(60)  # waits on the first connection's handshake, until its bound
            again = await channel.call(60)
            await channel.close()
            return mine, theirs, stuck, again, len(peer.writers)

    mine, theirs, stuck, again, connections = run(go())  # type: ignore[misc]
    assert mine == theirs == "DEADLINE_EXCEEDED"
    assert stuck == again == "UNAVAILABLE"
    assert connections == 3  # the sender's two and grpc.aio's one


def test_the_deadline_counts_the_time_spent_connecting() -> None:
    """The server's SETTINGS come 2 s after the connection; a request with a 2.5 s deadline that the server
    never answers ends at its deadline, not 2.5 s after the handshake (which would be past 4.5 s)."""

    async def never(peer: ScriptedPeer, stream: int) -> None:
        return

    async def go() -> tuple[str | None, float]:
        async with ScriptedPeer(never, settings_after_s=2.0) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            loop = asyncio.get_running_loop()
            started = loop.time()
            outcome = await channel.call(2.5)
            took = loop.time() - started
            await channel.close()
            return outcome, took

    outcome, took = run(go())  # type: ignore[misc]
    assert outcome == "DEADLINE_EXCEEDED"
    assert took < 4.4


def test_the_client_turns_push_off() -> None:
    async def go() -> list[bytes]:
        async with ScriptedPeer(answer_at_once) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            assert await channel.call(10) is None
            await channel.close()
            return peer.client_settings

    [settings] = run(go())  # type: ignore[misc]
    pairs = dict(struct.iter_unpack(">HI", settings))
    assert pairs[grpc_h2.SETTINGS_ENABLE_PUSH] == 0


def test_a_malformed_status_fails_its_own_request_only() -> None:
    async def odd_statuses(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if stream == 1:
            peer.writer.write(
                peer.headers(stream, [(":status", "200")]) + peer.headers(stream, [("grpc-status", "abc")], END_STREAM)
            )
        elif stream == 3:
            peer.writer.write(peer.headers(stream, [(":status", "x2")], END_STREAM))
        else:
            await peer.answer(stream)

    async def go() -> tuple[list[str | None], int]:
        async with ScriptedPeer(odd_statuses) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = [await channel.call(10) for _ in range(3)]
            await channel.close()
            return outcomes, len(peer.writers)

    assert run(go()) == (["UNKNOWN", "UNKNOWN", None], 1)  # the same connection served the third


@pytest.mark.parametrize(
    "broken",
    [
        frame(SETTINGS, 0, 0, b"\x00\x04\x00"),  # not a multiple of 6
        frame(HEADERS, END_HEADERS | PADDED, 1, b""),  # padded, with no room for the pad length
        frame(HEADERS, END_HEADERS | PADDED, 1, b"\x05ab"),  # more padding than frame
    ],
    ids=["settings-length", "empty-padded", "over-padded"],
)
def test_a_malformed_frame_ends_the_connection_as_internal(broken: bytes) -> None:
    async def send_broken(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if len(peer.writers) == 1:
            peer.writer.write(broken)
        else:
            await peer.answer(stream)

    async def go() -> list[str | None]:
        async with ScriptedPeer(send_broken) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = [await channel.call(10), await channel.call(10)]  # the second on a new connection
            await channel.close()
            return outcomes

    assert run(go()) == ["INTERNAL", None]


def test_closing_the_channel_cancels_what_it_carries() -> None:
    """One request on a stream and one waiting for a stream (limit 1) both end CANCELLED at close."""

    async def never(peer: ScriptedPeer, stream: int) -> None:
        return

    async def go() -> list[str | None]:
        settings = struct.pack(">HI", grpc_h2.SETTINGS_MAX_CONCURRENT_STREAMS, 1)
        async with ScriptedPeer(never, settings) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            await channel.connect()
            calls = [asyncio.ensure_future(channel.call(30)) for _ in range(2)]
            while not peer.requests:
                await asyncio.sleep(0.005)
            await channel.close()
            return list(await asyncio.gather(*calls))

    assert run(go()) == ["CANCELLED", "CANCELLED"]


def test_a_window_shrunk_after_the_handshake_hands_over_to_grpc_aio() -> None:
    """The server lowers its stream window below the request's size in mid-connection: the sender stops
    using the connection, and shoal-load's next request goes through grpc.aio (which this peer cannot
    serve: its deadline passes)."""

    async def shrink(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        peer.settings = struct.pack(">HI", grpc_h2.SETTINGS_INITIAL_WINDOW_SIZE, 4)
        peer.writer.write(frame(SETTINGS, 0, 0, peer.settings))
        await peer.answer(stream)

    async def go() -> tuple[str | None, str | None, type]:
        async with ScriptedPeer(shrink) as peer:
            senders = engine._Senders(peer.target, b"0123456789", 1, 8)
            await senders.connect(10)
            first = await senders.send(0, 10)
            second = await senders.send(0, 0.5)
            kind = type(senders.channels[0])
            await senders.close()
            return first, second, kind

    assert run(go()) == (None, "DEADLINE_EXCEEDED", engine._AioChannel)


def test_a_lost_connection_fails_what_was_in_flight() -> None:
    async def hang_up(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        peer.writer.transport.abort()

    async def go() -> str | None:
        async with ScriptedPeer(hang_up) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcome = await channel.call(10)
            await channel.close()
            return outcome

    assert run(go()) == "UNAVAILABLE"


def test_a_peer_window_smaller_than_the_request_hands_over_to_grpc_aio() -> None:
    async def go() -> type:
        settings = struct.pack(">HI", grpc_h2.SETTINGS_INITIAL_WINDOW_SIZE, 4)
        async with ScriptedPeer(answer_at_once, settings) as peer:
            senders = engine._Senders(peer.target, b"0123456789", 1, 8)
            await senders.connect(0.5)  # the grpc.aio channel cannot finish its handshake with this peer
            kind = type(senders.channels[0])
            await senders.close()
            return kind

    assert run(go()) is engine._AioChannel


def test_cancelling_a_request_resets_its_stream() -> None:
    async def never(peer: ScriptedPeer, stream: int) -> None:
        return

    async def go() -> list[int]:
        async with ScriptedPeer(never) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            task = asyncio.ensure_future(channel.call(10))
            while not peer.requests:
                await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            while not peer.resets:
                await asyncio.sleep(0.005)
            await channel.close()
            return peer.resets

    assert run(go()) == [1]


def test_a_refused_stream_is_sent_again_and_one_always_refused_fails() -> None:
    """REFUSED_STREAM means the server did not process it (grpc's server refuses a stream a little past its
    limit): sent again, as grpc's client does, up to MAX_RETRIES times, then UNAVAILABLE."""

    async def refuse_first(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if stream == 1:
            peer.writer.write(frame(RST_STREAM, 0, stream, struct.pack(">I", grpc_h2.REFUSED_STREAM)))
        else:
            await peer.answer(stream)

    async def refuse_all(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        peer.writer.write(frame(RST_STREAM, 0, stream, struct.pack(">I", grpc_h2.REFUSED_STREAM)))

    async def go(respond: Respond) -> tuple[str | None, int]:
        async with ScriptedPeer(respond) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcome = await channel.call(10)
            await channel.close()
            return outcome, len(peer.requests)

    assert run(go(refuse_first)) == (None, 2)
    assert run(go(refuse_all)) == ("UNAVAILABLE", grpc_h2.MAX_RETRIES + 1)


def test_refusals_while_other_streams_are_open_do_not_use_up_the_retries() -> None:
    """A server that holds one stream at a time and refuses the others while it is open (as grpc's does a little
    past its limit, for longer on a busy machine): the last of 12 requests is refused 11 times, more than
    MAX_RETRIES, yet every refusal had another stream open to explain it, so all 12 succeed."""
    calls = 12
    state = {"open": 0, "refused": 0, "answered": 0}

    async def one_at_a_time(peer: ScriptedPeer, stream: int) -> None:
        assert peer.writer is not None
        if state["open"]:
            peer.writer.write(frame(RST_STREAM, 0, stream, struct.pack(">I", grpc_h2.REFUSED_STREAM)))
            state["refused"] += 1
        else:
            state["open"], state["refused"] = stream, 0
        if state["refused"] == calls - state["answered"] - 1:  # every other request of this round refused
            await peer.answer(state["open"])
            state["open"], state["answered"] = 0, state["answered"] + 1

    async def go() -> list[str | None]:
        async with ScriptedPeer(one_at_a_time) as peer:
            channel = PrebuiltGrpcChannel(peer.target, INFER_PATH, b"x")
            outcomes = await asyncio.gather(*(channel.call(30) for _ in range(calls)))
            await channel.close()
            return list(outcomes)

    assert calls - 1 > grpc_h2.MAX_RETRIES
    assert run(go()) == [None] * calls

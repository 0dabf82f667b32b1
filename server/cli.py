"""The ``shoal`` command (also ``python -m server``): argument parsing and logging setup."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from server import __version__
from server.settings import ServerSettings, TlsSettings

SUBCOMMANDS = ("serve",)


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Shoal model server")
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model repository over gRPC (KServe v2 / Triton)")
    serve.add_argument("--model-repository", type=Path, required=True, help="folder of model folders")
    serve.add_argument("--grpc-address", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    serve.add_argument("--grpc-port", type=_port, default=8001, help="port (default 8001; 0 = any free)")
    serve.add_argument("--log-verbose", type=int, default=0, help="0 = info, 1 or more = debug")
    serve.add_argument(
        "--strict-readiness", type=_bool, default=True,
        help="ServerReady is true only while every model is ready (default true, as Triton)",
    )
    serve.add_argument(
        "--exit-timeout-secs", type=float, default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish",
    )
    serve.add_argument("--port-file", type=Path, help="write the bound gRPC port to this file once serving")
    tls = serve.add_argument_group("TLS (Triton's flag names)")
    tls.add_argument("--grpc-use-ssl", type=_bool, default=False, help="serve gRPC over TLS")
    tls.add_argument("--grpc-server-cert", type=Path, help="PEM certificate chain of the server")
    tls.add_argument("--grpc-server-key", type=Path, help="PEM private key of the server")
    tls.add_argument("--grpc-root-cert", type=Path, help="PEM CA that signs client certificates (for mTLS)")
    tls.add_argument("--grpc-use-ssl-mutual", type=_bool, default=False, help="require client certificates")
    return parser


def _tls_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TlsSettings | None:
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    if not args.grpc_server_cert or not args.grpc_server_key:
        parser.error("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
    if args.grpc_use_ssl_mutual and not args.grpc_root_cert:
        parser.error("--grpc-use-ssl-mutual needs --grpc-root-cert")
    for path in (args.grpc_server_cert, args.grpc_server_key, args.grpc_root_cert):
        if path is not None and not path.is_file():
            parser.error(f"TLS file {path} does not exist")
    return TlsSettings(args.grpc_server_cert, args.grpc_server_key, args.grpc_root_cert, args.grpc_use_ssl_mutual)


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0].startswith("--") and args_list[0] not in {"--help", "--version"}:
        args_list.insert(0, "serve")  # `python -m server --model-repository ...` means serve
    parser = build_parser()
    args = parser.parse_args(args_list)
    tls = _tls_settings(parser, args)
    logging.basicConfig(
        level=logging.DEBUG if args.log_verbose > 0 else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
    )
    if not args.model_repository.is_dir():
        print(f"shoal: error: model repository {args.model_repository} is not a folder", file=sys.stderr)
        return 2
    settings = ServerSettings(
        model_repository=args.model_repository,
        grpc_address=args.grpc_address,
        grpc_port=args.grpc_port,
        strict_readiness=args.strict_readiness,
        exit_timeout_s=args.exit_timeout_secs,
        port_file=args.port_file,
        tls=tls,
    )
    asyncio.run(_serve(settings))
    return 0


async def _serve(settings: ServerSettings) -> None:
    from server.app import serve  # imported late so --help stays fast

    await serve(settings)

"""TLS and mutual TLS: a real server with certificates made by openssl, called by Shoal's client."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from shoal.clients import ClientError, InferenceClient, TlsOptions
from tests import models

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by the CA."""
    folder = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=shoal-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=folder,
    )
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, extension in (("server", ["-extfile", "san.ext"]), ("client", [])):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=folder,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            f"{name}.pem",
            *extension,
            cwd=folder,
        )
    return folder


def _client_tls(pki: Path, with_certificate: bool) -> TlsOptions:
    return TlsOptions(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if with_certificate else None,
        certificate_chain=(pki / "client.pem").read_bytes() if with_certificate else None,
        server_name="localhost",
    )


def test_tls(pki: Path, tmp_path: Path, server_factory) -> None:
    credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    repo = models.repository(tmp_path, "simple")
    server = server_factory(
        repo,
        "--grpc-use-ssl",
        "true",
        "--grpc-server-cert",
        str(pki / "server.pem"),
        "--grpc-server-key",
        str(pki / "server.key"),
        credentials=credentials,
    )
    with InferenceClient(server.url, tls=_client_tls(pki, with_certificate=False), timeout_s=10) as client:
        assert client.is_model_ready("simple")
    # pygrpc-native has no TLS: --grpc-engine auto serves it on grpc.aio, and says so (in each worker too)
    assert "(engine grpcio: TLS is on, which pygrpc-native cannot serve)" in server.log(), server.log()
    assert "engine native" not in server.log()
    with InferenceClient(server.url, timeout_s=5) as plaintext:
        with pytest.raises(ClientError) as caught:
            plaintext.is_live()
    assert caught.value.status == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(pki: Path, tmp_path: Path, server_factory) -> None:
    credentials = grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(), (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
    )
    repo = models.repository(tmp_path, "simple")
    server = server_factory(
        repo,
        "--grpc-use-ssl-mutual",
        "true",
        "--grpc-server-cert",
        str(pki / "server.pem"),
        "--grpc-server-key",
        str(pki / "server.key"),
        "--grpc-root-cert",
        str(pki / "ca.pem"),
        credentials=credentials,
    )
    with InferenceClient(server.url, tls=_client_tls(pki, with_certificate=True), timeout_s=10) as client:
        assert client.is_model_ready("simple")
    with InferenceClient(server.url, tls=_client_tls(pki, with_certificate=False), timeout_s=5) as anonymous:
        with pytest.raises(ClientError) as caught:
            anonymous.is_live()
    assert caught.value.status == grpc.StatusCode.UNAVAILABLE


def test_the_native_engine_with_tls_is_a_clear_startup_error(pki: Path, tmp_path: Path) -> None:
    import sys

    repo = models.repository(tmp_path, "simple")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal",
            "serve",
            "--model-repository",
            str(repo),
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--metrics-port",
            "0",
            "--grpc-address",
            "127.0.0.1",
            "--grpc-engine",
            "native",
            "--grpc-use-ssl",
            "true",
            "--grpc-server-cert",
            str(pki / "server.pem"),
            "--grpc-server-key",
            str(pki / "server.key"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert (
        "--grpc-engine native cannot serve TLS (pygrpc-native has none); use --grpc-engine auto or grpcio"
        in result.stderr
    )


def test_tls_flags_are_checked() -> None:
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "shoal", "serve", "--model-repository", ".", "--grpc-use-ssl", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "needs --grpc-server-cert and --grpc-server-key" in result.stderr

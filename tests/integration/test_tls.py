"""`sluice serve` over TLS (HTTP and gRPC) and mutual TLS, with certificates made by `openssl`
for the test: the real `openai` SDK, httpx and `tritonclient.grpc` as clients."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, eventually, free_port, start_server, write_emulated_model

pytestmark = pytest.mark.slow


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _signed(folder: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    """A key and a certificate for `name`, signed by `ca` (certificate, key)."""
    key, request, cert, ext = (folder / f"{name}{suffix}" for suffix in (".key", ".csr", ".pem", ".ext"))
    ext.write_text(extensions)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-days", "2",
             "-out", cert, "-extfile", ext)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca = (folder / "ca.pem", folder / "ca.key")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca[1], "-out", ca[0], "-days", "2",
             "-subj", "/CN=sluice test CA")
    server = _signed(folder, "server", ca, "subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\n")
    client = _signed(folder, "client", ca, "extendedKeyUsage = clientAuth\n")
    return {"ca": ca[0], "server_cert": server[0], "server_key": server[1],
            "client_cert": client[0], "client_key": client[1]}


def _trusting(pki: dict[str, Path], with_client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if with_client_cert:
        context.load_cert_chain(pki["client_cert"], pki["client_key"])
    return context


def _serve(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path], *extra: str,
           tls: ssl.SSLContext) -> tuple[ServerProcess, int]:
    repo = write_emulated_model(tmp_path_factory.mktemp("repo"), slo_ms=30000)
    grpc_port = free_port()
    server = start_server(repo, tmp_path_factory.mktemp("log"), "--grpc-port", str(grpc_port),
                          "--ssl-certfile", str(pki["server_cert"]), "--ssl-keyfile", str(pki["server_key"]),
                          *extra, tls=tls)
    return server, grpc_port


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, pki) -> Iterator[tuple[ServerProcess, int]]:
    server, grpc_port = _serve(tmp_path_factory, pki, tls=_trusting(pki))
    yield server, grpc_port
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, pki) -> Iterator[tuple[ServerProcess, int]]:
    server, grpc_port = _serve(tmp_path_factory, pki, "--ssl-ca-certs", str(pki["ca"]),
                               tls=_trusting(pki, with_client_cert=True))
    yield server, grpc_port
    server.stop()


ROWS = np.arange(32, dtype=np.float32).reshape(2, 16)
INFER = {"inputs": [{"name": "INPUT0", "shape": [2, 16], "datatype": "FP32", "data": ROWS.ravel().tolist()}]}


def _grpc_sum(port: int, **tls: str) -> np.ndarray:
    """Row sums through tritonclient.grpc over TLS (`tls`: its file-path options)."""
    client = triton.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, **tls)
    try:
        tensor = triton.InferInput("INPUT0", list(ROWS.shape), "FP32")
        tensor.set_data_from_numpy(ROWS)
        return client.infer("emulated", [tensor], client_timeout=30).as_numpy("OUTPUT0")
    finally:
        client.close()


def test_https_and_grpc_over_tls_with_real_clients(tls_server, pki):
    server, grpc_port = tls_server
    assert server.url.startswith("https://")
    eventually(lambda: f"listening on https://127.0.0.1:{server.port}" in server.log(), "the banner")
    with httpx.Client(verify=_trusting(pki)) as http:
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", http_client=http)
        assert "emulated" in [model.id for model in sdk.models.list()]
        answer = http.post(f"{server.url}/v2/models/emulated/infer", json=INFER, timeout=30)
    assert answer.status_code == 200
    assert answer.json()["outputs"][0]["data"] == [120.0, 376.0]
    np.testing.assert_allclose(_grpc_sum(grpc_port, root_certificates=str(pki["ca"])), [120.0, 376.0])


def test_plain_http_and_untrusted_clients_are_not_served(tls_server):
    server, _ = tls_server
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server.port}/v2/health/ready", timeout=5)
    with pytest.raises(httpx.ConnectError):  # the system's CAs do not trust the test CA
        httpx.get(f"{server.url}/v2/health/ready", timeout=5)


def test_sluice_top_reads_an_https_server_given_its_ca(tls_server, pki):
    from tests.test_top import top_once

    server, _ = tls_server
    trusting = top_once(server.url, "--json", "--interval", "0.2", "--ca-certs", str(pki["ca"]))
    assert trusting.returncode == 0, trusting.stderr
    assert "emulated" in [row["model"] for row in json.loads(trusting.stdout)["models"]]
    untrusting = top_once(server.url, "--interval", "0.2")
    assert untrusting.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in untrusting.stderr


def test_mutual_tls_serves_only_clients_with_a_certificate_from_the_ca(mtls_server, pki):
    server, grpc_port = mtls_server
    with httpx.Client(verify=_trusting(pki, with_client_cert=True)) as http:
        assert http.post(f"{server.url}/v2/models/emulated/infer", json=INFER, timeout=30).status_code == 200
    with pytest.raises(httpx.HTTPError), httpx.Client(verify=_trusting(pki)) as anonymous:
        anonymous.post(f"{server.url}/v2/models/emulated/infer", json=INFER, timeout=10)
    client_tls = {"root_certificates": str(pki["ca"]), "private_key": str(pki["client_key"]),
                  "certificate_chain": str(pki["client_cert"])}
    np.testing.assert_allclose(_grpc_sum(grpc_port, **client_tls), [120.0, 376.0])
    with pytest.raises(InferenceServerException):
        _grpc_sum(grpc_port, root_certificates=str(pki["ca"]))


@pytest.mark.parametrize(("flags", "words"), [
    (["--ssl-certfile", "{server_cert}"], "give both --ssl-certfile and --ssl-keyfile"),
    (["--ssl-ca-certs", "{ca}"], "--ssl-ca-certs needs --ssl-certfile"),
    (["--ssl-certfile", "{server_cert}", "--ssl-keyfile", "{client_key}"], "cannot use the TLS certificate"),
    (["--ssl-certfile", "{server_cert}", "--ssl-keyfile", "{server_key}", "--ssl-ca-certs", "{server_key}"],
     "cannot read the client CA certificates"),
])
def test_unusable_tls_settings_stop_the_start_with_the_reason(tmp_path, pki, flags, words):
    repo = write_emulated_model(tmp_path / "repo")
    args = [flag.format(**pki) for flag in flags]
    done = subprocess.run([sys.executable, "-m", "sluice", "serve", "--models", str(repo), "--port", str(free_port()),
                           *args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert words in done.stderr

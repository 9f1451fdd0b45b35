"""TLS for the gateway's listeners (HTTP and gRPC), and mutual TLS when a CA is given.

    sluice serve --ssl-certfile server.pem --ssl-keyfile server.key [--ssl-ca-certs clients-ca.pem]

The certificate and key are read once at start, so a wrong path, a key that does not match the
certificate or an unreadable CA file stops `sluice serve` with that error instead of failing
each handshake later. With `--ssl-ca-certs` every client must present a certificate signed by one
of those CAs (HTTP and gRPC alike); API keys are still asked for on top when a tenants file is
in force. The gateway-to-worker link is not encrypted: it stays on the host (a Unix socket) or
inside the cluster's network.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from sluice.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TlsConfig:
    certfile: Path
    keyfile: Path
    ca_certs: Path | None = None
    """Clients must present a certificate signed by one of these CAs (mutual TLS)."""

    def check(self) -> None:
        """Load everything once, as each listener will: a ConfigError naming what is wrong."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot use the TLS certificate {self.certfile} with the key {self.keyfile}: "
                              f"{exc.strerror or exc}") from exc
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot read the client CA certificates {self.ca_certs}: {exc.strerror or exc}") \
                    from exc

    @property
    def uvicorn_options(self) -> dict[str, object]:
        return {
            "ssl_certfile": str(self.certfile),
            "ssl_keyfile": str(self.keyfile),
            "ssl_ca_certs": None if self.ca_certs is None else str(self.ca_certs),
            "ssl_cert_reqs": ssl.CERT_NONE if self.ca_certs is None else ssl.CERT_REQUIRED,
        }

    def grpc_credentials(self) -> grpc.ServerCredentials:
        roots = None if self.ca_certs is None else self.ca_certs.read_bytes()
        return grpc.ssl_server_credentials([(self.keyfile.read_bytes(), self.certfile.read_bytes())],
                                           root_certificates=roots, require_client_auth=roots is not None)

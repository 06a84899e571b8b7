"""TLS for Ferry's TCP ports, through grpcio's and uvicorn's own TLS: the certificate a service presents, and the CA
it checks its peers against (the router: the schedulers it dials; a scheduler: its callers, i.e. mutual TLS)."""
from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


def add_tls_args(parser: argparse.ArgumentParser, ca_help: str) -> None:
    parser.add_argument("--tls-cert", default="", help="PEM certificate (chain) this service presents; turns TLS on")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help=ca_help)


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""          # paths to PEM files
    key: str = ""
    ca: str = ""
    server_name: str = ""   # the name peers' certificates carry, when it is not the address dialed

    @property
    def serving(self) -> bool:
        return bool(self.cert)

    def check(self) -> None:
        """ValueError naming the flag when the files do not make a usable configuration."""
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file: {path}")
        if self.cert:
            try:
                ssl.create_default_context().load_cert_chain(self.cert, self.key)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"--tls-cert/--tls-key: not a matching PEM certificate and key: {e}") from e

    def server_credentials(self, require_client_cert: bool = False) -> grpc.ServerCredentials:
        """What a gRPC port serves with; with `require_client_cert`, callers must show a certificate --tls-ca signed."""
        return grpc.ssl_server_credentials([(read(self.key), read(self.cert))],
                                           root_certificates=read(self.ca) if require_client_cert else None,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """What a gRPC client dials with: trusts --tls-ca, and presents --tls-cert where a server asks for one."""
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca) if self.ca else None,
                                            private_key=read(self.key) if self.key else None,
                                            certificate_chain=read(self.cert) if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": self.cert, "ssl_keyfile": self.key} if self.serving else {}


def tls_config(args: argparse.Namespace) -> TlsConfig:
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca, getattr(args, "tls_server_name", ""))


def read(path: str) -> bytes:
    return Path(path).read_bytes()

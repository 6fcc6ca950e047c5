"""TLS material of `[security]` as gRPC credentials, and the one way the server listens.

`bind_port(server, address, config)` is what the server start-up calls instead of
`add_insecure_port`: TLS when `tls_cert` is set, mutual TLS (`require_client_auth`) when
`tls_client_ca` is set as well, plaintext otherwise. Plaintext with tokens on an address
other than loopback is allowed but logged as a warning: tokens then cross the network in
clear text.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from rlfeed.client.addressing import host_is_loopback
from rlfeed.service.config.security import SecurityConfig

_log = logging.getLogger(__name__)


def read_pem(path: str, field_name: str) -> bytes:
    """The bytes of a PEM file; ValueError naming the `[security]` field if unreadable or
    not PEM (never the content)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"[security] {field_name}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"[security] {field_name}: {path} is not a PEM file")
    return data


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials:
    """TLS server credentials of `config` (which must have `tls`): the certificate chain and
    key; with `tls_client_ca`, clients must present a certificate that chains to it."""
    if not config.tls:
        raise ValueError("[security] tls_cert: not set, so there is no TLS to configure")
    key = read_pem(config.tls_key, "tls_key")
    chain = read_pem(config.tls_cert, "tls_cert")
    client_ca = read_pem(config.tls_client_ca, "tls_client_ca") if config.mutual_tls else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(*, ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Client-side TLS credentials from PEM paths: `ca` to verify the server (system roots
    when ''), `cert` + `key` to present for mutual TLS (e.g. a front-end reaching its
    peers with the sidecar's own material, or `rlfeed status` on the sidecar's host)."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs its key and the other way round")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "tls_ca") if ca else None,
        private_key=read_pem(key, "tls_key") if key else None,
        certificate_chain=read_pem(cert, "tls_cert") if cert else None,
    )


def is_loopback(address: str) -> bool:
    """Whether "host:port" (IPv6 in brackets) names only this host."""
    return host_is_loopback(address.rsplit(":", 1)[0].strip("[]"))


def bind_port(server: grpc.Server, address: str, config: SecurityConfig) -> int:
    """Listen on `address` ("host:port"; port 0 picks one) per `config`; returns the port.
    RuntimeError if the address cannot be bound."""
    if config.tls:
        port = server.add_secure_port(address, server_credentials(config))
    else:
        if config.tokens and not is_loopback(address):
            _log.warning(
                "rlfeed: %s serves plaintext with tokens: tokens cross the network in clear "
                "text ([security] tls_cert and tls_key turn on TLS)",
                address,
            )
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    return port

"""`[security]`: transport security and tokens of the public gRPC port.

Every field is a path or a switch, never a secret itself, so the resolved config can be
printed and dumped at start-up as every other section. Empty paths mean "off": the
defaults are plaintext without tokens, which is safe only on loopback (the default host).
Structure is checked when the section is built (`ValueError` naming the field);
`rlfeed.service.security.files.check_files` reads the files, for start-up to fail before
it listens.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfeed.service.config.fields import documented, requirement

_require = requirement("security")


@dataclass(kw_only=True, frozen=True)
class SecurityConfig:
    """Who may connect and call: TLS or mutual TLS, and bearer tokens with roles."""

    tls_cert: str = documented(
        "",
        "PEM certificate chain the gRPC port presents (path); with tls_key, the port "
        "speaks TLS only; '' = plaintext",
    )
    tls_key: str = documented(
        "", "PEM private key of tls_cert (path; keep it mode 0600); '' = none"
    )
    tls_client_ca: str = documented(
        "",
        "PEM CA certificates (path) a client's certificate must chain to: mutual TLS, a "
        "client without one fails the handshake; needs tls_cert; '' = no client certificates",
    )
    auth_token_file: str = documented(
        "",
        "file of 'TOKEN ROLE' lines (path; roles producer, trainer, admin): every rlfeed.v1 "
        "call then needs 'authorization: Bearer TOKEN' metadata of a role allowed for it; "
        "re-read on SIGHUP; '' = no tokens",
    )
    allow_reflection: bool = documented(
        False,
        "serve gRPC server reflection on the public port (lists the services; with a token "
        "file it needs a token of any role); false = reflection calls are UNIMPLEMENTED",
    )

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            value = getattr(self, name)
            _require(isinstance(value, str), name, f"must be a path string, got {value!r}")
        _require(
            isinstance(self.allow_reflection, bool),
            "allow_reflection",
            f"must be true or false, got {self.allow_reflection!r}",
        )
        _require(
            bool(self.tls_cert) == bool(self.tls_key),
            "tls_key" if self.tls_cert else "tls_cert",
            "tls_cert and tls_key are set together (TLS needs both)",
        )
        _require(
            not self.tls_client_ca or bool(self.tls_cert),
            "tls_client_ca",
            "mutual TLS needs the server's own tls_cert and tls_key as well",
        )

    @property
    def tls(self) -> bool:
        """The port speaks TLS."""
        return bool(self.tls_cert)

    @property
    def mutual_tls(self) -> bool:
        """Clients must present a certificate signed by tls_client_ca."""
        return bool(self.tls_client_ca)

    @property
    def tokens(self) -> bool:
        """Calls need a bearer token."""
        return bool(self.auth_token_file)

    def summary(self) -> str:
        """What guards the port, for the "listening on" line: e.g. "TLS on, mTLS off,
        tokens on"."""
        switches = (("TLS", self.tls), ("mTLS", self.mutual_tls), ("tokens", self.tokens))
        return ", ".join(f"{name} {'on' if on else 'off'}" for name, on in switches)

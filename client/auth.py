"""The client's credentials for a secured sidecar: a bearer token and TLS material.

Each setting comes from its argument, else from the environment, so code written for a
plain sidecar (the README examples) runs unchanged against a secured one:

    argument         environment          meaning
    token            RLFEED_TOKEN         bearer token sent on every call
                     RLFEED_TOKEN_FILE    file holding it (first field of the first line
                                          that is not blank or a # comment)
    tls_ca           RLFEED_TLS_CA        PEM CA file to verify the sidecar (turns on TLS)
    tls_cert         RLFEED_TLS_CERT      PEM client certificate for mutual TLS (TLS too)
    tls_key          RLFEED_TLS_KEY       its PEM private key
    tls_server_name  RLFEED_TLS_SERVER_NAME  name to verify in the sidecar's certificate
                                          when it differs from the address's host; needed
                                          for a list of front-ends on several hosts
                                          (`client/addressing.py`), every one of whose
                                          certificates must carry it

An argument of "" means "none" and skips the environment. With TLS but no `tls_ca`, the
system's root certificates verify the sidecar. The token rides as `authorization: Bearer
<token>` metadata on every call, added by a client interceptor, so it works over TLS and
over plaintext alike; over plaintext to a host that is not loopback it crosses the
network in clear text, which is logged as a warning when the channel opens. The token
is kept out of `repr`, logs and error messages.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11; annotations only

from rlfeed.client.addressing import SidecarTarget, host_is_loopback, parse_address, tls_name

_log = logging.getLogger(__name__)

ENV_TOKEN = "RLFEED_TOKEN"
ENV_TOKEN_FILE = "RLFEED_TOKEN_FILE"
ENV_TLS_CA = "RLFEED_TLS_CA"
ENV_TLS_CERT = "RLFEED_TLS_CERT"
ENV_TLS_KEY = "RLFEED_TLS_KEY"
ENV_TLS_SERVER_NAME = "RLFEED_TLS_SERVER_NAME"


def _setting(value: str | None, env: str, environ: Mapping[str, str]) -> str:
    if value is not None:
        return str(value)
    return environ.get(env, "")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None


def _token_from_file(path: str) -> str:
    for line in _read(path, ENV_TOKEN_FILE).decode("utf-8", "replace").splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            return fields[0]
    raise ValueError(f"{ENV_TOKEN_FILE}: {path} holds no token")


@dataclass(frozen=True, kw_only=True)
class ChannelSecurity:
    """Resolved credentials for one channel (`resolve` builds it from arguments and the
    environment). `token` and `private_key` are left out of `repr`."""

    token: str = field(default="", repr=False)
    root_certificates: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    tls: bool = False
    server_name: str = ""

    @classmethod
    def resolve(
        cls,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ChannelSecurity:
        """Arguments first, then the environment (module docstring). ValueError for a
        certificate without its key (or the other way round), an unreadable file or a
        token that is not printable ASCII; messages name the setting, never the token."""
        environ = os.environ if environ is None else environ
        source = "token"
        if token is None:
            token = environ.get(ENV_TOKEN, "")
            source = ENV_TOKEN
            if not token and environ.get(ENV_TOKEN_FILE):
                token = _token_from_file(environ[ENV_TOKEN_FILE])
                source = ENV_TOKEN_FILE
        token = token.strip()
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            raise ValueError(f"{source}: the token must be printable ASCII without spaces")
        ca = _setting(tls_ca, ENV_TLS_CA, environ)
        cert = _setting(tls_cert, ENV_TLS_CERT, environ)
        key = _setting(tls_key, ENV_TLS_KEY, environ)
        if bool(cert) != bool(key):
            raise ValueError(
                "tls_cert and tls_key (RLFEED_TLS_CERT, RLFEED_TLS_KEY) go together: a client "
                "certificate needs its private key"
            )
        return cls(
            token=token,
            root_certificates=_read(ca, "tls_ca") if ca else None,
            certificate_chain=_read(cert, "tls_cert") if cert else None,
            private_key=_read(key, "tls_key") if key else None,
            tls=bool(ca or cert),
            server_name=_setting(tls_server_name, ENV_TLS_SERVER_NAME, environ),
        )


class Credentials(TypedDict, total=False):
    """The credential keyword arguments that `RolloutWriter`, `BatchLoader` and
    `GrpcTransport` take (`**credentials`), each as `ChannelSecurity.resolve` reads it:
    None (or absent) = from the environment, "" = none."""

    token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_server_name: str | None


CREDENTIAL_NAMES = ("token", "tls_ca", "tls_cert", "tls_key", "tls_server_name")


def given_credentials(security: ChannelSecurity | None, credentials: Mapping[str, Any]) -> str:
    """The settings a caller gave, sorted and comma-joined ("" for none): `security` when
    it is set, and each credential keyword that is not None. TypeError for a keyword that
    is not a credential (as Python's own for an unknown argument) or a `security` that is
    not a `ChannelSecurity`."""
    unknown = sorted(set(credentials) - set(CREDENTIAL_NAMES))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    if security is not None and not isinstance(security, ChannelSecurity):
        raise TypeError(f"security must be a ChannelSecurity, got {type(security).__name__}")
    named = sorted(name for name, value in credentials.items() if value is not None)
    return ", ".join(([] if security is None else ["security"]) + named)


def channel_security(
    security: ChannelSecurity | None = None, **credentials: Unpack[Credentials]
) -> ChannelSecurity:
    """The one place a client's credential arguments become a `ChannelSecurity`: `security`
    as given, else `ChannelSecurity.resolve(**credentials)` (arguments, then the
    environment). ValueError when both are given: which one would win?"""
    named = given_credentials(security, credentials)
    if security is None:
        return ChannelSecurity.resolve(**credentials)
    if named != "security":
        raise ValueError(f"{named}: give security= or the credential keywords, not both")
    return security


def _is_loopback(target: SidecarTarget) -> bool:
    """Every host the target names is this machine (a unix: socket is)."""
    if target.address.startswith("unix"):
        return True
    return bool(target.hosts) and all(host_is_loopback(host) for host in target.hosts)


_CallDetails = collections.namedtuple(
    "_CallDetails",
    ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
)


def _bearer_interceptor(token: str) -> Any:
    """A client interceptor of all four call kinds adding `authorization: Bearer` metadata."""
    import grpc

    entry = ("authorization", f"Bearer {token}")

    class BearerToken(
        grpc.UnaryUnaryClientInterceptor,
        grpc.UnaryStreamClientInterceptor,
        grpc.StreamUnaryClientInterceptor,
        grpc.StreamStreamClientInterceptor,
    ):
        def _with_token(self, details):
            metadata = [*(details.metadata or ()), entry]
            return _CallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                getattr(details, "wait_for_ready", None),
                getattr(details, "compression", None),
            )

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._with_token(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._with_token(details), request)

        def intercept_stream_unary(self, continuation, details, request_iterator):
            return continuation(self._with_token(details), request_iterator)

        def intercept_stream_stream(self, continuation, details, request_iterator):
            return continuation(self._with_token(details), request_iterator)

        def __repr__(self) -> str:
            return "BearerToken(<hidden>)"

    return BearerToken()


def open_channel(
    address: str, security: ChannelSecurity, options: list[tuple[str, Any]] | None = None
):
    """A gRPC channel to `address` (any form `client.addressing` takes: one front-end, a
    list, a gRPC target; round_robin over several) with `security`: secure when
    `security.tls`, and with the bearer token on every call when it has one. ValueError
    for an address it cannot parse, and for TLS to front-ends on several hosts without
    `server_name` (which name would their certificates carry?)."""
    import grpc

    target = parse_address(address)
    options = [*(options or ()), *target.channel_options]
    if security.tls:
        server_name = tls_name(target, security.server_name)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=security.root_certificates,
            private_key=security.private_key,
            certificate_chain=security.certificate_chain,
        )
        channel = grpc.secure_channel(target.target, credentials, options=options)
    else:
        if security.token and not _is_loopback(target):
            _log.warning(
                "rlfeed: sending the token to %s over plaintext (set RLFEED_TLS_CA for TLS)",
                address,
            )
        channel = grpc.insecure_channel(target.target, options=options)
    if security.token:
        channel = grpc.intercept_channel(channel, _bearer_interceptor(security.token))
    return channel

"""Telling a TLS mistake from a sidecar that is down, from gRPC's own words.

gRPC answers both with UNAVAILABLE ("failed to connect to all addresses"); only the last
connection error in its details differs (grpcio 1.85, C-core):

    client's mistake                     gRPC's last error
    no CA / wrong CA (RLFEED_TLS_CA)     Tls handshake failed ... CERTIFICATE_VERIFY_FAILED
    an expired / not yet valid cert      ... CERTIFICATE_VERIFY_FAILED: certificate has expired
    wrong name (RLFEED_TLS_SERVER_NAME)  Custom verification check failed ... Hostname
                                         Verification Check failed
    TLS client on a plaintext port       Tls handshake failed ... WRONG_VERSION_NUMBER
    mTLS port, no or a foreign client    Socket closed
    certificate; plaintext client on a
    TLS port

A handshake failure never heals by asking again, so the clients raise it at once instead
of retrying for their connect budget (`client/retry.py`). "Socket closed" alone is weaker
evidence (a sidecar going down mid-connection says it too), so it is `certain=False`:
the retry raises it only while the sidecar has never answered this client and it keeps
saying so (`SUSPECT_FOR_S`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfeed.client.auth import (
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TLS_SERVER_NAME,
    ChannelSecurity,
)

SUSPECT_FOR_S = 1.5
"""How long a never-answered client sees only "Socket closed" before calling it a TLS
mismatch (a few reconnect attempts; a restart's refusals or a live sidecar end it)."""


@dataclass(frozen=True)
class Handshake:
    """What a client's channel was set up with, for the advice (never the material)."""

    tls: bool = False
    client_cert: bool = False
    ca: bool = False
    server_name: str = ""

    @classmethod
    def of(cls, security: ChannelSecurity) -> Handshake:
        return cls(
            tls=security.tls,
            client_cert=security.certificate_chain is not None,
            ca=security.root_certificates is not None,
            server_name=security.server_name,
        )


@dataclass(frozen=True)
class Diagnosis:
    """`advice`: the sentence to show (what failed; what to check). `certain`: the
    gRPC words leave no other reading."""

    advice: str
    certain: bool


def last_error(details: str) -> str:
    """gRPC's last connection error out of an UNAVAILABLE's details (the whole text when
    it has no "last error:" part)."""
    return details.rsplit("last error: ", 1)[-1].strip()


def diagnose(details: str, handshake: Handshake) -> Diagnosis | None:
    """The TLS reading of an UNAVAILABLE's `details`, or None when it is not a handshake
    failure (nothing listens, a name that does not resolve, ...)."""
    reason = last_error(details)
    if "Hostname Verification" in reason or "No match found for server name" in reason:
        name = f" {handshake.server_name!r}" if handshake.server_name else " the address's host"
        return Diagnosis(
            f"the sidecar's certificate does not carry the name{name}: set "
            f"{ENV_TLS_SERVER_NAME} (tls_server_name) to a name in its certificate",
            certain=True,
        )
    if "CERTIFICATE_VERIFY_FAILED" in reason or "certificate verify failed" in reason:
        if "expired" in reason or "not yet valid" in reason:
            when = "has expired" if "expired" in reason else "is not valid yet"
            return Diagnosis(
                f"the sidecar's certificate {when}: renew its [security] tls_cert (or "
                "check the clocks of both hosts)",
                certain=True,
            )
        against = (
            f"the CA in {ENV_TLS_CA}"
            if handshake.ca
            else f"the system's root certificates ({ENV_TLS_CA} is not set)"
        )
        return Diagnosis(
            f"the sidecar's certificate does not verify against {against}: set "
            f"{ENV_TLS_CA} (tls_ca) to the CA that signed it",
            certain=True,
        )
    if "WRONG_VERSION_NUMBER" in reason or "wrong version number" in reason:
        return Diagnosis(
            "the sidecar does not speak TLS there (a plaintext port): unset "
            f"{ENV_TLS_CA} / {ENV_TLS_CERT}, or start it with --tls-cert and --tls-key",
            certain=True,
        )
    if "handshake failed" in reason.lower():
        return Diagnosis(
            f"check {ENV_TLS_CA}, {ENV_TLS_SERVER_NAME} and the sidecar's TLS settings",
            certain=True,
        )
    if "Socket closed" in reason and "failed to connect" in details:  # while connecting
        return Diagnosis(_closed_advice(handshake), certain=False)
    return None


def _closed_advice(handshake: Handshake) -> str:
    if not handshake.tls:
        return (
            "the sidecar closed the connection before answering: it may speak TLS only; "
            f"set {ENV_TLS_CA} to the CA of its certificate"
        )
    if not handshake.client_cert:
        return (
            "the sidecar closed the connection during the TLS handshake: it may require a "
            f"client certificate (mutual TLS); set {ENV_TLS_CERT} and {ENV_TLS_KEY}"
        )
    return (
        "the sidecar closed the connection during the TLS handshake: is the client "
        f"certificate in {ENV_TLS_CERT} signed by its --tls-client-ca?"
    )


def message(address: str, diagnosis: Diagnosis, details: str) -> str:
    """The one line for a handshake failure at `address`, gRPC's reason last."""
    reason = last_error(details)
    return (
        f"TLS handshake with the sidecar at {address} failed: {diagnosis.advice} (gRPC: {reason})"
    )

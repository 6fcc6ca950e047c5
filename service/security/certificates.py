"""The server's certificate and key, checked with the standard library before anything starts.

gRPC reads them only when the port is bound, after Ray has started, and then reports a
pair that does not match as "Failed to bind", which reads like a port in use; a client
facing an expired certificate only sees its handshake fail. So `rlfeed serve` checks:

- that `tls_cert` holds a certificate and `tls_key` a private key, and that they match
  (`ssl.SSLContext.load_cert_chain`, OpenSSL's own check);
- that the first certificate of `tls_cert` (the server's own) is valid now: neither
  expired nor not valid yet.

The dates come from `ssl._ssl._test_decode_cert`, CPython's decoder behind
`ssl.get_server_certificate`'s tests (present since Python 2.7; private, so where it is
missing the dates are not checked rather than failing): it keeps `cryptography` a test
dependency only.
"""

from __future__ import annotations

import datetime
import ssl


def _decoded(path: str, key: str) -> dict | None:
    """The first certificate of `path` as `ssl` decodes it; None if this Python has no
    decoder. ValueError (naming the key file too) if it holds no certificate."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    try:
        return decode(path)
    except (ssl.SSLError, OSError):
        raise ValueError(
            f"[security] tls_cert and tls_key: {path} holds no PEM certificate (the key "
            f"given as the certificate?); tls_key is {key}"
        ) from None


def _moment(text: str) -> datetime.datetime:
    seconds = ssl.cert_time_to_seconds(text)
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)


def check_certificate_pair(cert: str, key: str, now: datetime.datetime | None = None) -> None:
    """ValueError, one line naming both files, unless `cert` is a certificate valid at
    `now` (default: the current time) and `key` its private key."""
    decoded = _decoded(cert, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key gets an empty password (gRPC cannot use one) instead of a prompt.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            reason = "the key is not the certificate's (KEY_VALUES_MISMATCH)"
        else:
            reason = f"{key} holds no unencrypted PEM private key ({exc.reason or exc})"
        raise ValueError(
            f"[security] tls_cert and tls_key: {cert} and {key} are not a certificate and "
            f"its private key: {reason}"
        ) from None
    if decoded is None:
        return
    now = now or datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = _moment(decoded["notBefore"]), _moment(decoded["notAfter"])
    if now > not_after:
        raise ValueError(
            f"[security] tls_cert: {cert} expired on {not_after:%Y-%m-%d %H:%M} UTC: every "
            "client would refuse it; renew it"
        )
    if now < not_before:
        raise ValueError(
            f"[security] tls_cert: {cert} is not valid until {not_before:%Y-%m-%d %H:%M} UTC: "
            "every client would refuse it (check this host's clock)"
        )

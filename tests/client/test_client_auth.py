"""The client's credentials (`client/auth.py`): where each setting comes from, the bearer
token on calls of every kind, the refusal error, and no secret in any text."""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from rlfeed.client import BatchLoader, GrpcTransport, RolloutWriter
from rlfeed.client.auth import ChannelSecurity, channel_security, open_channel
from rlfeed.client.transport import AuthenticationError, SidecarError, _sidecar_error, connect
from rlfeed.service.inprocess import InProcessTransport

TOKEN = secrets.token_urlsafe(32)


def test_an_argument_wins_over_the_environment_and_the_token_over_its_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(f"# mine\n\n{TOKEN} producer\n")
    environ = {"RLFEED_TOKEN_FILE": str(token_file)}
    assert ChannelSecurity.resolve(environ=environ).token == TOKEN
    assert ChannelSecurity.resolve(environ={**environ, "RLFEED_TOKEN": "t" * 20}).token == "t" * 20
    assert ChannelSecurity.resolve(token="a" * 20, environ=environ).token == "a" * 20
    assert ChannelSecurity.resolve(token="", environ=environ).token == ""  # "" = none


def test_tls_is_on_with_a_ca_or_a_client_certificate(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert not ChannelSecurity.resolve(environ={}).tls
    with_ca = ChannelSecurity.resolve(environ={"RLFEED_TLS_CA": str(pem)})
    assert with_ca.tls and with_ca.root_certificates
    assert ChannelSecurity.resolve(tls_cert=str(pem), tls_key=str(pem), environ={}).tls
    assert not ChannelSecurity.resolve(tls_ca="", environ={"RLFEED_TLS_CA": str(pem)}).tls


def test_setting_errors_name_the_setting_not_the_secret(tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ChannelSecurity.resolve(tls_cert="c.pem", environ={})
    with pytest.raises(ValueError, match=r"tls_ca: cannot read .*missing.pem"):
        ChannelSecurity.resolve(tls_ca=str(tmp_path / "missing.pem"), environ={})
    with pytest.raises(ValueError, match="RLFEED_TOKEN: the token must be printable") as bad:
        ChannelSecurity.resolve(environ={"RLFEED_TOKEN": TOKEN + "\x00"})
    assert TOKEN not in str(bad.value)
    assert TOKEN not in repr(ChannelSecurity.resolve(token=TOKEN, environ={}))


def _echo_server():
    """A plain gRPC server (no rlfeed code) whose four methods, one of each kind, answer
    the authorization metadata they received."""

    def seen(context) -> bytes:
        values = [v for k, v in context.invocation_metadata() if k == "authorization"]
        return "|".join(values).encode()

    def unary(request, context):
        return seen(context)

    def streaming(request, context):
        yield seen(context)

    handlers = {
        "UU": grpc.unary_unary_rpc_method_handler(unary),
        "US": grpc.unary_stream_rpc_method_handler(streaming),
        "SU": grpc.stream_unary_rpc_method_handler(unary),
        "SS": grpc.stream_stream_rpc_method_handler(streaming),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_token_rides_on_calls_of_every_kind_over_plaintext_loopback():
    server, address = _echo_server()
    try:
        channel = open_channel(address, ChannelSecurity.resolve(token=TOKEN, environ={}))
        with channel:
            answers = [
                channel.unary_unary("/echo.Echo/UU")(b"", timeout=5),
                *channel.unary_stream("/echo.Echo/US")(b"", timeout=5),
                channel.stream_unary("/echo.Echo/SU")(iter([b""]), timeout=5),
                *channel.stream_stream("/echo.Echo/SS")(iter([b""]), timeout=5),
            ]
        assert answers == [f"Bearer {TOKEN}".encode()] * 4
        with open_channel(address, ChannelSecurity.resolve(token="", environ={})) as bare:
            assert bare.unary_unary("/echo.Echo/UU")(b"", timeout=5) == b""
    finally:
        server.stop(None)


def test_a_token_over_plaintext_off_loopback_is_warned_about(caplog):
    security = ChannelSecurity.resolve(token=TOKEN, environ={})
    with caplog.at_level(logging.WARNING):
        open_channel("127.0.0.1:1", security).close()
        open_channel("127.0.0.1:1,127.0.0.2:2", security).close()  # front-ends on this machine
        assert "plaintext" not in caplog.text
        open_channel("127.0.0.1:1,192.0.2.1:1", security).close()  # one of them is not
        assert "plaintext" in caplog.text
        caplog.clear()
        open_channel("192.0.2.1:1", security).close()  # channels connect lazily
    assert "plaintext" in caplog.text and TOKEN not in caplog.text


class _Refused(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "a producer token may not call /rlfeed.v1.BatchServing/GetBatch"


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED]
)
def test_refusals_become_an_authentication_error_naming_the_address(code):
    error = _sidecar_error(_Refused(code), "sidecar-host:50051")
    assert isinstance(error, AuthenticationError) and isinstance(error, SidecarError)
    assert error.code == code.name and "sidecar-host:50051" in str(error)


def test_credentials_go_with_an_address_not_a_transport():
    transport = InProcessTransport()
    assert connect(transport) == (transport, False)
    with pytest.raises(ValueError, match="token: credentials go with an address"):
        connect(transport, token=TOKEN)


def test_security_and_the_credential_keywords_are_one_or_the_other():
    security = ChannelSecurity.resolve(token=TOKEN, environ={})
    assert channel_security(security) is security
    assert channel_security(token=TOKEN).token == TOKEN
    with pytest.raises(ValueError, match="security, token: give security= or the credential"):
        channel_security(security, token=TOKEN)
    with pytest.raises(ValueError, match="security, tls_ca: give security="):
        GrpcTransport("127.0.0.1:1", security=security, tls_ca="ca.pem")
    with pytest.raises(TypeError, match="security must be a ChannelSecurity, got dict"):
        channel_security({"token": TOKEN})
    with pytest.raises(TypeError, match="unexpected keyword argument 'tls_crt'"):
        GrpcTransport("127.0.0.1:1", tls_crt="c.pem")
    transport = InProcessTransport()
    with pytest.raises(ValueError, match="security: credentials go with an address"):
        connect(transport, security)
    with pytest.raises(ValueError, match="security: credentials go with an address"):
        RolloutWriter(transport, security=security)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tokn'"):
        BatchLoader(transport, 0, 1, tokn=TOKEN)


def test_a_grpc_client_loads_nothing_of_the_service():
    code = (
        "import sys\n"
        "from rlfeed.client import GrpcTransport\n"
        "GrpcTransport('127.0.0.1:1', token='x' * 20).close()\n"
        "print([m for m in sys.modules if m.startswith('rlfeed.service')])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"

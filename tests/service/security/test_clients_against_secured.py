"""The client library against the secured loopback server of conftest (FAKE servicer):
credentials from the environment only, as the README examples would run unchanged."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
from rlfeed.client import (
    AuthenticationError,
    BatchLoader,
    GrpcTransport,
    RolloutWriter,
    SidecarError,
)
from rlfeed.client.auth import ChannelSecurity
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.security.credentials import bind_port


@pytest.fixture
def mtls_env(monkeypatch, pki, tokens):
    for name in ("RLFEED_TOKEN", "RLFEED_TOKEN_FILE", "RLFEED_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RLFEED_TLS_CA", str(pki.ca))
    monkeypatch.setenv("RLFEED_TLS_CERT", str(pki.client_cert))
    monkeypatch.setenv("RLFEED_TLS_KEY", str(pki.client_key))
    return monkeypatch


def test_transport_takes_token_and_mtls_from_the_environment(secured, tokens, mtls_env):
    mtls_env.setenv("RLFEED_TOKEN", tokens.admin)
    before = secured.calls["GetStatus"]
    transport = GrpcTransport(secured.mtls)
    try:
        transport.status()
        transport.sample_tasks(1)
    finally:
        transport.close()
    assert transport.tls and secured.calls["GetStatus"] == before + 1


def test_a_token_file_in_the_environment_works_too(secured, tokens, mtls_env, tmp_path):
    token_file = tmp_path / "trainer.token"
    token_file.write_text(f"# rank token\n{tokens.trainer} trainer\n")
    mtls_env.setenv("RLFEED_TOKEN_FILE", str(token_file))
    before = secured.calls["GetBatch"]
    loader = BatchLoader(secured.mtls, rank=0, world_size=1, timeout_s=0.2, poll_s=0.05)
    try:
        with pytest.raises(TimeoutError):  # the fake never has a step ready
            loader.fetch(0)
    finally:
        loader.close()
    assert secured.calls["GetBatch"] > before


def test_a_refused_token_is_an_authentication_error_naming_the_address(secured, tokens, mtls_env):
    mtls_env.setenv("RLFEED_TOKEN", tokens.producer)
    loader = BatchLoader(secured.mtls, rank=0, world_size=1, timeout_s=5)
    try:
        with pytest.raises(AuthenticationError) as refused:
            loader.fetch(0)
    finally:
        loader.close()
    error = refused.value
    assert isinstance(error, SidecarError) and error.code == "PERMISSION_DENIED"
    assert secured.mtls in str(error) and tokens.producer not in str(error)

    mtls_env.setenv("RLFEED_TOKEN", tokens.unknown)
    transport = GrpcTransport(secured.mtls)
    try:
        with pytest.raises(AuthenticationError) as refused:
            transport.status()
    finally:
        transport.close()
    assert refused.value.code == "UNAUTHENTICATED" and tokens.unknown not in str(refused.value)


def test_explicit_arguments_override_the_environment(secured, tokens, pki, mtls_env):
    mtls_env.setenv("RLFEED_TOKEN", tokens.unknown)
    transport = GrpcTransport(
        secured.tls, token=tokens.admin, tls_ca=str(pki.ca), tls_cert="", tls_key=""
    )
    try:
        transport.status()
    finally:
        transport.close()


def test_one_resolved_security_serves_every_client(secured, tokens, pki, mtls_env):
    """`security=` takes credentials resolved once (`ChannelSecurity`) in place of the
    keywords, for the transport, the loader and the writer alike."""
    mtls_env.setenv("RLFEED_TOKEN", tokens.unknown)  # not read: security is given
    security = ChannelSecurity.resolve(token=tokens.admin, tls_ca=str(pki.ca), environ={})
    before = secured.calls["GetStatus"]
    transport = GrpcTransport(secured.tls, security=security)
    try:
        transport.status()
    finally:
        transport.close()
    assert transport.tls and secured.calls["GetStatus"] == before + 1
    before = secured.calls["GetBatch"]
    loader = BatchLoader(secured.tls, 0, 1, timeout_s=0.2, poll_s=0.05, security=security)
    try:
        with pytest.raises(TimeoutError):  # the fake never has a step ready
            loader.fetch(0)
    finally:
        loader.close()
    assert secured.calls["GetBatch"] > before
    writer = RolloutWriter(secured.tls, security=security)
    try:
        assert writer._transport.tls
    finally:
        writer.close()


def test_front_ends_on_several_hosts_are_checked_against_the_one_server_name(
    pki, serve_fake, fake_servicer, monkeypatch
):
    """An address list over TLS: gRPC would check the whole list as the name, so a list on
    one host is checked against that host, and one on several hosts needs the name every
    front-end's certificate carries (`tls_server_name`); a wrong one is refused."""
    monkeypatch.delenv("RLFEED_TLS_SERVER_NAME", raising=False)
    tls = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    server, _, (first, second) = serve_fake([], tls, tls)
    other_host = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # 127.0.0.2: loopback
    pb_grpc.add_SidecarStatusServicer_to_server(fake_servicer, other_host)
    third = f"127.0.0.2:{bind_port(other_host, '127.0.0.2:0', tls)}"
    other_host.start()
    ca = {"tls_ca": str(pki.ca), "token": ""}
    try:
        one_host = GrpcTransport(f"{first},{second}", **ca)  # SAN 127.0.0.1
        for _ in range(4):
            one_host.status()
        one_host.close()
        with pytest.raises(ValueError, match=r"set tls_server_name \(RLFEED_TLS_SERVER_NAME\)"):
            GrpcTransport(f"{first},{third}", **ca)
        named = GrpcTransport(f"{first},{third}", tls_server_name="localhost", **ca)
        deadline = time.monotonic() + 10
        while not fake_servicer.calls["GetStatus"]:  # both hosts passed the check
            assert time.monotonic() < deadline, "127.0.0.2 was never called"
            named.status()
        named.close()
        wrong = GrpcTransport(f"{first},{third}", tls_server_name="other.example", **ca)
        with pytest.raises(SidecarError, match="UNAVAILABLE"):
            wrong.status()
        wrong.close()
    finally:
        server.stop(None)
        other_host.stop(None)

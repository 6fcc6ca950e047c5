"""`[security]` and `bind_port`: errors name the field; the method map covers the contract."""

from __future__ import annotations

import dataclasses
import logging
import secrets

import grpc
import pytest
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.security.credentials import bind_port, is_loopback, server_credentials
from rlfeed.service.security.files import check_files
from rlfeed.service.security.roles import public_method_roles


def test_every_field_is_documented_with_a_default():
    for field in dataclasses.fields(SecurityConfig):
        assert field.metadata.get("doc"), field.name
    assert SecurityConfig() == SecurityConfig(
        tls_cert="", tls_key="", tls_client_ca="", auth_token_file="", allow_reflection=False
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        SecurityConfig().tls_cert = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"tls_cert": "a.crt"}, "tls_key"),
        ({"tls_key": "a.key"}, "tls_cert"),
        ({"tls_client_ca": "ca.crt"}, "tls_client_ca"),
        ({"auth_token_file": 3}, "auth_token_file"),
        ({"allow_reflection": "yes"}, "allow_reflection"),
    ],
)
def test_structure_errors_name_the_field(values, field):
    with pytest.raises(ValueError, match=rf"^\[security\] {field}:"):
        SecurityConfig(**values)


def test_check_files_names_the_missing_file_and_bad_token_file(tmp_path, pki, caplog):
    missing = SecurityConfig(tls_cert=str(tmp_path / "nope.crt"), tls_key=str(pki.server_key))
    with pytest.raises(ValueError, match=r"^\[security\] tls_cert: .*nope.crt is not a file"):
        check_files(missing)

    token = secrets.token_urlsafe(32)
    bad = tmp_path / "tokens.txt"
    bad.write_text(f"{token} root\n")
    with pytest.raises(ValueError, match=r"^\[security\] auth_token_file: .*tokens.txt:1") as e:
        check_files(SecurityConfig(auth_token_file=str(bad)))
    assert token not in str(e.value)

    bad.write_text(f"{token} admin\n")
    bad.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        check_files(SecurityConfig(auth_token_file=str(bad)))
    assert "readable by other users" in caplog.text and token not in caplog.text


def test_server_credentials_refuse_a_file_that_is_not_pem(tmp_path, pki):
    not_pem = tmp_path / "key.txt"
    not_pem.write_text("hello")
    config = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(not_pem))
    with pytest.raises(ValueError, match=r"^\[security\] tls_key: .* is not a PEM file"):
        server_credentials(config)


def test_bind_port_warns_of_plaintext_tokens_off_loopback(tokens, caplog):
    server = grpc.server(thread_pool=None)  # never started: only binds
    config = SecurityConfig(auth_token_file=str(tokens.path))
    with caplog.at_level(logging.WARNING):
        assert bind_port(server, "127.0.0.1:0", config) > 0
        assert "clear text" not in caplog.text
        assert bind_port(server, "0.0.0.0:0", config) > 0
    assert "clear text" in caplog.text
    server.stop(None)
    assert is_loopback("[::1]:5") and is_loopback("localhost:5") and not is_loopback("10.0.0.1:5")


def test_the_method_map_covers_every_method_of_the_contract():
    from rlfeed.proto import rlfeed_pb2 as pb

    roles = public_method_roles()
    for service in pb.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            allowed = roles[f"/{service.full_name}/{method.name}"]
            assert "admin" in allowed and "peer" not in allowed
    assert all(allowed == {"peer"} for name, allowed in roles.items() if "internal" in name)


def test_server_security_builds_binds_and_describes(pki, tokens, fake_servicer):
    from rlfeed.service.security.server_security import ServerSecurity

    config = SecurityConfig(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca),
        auth_token_file=str(tokens.path),
    )
    security = ServerSecurity.from_config(config)
    assert (
        security.describe() == "mutual TLS, tokens (admin 1, producer 1, trainer 1), reflection off"
    )
    assert ServerSecurity.from_config(SecurityConfig()).describe() == (
        "plaintext, no tokens, reflection off"
    )
    server = grpc.server(thread_pool=None, interceptors=security.interceptors)
    assert security.bind(server, "127.0.0.1:0") > 0
    server.stop(None)
    restore = security.reload_on_sighup()
    restore()


def test_the_peer_map_names_the_methods_the_peer_service_serves():
    from collections import namedtuple

    from rlfeed.service.frontend import peers
    from rlfeed.service.security.roles import PEER_METHODS, PEER_SERVICE, peer_method_roles

    assert peers.PEER_SERVICE == PEER_SERVICE
    handler = peers.peer_handler(lambda key: None, lambda step, rank: None, lambda s, f: None)
    details = namedtuple("Details", "method invocation_metadata")
    for name in PEER_METHODS:
        assert handler.service(details(f"/{PEER_SERVICE}/{name}", ())) is not None, name
    assert handler.service(details(f"/{PEER_SERVICE}/Unknown", ())) is None
    assert set(peer_method_roles()) == {
        *(f"/{PEER_SERVICE}/{name}" for name in PEER_METHODS),
        "/rlfeed.v1.BatchServing/GetBatch",
    }

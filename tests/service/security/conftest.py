"""Fixtures of the security tests: certificates made at test time, tokens, and a real
gRPC server on loopback whose handlers are a FAKE servicer.

- `pki` (module): two certificate authorities made with `cryptography` (EC P-256, valid
  for a day): `ca` signs the server's certificate (SAN 127.0.0.1, localhost) and a client
  certificate; `other_ca` signs a client certificate the server must refuse. The server's
  key has two more certificates from `ca`: one expired yesterday, one valid from
  tomorrow. PEM files in a temporary folder; no key is ever committed.
- `tokens` (module): a token file with one producer, one trainer and one admin token.
- `secured` (module): one `grpc.server` with the `AuthInterceptor` and three ports made
  by `bind_port`: plaintext, TLS and mutual TLS. Its rlfeed.v1 handlers are the generated
  `rlfeed_pb2_grpc` servicer base classes subclassed by `FakeServicer`, which answers
  empty messages and only records which methods a call reached; plus the standard health
  service. `secured.calls` is that record.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from collections import Counter
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.config.security import SecurityConfig
from rlfeed.service.security.credentials import bind_port
from rlfeed.service.security.interceptor import AuthInterceptor
from rlfeed.service.security.tokens import TokenStore

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str,
    key,
    issuer: x509.Name,
    issuer_key,
    *,
    ca=False,
    usage=None,
    names=(),
    valid_from=datetime.timedelta(minutes=-5),
    valid_for=datetime.timedelta(days=1),
):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + valid_from)
        .not_valid_after(now + valid_from + valid_for)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA the server's certificate chains to, and the mTLS client CA
    server_cert: Path
    server_key: Path
    client_cert: Path  # signed by ca
    client_key: Path
    other_ca: Path  # an unrelated CA
    other_client_cert: Path  # signed by other_ca
    other_client_key: Path
    expired_server_cert: Path  # server_key's, signed by ca, valid until yesterday
    future_server_cert: Path  # server_key's, signed by ca, valid from tomorrow

    def read(self, name: str) -> bytes:
        return getattr(self, name).read_bytes()


def _write(folder: Path, name: str, key, cert) -> tuple[Path, Path]:
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    made = {}
    for ca_name in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = f"rlfeed test {ca_name}"
        cert = _certificate(subject, key, _name(subject), key, ca=True)
        made[ca_name] = (key, cert, *_write(folder, ca_name, key, cert))
    server_names = (
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    )
    leaves = {
        "server": ("ca", ExtendedKeyUsageOID.SERVER_AUTH, server_names),
        "client": ("ca", ExtendedKeyUsageOID.CLIENT_AUTH, ()),
        "other_client": ("other_ca", ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    }
    for name, (ca_name, usage, names) in leaves.items():
        ca_key, ca_cert = made[ca_name][:2]
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(name, key, ca_cert.subject, ca_key, usage=usage, names=names)
        made[name] = (key, cert, *_write(folder, name, key, cert))
    server_key, (ca_key, ca_cert) = made["server"][0], made["ca"][:2]
    dated = {}
    for name, valid_from in (("expired_server", -2), ("future_server", 1)):
        cert = _certificate(
            "server", server_key, ca_cert.subject, ca_key,
            usage=ExtendedKeyUsageOID.SERVER_AUTH, names=server_names,
            valid_from=datetime.timedelta(days=valid_from),
        )  # fmt: skip
        dated[name] = folder / f"{name}.crt"
        dated[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Pki(
        expired_server_cert=dated["expired_server"],
        future_server_cert=dated["future_server"],
        ca=made["ca"][2],
        server_cert=made["server"][2],
        server_key=made["server"][3],
        client_cert=made["client"][2],
        client_key=made["client"][3],
        other_ca=made["other_ca"][2],
        other_client_cert=made["other_client"][2],
        other_client_key=made["other_client"][3],
    )


@dataclass(frozen=True)
class Tokens:
    path: Path
    producer: str
    trainer: str
    admin: str
    unknown: str  # in no file

    def of(self, role: str | None) -> str | None:
        return None if role is None else getattr(self, role)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Tokens:
    made = {role: secrets.token_urlsafe(32) for role in ("producer", "trainer", "admin")}
    path = tmp_path_factory.mktemp("tokens") / "tokens.txt"
    path.write_text(
        "# rlfeed test tokens\n" + "".join(f"{token} {role}\n" for role, token in made.items())
    )
    path.chmod(0o600)
    return Tokens(path=path, unknown=secrets.token_urlsafe(32), **made)


class FakeServicer(
    pb_grpc.RolloutIngestServicer,
    pb_grpc.TaskSamplingServicer,
    pb_grpc.BatchServingServicer,
    pb_grpc.SidecarStatusServicer,
):
    """A FAKE rlfeed servicer: answers empty messages and records the methods reached (any
    call recorded here got past the interceptor)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def SubmitRollouts(self, request_iterator, context):
        self.calls["SubmitRollouts"] += 1
        for batch in request_iterator:
            yield pb.SubmitAck(sequence=batch.sequence)

    def SubmitRolloutBatch(self, request, context):
        self.calls["SubmitRolloutBatch"] += 1
        return pb.SubmitAck(sequence=request.sequence)

    def RegisterTasks(self, request, context):
        self.calls["RegisterTasks"] += 1
        return pb.RegisterTasksResponse()

    def SampleTasks(self, request, context):
        self.calls["SampleTasks"] += 1
        return pb.SampleTasksResponse()

    def GetBatch(self, request, context):
        self.calls["GetBatch"] += 1
        return pb.GetBatchResponse()

    def AckSteps(self, request, context):
        self.calls["AckSteps"] += 1
        return pb.AckStepsResponse()

    def ReportTrainerMetrics(self, request, context):
        self.calls["ReportTrainerMetrics"] += 1
        return pb.TrainerReportAck()

    def GetStatus(self, request, context):
        self.calls["GetStatus"] += 1
        return pb.StatusResponse()


@dataclass
class SecuredServer:
    server: grpc.Server
    servicer: FakeServicer
    store: TokenStore
    plaintext: str  # "127.0.0.1:port" of each listener
    tls: str
    mtls: str

    @property
    def calls(self) -> Counter[str]:
        return self.servicer.calls


def _serve_fake(interceptors, *configs: SecurityConfig) -> tuple[grpc.Server, FakeServicer, list]:
    """A started grpc.server with the fake servicer and health, one loopback port per
    config; returns it, the servicer and the addresses."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=interceptors)
    servicer = FakeServicer()
    pb_grpc.add_RolloutIngestServicer_to_server(servicer, server)
    pb_grpc.add_TaskSamplingServicer_to_server(servicer, server)
    pb_grpc.add_BatchServingServicer_to_server(servicer, server)
    pb_grpc.add_SidecarStatusServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    addresses = [f"127.0.0.1:{bind_port(server, '127.0.0.1:0', config)}" for config in configs]
    server.start()
    return server, servicer, addresses


@pytest.fixture
def serve_fake():
    """`serve_fake(interceptors, *security_configs)` -> (started server, its FakeServicer,
    one "127.0.0.1:port" per config); the caller stops the server."""
    return _serve_fake


@pytest.fixture
def fake_servicer() -> FakeServicer:
    """A fresh FakeServicer (for servers a test builds itself)."""
    return FakeServicer()


@pytest.fixture(scope="module")
def secured(pki, tokens):
    store = TokenStore(tokens.path)
    tls = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    mtls = SecurityConfig(
        tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca)
    )
    server, servicer, addresses = _serve_fake([AuthInterceptor(store)], SecurityConfig(), tls, mtls)
    try:
        yield SecuredServer(server, servicer, store, *addresses)
    finally:
        server.stop(None)

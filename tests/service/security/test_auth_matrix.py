"""The auth matrix against a real gRPC server on loopback (`secured` in conftest: the
`AuthInterceptor`, ports bound by `bind_port`, and a FAKE servicer that only records which
methods a call reached).

Every rlfeed.v1 method x {no token, unknown token, producer, trainer, admin} x {plaintext,
TLS, mutual TLS}: the right role is OK and reaches the servicer; no token or an unknown
one is UNAUTHENTICATED and a wrong role PERMISSION_DENIED, and neither reaches it. The
TLS refusals (wrong CA, no client certificate, a client certificate from another CA,
plaintext to a TLS port) fail the handshake (UNAVAILABLE), with the servicer untouched.
"""

from __future__ import annotations

import secrets
from concurrent import futures

import grpc
import pytest
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.security.interceptor import AuthInterceptor, peer_interceptor
from rlfeed.service.security.roles import PEER_METHODS, PEER_SERVICE

OK = grpc.StatusCode.OK
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
CALL_TIMEOUT_S = 5.0

# The specification (issue 16): which roles may call each method.
ALLOWED = {
    "SubmitRollouts": {"producer", "admin"},
    "SubmitRolloutBatch": {"producer", "admin"},
    "RegisterTasks": {"producer", "admin"},
    "SampleTasks": {"producer", "admin"},
    "GetBatch": {"trainer", "admin"},
    "AckSteps": {"trainer", "admin"},
    "ReportTrainerMetrics": {"trainer", "admin"},
    "GetStatus": {"admin"},
}
CREDENTIALS = (None, "unknown", "producer", "trainer", "admin")
LISTENERS = ("plaintext", "tls", "mtls")


def call(channel: grpc.Channel, method: str, token: str | None) -> grpc.StatusCode:
    """Make one `method` call on `channel` with `token` (or none); its status code."""
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    ingest = pb_grpc.RolloutIngestStub(channel)
    tasks = pb_grpc.TaskSamplingStub(channel)
    batches = pb_grpc.BatchServingStub(channel)
    status = pb_grpc.SidecarStatusStub(channel)
    calls = {
        "SubmitRollouts": lambda **kw: list(
            ingest.SubmitRollouts(iter([pb.RolloutBatch(sequence=1)]), **kw)
        ),
        "SubmitRolloutBatch": lambda **kw: ingest.SubmitRolloutBatch(pb.RolloutBatch(), **kw),
        "RegisterTasks": lambda **kw: tasks.RegisterTasks(
            pb.RegisterTasksRequest(task_ids=["t"]), **kw
        ),
        "SampleTasks": lambda **kw: tasks.SampleTasks(pb.SampleTasksRequest(n=1), **kw),
        "GetBatch": lambda **kw: batches.GetBatch(pb.GetBatchRequest(), **kw),
        "AckSteps": lambda **kw: batches.AckSteps(pb.AckStepsRequest(), **kw),
        "ReportTrainerMetrics": lambda **kw: batches.ReportTrainerMetrics(pb.TrainerReport(), **kw),
        "GetStatus": lambda **kw: status.GetStatus(pb.GetStatusRequest(), **kw),
    }
    try:
        calls[method](metadata=metadata, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code()
    return OK


def open_channel(address, pki, *, tls=True, ca="ca", client=None) -> grpc.Channel:
    if not tls:
        return grpc.insecure_channel(address)
    cert_key = (
        {}
        if client is None
        else {
            "certificate_chain": pki.read(f"{client}_cert"),
            "private_key": pki.read(f"{client}_key"),
        }
    )
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.read(ca), **cert_key)
    return grpc.secure_channel(address, credentials)


@pytest.fixture(scope="module")
def channels(secured, pki):
    """One well-configured channel per listener (the mTLS one with the good client cert)."""
    made = {
        "plaintext": open_channel(secured.plaintext, pki, tls=False),
        "tls": open_channel(secured.tls, pki),
        "mtls": open_channel(secured.mtls, pki, client="client"),
    }
    yield made
    for channel in made.values():
        channel.close()


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize("method", sorted(ALLOWED))
@pytest.mark.parametrize("credential", CREDENTIALS, ids=str)
def test_only_an_allowed_role_reaches_the_servicer(
    secured, tokens, channels, listener, method, credential
):
    token = tokens.unknown if credential == "unknown" else tokens.of(credential)
    before = secured.calls[method]
    code = call(channels[listener], method, token)
    if credential in (None, "unknown"):
        assert code == UNAUTHENTICATED
    elif credential in ALLOWED[method]:
        assert code == OK
    else:
        assert code == PERMISSION_DENIED
    assert secured.calls[method] - before == (1 if code == OK else 0)


HANDSHAKE_REFUSALS = {
    "tls port, server cert from a CA the client does not trust": ("tls", {"ca": "other_ca"}),
    "mtls port, no client certificate": ("mtls", {}),
    "mtls port, client certificate from another CA": ("mtls", {"client": "other_client"}),
    "mtls port, wrong CA and a good client certificate": (
        "mtls",
        {"ca": "other_ca", "client": "client"},
    ),
    "plaintext to the tls port": ("tls", {"tls": False}),
    "plaintext to the mtls port": ("mtls", {"tls": False}),
}


@pytest.mark.parametrize("case", sorted(HANDSHAKE_REFUSALS))
def test_a_failed_handshake_reaches_nothing_even_with_an_admin_token(secured, tokens, pki, case):
    listener, options = HANDSHAKE_REFUSALS[case]
    before = sum(secured.calls.values())
    with open_channel(getattr(secured, listener), pki, **options) as channel:
        for method in ALLOWED:
            assert call(channel, method, tokens.admin) == UNAVAILABLE, method
    assert sum(secured.calls.values()) == before


@pytest.mark.parametrize("listener", LISTENERS)
def test_health_answers_without_a_token(secured, pki, listener):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = {"tls": False} if listener == "plaintext" else {}
    if listener == "mtls":
        options["client"] = "client"  # the handshake still needs a certificate
    with open_channel(getattr(secured, listener), pki, **options) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S
        )
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("role", ["producer", "trainer", "admin"])
def test_no_file_token_may_call_the_peer_service_on_the_public_port(secured, tokens, role):
    with grpc.insecure_channel(secured.plaintext) as channel:
        for name in PEER_METHODS:
            peer_call = channel.unary_unary(f"/{PEER_SERVICE}/{name}")
            metadata = (("authorization", f"Bearer {tokens.of(role)}"),)
            with pytest.raises(grpc.RpcError) as refused:
                peer_call(b"", metadata=metadata, timeout=CALL_TIMEOUT_S)
            assert refused.value.code() == PERMISSION_DENIED


def _peer_server(peer_token: str, servicer):
    """A loopback server as the peer port is wired: the peer interceptor, a FAKE peer
    service recording calls, and the fake BatchServing (forwarded GetBatch)."""
    calls: list[str] = []

    def record(name):
        def handler(request, context):
            calls.append(name)
            return b""

        return grpc.unary_unary_rpc_method_handler(handler)

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[peer_interceptor(peer_token)]
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(PEER_SERVICE, {n: record(n) for n in PEER_METHODS}),)
    )
    pb_grpc.add_BatchServingServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", calls, servicer


def test_the_peer_port_answers_only_the_sidecars_own_peer_token(tokens, fake_servicer):
    peer_token = secrets.token_urlsafe(32)
    server, address, calls, servicer = _peer_server(peer_token, fake_servicer)
    try:
        with grpc.insecure_channel(address) as channel:
            for token in (None, tokens.unknown, tokens.producer, tokens.trainer, tokens.admin):
                metadata = () if token is None else (("authorization", f"Bearer {token}"),)
                for name in PEER_METHODS:
                    with pytest.raises(grpc.RpcError) as refused:
                        channel.unary_unary(f"/{PEER_SERVICE}/{name}")(
                            b"", metadata=metadata, timeout=CALL_TIMEOUT_S
                        )
                    assert refused.value.code() == UNAUTHENTICATED
                assert call(channel, "GetBatch", token) == UNAUTHENTICATED
            assert calls == [] and sum(servicer.calls.values()) == 0
            for name in PEER_METHODS:
                channel.unary_unary(f"/{PEER_SERVICE}/{name}")(
                    b"", metadata=(("authorization", f"Bearer {peer_token}"),), timeout=5
                )
            assert call(channel, "GetBatch", peer_token) == OK
            assert call(channel, "GetStatus", peer_token) == PERMISSION_DENIED
        assert calls == list(PEER_METHODS) and servicer.calls["GetBatch"] == 1
    finally:
        server.stop(None)


def _kinds_server(store):
    """A FAKE service with one method of each of gRPC's four kinds, open to admin."""
    calls: list[str] = []

    def unary(name):
        def handler(request, context):
            calls.append(name)
            return b"ok"

        return handler

    def streaming(name):
        def handler(request, context):
            calls.append(name)
            yield b"ok"

        return handler

    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary("UnaryUnary")),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(streaming("UnaryStream")),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(unary("StreamUnary")),
        "StreamStream": grpc.stream_stream_rpc_method_handler(streaming("StreamStream")),
    }
    roles = {f"/test.Kinds/{name}": frozenset({"admin"}) for name in handlers}
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[AuthInterceptor(store, method_roles=roles)],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Kinds", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", calls


def test_every_rpc_kind_is_refused_with_a_status(secured, tokens):
    server, address, calls = _kinds_server(secured.store)
    try:
        with grpc.insecure_channel(address) as channel:
            kinds = {
                "UnaryUnary": lambda **kw: channel.unary_unary("/test.Kinds/UnaryUnary")(
                    b"x", **kw
                ),
                "UnaryStream": lambda **kw: list(
                    channel.unary_stream("/test.Kinds/UnaryStream")(b"x", **kw)
                ),
                "StreamUnary": lambda **kw: channel.stream_unary("/test.Kinds/StreamUnary")(
                    iter([b"x", b"y"]), **kw
                ),
                "StreamStream": lambda **kw: list(
                    channel.stream_stream("/test.Kinds/StreamStream")(iter([b"x", b"y"]), **kw)
                ),
            }
            for reached, (name, make) in enumerate(kinds.items()):
                for token, expected in (
                    (None, UNAUTHENTICATED),
                    (tokens.unknown, UNAUTHENTICATED),
                    (tokens.producer, PERMISSION_DENIED),
                ):
                    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
                    with pytest.raises(grpc.RpcError) as refused:
                        make(metadata=metadata, timeout=CALL_TIMEOUT_S)
                    assert refused.value.code() == expected, name
                assert len(calls) == reached  # no refused call got through
                make(metadata=(("authorization", f"Bearer {tokens.admin}"),), timeout=5)
            assert calls == list(kinds)
    finally:
        server.stop(None)


def test_reflection_is_unimplemented_unless_allowed_then_needs_a_token(tokens, secured):
    from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

    def ask(address, token):
        metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            try:
                list(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=5))
            except grpc.RpcError as exc:
                return exc.code()
            return OK

    for allow in (False, True):
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2),
            interceptors=[AuthInterceptor(secured.store, allow_reflection=allow)],
        )
        reflection.enable_server_reflection([reflection.SERVICE_NAME], server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        try:
            if not allow:
                assert ask(address, tokens.admin) == grpc.StatusCode.UNIMPLEMENTED
            else:
                assert ask(address, None) == UNAUTHENTICATED
                assert ask(address, tokens.producer) == OK
        finally:
            server.stop(None)

"""A real sidecar (`start_server`, real Ray, real gRPC on loopback) behind `[security]`:
mutual TLS plus role tokens on the public port, its own secret on the peer port.

The right credentials carry a step end to end; every wrong one is refused before any row
is accepted or any byte served.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import ray
from rlfeed.client.transport import AuthenticationError, GrpcTransport
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.testing import check_served_step, synthetic_groups

GROUPS = {"prompts_per_step": 2, "group_size": 4}


@pytest.fixture
def secured_sidecar(make_sidecar, pki, tokens):
    return make_sidecar(
        rollouts=GROUPS,
        batching={"world_size": 1},
        security={
            "tls_cert": str(pki.server_cert),
            "tls_key": str(pki.server_key),
            "tls_client_ca": str(pki.ca),
            "auth_token_file": str(tokens.path),
        },
    )


def _transport(sidecar, pki, token, *, cert="client_cert", key="client_key") -> GrpcTransport:
    return GrpcTransport(
        sidecar.address,
        call_timeout_s=10,
        token=token or "",
        tls_ca=str(pki.ca),
        tls_cert=str(getattr(pki, cert)),
        tls_key=str(getattr(pki, key)),
    )


def test_right_credentials_carry_a_step_end_to_end(secured_sidecar, pki, tokens):
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(3))
    producer = _transport(secured_sidecar, pki, tokens.producer)
    trainer = _transport(secured_sidecar, pki, tokens.trainer)
    admin = _transport(secured_sidecar, pki, tokens.admin)
    producer.register_tasks(sorted(set(rollouts.task_ids)))
    ack = producer.submit(pb.RolloutBatch(arrow_ipc=rollouts.encode(), sequence=1))
    assert ack.accepted == len(rollouts)
    response = trainer.get_batch(0, 0, wait_s=10.0)
    assert sorted(check_served_step([response], rollouts)) == sorted(rollouts.rollout_ids)
    assert admin.status().next_step == 1


@pytest.mark.parametrize(
    ("role", "call", "code"),
    [
        (None, "submit", "UNAUTHENTICATED"),
        ("unknown", "submit", "UNAUTHENTICATED"),
        ("trainer", "submit", "PERMISSION_DENIED"),
        (None, "get_batch", "UNAUTHENTICATED"),
        ("producer", "get_batch", "PERMISSION_DENIED"),
        ("producer", "status", "PERMISSION_DENIED"),
    ],
)
def test_wrong_tokens_are_refused_and_change_nothing(
    secured_sidecar, pki, tokens, role, call, code
):
    rollouts = synthetic_groups(num_groups=2, group_size=4, rng=np.random.default_rng(4))
    _transport(secured_sidecar, pki, tokens.admin).register_tasks(sorted(set(rollouts.task_ids)))
    caller = _transport(secured_sidecar, pki, tokens.of(role))
    calls = {
        "submit": lambda: caller.submit(pb.RolloutBatch(arrow_ipc=rollouts.encode())),
        "get_batch": lambda: caller.get_batch(0, 0, wait_s=0.1),
        "status": caller.status,
    }
    with pytest.raises(AuthenticationError) as refused:
        calls[call]()
    assert refused.value.code == code
    assert tokens.of(role) is None or tokens.of(role) not in str(refused.value)
    status = _transport(secured_sidecar, pki, tokens.admin).status()
    assert status.counters.rollouts_received == 0 and status.buffered_rollouts == 0


@pytest.mark.parametrize(
    ("cert", "key"), [("other_client_cert", "other_client_key")], ids=["client-of-another-ca"]
)
def test_a_client_certificate_from_another_ca_fails_the_handshake(
    secured_sidecar, pki, tokens, cert, key
):
    caller = _transport(secured_sidecar, pki, tokens.admin, cert=cert, key=key)
    with pytest.raises(Exception) as refused:
        caller.status()
    assert "UNAVAILABLE" in str(refused.value)


def test_plaintext_to_the_tls_port_fails(secured_sidecar, tokens):
    caller = GrpcTransport(secured_sidecar.address, call_timeout_s=5, token=tokens.admin)
    with pytest.raises(Exception) as refused:
        caller.status()
    assert "UNAVAILABLE" in str(refused.value)


def test_the_peer_port_refuses_every_token_but_the_sidecars_secret(secured_sidecar, tokens):
    [peer_address] = ray.get(secured_sidecar.actor.frontend_addresses.remote()).values()
    get_batch = pb.GetBatchRequest(step=0, rank=0, timeout_ms=10)
    for token in (None, tokens.admin, tokens.trainer):
        metadata = None if token is None else (("authorization", f"Bearer {token}"),)
        with grpc.insecure_channel(peer_address) as channel:
            stub = channel.unary_unary(
                "/rlfeed.v1.BatchServing/GetBatch",
                request_serializer=pb.GetBatchRequest.SerializeToString,
                response_deserializer=pb.GetBatchResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as refused:
                stub(get_batch, timeout=5, metadata=metadata)
        assert refused.value.code() in (
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED,
        )
    secret = secured_sidecar.frontend.peer_token  # what the sidecar's own front-ends send
    with grpc.insecure_channel(peer_address) as channel:
        stub = channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=pb.GetBatchResponse.FromString,
        )
        answer = stub(get_batch, timeout=5, metadata=(("authorization", f"Bearer {secret}"),))
    assert not answer.ready


def test_reflection_is_off_unless_allowed(make_sidecar):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    sidecar = make_sidecar(rollouts=GROUPS)
    with grpc.insecure_channel(sidecar.address) as channel, pytest.raises(grpc.RpcError) as refused:
        ProtoReflectionDescriptorDatabase(channel).get_services()
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

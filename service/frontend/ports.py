"""A front-end's two gRPC servers with their services added: the public port (asyncio,
the four rlfeed.v1 services behind `[security]` and the call guard) and the peer port
(threaded, the other front-ends only). RolloutIngest and BatchServing are registered by
hand so a batch is read in place and stored responses go out as they are."""

from __future__ import annotations

import errno
import itertools
import socket
import sys
from concurrent import futures

import grpc
import ray
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.codec.messages import parse_rollout_batch
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.aio_host import AioServerThread
from rlfeed.service.frontend.call_guard import AioCallGuard, CallGuard
from rlfeed.service.frontend.handover import PeerQueries
from rlfeed.service.frontend.ingest import RolloutIngest
from rlfeed.service.frontend.peers import peer_handler
from rlfeed.service.frontend.serving import BatchServing
from rlfeed.service.security.interceptor import peer_interceptor
from rlfeed.service.security.server_security import ServerSecurity

SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())
_server_numbers = itertools.count()  # names each public server's threads apart


def _pass_through(message: bytes | pb.GetBatchResponse) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _rollout_ingest_handler(ingest: RolloutIngest) -> grpc.GenericRpcHandler:
    """RolloutIngest registered by hand: a batch's Arrow payload is read in place from the
    request bytes (`parse_rollout_batch`), not copied into a message and out again."""
    return grpc.method_handlers_generic_handler(
        "rlfeed.v1.RolloutIngest",
        {
            "SubmitRollouts": grpc.stream_stream_rpc_method_handler(
                ingest.SubmitRollouts,
                request_deserializer=parse_rollout_batch,
                response_serializer=pb.SubmitAck.SerializeToString,
            ),
            "SubmitRolloutBatch": grpc.unary_unary_rpc_method_handler(
                ingest.SubmitRolloutBatch,
                request_deserializer=parse_rollout_batch,
                response_serializer=pb.SubmitAck.SerializeToString,
            ),
        },
    )


def _batch_serving_handler(serving: BatchServing, *, waits_on_loop: bool) -> grpc.GenericRpcHandler:
    """BatchServing registered by hand: GetBatch returns stored bytes as they are. With
    `waits_on_loop` (the asyncio server), GetBatch and AckSteps are the coroutine forms."""
    return grpc.method_handlers_generic_handler(
        "rlfeed.v1.BatchServing",
        {
            "GetBatch": grpc.unary_unary_rpc_method_handler(
                serving.GetBatchAsync if waits_on_loop else serving.GetBatch,
                request_deserializer=pb.GetBatchRequest.FromString,
                response_serializer=_pass_through,
            ),
            "AckSteps": grpc.unary_unary_rpc_method_handler(
                serving.AckStepsAsync if waits_on_loop else serving.AckSteps,
                request_deserializer=pb.AckStepsRequest.FromString,
                response_serializer=pb.AckStepsResponse.SerializeToString,
            ),
            "ReportTrainerMetrics": grpc.unary_unary_rpc_method_handler(
                serving.ReportTrainerMetrics,
                request_deserializer=pb.TrainerReport.FromString,
                response_serializer=pb.TrainerReportAck.SerializeToString,
            ),
        },
    )


def public_server(
    config: SidecarConfig,
    security: ServerSecurity,
    guard: CallGuard,
    replicated: bool,
    ingest: RolloutIngest,
    serving: BatchServing,
) -> AioServerThread:
    """The public port's asyncio server with every public service added (not bound)."""
    server = AioServerThread(
        name=f"rlfeed-grpc-{next(_server_numbers)}",
        max_workers=config.server.max_workers,
        # Who may call first, then what a call may cost.
        interceptors=[*security.aio_interceptors, AioCallGuard(guard)],
        # A busy port is an error, not a shared socket, unless replicas share it.
        options=[*config.server.grpc_options(), ("grpc.so_reuseport", int(replicated))],
        maximum_concurrent_rpcs=config.server.max_pending_calls,
    )
    pb_grpc.add_TaskSamplingServicer_to_server(ingest, server)
    pb_grpc.add_SidecarStatusServicer_to_server(serving, server)
    server.add_generic_rpc_handlers(
        (_rollout_ingest_handler(ingest), _batch_serving_handler(serving, waits_on_loop=True))
    )
    if config.security.allow_reflection:
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    return server


def hold_port(host: str, port: int) -> socket.socket | None:
    """Claim `port` for this sidecar and check nothing listens there (`check_port_free`),
    before anything starts; returns the claim, to hold until the sidecar stops (None for
    port 0, or off Linux). RuntimeError naming `host:port` if another sidecar claimed it.

    The claim closes the gap the check leaves: two sidecars of `[server] replicas` > 1
    started within one Ray start-up both find the port free, then both bind it with
    SO_REUSEPORT, which the kernel allows, and split the clients between two schedulers.
    It is a Linux abstract Unix socket named after the port: bound by one process at a
    time, scoped to the network namespace as the port is, and freed by the kernel when
    the process dies, however it dies (no file left behind to clean up)."""
    if port == 0 or not sys.platform.startswith("linux"):
        check_port_free(host, port)
        return None
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0rlfeed-serve-port-{port}")
    except OSError as exc:
        claim.close()
        if exc.errno != errno.EADDRINUSE:
            raise RuntimeError(f"cannot claim {host}:{port}: {exc.strerror}") from None
        raise RuntimeError(
            f"cannot listen on {host}:{port}: the port is in use (another rlfeed serve "
            "is starting on it or serves it)"
        ) from None
    try:
        check_port_free(host, port)
    except BaseException:
        claim.close()
        raise
    return claim


def check_port_free(host: str, port: int) -> None:
    """RuntimeError naming `host:port` when something listens there, before anything
    starts (Ray's start-up costs seconds). A plain bind, without SO_REUSEPORT, so another
    sidecar whose front-ends share the port with SO_REUSEPORT is found too; port 0 (any
    free port) passes."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: connections of an earlier run in TIME_WAIT do not count.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                reason = (
                    "the port is in use (another rlfeed serve?)"
                    if exc.errno == errno.EADDRINUSE
                    else exc.strerror
                )
                raise RuntimeError(f"cannot listen on {host}:{port}: {reason}") from None


def peer_host(host: str) -> str:
    """The address other front-ends reach this one at: the bound interface, or this node's
    address when bound to all interfaces."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        return ray.util.get_node_ip_address()
    return host


def public_address(config: SidecarConfig, port: int) -> str:
    """Where clients reach a front-end on `port`: `[server] host`, with this node's address
    for a wildcard host."""
    return f"{peer_host(config.server.host)}:{port}"


def _grpc_server(
    config: SidecarConfig, name: str, interceptors: list[grpc.ServerInterceptor]
) -> grpc.Server:
    """A threaded gRPC server with the `[server]` channel arguments (message size limit
    both ways, keepalive, idle and aged connections, handshake timeout)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.server.max_workers, thread_name_prefix=name),
        interceptors=interceptors,
        options=config.server.grpc_options(),
    )


def start_peer_server(
    config: SidecarConfig, queries: PeerQueries, serving: BatchServing, peer_token: str
) -> tuple[grpc.Server, str]:
    """The server the other front-ends reach this one at, on a port of its own (the public
    port never serves the peer service): the peer service and BatchServing (forwarded
    fetches). Returns it started, with its address."""
    # Only this sidecar's front-ends get in: they present the secret the actor shares with
    # them. The port is plaintext (a replica on another node joins over the node network;
    # run Ray and the sidecar on a private network, or put mTLS on it: see security/README).
    peer_server = _grpc_server(config, "rlfeed-peer", [peer_interceptor(peer_token)])
    peer_server.add_generic_rpc_handlers(
        (
            peer_handler(queries.columns_of, queries.response_of, queries.stored_by),
            _batch_serving_handler(serving, waits_on_loop=False),
        )
    )
    host = peer_host(config.server.host)
    port = peer_server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise RuntimeError(f"cannot listen on {host} for the other front-ends")
    peer_server.start()
    return peer_server, f"{host}:{port}"

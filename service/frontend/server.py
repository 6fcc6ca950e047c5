"""One front-end's gRPC servers: start-up, handler registration and the one shutdown path.

`start_server(config)` brings up (or joins) Ray and the scheduler actor, the front-end's
parts (`FrontendState`, `StepAssembler`, `RolloutIngest`, `BatchServing`, `PeerQueries`)
and a threaded `grpc.server` with the four rlfeed.v1 services, health and (if allowed)
reflection, behind `[security]` (TLS, mTLS, role tokens: `service/security/README.md`).
`SidecarServer.stop()` is the one teardown. How the parts cooperate: `README.md` here.
"""

from __future__ import annotations

import contextlib
import logging
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from rlfeed.client.allocator import retain_freed_memory
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.assembler import StepAssembler
from rlfeed.service.frontend.codec import parse_rollout_batch
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.frontend.ingest import RolloutIngest
from rlfeed.service.frontend.serving import BatchServing
from rlfeed.service.frontend.state import FrontendState
from rlfeed.service.replicas.handover import PeerQueries, hand_over
from rlfeed.service.replicas.peers import peer_handler
from rlfeed.service.scheduler.actor import create_scheduler_actor
from rlfeed.service.security.interceptor import peer_interceptor
from rlfeed.service.security.server_security import ServerSecurity

_log = logging.getLogger("rlfeed.service.frontend.server")
SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())


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


def _batch_serving_handler(serving: BatchServing) -> grpc.GenericRpcHandler:
    """BatchServing registered by hand: GetBatch returns stored bytes as they are."""
    return grpc.method_handlers_generic_handler(
        "rlfeed.v1.BatchServing",
        {
            "GetBatch": grpc.unary_unary_rpc_method_handler(
                serving.GetBatch,
                request_deserializer=pb.GetBatchRequest.FromString,
                response_serializer=_pass_through,
            ),
            "AckSteps": grpc.unary_unary_rpc_method_handler(
                serving.AckSteps,
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


@dataclass
class SidecarServer:
    """A running sidecar: `address` is "host:port"; `stop()` is idempotent."""

    config: SidecarConfig
    port: int
    server: grpc.Server
    frontend: FrontendState
    assembler: StepAssembler
    peer_queries: PeerQueries
    security: ServerSecurity
    health: health.HealthServicer
    actor: ray.actor.ActorHandle
    started_ray: bool
    owns_actor: bool = True  # False for a replica that joined another front-end's actor
    peer_server: grpc.Server | None = None  # the other front-ends' way in
    # A replica that stopped: whether it handed its data over (`replicas.handover`;
    # also true when the whole sidecar was stopping and nothing needed keeping).
    handed_over: bool = False
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    def stop(self, grace: float = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.health.enter_graceful_shutdown()
            self.frontend.signals.stop()  # answers waiting GetBatch calls now
            self.assembler.stop()
            self.server.stop(grace).wait(grace + 1.0)
            if not self.owns_actor:  # the sidecar runs on with what this replica holds
                try:
                    hand_over(self.frontend, self.assembler)
                    self.handed_over = True
                except Exception:  # its data is lost: the caller reports the replica failed
                    _log.exception("rlfeed: this front-end could not hand its data over")
            if self.peer_server is not None:
                self.peer_server.stop(grace).wait(grace + 1.0)
            self.frontend.peers.close()
            if not self.owns_actor:  # the sidecar runs on; its releases need not wait for us
                with contextlib.suppress(ray.exceptions.RayError):  # stopped first: it is gone
                    self.frontend.scheduler.unregister(timeout_s=10)
        finally:
            try:
                if self.owns_actor:
                    ray.kill(self.actor)
            finally:
                if self.started_ray:
                    ray.shutdown()

    def wait(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)

    def __enter__(self) -> SidecarServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _connect_ray(config: SidecarConfig, ray_address: str | None) -> bool:
    """Make sure this process is a Ray driver; returns True if it started/joined Ray here."""
    if ray.is_initialized():
        return False
    if ray_address is None:
        ray.init(
            address="local",  # always a fresh embedded instance, never a stray cluster
            num_cpus=config.ray.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            namespace=config.ray.namespace,
        )
    else:
        ray.init(address=ray_address, namespace=config.ray.namespace, log_to_driver=False)
    return True


def _peer_host(host: str) -> str:
    """The address other front-ends reach this one at: the bound interface, or this node's
    address when bound to all interfaces."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        return ray.util.get_node_ip_address()
    return host


def _grpc_server(
    config: SidecarConfig,
    name: str,
    interceptors: list[grpc.ServerInterceptor],
    *options: tuple[str, int],
) -> grpc.Server:
    """A threaded gRPC server with the sidecar's message size limit both ways."""
    limit = config.server.max_message_bytes
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.server.max_workers, thread_name_prefix=name),
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            *options,
        ],
    )


def _start_peer_server(
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
            _batch_serving_handler(serving),
        )
    )
    host = _peer_host(config.server.host)
    port = peer_server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise RuntimeError(f"cannot listen on {host} for the other front-ends")
    peer_server.start()
    return peer_server, f"{host}:{port}"


def start_server(
    config: SidecarConfig,
    ray_address: str | None = None,
    events: ServerEvents | None = None,
    join: bool = False,
) -> SidecarServer:
    """Start Ray (embedded, or join `ray_address`: "auto" or host:port) unless this process
    already runs it, the scheduler actor and the gRPC server; returns once serving.
    `events` receives the front-end's hooks (metrics); default: no-ops.

    With `join`, this is another front-end (replica) of a running sidecar: it finds the
    named actor instead of creating one, shares the port (SO_REUSEPORT, as every front-end
    does when `[server] replicas` > 1) and leaves the actor running when it stops.

    `[server] retained_free_mib` sets glibc's malloc for this whole process, whatever
    else it runs (client.allocator, with one heap for all threads: that part only if no
    thread has needed a heap of its own yet, which `rlfeed serve` sees to)."""
    retained = config.server.retained_free_mib
    if retained and not retain_freed_memory(retained * 2**20, single_arena=True):
        _log.info("rlfeed: [server] retained_free_mib not applied (the C library is not glibc)")
    # Certificates and the token file are read before Ray starts: a bad one costs no start-up.
    security = ServerSecurity.from_config(config.security)
    started_ray = _connect_ray(config, ray_address)
    actor = server = peer_server = None
    replicated = join or config.server.replicas > 1  # other front-ends may share the actor
    try:
        if join:
            actor = ray.get_actor(config.ray.actor_name, namespace=config.ray.namespace)
        else:
            actor = create_scheduler_actor(config)
        frontend = FrontendState(config, actor, events, announce=replicated)
        assembler = StepAssembler(frontend)
        ingest, serving = RolloutIngest(frontend, assembler), BatchServing(frontend)
        queries = PeerQueries(frontend)
        peer_server, peer_address = _start_peer_server(
            config, queries, serving, frontend.peer_token
        )
        # A busy port is an error, not a shared socket, unless replicas share it.
        server = _grpc_server(
            config, "rlfeed-grpc", security.interceptors, ("grpc.so_reuseport", int(replicated))
        )
        pb_grpc.add_TaskSamplingServicer_to_server(ingest, server)
        pb_grpc.add_SidecarStatusServicer_to_server(serving, server)
        server.add_generic_rpc_handlers(
            (_rollout_ingest_handler(ingest), _batch_serving_handler(serving))
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if config.security.allow_reflection:
            reflection.enable_server_reflection(
                (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
        target = f"{config.server.host}:{config.server.port}"
        try:
            port = security.bind(server, target)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {target}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot listen on {target} (port in use?)")
        frontend.scheduler.register(peer_address)
        server.start()
        _log.info("rlfeed: %s serves %s", target, security.describe())
        assembler.start()
        for name in ("", *SERVICE_NAMES):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        if server is not None:
            server.stop(0)
        if peer_server is not None:
            peer_server.stop(0)
        if actor is not None and not join:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
        raise
    return SidecarServer(
        config=config,
        port=port,
        server=server,
        frontend=frontend,
        assembler=assembler,
        peer_queries=queries,
        security=security,
        health=health_servicer,
        actor=actor,
        started_ray=started_ray,
        owns_actor=not join,
        peer_server=peer_server,
    )

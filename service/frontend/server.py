"""One front-end's gRPC servers: start-up, handler registration and the one shutdown path.

`start_server(config)` brings up (or joins) Ray and the scheduler actor, the front-end's
parts (`FrontendState`, `StepAssembler`, `RolloutIngest`, `BatchServing`, `PeerQueries`)
and the public port's asyncio gRPC server (`aio_host.AioServerThread`: a waiting GetBatch
holds no thread; the other handlers run in its thread pool) with the four rlfeed.v1
services, health and (if allowed) reflection, behind `[security]` (TLS, mTLS, role tokens:
`service/security/README.md`) and the `[server]` limits on what a call may hold
(`call_guard`). The peer port (other front-ends only) stays a threaded `grpc.server`.
`SidecarServer.stop()` is the one teardown. How the parts cooperate: `README.md` here.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import signal
import socket
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from rlfeed.client.allocator import retain_freed_memory
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.service.codec.messages import parse_rollout_batch
from rlfeed.service.config import SidecarConfig
from rlfeed.service.config.scaleout import embedded_cpus
from rlfeed.service.frontend.aio_host import AioServerThread
from rlfeed.service.frontend.assembler import StepAssembler
from rlfeed.service.frontend.call_guard import AioCallGuard, CallGuard
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.frontend.handover import PeerQueries, hand_over
from rlfeed.service.frontend.ingest import RolloutIngest
from rlfeed.service.frontend.journaling import frontend_slot, load_claim, open_slot_journal
from rlfeed.service.frontend.peers import peer_handler
from rlfeed.service.frontend.serving import BatchServing
from rlfeed.service.frontend.state import FrontendState
from rlfeed.service.frontend.watch import ActorWatch
from rlfeed.service.scheduler.actor import create_scheduler_actor
from rlfeed.service.security.interceptor import peer_interceptor
from rlfeed.service.security.server_security import ServerSecurity

_log = logging.getLogger("rlfeed.service.frontend.server")
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
    `waits_on_loop` (the asyncio server), GetBatch is the coroutine form."""
    return grpc.method_handlers_generic_handler(
        "rlfeed.v1.BatchServing",
        {
            "GetBatch": grpc.unary_unary_rpc_method_handler(
                serving.GetBatchAsync if waits_on_loop else serving.GetBatch,
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


@dataclass(frozen=True)
class Registration:
    """What a front-end tells the scheduler actor when it joins (and joins again after the
    actor restarted): where its peers and its clients reach it, its slot and Ray node."""

    peer_address: str
    slot: str  # its journal folder; "" without a journal
    address: str  # host:port of the public port (the node's address for 0.0.0.0)
    node_id: str

    def register(self, frontend: FrontendState) -> None:
        frontend.scheduler.register(self.peer_address, self.slot, self.address, self.node_id)


@dataclass
class SidecarServer:
    """A running sidecar: `address` is "host:port"; `stop()` is idempotent."""

    config: SidecarConfig
    port: int
    server: AioServerThread
    frontend: FrontendState
    assembler: StepAssembler
    peer_queries: PeerQueries
    security: ServerSecurity
    guard: CallGuard
    health: health.HealthServicer
    actor: ray.actor.ActorHandle
    started_ray: bool
    watch: ActorWatch | None = None
    # Set when the scheduler actor is gone for good (no journal to come back from): the
    # process should exit non-zero (`rlfeed serve` does), `lost_reason` says why.
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str = ""
    owns_actor: bool = True  # False for a replica that joined another front-end's actor
    peer_server: grpc.Server | None = None  # the other front-ends' way in
    # A replica that stopped: whether it handed its data over (`replicas.handover`;
    # also true when the whole sidecar was stopping and nothing needed keeping).
    handed_over: bool = False
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    @property
    def public_address(self) -> str:
        return _public_address(self.config, self.port)

    def stop(self, grace: float = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.watch is not None:
                self.watch.stop()
            self.health.enter_graceful_shutdown()
            self.frontend.signals.stop()  # answers waiting GetBatch calls now
            self.assembler.stop()
            self.server.stop(grace).wait(grace + 1.0)
            self.guard.stop()
            if not self.owns_actor:  # the sidecar runs on with what this replica holds
                try:
                    hand_over(self.frontend, self.assembler)
                    self.handed_over = True
                except Exception:  # its data is lost: the caller reports the replica failed
                    _log.exception("rlfeed: this front-end could not hand its data over")
            if self.peer_server is not None:
                self.peer_server.stop(grace).wait(grace + 1.0)
            self.frontend.peers.close()
            if self.frontend.journal is not None:
                self.frontend.journal.close()
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

    def abandon(self) -> None:
        """Stop serving at once, saying nothing to the actor or Ray: a replica whose first
        process died (Ray and the actor went with it, so any call would only wait for a
        timeout). The ports are freed and the journal closed; what it acknowledged is in
        the journal for the next `rlfeed serve` on it. The caller then exits the process
        (Ray's own exit hooks would wait for the dead cluster too)."""
        if self._stopped:
            return
        self._stopped = True
        _set_serving(self.health, False)
        self.frontend.signals.stop()
        self.server.stop(0)
        if self.peer_server is not None:
            self.peer_server.stop(0)
        if self.frontend.journal is not None:
            with contextlib.suppress(Exception):  # mid-append in another thread: exiting anyway
                self.frontend.journal.close()

    def wait(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)

    def __enter__(self) -> SidecarServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def connect_ray(config: SidecarConfig, ray_address: str | None) -> bool:
    """Make sure this process is a Ray driver; returns True if it started/joined Ray here.

    `ray.init` replaces the SIGTERM handler (with one that exits, and its core worker's C
    handler that dumps a stack); the caller's is put back once it returns, so `rlfeed
    serve` and `rlfeed demo` stop on SIGTERM as they decided."""
    if ray.is_initialized():
        return False
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm_handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        if ray_address is None:
            ray.init(
                address="local",  # always a fresh embedded instance, never a stray cluster
                num_cpus=embedded_cpus(config.ray.num_cpus, config.frontends),
                include_dashboard=False,
                log_to_driver=False,
                namespace=config.ray.namespace,
            )
        else:
            ray.init(address=ray_address, namespace=config.ray.namespace, log_to_driver=False)
    finally:
        if sigterm_handler is not None:
            signal.signal(signal.SIGTERM, sigterm_handler)
    return True


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


def _peer_host(host: str) -> str:
    """The address other front-ends reach this one at: the bound interface, or this node's
    address when bound to all interfaces."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        return ray.util.get_node_ip_address()
    return host


def _public_address(config: SidecarConfig, port: int) -> str:
    """Where clients reach a front-end on `port`: `[server] host`, with this node's address
    for a wildcard host."""
    return f"{_peer_host(config.server.host)}:{port}"


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
            _batch_serving_handler(serving, waits_on_loop=False),
        )
    )
    host = _peer_host(config.server.host)
    port = peer_server.add_insecure_port(f"{host}:0")
    if port == 0:
        raise RuntimeError(f"cannot listen on {host} for the other front-ends")
    peer_server.start()
    return peer_server, f"{host}:{port}"


def _take_over_slot(frontend: FrontendState, assembler: StepAssembler) -> None:
    """Load what the scheduler's recovery left in this front-end's journal slot, and queue
    the planned steps to materialize again, before serving anything."""
    claim = frontend.scheduler.claim_slot(frontend.slot)
    batches, steps = load_claim(frontend.journal, claim, frontend.payloads, frontend.responses)
    for step in claim.steps:
        frontend.signals.stored_here(step)
    assembler.add_work(claim.work)
    if batches or steps or claim.work:
        _log.info(
            "rlfeed: %s recovered %d ingest batches and %d stored steps from its journal; "
            "%d planned steps to materialize again",
            frontend.slot,
            batches,
            steps,
            len(claim.work),
        )


def start_server(
    config: SidecarConfig,
    ray_address: str | None = None,
    events: ServerEvents | None = None,
    join: bool = False,
    slot: str = frontend_slot(0),
) -> SidecarServer:
    """Start Ray (embedded, or join `ray_address`: "auto" or host:port) unless this process
    already runs it, the scheduler actor and the gRPC server; returns once serving.
    `events` receives the front-end's hooks (metrics); default: no-ops.

    With `join`, this is another front-end (replica) of a running sidecar: it finds the
    named actor instead of creating one, shares the port (SO_REUSEPORT, as every front-end
    does when `[server] replicas` > 1) and leaves the actor running when it stops.

    `slot` names this front-end's journal folder under `[journal] dir` (replicas: their
    index); a restarted front-end takes over what its slot's journal holds before serving.

    `[server] retained_free_mib` sets glibc's malloc for this whole process, whatever
    else it runs (client.allocator, with one heap for all threads: that part only if no
    thread has needed a heap of its own yet, which `rlfeed serve` sees to)."""
    retained = config.server.retained_free_mib
    if retained and not retain_freed_memory(retained * 2**20, single_arena=True):
        _log.info("rlfeed: [server] retained_free_mib not applied (the C library is not glibc)")
    # Certificates, the token file and the port are checked before Ray starts: a bad one
    # costs no start-up. A replica joining shares the port its sidecar already holds.
    security = ServerSecurity.from_config(config.security)
    if not join:
        check_port_free(config.server.host, config.server.port)
    guard = CallGuard(config.server)
    started_ray = connect_ray(config, ray_address)
    actor = server = peer_server = journal = None
    replicated = join or config.server.replicas > 1  # other front-ends may share the actor
    try:
        journal = open_slot_journal(config, slot)
        if join:
            actor = ray.get_actor(config.ray.actor_name, namespace=config.ray.namespace)
        else:
            actor = create_scheduler_actor(config)
        frontend = FrontendState(
            config, actor, events, announce=replicated, journal=journal, slot=slot
        )
        assembler = StepAssembler(frontend)
        ingest, serving = RolloutIngest(frontend, assembler), BatchServing(frontend)
        queries = PeerQueries(frontend)
        peer_server, peer_address = _start_peer_server(
            config, queries, serving, frontend.peer_token
        )
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
        public = Registration(
            peer_address=peer_address,
            slot=slot if journal is not None else "",
            address=_public_address(config, port),
            node_id=ray.get_runtime_context().get_node_id(),
        )
        public.register(frontend)
        if journal is not None:
            _take_over_slot(frontend, assembler)
        guard.start()
        server.start()
        _log.info("rlfeed: %s serves %s", target, security.describe())
        assembler.start()
        _set_serving(health_servicer, True)
    except BaseException:
        guard.stop()
        if server is not None:
            server.stop(0).wait(10)
        if peer_server is not None:
            peer_server.stop(0)
        if actor is not None and not join:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
        if journal is not None:
            journal.close()
        raise
    sidecar = SidecarServer(
        config=config,
        port=port,
        server=server,
        frontend=frontend,
        assembler=assembler,
        peer_queries=queries,
        security=security,
        guard=guard,
        health=health_servicer,
        actor=actor,
        started_ray=started_ray,
        owns_actor=not join,
        peer_server=peer_server,
    )
    sidecar.watch = _watch(sidecar, public)
    return sidecar


def _set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    answer = health_pb2.HealthCheckResponse
    status = answer.SERVING if serving else answer.NOT_SERVING
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, status)


def _watch(sidecar: SidecarServer, registration: Registration) -> ActorWatch:
    """Start the front-end's watch on the scheduler actor (see `watch.py`)."""
    frontend = sidecar.frontend
    retention = frontend.retention

    def rejoin() -> None:
        frontend.scheduler.drop_notes()
        registration.register(frontend)
        if frontend.journal is not None:
            _take_over_slot(frontend, sidecar.assembler)

    def on_lost(reason: str) -> None:
        _log.error("rlfeed: %s; this front-end stops serving", reason)
        sidecar.lost_reason = reason
        sidecar.lost.set()

    watch = ActorWatch(
        frontend,
        set_serving=lambda serving: _set_serving(sidecar.health, serving),
        rejoin=rejoin,
        on_lost=on_lost,
        maintain=(lambda: retention.trim(frontend.scheduler)) if retention else None,
    )
    watch.start(frontend.scheduler.incarnation(timeout_s=30))
    return watch

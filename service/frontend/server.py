"""One front-end's start-up and its one shutdown.

`start_server(config)` brings up (or joins) Ray and the scheduler actor, the front-end's
parts (`FrontendState`, `StepAssembler`, `RolloutIngest`, `BatchServing`, `PeerQueries`)
and the public port's asyncio gRPC server (`aio_host.AioServerThread`: a waiting GetBatch
holds no thread; the other handlers run in its thread pool) with the four rlfeed.v1
services, health and (if allowed) reflection, behind `[security]` (TLS, mTLS, role tokens:
`service/security/README.md`) and the `[server]` limits on what a call may hold
(`call_guard`); the peer port (other front-ends only) stays a threaded `grpc.server`
(both built in `ports.py`). Each resource registers its closer on one `ExitStack` as it
is acquired: a failed start-up, `SidecarServer.stop()` and `abandon()` all unwind it.
How the parts cooperate: `README.md` here.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from dataclasses import dataclass, field

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rlfeed.client.allocator import retain_freed_memory
from rlfeed.service.config import SidecarConfig
from rlfeed.service.config.scaleout import embedded_cpus
from rlfeed.service.frontend import ports
from rlfeed.service.frontend.aio_host import AioServerThread
from rlfeed.service.frontend.assembler import StepAssembler
from rlfeed.service.frontend.call_guard import CallGuard
from rlfeed.service.frontend.events import ServerEvents
from rlfeed.service.frontend.handover import PeerQueries, hand_over
from rlfeed.service.frontend.ingest import RolloutIngest
from rlfeed.service.frontend.journaling import (
    JournalHealth,
    frontend_slot,
    load_claim,
    open_slot_journal,
)
from rlfeed.service.frontend.ports import SERVICE_NAMES, hold_port, start_peer_server
from rlfeed.service.frontend.serving import BatchServing
from rlfeed.service.frontend.state import FrontendState
from rlfeed.service.frontend.watch import ActorWatch
from rlfeed.service.scheduler.actor import create_scheduler_actor
from rlfeed.service.security.server_security import ServerSecurity

_log = logging.getLogger("rlfeed.service.frontend.server")


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
class _Teardown:
    """How a front-end lets go of what it holds; each closer reads it as it runs."""

    grace: float = 0.0  # seconds calls in flight may take to finish
    graceful: bool = False  # stop(): drain, hand over, unregister; else a failed start-up
    abandon: bool = False  # the actor and Ray are gone: say nothing to them
    handed_over: bool = False  # set by the hand-over closer of a replica


@dataclass
class SidecarServer:
    """A running sidecar: `address` is "host:port"; `stop()` is idempotent.

    Every resource start-up acquires registers its closer on `_closers` as it is acquired,
    so start-up that fails, `stop()` and `abandon()` are one unwinding, in reverse order
    of acquisition, with `_teardown` saying how."""

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
    watch: ActorWatch
    registration: Registration  # what it tells the actor, again after the actor restarts
    _closers: contextlib.ExitStack = field(repr=False)
    _teardown: _Teardown = field(repr=False)
    # Set when the scheduler actor is gone for good (no journal to come back from): the
    # process should exit non-zero (`rlfeed serve` does), `lost_reason` says why.
    lost: threading.Event = field(default_factory=threading.Event)
    lost_reason: str = ""
    owns_actor: bool = True  # False for a replica that joined another front-end's actor
    peer_server: grpc.Server | None = None  # the other front-ends' way in
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        return f"{self.config.server.host}:{self.port}"

    @property
    def public_address(self) -> str:
        return ports.public_address(self.config, self.port)

    @property
    def handed_over(self) -> bool:
        """A replica that stopped: whether it handed its data over (`handover.py`)."""
        return self._teardown.handed_over

    def stop(self, grace: float = 2.0) -> None:
        """Health goes NOT_SERVING, waiting calls are answered, the servers drain within
        `grace` seconds, a replica hands over and unregisters; the actor and Ray stop if
        this process started them."""
        self._unwind(_Teardown(grace=grace, graceful=True))

    def abandon(self) -> None:
        """Stop serving at once, saying nothing to the actor or Ray: a replica whose first
        process died (Ray and the actor went with it, so any call would only wait for a
        timeout). The ports are freed and the journal closed; what it acknowledged is in
        the journal for the next `rlfeed serve` on it. The caller then exits the process
        (Ray's own exit hooks would wait for the dead cluster too)."""
        self._unwind(_Teardown(abandon=True))

    def _unwind(self, how: _Teardown) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._teardown.grace, self._teardown.graceful = how.grace, how.graceful
        self._teardown.abandon = how.abandon
        self._closers.close()

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


def _take_over_slot(frontend: FrontendState, assembler: StepAssembler) -> None:
    """Load what the scheduler's recovery left in this front-end's journal slot, and queue
    the planned steps to materialize again, before serving anything."""
    claim = frontend.scheduler.claim_slot(frontend.slot)
    batches, steps = load_claim(frontend.journal, claim, frontend.payloads, frontend.responses)
    for step in [*claim.steps, *(work.step for work, _ in claim.derive)]:
        frontend.signals.stored_here(step)  # (held here, journaled or built again)
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
    claim = None if join else hold_port(config.server.host, config.server.port)
    teardown = _Teardown()
    with contextlib.ExitStack() as closers:  # a start-up that fails unwinds it at once
        if claim is not None:  # let go last: no other sidecar takes the port before
            closers.callback(claim.close)
        sidecar = _start(config, ray_address, events, join, slot, security, closers, teardown)
        sidecar.watch = _watch(sidecar, closers)
        sidecar._closers = closers.pop_all()
    return sidecar


def _start(
    config: SidecarConfig,
    ray_address: str | None,
    events: ServerEvents | None,
    join: bool,
    slot: str,
    security: ServerSecurity,
    closers: contextlib.ExitStack,
    teardown: _Teardown,
) -> SidecarServer:
    """Acquire, in order, what a front-end holds, each registering its closer on `closers`
    (they run in reverse: the last acquired is let go first)."""
    started_ray = connect_ray(config, ray_address)
    if started_ray:
        closers.callback(lambda: None if teardown.abandon else ray.shutdown())
    # Registered before the journal opens: the journal closes before the actor goes.
    held: dict[str, ray.actor.ActorHandle] = {}
    closers.callback(_let_actor_go, held, join, teardown)
    journal = open_slot_journal(config, slot)
    if journal is not None:
        closers.callback(_close_journal, journal, teardown)
    if join:
        actor = ray.get_actor(config.ray.actor_name, namespace=config.ray.namespace)
    else:
        actor = create_scheduler_actor(config)
    held["actor"] = actor
    replicated = join or config.server.replicas > 1  # other front-ends may share the actor
    frontend = held["frontend"] = FrontendState(
        config, actor, events, announce=replicated, journal=journal, slot=slot
    )
    closers.callback(lambda: None if teardown.abandon else frontend.peers.close())
    assembler = StepAssembler(frontend)
    ingest, serving = RolloutIngest(frontend, assembler), BatchServing(frontend)
    queries = PeerQueries(frontend)
    peer_server, peer_address = start_peer_server(config, queries, serving, frontend.peer_token)
    closers.callback(_stop_grpc, peer_server, teardown, None)
    if join:  # the sidecar runs on with what this replica holds: hand it over first
        closers.callback(_hand_over, frontend, assembler, teardown)
    guard = CallGuard(config.server)
    closers.callback(lambda: None if teardown.abandon else guard.stop())
    server = ports.public_server(config, security, guard, replicated, ingest, serving)
    closers.callback(_stop_grpc, server, teardown, 10.0)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    target = f"{config.server.host}:{config.server.port}"
    try:
        port = security.bind(server, target)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {target}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot listen on {target} (port in use?)")
    registration = Registration(
        peer_address=peer_address,
        slot=slot if journal is not None else "",
        address=ports.public_address(config, port),
        node_id=ray.get_runtime_context().get_node_id(),
    )
    registration.register(frontend)
    if journal is not None:
        _take_over_slot(frontend, assembler)
    guard.start()
    server.start()
    _log.info("rlfeed: %s serves %s", target, security.describe())
    assembler.start()
    closers.callback(lambda: None if teardown.abandon else assembler.stop())
    closers.callback(frontend.signals.stop)  # answers waiting GetBatch calls now
    closers.callback(_leave_health, health_servicer, teardown)
    _set_serving(health_servicer, True)
    return SidecarServer(
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
        watch=None,  # type: ignore[arg-type]  # set by start_server once serving
        registration=registration,
        _closers=closers,
        _teardown=teardown,
        owns_actor=not join,
        peer_server=peer_server,
    )


# The closers start-up registers, each reading the _Teardown as it runs.


def _let_actor_go(held: dict, join: bool, teardown: _Teardown) -> None:
    """The actor this process created is killed; a replica that stops unregisters (the
    sidecar runs on, its releases need not wait for this one)."""
    actor = held.get("actor")
    if actor is None or teardown.abandon:
        return
    if not join:
        ray.kill(actor)
    elif teardown.graceful:
        with contextlib.suppress(ray.exceptions.RayError):  # stopped first: it is gone
            held["frontend"].scheduler.unregister(timeout_s=10)


def _close_journal(journal, teardown: _Teardown) -> None:
    if not teardown.abandon:
        journal.close()
        return
    with contextlib.suppress(Exception):  # mid-append in another thread: exiting anyway
        journal.close()


def _stop_grpc(server, teardown: _Teardown, failed_wait: float | None) -> None:
    """Drain within the grace of a stop; at once on a failed start-up (waiting
    `failed_wait` seconds for it, if given) or when abandoned."""
    if teardown.graceful:
        server.stop(teardown.grace).wait(teardown.grace + 1.0)
    elif teardown.abandon or failed_wait is None:
        server.stop(0)
    else:
        server.stop(0).wait(failed_wait)


def _hand_over(frontend: FrontendState, assembler: StepAssembler, teardown: _Teardown) -> None:
    if not teardown.graceful:
        return
    try:
        hand_over(frontend, assembler)
        teardown.handed_over = True
    except Exception:  # its data is lost: the caller reports the replica failed
        _log.exception("rlfeed: this front-end could not hand its data over")


def _leave_health(health_servicer: health.HealthServicer, teardown: _Teardown) -> None:
    if teardown.graceful:
        health_servicer.enter_graceful_shutdown()
    elif teardown.abandon:
        _set_serving(health_servicer, False)


def _set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    answer = health_pb2.HealthCheckResponse
    status = answer.SERVING if serving else answer.NOT_SERVING
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, status)


def _watch(sidecar: SidecarServer, closers: contextlib.ExitStack) -> ActorWatch:
    """Start the front-end's watch on the scheduler actor (see `watch.py`); it is the
    first thing a stop lets go of."""
    frontend = sidecar.frontend
    retention = frontend.retention

    def rejoin() -> None:
        frontend.scheduler.drop_notes()
        sidecar.registration.register(frontend)
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
        check_journal=JournalHealth(frontend.journal, sidecar.health) if retention else None,
    )
    watch.start(frontend.scheduler.incarnation(timeout_s=30))
    closers.callback(lambda: None if sidecar._teardown.abandon else watch.stop())
    return watch

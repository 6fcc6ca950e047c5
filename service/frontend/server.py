"""The gRPC front-end: decode + validate on the handler thread, then one small actor call.

`start_server(config)` brings up (or joins) Ray, creates the named scheduler actor and a
threaded `grpc.server` serving the four rlfeed.v1 services, the standard health service
and server reflection. `SidecarServer.stop()` is the one shutdown path: health goes
NOT_SERVING, waiting GetBatch calls are released, the server drains for `grace` seconds,
a replica hands its data over (`SidecarServicer.hand_over`) and leaves the actor, and the
actor is killed and Ray is shut down if this process started it.

Per rollout batch the handler thread decodes the Arrow payload and validates it
(vectorized numpy), keeps the columns in this process under a key (`LocalPayloads`; no
copy into the object store) and sends the actor one call with metadata arrays and the
handle (front-end id, key); the ack answers from its result. A batch that completes a step
has the step planned in the same call: the handler hands the work to this front-end's
assembler thread and returns. The assembler materializes every rank's response (the bulk
work, here and not in the actor), keeps the bytes in its memory, notes the step stored for
the actor (`StoreStepNote`) and moves the oldest responses beyond `_RESPONSE_CACHE_BYTES`
to the object store (`move_step`), so memory stays bounded and every held step stays
servable. Notes ride along with the next actor call (`ActorCalls`) rather than costing a
Ray call each, and batches arriving while an ingest call is in flight share the next one
(`IngestGroups`). So the actor's Python loop only sees metadata, and a producer's ack
waits for planning (a few ms, in the actor) but never for materialization. GetBatch answers
with the stored response bytes as they are (a pass-through serializer), so a re-fetch is
byte-identical. The actor's answers also say what this front-end may free (`Releases`):
ingest batches once no buffered rollout and no step still to be stored reads them, and
responses of released steps, so their memory goes to the next steps.

Several front-ends may share one actor (`[server] replicas`, `start_server(join=True)`):
each registers a private peer address with the actor and answers its peers from its memory
(`service/peers.py`). A step reads the batches other front-ends decoded through their peer
service, and a rank asking one front-end for a step another stored gets the bytes fetched
from that one, unchanged.

GetBatch protocol: wait up to min(timeout_ms, max_wait_seconds, the call's deadline) for
the step; if it is still not assembled, answer OK with `ready = false` (poll again). A
rank's first fetch of a step this front-end assembled is answered from its memory, and a
`FetchNote` tells the actor (after the step's StoreStepNote: one caller's actor calls run
in submission order). Every other fetch
waits for the actor's answer, which is how a released step is reported NOT_FOUND.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass, field, replace

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from rlfeed.client.allocator import retain_freed_memory
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.sched.assembly import TokenColumns
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.codec import (
    RolloutBatchView,
    decode_rollout_batch,
    parse_rollout_batch,
    status_to_proto,
)
from rlfeed.service.frontend.events import ServerEvents, notify
from rlfeed.service.frontend.materialize import StepWork, materialize_work
from rlfeed.service.frontend.memory import LocalPayloads, ResponseCache
from rlfeed.service.frontend.validation import InvalidBatchError, validate_rollout_batch
from rlfeed.service.replicas.peers import PeerClient, peer_handler
from rlfeed.service.scheduler.actor import create_scheduler_actor
from rlfeed.service.scheduler.client import ActorCalls, IngestGroups
from rlfeed.service.scheduler.records import FetchNote, IngestReply, Releases, StoreStepNote
from rlfeed.service.scheduler.state import BackpressureError, BatchMeta

_log = logging.getLogger("rlfeed.service.frontend.server")
SERVICE_NAMES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())
# A waiting GetBatch re-asks the actor this often even without a local "step assembled"
# signal (a step this front-end did not store; with replicas, another front-end's).
_POLL_SECONDS = 0.25
ASSEMBLY_RETRY_SECONDS = 1.0  # after a failed step materialization (the step is kept)
# Notes wait for the front-end's next actor call; with none for this long, they go alone.
NOTE_FLUSH_SECONDS = 0.05
# An idle front-end asks the actor this often what it may free, notes or not.
RELEASES_POLL_SECONDS = 1.0


# How many other front-ends' step announcements a front-end remembers.
_ANNOUNCEMENTS_KEPT = 1024
# A replica leaving waits at most this long for its own planned steps to be materialized,
# and again for the other front-ends' steps that read its batches to be stored.
HAND_OVER_SECONDS = 30.0

# Steps this front-end materialized stay in its memory, and are served from there, up to
# this size; beyond it the oldest steps the actor still holds move to the object store
# (`move_step`) and released ones are dropped.
_RESPONSE_CACHE_BYTES = 256 * 2**20


def _unavailable_when_ray_fails(handler):
    """A dead scheduler actor or Ray connection answers UNAVAILABLE (retryable), not
    UNKNOWN with a traceback."""

    @functools.wraps(handler)
    def wrapped(self, request, context):
        try:
            return handler(self, request, context)
        except ray.exceptions.RayError as exc:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"scheduler unavailable: {type(exc).__name__}: {str(exc)[:500]}",
            )

    return wrapped


def _admitted(method):
    """Count a state-changing call in flight (ingest, GetBatch), or answer UNAVAILABLE once
    this front-end is leaving: `hand_over` waits until none is in flight, and the client's
    retry reaches another front-end."""

    @functools.wraps(method)
    def wrapped(self, request, context):
        with self._gate:
            if self._leaving:
                context.abort(
                    grpc.StatusCode.UNAVAILABLE, "this front-end is leaving the sidecar; ask again"
                )
            self._in_flight += 1
        try:
            return method(self, request, context)
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()

    return wrapped


def _step_of(item: tuple[int, float, StepWork]) -> int:
    return item[0]


def _pass_through(message: bytes | pb.GetBatchResponse) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class SidecarServicer:
    """Handlers of the rlfeed.v1 services; every scheduler call goes through `actor`."""

    def __init__(
        self,
        config: SidecarConfig,
        actor: ray.actor.ActorHandle,
        events: ServerEvents | None = None,
        *,
        announce: bool = False,
    ) -> None:
        self.config = config
        # Announce stored steps to the other front-ends (when there may be any).
        self._announce = announce
        self.actor = actor
        self.events = events if events is not None else ServerEvents()
        self._id = uuid.uuid4().hex
        self._calls = ActorCalls(actor, self._id)
        self._peers = PeerClient(
            self._id,
            lambda: ray.get(actor.frontend_addresses.remote()),
            config.server.max_message_bytes,
        )
        self._ingest_groups = IngestGroups(
            lambda batches: ray.get(self._calls.submit_with_notes("ingest", batches))
        )
        self._steps_changed = threading.Condition()
        self._steps_stored = 0  # bumped whenever this front-end stores a step
        self._newest_stored = -1  # the newest step this front-end stored
        # Steps other front-ends announced they stored (step -> their id), newest last.
        self._stored_elsewhere: OrderedDict[int, str] = OrderedDict()
        self._stopping = False
        self._leaving = False  # set by hand_over: ingest and GetBatch answer UNAVAILABLE
        self._in_flight = 0  # ingest and GetBatch calls running (see _admitted)
        self._gate = threading.Condition()
        # Steps this front-end moved out of its memory: their object references (it owns
        # them) until the actor releases the step; `hand_over` re-homes the held ones.
        self._moved_out: dict[int, list[list]] = {}
        self._responses = ResponseCache(_RESPONSE_CACHE_BYTES)
        self._last_sync = time.monotonic()
        # The handle the actor keeps for a step whose bytes are in this front-end's memory.
        self._marker = ("front-end", self._id)
        self._payloads = LocalPayloads()
        # Steps the actor planned (and so removed from its buffer) that are not stored yet,
        # in step order: kept until stored, so a failed materialization is retried.
        self._unstored: list[tuple[int, float, StepWork]] = []  # (step, planned at, work)
        self._unstored_lock = threading.Lock()
        # Held from queueing a step's StoreStepNote until its responses are in the cache, so
        # a fetch the actor answers with this front-end's marker finds the bytes here.
        self._storing = threading.Lock()
        self._steps_ready = threading.Event()  # set when planned work arrives
        self._assembler: threading.Thread | None = None  # started by the first ready step
        self._assembler_lock = threading.Lock()

    def release_waiters(self) -> None:
        """Answer waiting GetBatch calls now and stop the assembler thread."""
        with self._steps_changed:
            self._stopping = True
            self._steps_changed.notify_all()
        self._steps_ready.set()
        if self._assembler is not None:
            self._assembler.join(timeout=5.0)

    # ---- RolloutIngest --------------------------------------------------------------

    def SubmitRollouts(self, request_iterator, context):
        for request in request_iterator:
            yield self.SubmitRolloutBatch(request, context)

    @_unavailable_when_ray_fails
    @_admitted
    def SubmitRolloutBatch(self, request: RolloutBatchView, context) -> pb.SubmitAck:
        received = time.monotonic()
        arrays = None
        try:
            arrays = decode_rollout_batch(request.arrow_ipc)
            validate_rollout_batch(
                arrays,
                token_budget=self.config.batching.token_budget,
                vocab_size=self.config.rollouts.vocab_size,
            )
        except ValueError as exc:
            self._calls.submit_with_notes("record_rejection")
            self._rejected(exc, arrays)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        reply = self._ingest(arrays)
        if reply.kind == "invalid":
            self._rejected(InvalidBatchError(reply.message), arrays)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, reply.message)
        if reply.kind == "backpressure":
            self._rejected(BackpressureError(reply.message), arrays)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reply.message)
        result = reply.result
        notify(
            self.events,
            "on_ingest",
            result,
            tokens=int(arrays.token_ids.size),
            seconds=time.monotonic() - received,
        )
        return pb.SubmitAck(
            sequence=request.sequence,
            accepted=result.accepted,
            duplicate=result.duplicate,
            stale=result.stale,
            newest_policy_version=result.newest_policy_version,
            buffered_rollouts=result.buffered_rollouts,
        )

    def _ingest(self, arrays) -> IngestReply:
        """Buffer a validated batch in the actor: its columns stay here under a key, the
        actor gets the metadata and the handle (this front-end's id, key), in a call shared
        with the batches arriving alongside. Hands the work of the steps it made ready to
        the assembler and frees what the actor released."""
        key = self._payloads.add(arrays.columns) if len(arrays) else None
        handle = (self._id, key) if key is not None else None
        # A failed call keeps the columns: the batch may have been buffered before the
        # failure (a dead actor takes the whole sidecar down anyway).
        reply = self._ingest_groups.ingest(BatchMeta.from_arrays(arrays), handle)
        if key is not None and not (reply.kind == "ok" and reply.result.accepted > 0):
            self._payloads.discard(key)  # the scheduler did not keep the batch
        if reply.work:
            planned_at = time.time()
            with self._unstored_lock:
                for work in reply.work:
                    bisect.insort(self._unstored, (work.step, planned_at, work), key=_step_of)
            self._wake_assembler()
        self._free(reply.releases)
        return reply

    def _free(self, releases: Releases) -> None:
        """Free what the actor released: batches nothing reads any more, and responses of
        steps no longer servable (their memory goes to the next steps)."""
        self._last_sync = time.monotonic()
        self._payloads.release(releases.payload_keys)
        self._responses.drop(releases.steps)
        for step in releases.steps:
            self._moved_out.pop(step, None)

    def _rejected(self, error: BaseException, arrays) -> None:
        rollouts, tokens = (len(arrays), int(arrays.token_ids.size)) if arrays else (0, 0)
        notify(self.events, "on_reject", error, rollouts=rollouts, tokens=tokens)

    def start_assembler(self) -> None:
        """Start the thread that materializes planned steps and, when idle, sends notes and
        collects releases (so a front-end that never plans a step still frees batches)."""
        with self._assembler_lock:
            if self._assembler is None and not self._stopping:
                self._assembler = threading.Thread(
                    target=self._assemble_loop, name="rlfeed-assembler", daemon=True
                )
                self._assembler.start()

    def _wake_assembler(self) -> None:
        self.start_assembler()
        self._steps_ready.set()

    def _assemble_loop(self) -> None:
        """Assemble steps off the ingest path: the producer's ack never waits for
        materialization. With nothing to assemble for NOTE_FLUSH_SECONDS, send the notes no
        call took along (and, every RELEASES_POLL_SECONDS, ask even without notes), freeing
        what the answer releases. What to do is read from the state, not from the wake-up:
        work inserted just after a timed-out wait is still assembled."""
        while True:
            self._steps_ready.wait(timeout=NOTE_FLUSH_SECONDS)
            self._steps_ready.clear()  # before reading the state: later work wakes us again
            if self._stopping:
                return
            try:
                if not self._nothing_unstored():
                    self._assemble()
                else:
                    due = time.monotonic() - self._last_sync > RELEASES_POLL_SECONDS
                    sent = self._calls.sync(force=due)
                    if sent is not None:
                        self._free(ray.get(sent))
            except Exception:  # a dead actor surfaces on the next handler call too
                if not self._stopping:
                    _log.exception("rlfeed: step assembly failed; retrying in 1 s")
                    time.sleep(ASSEMBLY_RETRY_SECONDS)
                    self._steps_ready.set()

    def _assemble(self) -> None:
        """Materialize every planned step, lowest first, here (this thread's CPU, not the
        actor's), keep the responses in this front-end's memory and note the step stored
        for the actor.

        The StoreStepNote is queued before the step enters the local cache, so any
        FetchNote of the step is queued (and reaches the actor) after it; `_storing` covers
        both, for a fetch answered with this front-end's marker in between."""
        while True:
            with self._unstored_lock:
                if not self._unstored:
                    break
                step, planned_at, work = self._unstored[0]
            responses = materialize_work(work, resolve=self._resolve_payload)
            size = sum(map(len, responses))
            # The record store_step returns, known without waiting; reported before any
            # fetch can see the step.
            record = replace(work.record, response_bytes=size)
            notify(self.events, "on_step", record, responses=responses, ready_time=planned_at)
            with self._storing:
                self._calls.note(StoreStepNote(step, [self._marker] * len(responses), size))
                self._responses.put(step, responses)
                # Stored: never built again, whatever fails below (the actor will release
                # the batches it read). Work for a lower step may have arrived meanwhile.
                with self._unstored_lock:
                    del self._unstored[bisect.bisect_left(self._unstored, step, key=_step_of)]
            with self._steps_changed:
                self._steps_stored += 1
                self._newest_stored = max(self._newest_stored, step)
                self._steps_changed.notify_all()
            if self._announce:
                try:  # best effort: a waiting rank elsewhere then takes the actor's path
                    self._peers.announce_stored(step)
                except Exception:
                    _log.warning("rlfeed: announcing step %d to the other front-ends failed", step)
        self._move_out_old_steps()

    def _resolve_payload(self, handle: tuple[str, int] | list) -> TokenColumns:
        """An ingest batch's columns: from this front-end's memory, from the front-end
        that decoded it (the step being materialized holds it there until stored), or from
        the object store ([ObjectRef]: its front-end has left, see `hand_over`)."""
        if isinstance(handle, list):
            return ray.get(handle[0])
        owner, key = handle
        if owner != self._id:
            return self._peers.payload(owner, key)
        return self._payloads.get(key)

    def _columns_of(self, key: int) -> TokenColumns | None:
        """For a peer: an ingest batch this front-end holds."""
        try:
            return self._payloads.get(key)
        except KeyError:
            return None

    def _stored_by(self, step: int, frontend_id: str) -> None:
        """For a peer: it stored `step`; ranks waiting here for it are forwarded there."""
        with self._steps_changed:
            self._stored_elsewhere[step] = frontend_id
            while len(self._stored_elsewhere) > _ANNOUNCEMENTS_KEPT:
                self._stored_elsewhere.popitem(last=False)
            self._steps_stored += 1  # wakes the waiting GetBatch calls
            self._steps_changed.notify_all()

    def _forwarded(self, holder: str, request: pb.GetBatchRequest, context) -> bytes | None:
        """GetBatch answered by the front-end that stored the step (which then records the
        fetch, in its order after the step's store); None if it cannot be reached (the
        announcement is forgotten and the actor's path answers instead). Its answers,
        NOT_FOUND and INVALID_ARGUMENT included, are this call's answers."""
        try:
            return self._peers.forward_get_batch(holder, request, context.time_remaining())
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                context.abort(exc.code(), exc.details())
        except RuntimeError:  # not registered (any more)
            pass
        with self._steps_changed:
            self._stored_elsewhere.pop(int(request.step), None)
        return None

    def _response_of(self, step: int, rank: int) -> bytes | None:
        """For a peer answering `rank` with it (the actor recorded the fetch): a stored
        response this front-end holds, the rank then noted served here (and the fetch
        reported here, where the step's other ranks count too)."""
        response = self._responses.serve_to_peer(step, rank)
        if response is None:
            with self._storing:  # the actor may have seen the note before the cache the bytes
                response = self._responses.serve_to_peer(step, rank)
        if response is not None:
            notify(self.events, "on_served", step, rank, response)
        return response

    def hand_over(self, timeout_s: float = HAND_OVER_SECONDS) -> None:
        """Leave the sidecar without taking data along (a replica stopping while the
        others run on); call once the public server stopped, while the peer service still
        answers. It closes to ingest and GetBatch and waits for the calls in flight,
        materializes the steps planned here, hands the ingest batches and the responses
        of held steps to the actor, which puts them into the object store (owned there,
        they outlive this process) and swaps the handles (bulk data through the actor's
        queue, once per leave: one call for the batches, one per step), and waits until
        the steps other front-ends planned with the old handles are stored. Nothing to do
        when the whole sidecar is stopping. RuntimeError if a wait takes longer than
        `timeout_s`."""
        if ray.get(self._calls.submit("sidecar_stopping")):
            return  # the whole sidecar stops: nothing to keep
        with self._gate:  # no ingest or first fetch may change what is handed over below
            self._leaving = True
            if not self._gate.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                raise RuntimeError("calls to this front-end did not finish")
        if self._assembler is not None:  # stopped by release_waiters; it may still finish one
            self._assembler.join(timeout=timeout_s)
            if self._assembler.is_alive():
                raise RuntimeError("the assembler thread did not stop")
        deadline = time.monotonic() + timeout_s
        while True:  # what was planned here (the assembler's own retry, bounded)
            try:
                self._assemble()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                _log.exception("rlfeed: step assembly failed while leaving; retrying in 1 s")
                time.sleep(ASSEMBLY_RETRY_SECONDS)
        reading = ray.get(self._calls.submit_with_notes("adopt_payloads", self._payloads.held()))
        in_memory = dict(self._responses.stored())
        moved_out = dict(self._moved_out)  # under references this process owns
        steps = sorted({*in_memory, *moved_out})
        for step in ray.get(self._calls.submit("held_steps", steps)):  # one step at a time
            if step in in_memory:
                responses = in_memory[step]
            else:
                responses = ray.get([ref for (ref,) in moved_out[step]])
            ray.get(self._calls.submit("adopt_step", step, responses))
        deadline = time.monotonic() + timeout_s
        while reading:
            if time.monotonic() > deadline:
                raise RuntimeError(f"steps {reading} reading this front-end's batches not stored")
            time.sleep(_POLL_SECONDS / 5)
            reading = ray.get(self._calls.submit("unstored_steps", reading))
        sent = self._calls.sync(force=True)
        if sent is not None:
            ray.get(sent)
        if not self._nothing_unstored():
            raise RuntimeError("a step planned here was left unmaterialized")

    def _nothing_unstored(self) -> bool:
        with self._unstored_lock:
            return not self._unstored

    def _move_out_old_steps(self) -> None:
        """Keep this front-end's memory bounded: of the oldest steps beyond the cache size,
        put those the actor still holds into the object store and hand it the references
        (before dropping them here, so a fetch answered with the marker finds the bytes on
        its next ask); released ones are simply dropped."""
        oldest = self._responses.oldest_beyond()
        if not oldest:
            return
        held = set(ray.get(self._calls.submit("held_steps", oldest)))
        for step in oldest:
            responses = self._responses.get(step)
            if step in held and responses is not None:
                refs = [[ray.put(response)] for response in responses]
                self._moved_out[step] = refs
                if not ray.get(self._calls.submit("move_step", step, refs)):
                    self._moved_out.pop(step, None)  # released meanwhile (maybe freed first)
        self._responses.drop(oldest)

    # ---- TaskSampling ---------------------------------------------------------------

    @_unavailable_when_ray_fails
    def RegisterTasks(self, request: pb.RegisterTasksRequest, context):
        kind, result = ray.get(self._calls.submit("register_tasks", list(request.task_ids)))
        if kind != "ok":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, result)
        added, total = result
        return pb.RegisterTasksResponse(added=added, total_tasks=total)

    @_unavailable_when_ray_fails
    def SampleTasks(self, request: pb.SampleTasksRequest, context):
        _, result = ray.get(self._calls.submit("sample_tasks", int(request.n)))
        requested = int(request.n) or self.config.rollouts.prompts_per_step
        notify(self.events, "on_task_sample", requested=requested, result=result)
        return pb.SampleTasksResponse(
            task_ids=result.task_ids, revisit=result.revisit, pass_rate=result.pass_rate
        )

    # ---- BatchServing ---------------------------------------------------------------

    @_unavailable_when_ray_fails
    @_admitted
    def GetBatch(self, request: pb.GetBatchRequest, context) -> bytes | pb.GetBatchResponse:
        step, rank = int(request.step), int(request.rank)
        wait = min(request.timeout_ms / 1000.0, self.config.server.max_wait_seconds)
        remaining_call = context.time_remaining()
        if remaining_call is not None:
            wait = min(wait, max(remaining_call - 0.05, 0.0))  # answer before the deadline
        deadline = time.monotonic() + wait
        local = 0 <= rank < self.config.batching.world_size
        timed_out = False
        while True:
            # Read before asking, so a step stored in between still wakes the wait below.
            stored_before = self._steps_stored
            response = self._responses.first_fetch(step, rank) if local else None
            if response is not None:
                # A first fetch cannot meet a released step (release needs every rank's
                # fetch), so it is answered from here; the actor records it in order after
                # the step's store_step. Re-fetches ask the actor (it may have released).
                self._calls.note(FetchNote(step, rank))
                notify(self.events, "on_served", step, rank, response)
                return response
            holder = self._stored_elsewhere.get(step) if local else None
            if holder is not None:  # another front-end stored it: it answers (and counts it)
                forwarded = self._forwarded(holder, request, context)
                if forwarded is not None:
                    return forwarded
            # A step past the newest one stored here is most likely still being produced:
            # wait for this front-end's signal first and ask the actor only once a wait
            # times out (another front-end may have stored it; answers stay correct, the
            # actor is just not asked a round trip per prefetching rank and step).
            ahead = local and step > self._newest_stored and not timed_out
            kind, value = ("waiting", None) if ahead else self._ask_fetch(step, rank)
            if kind == "ready":
                response = self._stored_response(step, rank, value, context)
                if response is None:  # moved out meanwhile: the next answer has the reference
                    kind, value = self._ask_fetch(step, rank)
                    if kind == "ready":
                        response = self._stored_response(step, rank, value, context)
                if response is not None:
                    return response
                if kind == "ready":
                    context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"step {step} left the memory of the front-end holding it twice "
                        "while being fetched; ask again",
                    )
            if kind == "invalid":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, value)
            if kind == "released":
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"step {step} was released (every rank fetched it and retained_steps "
                    f"newer steps followed); the next step to be assembled is {value}",
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping:
                return pb.GetBatchResponse(ready=False, step=step, rank=rank)
            with self._steps_changed:
                timed_out = not self._steps_changed.wait_for(
                    lambda before=stored_before: self._steps_stored != before or self._stopping,
                    timeout=min(remaining, _POLL_SECONDS),
                )

    def close_peers(self) -> None:
        self._peers.close()

    def _ask_fetch(self, step: int, rank: int) -> tuple[str, object]:
        return ray.get(self._calls.submit("fetch_batch", step, rank))

    def _stored_response(self, step: int, rank: int, handle, context) -> bytes | None:
        """The bytes behind the actor's handle of (step, rank): from this front-end's
        memory, the memory of the front-end whose marker it is, or the object store; None
        if the front-end holding it has moved it out meanwhile (ask the actor again). A
        holder that cannot be reached answers the call UNAVAILABLE (ask again later).

        The fetch is reported (`on_served`) where the bytes are held: here, or by the
        holding front-end when it hands them over, so every rank of a step counts at the
        front-end that stored it, whichever front-end each rank asked."""
        cached = self._responses.get(step)
        if cached is None and handle == self._marker:
            with self._storing:  # the actor may have seen the note before the cache the bytes
                cached = self._responses.get(step)
        if cached is not None:
            notify(self.events, "on_served", step, rank, cached[rank])
            return cached[rank]
        if isinstance(handle, list):  # [ObjectRef]
            response = ray.get(handle[0])
            notify(self.events, "on_served", step, rank, response)
            return response
        if isinstance(handle, tuple) and handle != self._marker:  # ("front-end", its id)
            try:
                return self._peers.stored_response(handle[1], step, rank, context.time_remaining())
            except (grpc.RpcError, RuntimeError) as exc:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"step {step} is held by front-end {handle[1]}, which cannot be reached: "
                    f"{detail}",
                )
        return None

    @_unavailable_when_ray_fails
    def ReportTrainerMetrics(self, request: pb.TrainerReport, context) -> pb.TrainerReportAck:
        report = {
            "step": int(request.step),
            "loss": request.loss,
            "ratio_outlier_share": request.ratio_outlier_share,
            "tokens_per_second": request.tokens_per_second,
            "step_seconds": request.step_seconds,
        }
        kind, message = ray.get(self._calls.submit("record_report", int(request.rank), report))
        if kind == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        notify(self.events, "on_trainer_report", int(request.rank), report)
        return pb.TrainerReportAck()

    # ---- SidecarStatus --------------------------------------------------------------

    @_unavailable_when_ray_fails
    def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.StatusResponse:
        return status_to_proto(ray.get(self._calls.submit("status")), self.config)


def _rollout_ingest_handler(servicer: SidecarServicer) -> grpc.GenericRpcHandler:
    """RolloutIngest registered by hand: a batch's Arrow payload is read in place from the
    request bytes (`parse_rollout_batch`), not copied into a message and out again."""
    return grpc.method_handlers_generic_handler(
        "rlfeed.v1.RolloutIngest",
        {
            "SubmitRollouts": grpc.stream_stream_rpc_method_handler(
                servicer.SubmitRollouts,
                request_deserializer=parse_rollout_batch,
                response_serializer=pb.SubmitAck.SerializeToString,
            ),
            "SubmitRolloutBatch": grpc.unary_unary_rpc_method_handler(
                servicer.SubmitRolloutBatch,
                request_deserializer=parse_rollout_batch,
                response_serializer=pb.SubmitAck.SerializeToString,
            ),
        },
    )


def _batch_serving_handler(servicer: SidecarServicer) -> grpc.GenericRpcHandler:
    """BatchServing registered by hand: GetBatch returns stored bytes as they are."""
    return grpc.method_handlers_generic_handler(
        "rlfeed.v1.BatchServing",
        {
            "GetBatch": grpc.unary_unary_rpc_method_handler(
                servicer.GetBatch,
                request_deserializer=pb.GetBatchRequest.FromString,
                response_serializer=_pass_through,
            ),
            "ReportTrainerMetrics": grpc.unary_unary_rpc_method_handler(
                servicer.ReportTrainerMetrics,
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
    servicer: SidecarServicer
    health: health.HealthServicer
    actor: ray.actor.ActorHandle
    started_ray: bool
    owns_actor: bool = True  # False for a replica that joined another front-end's actor
    peer_server: grpc.Server | None = None  # the other front-ends' way in
    # A replica that stopped: whether it handed its data over (`SidecarServicer.hand_over`;
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
            self.servicer.release_waiters()
            self.server.stop(grace).wait(grace + 1.0)
            if not self.owns_actor:  # the sidecar runs on with what this replica holds
                try:
                    self.servicer.hand_over()
                    self.handed_over = True
                except Exception:  # its data is lost: the caller reports the replica failed
                    _log.exception("rlfeed: this front-end could not hand its data over")
            if self.peer_server is not None:
                self.peer_server.stop(grace).wait(grace + 1.0)
            self.servicer.close_peers()
            if not self.owns_actor:  # the sidecar runs on; its releases need not wait for us
                with contextlib.suppress(ray.exceptions.RayError):  # stopped first: it is gone
                    ray.get(self.actor.unregister_frontend.remote(self.servicer._id), timeout=10)
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


def _grpc_server(config: SidecarConfig, name: str, *options: tuple[str, int]) -> grpc.Server:
    """A threaded gRPC server with the sidecar's message size limit both ways."""
    limit = config.server.max_message_bytes
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.server.max_workers, thread_name_prefix=name),
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            *options,
        ],
    )


def _start_peer_server(config: SidecarConfig, servicer: SidecarServicer) -> tuple[grpc.Server, str]:
    """The server the other front-ends reach this one at, on a port of its own (the public
    port never serves the peer service): the peer service and BatchServing (forwarded
    fetches). Returns it started, with its address."""
    peer_server = _grpc_server(config, "rlfeed-peer")
    peer_server.add_generic_rpc_handlers(
        (
            peer_handler(servicer._columns_of, servicer._response_of, servicer._stored_by),
            _batch_serving_handler(servicer),
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
    started_ray = _connect_ray(config, ray_address)
    actor = server = peer_server = None
    replicated = join or config.server.replicas > 1  # other front-ends may share the actor
    try:
        if join:
            actor = ray.get_actor(config.ray.actor_name, namespace=config.ray.namespace)
        else:
            actor = create_scheduler_actor(config)
        servicer = SidecarServicer(config, actor, events, announce=replicated)
        peer_server, peer_address = _start_peer_server(config, servicer)
        # A busy port is an error, not a shared socket, unless replicas share it.
        server = _grpc_server(config, "rlfeed-grpc", ("grpc.so_reuseport", int(replicated)))
        pb_grpc.add_TaskSamplingServicer_to_server(servicer, server)
        pb_grpc.add_SidecarStatusServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers(
            (_rollout_ingest_handler(servicer), _batch_serving_handler(servicer))
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        target = f"{config.server.host}:{config.server.port}"
        try:
            port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {target}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot listen on {target} (port in use?)")
        ray.get(actor.register_frontend.remote(servicer._id, peer_address))
        server.start()
        servicer.start_assembler()
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
        servicer=servicer,
        health=health_servicer,
        actor=actor,
        started_ray=started_ray,
        owns_actor=not join,
        peer_server=peer_server,
    )

"""Serving: the BatchServing and SidecarStatus handlers of one front-end.

GetBatch waits up to min(timeout_ms, max_wait_seconds, the call's deadline) for the step
and, if it is still not stored, answers OK with `ready = false` (poll again). Stored bytes
are answered as they are (a pass-through serializer), so a re-fetch is byte-identical.

GetBatch comes in two forms with one logic: `GetBatch`, a thread's handler (the threaded
peer server, where another front-end forwards a fetch), and `GetBatchAsync`, the public
asyncio server's: it waits on the event loop (`StepSignals.wait_async`), holding no thread,
answers a first fetch of a step stored here on the loop, and runs only what blocks (the
actor's answer, a peer's) in the loop's executor, the server's thread pool. AckSteps too:
`AckStepsAsync` answers on the loop what a lone front-end answers itself (`acks.py`) and
takes the actor's answer in the pool.

A GetBatch carrying `acked_through_step` is an AckSteps first, answered the same way, so a
rank's step costs one call, not two (the acknowledgement of step s rides on the fetch of
s + 2 that the loader's prefetch makes once the loop asks for s + 1). A fetch forwarded to
another front-end goes without it: it was applied here.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import ray
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.codec.messages import status_to_proto
from rlfeed.service.codec.request_checks import trainer_report_of
from rlfeed.service.frontend.acks import LoneAcks
from rlfeed.service.frontend.aio_host import PoolContext
from rlfeed.service.frontend.re_asks import POLL_SECONDS, ReAsks
from rlfeed.service.frontend.state import (
    AdmissionGate,
    FrontendState,
    admitted,
    unavailable_when_ray_fails,
)
from rlfeed.service.scheduler.records import (
    AckNote,
    Fetch,
    FetchKind,
    FetchNote,
    HeldBy,
    JournalRef,
    Rederive,
    Refused,
    StoredObject,
)


class CallEnds(Exception):
    """The call's answer is this status: raised where GetBatch's logic decides it, turned
    into `context.abort` by the handler of either form (a coroutine's abort is awaited)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def _ray_failed(exc: ray.exceptions.RayError) -> CallEnds:
    """As `unavailable_when_ray_fails` answers it."""
    return CallEnds(
        grpc.StatusCode.UNAVAILABLE,
        f"scheduler unavailable: {type(exc).__name__}: {str(exc)[:500]}",
    )


class _Poll:
    """One GetBatch's bounds: how long it may wait and whether the rank is served here."""

    def __init__(self, frontend: FrontendState, request: pb.GetBatchRequest, context) -> None:
        self.step, self.rank = int(request.step), int(request.rank)
        wait = min(request.timeout_ms / 1000.0, frontend.config.server.max_wait_seconds)
        remaining_call = context.time_remaining()
        if remaining_call is not None:
            wait = min(wait, max(remaining_call - 0.05, 0.0))  # answer before the deadline
        self.deadline = time.monotonic() + wait
        self.local = 0 <= self.rank < frontend.config.batching.world_size
        self.timed_out = False
        self.asked_at: float | None = None  # when this call last asked the actor
        self.re_ask = False  # the ask now due is a re-ask (`ReAsks` coalesces them)
        self._since = time.monotonic()  # the call's start, then its last ask

    def asks_actor(self, signals, re_asks: ReAsks) -> bool:
        """Whether to ask the actor now. The actor, not this front-end's memory, says
        which steps exist (another front-end may have stored one and its announcement be
        lost, as across a restart): a call never answers "not ready" without having asked
        once, nor waits longer than POLL_SECONDS without a (re-)ask being due, however
        often other steps wake it. Within those bounds a step past the newest one stored
        here (most likely still being produced) waits for this front-end's signal first,
        so the actor is not asked a round trip per prefetching rank and step; and once a
        wait timed out or is overdue, asks go through `ReAsks` (one call per step per
        POLL_SECONDS; the actor's "not stored" to one rank is every rank's)."""
        now = time.monotonic()
        self.re_ask = False
        if self.asked_at is None and now >= self.deadline:
            return self._asking(now)  # about to answer "not ready": ask the authority first
        overdue = self.timed_out or now - self._since >= POLL_SECONDS
        if not overdue:  # woken by a signal (or just called)
            if self.local and self.step > signals.newest_stored_here:
                return False
            return self._asking(now)
        if not re_asks.claim(self.step):
            return False
        self.re_ask = True
        return self._asking(now)

    def _asking(self, now: float) -> bool:
        self.asked_at = self._since = now
        return True

    def remaining(self, signals) -> float | None:
        """Seconds left to wait; None once the call answers "not ready" (out of time and
        the actor asked, or the front-end stopping). Out of time but never asked: 0, so
        the loop comes round once more and `asks_actor` asks."""
        remaining = self.deadline - time.monotonic()
        if signals.stopping or (remaining <= 0 and self.asked_at is not None):
            return None
        return max(remaining, 0.0)

    def not_ready(self) -> pb.GetBatchResponse:
        return pb.GetBatchResponse(ready=False, step=self.step, rank=self.rank)


class BatchServing:
    """BatchServing (GetBatch, AckSteps, ReportTrainerMetrics) and SidecarStatus handlers."""

    def __init__(self, frontend: FrontendState) -> None:
        self.frontend = frontend
        self.re_asks = ReAsks()
        self.acks = LoneAcks(frontend.config.batching.world_size, alone=not frontend.announce)

    @unavailable_when_ray_fails
    @admitted
    def GetBatch(self, request: pb.GetBatchRequest, context) -> bytes | pb.GetBatchResponse:
        try:
            return self._get_batch(request, context)
        except CallEnds as end:
            context.abort(end.code, end.details)

    def _get_batch(self, request: pb.GetBatchRequest, context) -> bytes | pb.GetBatchResponse:
        ack = _fetch_ack_of(request)
        if ack is not None and self._ack_here(*ack) is None:
            self._ack_by_actor(*ack, field="acked_through_step")
        signals, poll = self.frontend.signals, _Poll(self.frontend, request, context)
        while True:
            # Read before asking, so a step stored in between still wakes the wait below.
            version = signals.version
            response = self._local_answer(request, context) if poll.local else None
            if response is not None:
                return response
            if poll.asks_actor(signals, self.re_asks):
                response = self._asked_actor(poll, context)
                if response is not None:
                    return response
            remaining = poll.remaining(signals)
            if remaining is None:
                return poll.not_ready()
            if remaining > 0:
                poll.timed_out = not signals.wait(version, timeout=min(remaining, POLL_SECONDS))

    async def GetBatchAsync(
        self, request: pb.GetBatchRequest, context
    ) -> bytes | pb.GetBatchResponse:
        """GetBatch on an asyncio server (module docstring): same answers, no thread held
        while waiting."""
        gate = self.frontend.gate
        if not gate.enter():
            await context.abort(grpc.StatusCode.UNAVAILABLE, AdmissionGate.REFUSAL)
        try:
            try:
                return await self._get_batch_async(request, context)
            except ray.exceptions.RayError as exc:
                end = _ray_failed(exc)
            except CallEnds as raised:
                end = raised
        finally:
            gate.leave()
        await context.abort(end.code, end.details)

    async def _get_batch_async(
        self, request: pb.GetBatchRequest, context
    ) -> bytes | pb.GetBatchResponse:
        loop = asyncio.get_running_loop()
        ack = _fetch_ack_of(request)
        if ack is not None and self._ack_here(*ack) is None:
            await loop.run_in_executor(
                None, functools.partial(self._ack_by_actor, *ack, field="acked_through_step")
            )
        signals, poll = self.frontend.signals, _Poll(self.frontend, request, context)
        while True:
            version = signals.version
            if poll.local:
                response = self._first_fetch(poll.step, poll.rank)  # memory only: on the loop
                if response is not None:
                    return response
                holder = signals.holder(poll.step)
                if holder is not None:
                    response = await loop.run_in_executor(
                        None, self._forwarded, holder, request, context
                    )
                    if response is not None:
                        return response
            if poll.asks_actor(signals, self.re_asks):
                response = await loop.run_in_executor(None, self._asked_actor, poll, context)
                if response is not None:
                    return response
            remaining = poll.remaining(signals)
            if remaining is None:
                return poll.not_ready()
            if remaining > 0:
                poll.timed_out = not await signals.wait_async(
                    version, timeout=min(remaining, POLL_SECONDS)
                )

    def _asked_actor(self, poll: _Poll, context) -> bytes | None:
        """`_actor_answer`; a re-ask that got an answer other than "not stored yet" makes
        every call waiting for the step ask (`ReAsks`), woken now."""
        try:
            response = self._actor_answer(poll.step, poll.rank, context)
        except CallEnds:
            if poll.re_ask:
                self._re_asked(poll.step)
            raise
        if response is not None and poll.re_ask:
            self._re_asked(poll.step)
        return response

    def _re_asked(self, step: int) -> None:
        self.re_asks.answered(step)
        self.frontend.signals.nudge()

    def _first_fetch(self, step: int, rank: int) -> bytes | None:
        """A first fetch of a step stored here (memory and a queued note: never blocks)."""
        response = self.frontend.responses.first_fetch(step, rank)
        if response is not None:
            # A first fetch cannot meet a released step (release needs every rank's fetch),
            # so it is answered from here; the actor records it in order after the step's
            # store. Re-fetches ask the actor (it may have released the step).
            self.frontend.scheduler.note(FetchNote(step, rank))
            self.frontend.events.on_served(step, rank, response)
        return response

    def _local_answer(self, request: pb.GetBatchRequest, context) -> bytes | None:
        """A first fetch of a step stored here, or a fetch forwarded to the front-end that
        announced the step; None if neither answers."""
        step, rank = int(request.step), int(request.rank)
        response = self._first_fetch(step, rank)
        if response is not None:
            return response
        holder = self.frontend.signals.holder(step)
        if holder is not None:  # another front-end stored it: it answers (and counts it)
            return self._forwarded(holder, request, context)
        return None

    def _actor_answer(self, step: int, rank: int, context) -> bytes | None:
        """The actor's answer: the bytes behind its handle, `CallEnds` (invalid, released,
        holder unreachable), or None (not stored yet: wait). Blocks on the actor."""
        fetch = self.frontend.scheduler.fetch_batch(step, rank)
        if fetch.kind is FetchKind.READY:
            response = self._stored_response(step, rank, fetch, context)
            if response is None:  # moved out meanwhile: the next answer has the reference
                fetch = self.frontend.scheduler.fetch_batch(step, rank)
                if fetch.kind is FetchKind.READY:
                    response = self._stored_response(step, rank, fetch, context)
                    if response is None:
                        raise CallEnds(
                            grpc.StatusCode.UNAVAILABLE,
                            f"step {step} left the memory of the front-end holding it twice "
                            "while being fetched; ask again",
                        )
            if response is not None:
                return response
        if fetch.kind is FetchKind.INVALID:
            raise CallEnds(grpc.StatusCode.INVALID_ARGUMENT, fetch.value)
        if fetch.kind is FetchKind.RELEASED:
            raise CallEnds(
                grpc.StatusCode.NOT_FOUND,
                f"step {step} was released (every rank acknowledged it and retained_steps "
                f"newer steps followed); the next step to be assembled is {fetch.value}",
            )
        return None

    def _forwarded(self, holder: str, request: pb.GetBatchRequest, context) -> bytes | None:
        """GetBatch answered by the front-end that stored the step (which then records the
        fetch, in its order after the step's store); None if it cannot be reached (the
        announcement is forgotten and the actor's path answers instead). Its answers,
        NOT_FOUND and INVALID_ARGUMENT included, are this call's answers."""
        if request.HasField("acked_through_step"):  # applied here already
            request = pb.GetBatchRequest(
                step=request.step, rank=request.rank, timeout_ms=request.timeout_ms
            )
        try:
            return self.frontend.peers.forward_get_batch(holder, request, context.time_remaining())
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise CallEnds(exc.code(), exc.details()) from None
        except RuntimeError:  # not registered (any more)
            pass
        self.frontend.signals.forget_holder(int(request.step))
        return None

    def _stored_response(self, step: int, rank: int, fetch: Fetch, context) -> bytes | None:
        """The bytes behind the actor's handle of (step, rank): from this front-end's
        memory, the memory of the front-end holding them, or the object store; None if the
        holder has moved them out meanwhile (ask the actor again). A holder that cannot be
        reached answers the call UNAVAILABLE.

        The fetch is reported (`on_served`) where the bytes are held: here, or by the
        holding front-end, so every rank of a step counts at the front-end that stored it."""
        frontend, handle = self.frontend, fetch.value
        cached = frontend.responses.get(step)
        if cached is None and handle == frontend.marker:
            with frontend.storing:  # the actor may have seen the note before the cache the bytes
                cached = frontend.responses.get(step)
        if cached is not None:
            frontend.events.on_served(step, rank, cached[rank])
            return cached[rank]
        if isinstance(handle, StoredObject):
            response = ray.get(handle.ref)
            frontend.events.on_served(step, rank, response)
            return response
        if isinstance(handle, JournalRef | Rederive):  # its front-end died; the next one loads it
            raise CallEnds(
                grpc.StatusCode.UNAVAILABLE,
                f"step {step} is in the journal of {handle.slot}, whose front-end restarts; "
                "ask again",
            )
        if isinstance(handle, HeldBy) and handle != frontend.marker:
            try:
                return frontend.peers.stored_response(
                    handle.frontend_id, step, rank, context.time_remaining()
                )
            except (grpc.RpcError, RuntimeError) as exc:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                raise CallEnds(
                    grpc.StatusCode.UNAVAILABLE,
                    f"step {step} is held by front-end {handle.frontend_id}, which cannot be "
                    f"reached: {detail}",
                ) from None
        return None

    @unavailable_when_ray_fails
    def AckSteps(self, request: pb.AckStepsRequest, context) -> pb.AckStepsResponse:
        rank, through_step = _ack_of(request)
        acked = self._ack_here(rank, through_step)
        if acked is None:
            try:
                acked = self._ack_by_actor(rank, through_step)
            except CallEnds as end:
                context.abort(end.code, end.details)
        return pb.AckStepsResponse(acked_through=acked, acks_with_get_batch=True)

    async def AckStepsAsync(self, request: pb.AckStepsRequest, context) -> pb.AckStepsResponse:
        """AckSteps on an asyncio server: answered on the loop when this front-end knows
        the answer (`acks.py`: it never blocks), else in the pool (it waits for the actor)."""
        acked = self._ack_here(*_ack_of(request))
        if acked is not None:
            return pb.AckStepsResponse(acked_through=acked, acks_with_get_batch=True)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.AckSteps, request, PoolContext(context, loop))

    def _ack_here(self, rank: int, through_step: int | None) -> int | None:
        """The rank's acknowledged step if this front-end answers the acknowledgement
        itself (then the actor hears it in order, as a note); None: the actor answers."""
        acked = self.acks.answer(rank, through_step, self.frontend.signals.newest_stored_here)
        if acked is not None:
            self.frontend.scheduler.note(AckNote(rank, through_step))
        return acked

    def _ack_by_actor(self, rank: int, through_step: int | None, field: str = "") -> int:
        """The actor's answer to the acknowledgement (blocks on it); `CallEnds` if refused,
        its message after `field`, the request field that carried it, if given."""
        acked = self.frontend.scheduler.ack_steps(rank, through_step)
        if isinstance(acked, Refused):
            named = f"{field} (AckSteps' through_step): " if field else ""
            raise CallEnds(grpc.StatusCode.INVALID_ARGUMENT, named + acked.message)
        self.acks.heard(rank, acked)
        return acked

    @unavailable_when_ray_fails
    def ReportTrainerMetrics(self, request: pb.TrainerReport, context) -> pb.TrainerReportAck:
        try:
            report = trainer_report_of(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        refused = self.frontend.scheduler.record_report(int(request.rank), report)
        if refused is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused.message)
        self.frontend.events.on_trainer_report(int(request.rank), report)
        return pb.TrainerReportAck()

    @unavailable_when_ray_fails
    def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.StatusResponse:
        return status_to_proto(self.frontend.scheduler.status(), self.frontend.config)


def _fetch_ack_of(request: pb.GetBatchRequest) -> tuple[int, int] | None:
    """(rank, through_step) of the acknowledgement a GetBatch carries, if any."""
    if not request.HasField("acked_through_step"):
        return None
    return int(request.rank), int(request.acked_through_step)


def _ack_of(request: pb.AckStepsRequest) -> tuple[int, int | None]:
    """(rank, through_step) of an AckSteps request; through_step None when unset."""
    through_step = int(request.through_step) if request.HasField("through_step") else None
    return int(request.rank), through_step

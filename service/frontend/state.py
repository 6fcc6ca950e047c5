"""What every part of one front-end shares: its identity, its link to the scheduler actor,
its memory, the signal that a step was stored, and the gate that closes it when it leaves.

The parts (ingest, serving, the assembler thread, the replica hand-over) each take this one
object instead of reaching into each other; `frontend/README.md` tells how they cooperate.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator

import grpc
import ray
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.events import GuardedEvents, ServerEvents
from rlfeed.service.frontend.journaling import SlotRetention
from rlfeed.service.frontend.memory import LocalPayloads, ResponseCache
from rlfeed.service.frontend.peers import PeerClient
from rlfeed.service.journal import Journal
from rlfeed.service.scheduler.client import SchedulerClient
from rlfeed.service.scheduler.records import HeldBy

# How many other front-ends' step announcements a front-end remembers.
_ANNOUNCEMENTS_KEPT = 1024


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class StepSignals:
    """Which steps were stored, here or (announced) at another front-end; waiting GetBatch
    calls sleep on it and wake when anything changes or the front-end stops.

    A thread waits on a condition (`wait`); a coroutine (the asyncio server's GetBatch)
    awaits one future per event loop that every change resolves (`wait_async`), so a
    waiting call holds no thread and a change costs one wake-up per loop, not per call."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.version = 0  # bumped on every change; read it before asking, wait on it after
        self.newest_stored_here = -1
        self._holders: OrderedDict[int, str] = OrderedDict()  # step -> front-end id, newest last
        self.stopping = False
        # The future of each event loop with coroutines waiting; replaced on every change.
        self._loop_futures: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}

    def _changed_now(self) -> None:
        """Wake every waiter; the caller holds `_changed` and has bumped the version."""
        self._changed.notify_all()
        futures, self._loop_futures = self._loop_futures, {}
        for loop, future in futures.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_wake, future)

    def stored_here(self, step: int) -> None:
        with self._changed:
            self.version += 1
            self.newest_stored_here = max(self.newest_stored_here, step)
            self._changed_now()

    def stored_elsewhere(self, step: int, frontend_id: str) -> None:
        """A peer stored `step`: ranks waiting here for it are forwarded there."""
        with self._changed:
            self._holders[step] = frontend_id
            while len(self._holders) > _ANNOUNCEMENTS_KEPT:
                self._holders.popitem(last=False)
            self.version += 1
            self._changed_now()

    def nudge(self) -> None:
        """Wake every waiting call to look again (nothing was stored here)."""
        with self._changed:
            self.version += 1
            self._changed_now()

    def holder(self, step: int) -> str | None:
        """The other front-end that announced `step`, if any (and not forgotten)."""
        with self._changed:
            return self._holders.get(step)

    def forget_holder(self, step: int | None = None) -> None:
        """Forget one announcement (its front-end cannot be reached), or all of them."""
        with self._changed:
            if step is None:
                self._holders.clear()
            else:
                self._holders.pop(step, None)

    def wait(self, version: int, timeout: float) -> bool:
        """Wait until something changed since `version` (or stopping); False on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self.version != version or self.stopping, timeout=timeout
            )

    async def wait_async(self, version: int, timeout: float) -> bool:
        """`wait` for a coroutine on the running loop, holding no thread."""
        loop = asyncio.get_running_loop()
        with self._changed:
            if self.version != version or self.stopping:
                return True
            future = self._loop_futures.get(loop)
            if future is None:
                future = self._loop_futures[loop] = loop.create_future()
        done, _ = await asyncio.wait((future,), timeout=timeout)  # never cancels the future
        return bool(done)

    def stop(self) -> None:
        with self._changed:
            self.stopping = True
            self._changed_now()


class AdmissionGate:
    """Counts the state-changing calls in flight (ingest, GetBatch) and closes for good when
    the front-end leaves: `hand_over` then waits until none is in flight."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self.closed = False

    REFUSAL = "this front-end is leaving the sidecar; ask again"  # answered UNAVAILABLE

    def enter(self) -> bool:
        """Count a call in; False (nothing counted) once closed. Never blocks for long."""
        with self._cond:
            if self.closed:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def admit(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self.enter():
            context.abort(grpc.StatusCode.UNAVAILABLE, self.REFUSAL)
        try:
            yield
        finally:
            self.leave()

    def close(self, timeout_s: float) -> None:
        """Admit nothing more and wait for the calls in flight; RuntimeError on timeout."""
        with self._cond:
            self.closed = True
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                raise RuntimeError("calls to this front-end did not finish")


class FrontendState:
    """One front-end's shared parts (see the module docstring)."""

    def __init__(
        self,
        config: SidecarConfig,
        actor: ray.actor.ActorHandle,
        events: ServerEvents | None = None,
        *,
        announce: bool = False,
        journal: Journal | None = None,
        slot: str = "",
    ) -> None:
        self.config = config
        # Where this front-end journals what it acknowledges (None: [journal] dir unset).
        self.journal, self.slot = journal, slot
        self.retention = SlotRetention(journal, slot) if journal is not None else None
        self.id = uuid.uuid4().hex
        self.marker = HeldBy(self.id)  # the actor's handle of a step whose bytes are here
        self.announce = announce  # tell the other front-ends (when there may be any)
        self.actor = actor
        self.scheduler = SchedulerClient(actor, self.id)
        self.events = GuardedEvents(events if events is not None else ServerEvents())
        self.peer_token = self.scheduler.peer_token()
        self.peers = PeerClient(
            self.id,
            self.scheduler.frontend_addresses,
            config.server.max_message_bytes,
            peer_token=self.peer_token,
        )
        self.payloads = LocalPayloads()
        # Steps this front-end materialized are served from its memory up to this size;
        # beyond it the oldest ones the actor still holds move to the object store.
        self.responses = ResponseCache(config.server.max_held_response_bytes)
        self.signals = StepSignals()
        self.gate = AdmissionGate()
        # Held from queueing a step's StoreStepNote until its responses are in the cache, so
        # a fetch the actor answers with this front-end's marker finds the bytes here.
        self.storing = threading.Lock()


def unavailable_when_ray_fails(handler):
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


def admitted(handler):
    """Run a state-changing handler through the front-end's admission gate."""

    @functools.wraps(handler)
    def wrapped(self, request, context):
        with self.frontend.gate.admit(context):
            return handler(self, request, context)

    return wrapped

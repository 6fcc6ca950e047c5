"""A replica's side of sharing one sidecar: what it answers its peers, and how it leaves.

`PeerQueries` answers the other front-ends from this one's memory (`peers.peer_handler`).
`hand_over` lets a replica leave while the others run on, without taking data along.
"""

from __future__ import annotations

import logging
import time

import ray
from rlfeed.sched.assembly import TokenColumns
from rlfeed.service.frontend.assembler import (
    ASSEMBLY_RETRY_SECONDS,
    AssemblyFailures,
    StepAssembler,
)
from rlfeed.service.frontend.re_asks import POLL_SECONDS
from rlfeed.service.frontend.state import FrontendState

_log = logging.getLogger("rlfeed.service.frontend.handover")
# A replica leaving waits at most this long for its own planned steps to be materialized,
# and again for the other front-ends' steps that read its batches to be stored.
HAND_OVER_SECONDS = 30.0


class PeerQueries:
    """What this front-end answers its peers."""

    def __init__(self, frontend: FrontendState) -> None:
        self.frontend = frontend

    def columns_of(self, key: int) -> TokenColumns | None:
        """An ingest batch this front-end holds."""
        try:
            return self.frontend.payloads.get(key)
        except KeyError:
            return None

    def stored_by(self, step: int, frontend_id: str) -> None:
        """A peer stored `step`: ranks waiting here for it are forwarded there."""
        self.frontend.signals.stored_elsewhere(step, frontend_id)

    def response_of(self, step: int, rank: int) -> bytes | None:
        """For a peer answering `rank` with it (the actor recorded the fetch): a stored
        response this front-end holds, the rank then noted served here (and the fetch
        reported here, where the step's other ranks count too)."""
        frontend = self.frontend
        response = frontend.responses.serve_to_peer(step, rank)
        if response is None:
            with frontend.storing:  # the actor may have seen the note before the cache the bytes
                response = frontend.responses.serve_to_peer(step, rank)
        if response is not None:
            frontend.events.on_served(step, rank, response)
        return response


def hand_over(
    frontend: FrontendState, assembler: StepAssembler, timeout_s: float = HAND_OVER_SECONDS
) -> None:
    """Leave the sidecar without taking data along; call once the public server stopped,
    while the peer service still answers. In order: close to ingest and GetBatch and wait
    for the calls in flight; materialize the steps planned here; hand the ingest batches
    and the responses of held steps to the actor (it puts them into the object store, so
    they outlive this process; one call for the batches, one per step); wait until the
    steps other front-ends planned with the old handles are stored. Nothing to do when the
    whole sidecar is stopping. RuntimeError if a wait takes longer than `timeout_s`."""
    scheduler = frontend.scheduler
    if scheduler.sidecar_stopping():
        return  # the whole sidecar stops: nothing to keep
    frontend.gate.close(timeout_s)  # nothing may change what is handed over below
    if not assembler.stop(timeout_s):  # stopped with the waiters; it may still finish one
        raise RuntimeError("the assembler thread did not stop")
    _assemble_what_was_planned_here(assembler, timeout_s)
    reading = scheduler.adopt_payloads(frontend.payloads.held())
    in_memory = dict(frontend.responses.stored())
    moved_out = assembler.moved_out()  # under references this process owns
    for step in scheduler.held_steps(sorted({*in_memory, *moved_out})):  # one at a time
        if step in in_memory:
            responses = in_memory[step]
        else:
            responses = ray.get([stored.ref for stored in moved_out[step]])
        scheduler.adopt_step(step, responses)
    deadline = time.monotonic() + timeout_s
    while reading:
        if time.monotonic() > deadline:
            raise RuntimeError(f"steps {reading} reading this front-end's batches not stored")
        time.sleep(POLL_SECONDS / 5)
        reading = scheduler.unstored_steps(reading)
    scheduler.sync(force=True)
    if assembler.has_unstored():
        raise RuntimeError("a step planned here was left unmaterialized")


def _assemble_what_was_planned_here(assembler: StepAssembler, timeout_s: float) -> None:
    """The assembler's own retry, bounded by `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    failures = AssemblyFailures(_log)
    while True:
        assembler.failing_step = None
        try:
            assembler.assemble()
            failures.succeeded()
            return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise
            failures.failed(exc, assembler.failing_step)
            time.sleep(ASSEMBLY_RETRY_SECONDS)

"""The driver lease: which `rlfeed serve` owns a sidecar whose actors outlive their driver.

With `--ray-address` and `[frontends] count`, the scheduler and the front-end actors are
detached (`driver.py`): a driver that is killed leaves them serving, and the next `rlfeed
serve` with that config adopts them. Two live drivers of one sidecar would both supervise
it, and either could stop it, so one driver at a time owns it: the one holding its lease.

The lease is a small detached actor, `<[ray] actor_name>-driver` in `[ray] namespace`,
holding the owner's identity (a random id, its host and pid, its config's digest) and
when it last renewed. The owner renews every `RENEW_EVERY_S` from a thread. A driver
starting finds the lease one of three ways:

- new (it created it): it owns a sidecar with nothing running yet;
- lapsed (not renewed for `LEASE_TTL_S`: its owner is dead): it takes it over, and adopts;
- renewed while it watches: the owner is alive; `SidecarBusy` (exit 2, naming the sidecar
  and the owner's pid and host). A refusal takes about one renewal interval.

The lease actor judges staleness by its own clock, so the hosts' clocks need not agree.
Two drivers starting at the same moment may both create the lease actor; Ray keeps one
of them (the other's calls fail) and whoever renews it first owns it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import ray
from rlfeed.service.config import SidecarConfig
from rlfeed.service.scheduler.actor import HEAD_NODE_RESOURCE

_log = logging.getLogger("rlfeed.service.scaleout.lease")

LEASE_TTL_S = 5.0  # a lease not renewed for this long belongs to a dead driver
RENEW_EVERY_S = 1.0
_CALL_TIMEOUT_S = 10.0


def sidecar_name(config: SidecarConfig) -> str:
    """How messages name the sidecar: its scheduler actor's name and Ray namespace."""
    return f"sidecar {config.ray.actor_name!r} in Ray namespace {config.ray.namespace!r}"


def lease_actor_name(config: SidecarConfig) -> str:
    return f"{config.ray.actor_name}-driver"


@dataclass(frozen=True)
class LeaseHolder:
    """A driver: `driver_id` is unique per process; host and pid are for people."""

    driver_id: str
    host: str
    pid: int
    config_digest: str  # of the resolved config it serves: adopt only what it started

    @staticmethod
    def this_process(config_digest: str) -> LeaseHolder:
        return LeaseHolder(uuid.uuid4().hex, socket.gethostname(), os.getpid(), config_digest)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


@dataclass(frozen=True)
class LeaseAnswer:
    """The lease actor's answer to `take`: whether the caller holds the lease now."""

    taken: bool
    holder: LeaseHolder  # who holds it after the call
    previous: LeaseHolder | None  # the dead driver it was taken over from, if it was
    age_s: float  # seconds since the holder before the call last renewed
    renewals: int  # renewals so far; a holder that renews raises it


class DriverLeaseActor:
    """Ray actor body: the lease of one sidecar (module docstring)."""

    def __init__(self, holder: LeaseHolder, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holder = holder
        self._renewals = 0
        # Ray restarted this actor (its process died): whoever renews first owns the lease,
        # as a live owner does within a second, not the driver that created it.
        self._renewed = -math.inf if _restarted_actor() else clock()

    def take(self, holder: LeaseHolder, ttl_s: float) -> LeaseAnswer:
        """Renew the lease for its holder, or take it over if it lapsed (`ttl_s`)."""
        now = self._clock()
        age = now - self._renewed
        own = holder.driver_id == self._holder.driver_id
        if not own and age <= ttl_s:
            return LeaseAnswer(False, self._holder, None, age, self._renewals)
        previous = None if own else self._holder
        self._holder, self._renewed = holder, now
        self._renewals += 1
        return LeaseAnswer(True, holder, previous, age, self._renewals)


def _restarted_actor() -> bool:
    if not ray.is_initialized():  # a plain object (tests): asking would start a Ray
        return False
    context = ray.get_runtime_context()
    return context.get_actor_id() is not None and bool(context.was_current_actor_reconstructed)


class SidecarBusy(RuntimeError):
    """Another live `rlfeed serve` owns this sidecar: the message says which."""


class DriverLease:
    """This driver's lease on a sidecar: `acquire` it, renew it while serving, `end` it
    (the lease actor is killed last, when the sidecar is torn down). `lost` is set if
    another driver took it over (this one was stalled for `LEASE_TTL_S`): the sidecar is
    then that driver's, and this one must leave it running."""

    def __init__(self, config: SidecarConfig, handle, holder: LeaseHolder, answer: LeaseAnswer):
        self.config, self.handle, self.holder = config, handle, holder
        self.previous = answer.previous  # the dead driver whose sidecar this one adopts
        self.lost = threading.Event()
        self.lost_to: LeaseHolder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, config: SidecarConfig, config_digest: str) -> DriverLease:
        """Take the sidecar's lease: new, or lapsed (adoption: `previous` names the dead
        driver). `SidecarBusy` if a live driver holds it."""
        holder = LeaseHolder.this_process(config_digest)
        first: LeaseAnswer | None = None
        deadline = time.monotonic() + LEASE_TTL_S + 2 * RENEW_EVERY_S + _CALL_TIMEOUT_S
        while True:
            handle = _lease_actor(config, holder)
            try:
                answer = ray.get(handle.take.remote(holder, LEASE_TTL_S), timeout=_CALL_TIMEOUT_S)
            except ray.exceptions.RayActorError:  # lost the race to create it: the other's
                answer = None
            if answer is not None and answer.taken:
                lease = cls(config, handle, holder, answer)
                lease._start_renewing()
                return lease
            if answer is not None:
                first = first or answer
                if answer.renewals != first.renewals or answer.holder != first.holder:
                    raise SidecarBusy(_busy(config, answer))
            if time.monotonic() > deadline:
                raise SidecarBusy(_busy(config, answer) if answer else f"{sidecar_name(config)}: "
                                  "its driver lease does not answer")  # fmt: skip
            time.sleep(RENEW_EVERY_S / 2)

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="rlfeed-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            try:
                answer = ray.get(
                    self.handle.take.remote(self.holder, LEASE_TTL_S), timeout=_CALL_TIMEOUT_S
                )
            except ray.exceptions.RayError as exc:  # restarting, or the head unreachable
                _log.warning("rlfeed: renewing the driver lease failed (%s)", type(exc).__name__)
                continue
            if not answer.taken:
                self.lost_to = answer.holder
                self.lost.set()
                return

    def still_held(self) -> bool:
        """Renew once more, the renewing thread stopped: whether this driver may tear the
        sidecar down (a lease it cannot reach counts as held: Ray's head is gone)."""
        self._stop_renewing()
        if self.lost.is_set():
            return False
        try:
            answer = ray.get(
                self.handle.take.remote(self.holder, LEASE_TTL_S), timeout=_CALL_TIMEOUT_S
            )
        except ray.exceptions.RayError:
            return True
        if not answer.taken:
            self.lost_to = answer.holder
            self.lost.set()
        return answer.taken

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_CALL_TIMEOUT_S)

    def end(self, kill: bool) -> None:
        """Stop renewing; with `kill`, the lease actor goes too (the sidecar was torn down)."""
        self._stop_renewing()
        if kill:
            with contextlib.suppress(Exception):
                ray.kill(self.handle, no_restart=True)


def _lease_actor(config: SidecarConfig, holder: LeaseHolder):
    """The sidecar's lease actor, created (detached, on the head node, holding `holder`)
    if there is none."""
    options = ray.remote(DriverLeaseActor).options(
        name=lease_actor_name(config),
        namespace=config.ray.namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        num_cpus=0,
        resources={HEAD_NODE_RESOURCE: 0.001},
    )
    return options.remote(holder)


def _busy(config: SidecarConfig, answer: LeaseAnswer) -> str:
    return (
        f"{sidecar_name(config)} is owned by a running rlfeed serve "
        f"({answer.holder.describe()}, lease renewed {answer.age_s:.1f} s ago); stop that one "
        "first, or set [ray] actor_name to run another sidecar"
    )

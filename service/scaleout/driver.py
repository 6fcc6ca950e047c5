"""`rlfeed serve` with `[frontends] count` > 0: this process is the Ray driver of the
scheduler actor and the front-end actors (`actor.py`, `placement.py`); it serves nothing
itself. It prints where each front-end listens, then one line

    rlfeed serve: listening on HOST:PORT,HOST:PORT (Ray at ..., 2 front-ends as Ray actors; TLS off,
        mTLS off, tokens off)

whose address list a client takes as it is (round-robin over the front-ends). It watches
the front-ends until told to stop (exit 0) or one is gone for good (exit 1, said why);
SIGHUP makes every front-end re-read the token file.

On a Ray cluster that outlives the driver (`--ray-address`) the actors are detached, in
`[ray] namespace`: a driver killed (SIGKILL, its pod lost) leaves them serving, and the
next `rlfeed serve` with the same config takes over the lapsed driver lease (`lease.py`)
and adopts them: no new actor, no journal reload, its listening line says "adopted N
front-ends". A leftover it cannot adopt whole (another config, or a driver killed while
starting or stopping the sidecar) is replaced: stopped, then started afresh, as every
restart was before. A second `rlfeed serve` while the owner lives is refused (exit 2).
Every other way out (a stop asked for, a front-end lost for good, a failed start-up)
tears down every actor of the sidecar, the lease last. On an embedded Ray, which dies with
the driver, nothing could outlive it: the actors are owned by the driver, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import sys
import threading
import time
from dataclasses import dataclass

import ray
from rlfeed.service.config import SidecarConfig, dump_config
from rlfeed.service.scaleout.lease import DriverLease, SidecarBusy, sidecar_name
from rlfeed.service.scaleout.placement import (
    FrontendActors,
    FrontendLost,
    frontend_actor_name,
    running_frontends,
    start_frontend_actors,
)

_NAMES_FREED_TIMEOUT_S = 30.0


@dataclass
class _Owned:
    """What this driver owns; `tear_down` lets go of it on every way out but SIGKILL."""

    lease: DriverLease | None = None
    scheduler: ray.actor.ActorHandle | None = None
    actors: FrontendActors | None = None
    handed_on: bool = False  # another driver took the lease over: the sidecar is its now

    def tear_down(self) -> None:
        if self.lease is not None and not self.lease.still_held():
            self.handed_on = True  # never stop what another driver owns now
        if self.handed_on:
            if self.lease is not None:
                self.lease.end(kill=False)
            return
        try:
            if self.actors is not None:
                self.actors.stop()
            if self.scheduler is not None:
                with contextlib.suppress(Exception):  # gone already
                    ray.kill(self.scheduler)
        finally:
            if self.lease is not None:  # last: a second driver is refused until the end
                self.lease.end(kill=True)


def serve_frontend_actors(
    config: SidecarConfig, ray_address: str | None, where: str, stop: threading.Event
) -> int:
    from rlfeed.service.frontend.server import connect_ray

    started_ray = connect_ray(config, ray_address)
    owned = _Owned()
    try:
        return _serve(config, where, stop, ray_address is not None, owned)
    finally:
        try:
            owned.tear_down()
        finally:
            if started_ray:
                ray.shutdown()


def _serve(
    config: SidecarConfig, where: str, stop: threading.Event, detached: bool, owned: _Owned
) -> int:
    from rlfeed.service.scheduler.actor import create_scheduler_actor

    adopted = None
    if detached:
        try:
            owned.lease = DriverLease.acquire(config, _digest(config))
        except SidecarBusy as exc:
            print(f"rlfeed serve: {exc}", file=sys.stderr)
            return 2
        try:
            adopted = _adoptable(config, owned.lease)
        except RuntimeError as exc:  # a leftover that does not stop
            print(f"rlfeed serve: {exc}", file=sys.stderr)
            return 1
    try:
        owned.scheduler = (
            adopted[0]
            if adopted
            else create_scheduler_actor(config, on_head=True, detached=detached)
        )
    except RuntimeError as exc:  # a sidecar of that name runs, not under a driver lease
        print(f"rlfeed serve: {exc}", file=sys.stderr)
        return 2
    try:
        owned.actors = start_frontend_actors(
            config, owned.scheduler, detached, adopted[1] if adopted else None
        )
    except RuntimeError as exc:
        print(f"rlfeed serve: {exc}", file=sys.stderr)
        return 1
    actors = owned.actors
    _announce(config, actors, where)
    if hasattr(signal, "SIGHUP"):  # token rotation, as for in-process front-ends
        signal.signal(signal.SIGHUP, lambda signum, frame: actors.reload_tokens())
    while not stop.wait(1.0):
        if owned.lease is not None and owned.lease.lost.is_set():
            owned.handed_on = True
            taker = owned.lease.lost_to.describe() if owned.lease.lost_to else "another driver"
            print(
                f"rlfeed serve: {sidecar_name(config)} was taken over by the rlfeed serve of "
                f"{taker} (this one stalled); it runs on, this driver exits",
                file=sys.stderr,
            )
            return 1
        try:
            for line in actors.check():
                print(f"rlfeed serve: {line}", file=sys.stderr, flush=True)
        except FrontendLost as exc:
            print(f"rlfeed serve: {exc}; stopping the sidecar", file=sys.stderr)
            return 1
    print("rlfeed serve: stopping", flush=True)
    return 0


def _announce(config: SidecarConfig, actors: FrontendActors, where: str) -> None:
    for place in actors.places:
        metrics = f", metrics {place.metrics_url}/metrics" if place.metrics_url else ""
        print(
            f"rlfeed serve: front-end {place.index} on node {place.node_id[:12]} "
            f"serves {place.address}{metrics}",
            flush=True,
        )
    addresses = ",".join(dict.fromkeys(actors.addresses))  # front-ends sharing a port: once
    adopted = f", adopted {actors.adopted} front-ends" if actors.adopted else ""
    print(
        f"rlfeed serve: listening on {addresses} ({where}, {len(actors.places)} front-ends as "
        f"Ray actors{adopted}; {config.security.summary()})",
        flush=True,
    )


def _digest(config: SidecarConfig) -> str:
    """Of the resolved config: a driver adopts only actors started with the same one."""
    return hashlib.sha256(dump_config(config, "toml").encode()).hexdigest()[:16]


def _adoptable(config: SidecarConfig, lease: DriverLease) -> tuple | None:
    """(scheduler, front-end handles) a dead driver left running, to adopt whole; None
    when there are none, or after stopping a leftover that cannot be (said why)."""
    previous = lease.previous
    if previous is None:  # a new lease: a leftover without one makes creation fail, named
        return None
    scheduler = _running_scheduler(config)
    frontends = running_frontends(config)
    wanted = list(range(config.frontends.count))
    reason = ""
    if previous.config_digest != lease.holder.config_digest:
        reason = "its driver ran another config"
    elif scheduler is None or sorted(frontends) != wanted:
        reason = "its driver died while starting or stopping it"
    else:
        try:
            timeout_s = config.frontends.serving_timeout_s
            if ray.get(scheduler.sidecar_stopping.remote(), timeout=timeout_s):
                reason = "its driver died while stopping it"
        except ray.exceptions.RayError as exc:
            reason = f"its scheduler does not answer ({type(exc).__name__})"
    left_by = f"{sidecar_name(config)} left running by {previous.describe()}"
    if not reason:
        print(f"rlfeed serve: adopting {left_by}", flush=True)
        return scheduler, [frontends[index] for index in wanted]
    if scheduler is None and not frontends:
        return None
    journal = "its journal resumes the run" if config.journal.dir else "no journal: it starts empty"
    print(f"rlfeed serve: replacing {left_by} ({reason}; {journal})", file=sys.stderr)
    _stop_leftover(config, scheduler, frontends)
    return None


def _running_scheduler(config: SidecarConfig) -> ray.actor.ActorHandle | None:
    try:
        return ray.get_actor(config.ray.actor_name, namespace=config.ray.namespace)
    except ValueError:
        return None


def _stop_leftover(
    config: SidecarConfig,
    scheduler: ray.actor.ActorHandle | None,
    frontends: dict[int, ray.actor.ActorHandle],
) -> None:
    """Stop what a dead driver left (the front-ends told the whole sidecar stops, so none
    hands over), and return once its names are free for new actors."""
    names = {config.ray.actor_name} | {frontend_actor_name(config, i) for i in frontends}
    if scheduler is not None:
        FrontendActors(config, scheduler, list(frontends.values()), places=[]).stop()
        with contextlib.suppress(Exception):
            ray.kill(scheduler)
    else:
        for handle in frontends.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + _NAMES_FREED_TIMEOUT_S
    while names & set(ray.util.list_named_actors()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the leftover actors of {sidecar_name(config)} do not stop")
        time.sleep(0.2)

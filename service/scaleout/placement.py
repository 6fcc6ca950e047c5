"""The driver's side of front-ends as Ray actors: create them where `[frontends]` says,
wait until each serves, watch them while the sidecar runs, stop them with it.

Ray does the process management: placement (one unit of `[frontends] resource` each, or
SPREAD over the nodes) and restarts after a crash or a lost node (`max_restarts=-1` with a
journal, the restarted actor recovering its slot). On a Ray cluster of its own
(`--ray-address`) the actors are detached and outlive their driver, which a restarted
`rlfeed serve` adopts (`driver.py`); on an embedded Ray they share the driver's fate.
Without a journal a front-end that dies took what it held in memory along, so it is not
restarted and the sidecar stops, as with `--replicas`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import ray
from rlfeed.client.allocator import retained_memory_environment
from rlfeed.service.config import SidecarConfig
from rlfeed.service.scaleout.actor import FrontendActor, FrontendPlace
from rlfeed.service.scheduler.actor import SERVING_RUNTIME_ENV

WATCH_TIMEOUT_S = 5.0  # an answer slower than this counts as down (restarting or cut off)


class FrontendLost(RuntimeError):
    """A front-end is gone for good, or not back within `[frontends] serving_timeout_s`:
    the sidecar stops (exit 1); the message says which and why."""


def _frontend_prefix(config: SidecarConfig) -> str:
    return f"{config.ray.actor_name}-frontend-"


def frontend_actor_name(config: SidecarConfig, index: int) -> str:
    return f"{_frontend_prefix(config)}{index}"


def running_frontends(config: SidecarConfig) -> dict[int, ray.actor.ActorHandle]:
    """Index -> handle of every front-end actor of this sidecar alive (or restarting) in
    the driver's namespace, `[ray] namespace` (a driver killed left them running)."""
    prefix = _frontend_prefix(config)
    found = {}
    for name in ray.util.list_named_actors():
        index = name[len(prefix) :]
        if name.startswith(prefix) and index.isdigit():
            with contextlib.suppress(ValueError):  # gone since listed
                found[int(index)] = ray.get_actor(name, namespace=config.ray.namespace)
    return found


def _options(config: SidecarConfig, index: int, detached: bool) -> dict:
    placement = config.frontends
    options = {
        "name": frontend_actor_name(config, index),
        "namespace": config.ray.namespace,
        "max_restarts": -1 if config.journal.dir else 0,
        "num_cpus": placement.num_cpus,
        "max_concurrency": 4,  # `place` and `stop` answer while gRPC threads serve
        # Nice 0, not Ray's 15 for workers; glibc's malloc set up at the worker's start,
        # as `rlfeed serve` sets up its own before any thread (client.allocator).
        "runtime_env": {
            "env_vars": {
                **SERVING_RUNTIME_ENV["env_vars"],
                **retained_memory_environment(config.server.retained_free_mib * 2**20),
            }
        },
    }
    if detached:
        options["lifetime"] = "detached"
    if placement.resource:
        options["resources"] = {placement.resource: 1}
    else:
        options["scheduling_strategy"] = "SPREAD"
    return options


@dataclass
class FrontendActors:
    """The running front-end actors of this sidecar; `check()` while it runs, `stop()`."""

    config: SidecarConfig
    scheduler: ray.actor.ActorHandle
    handles: list[ray.actor.ActorHandle]
    places: list[FrontendPlace]
    restarts: int = 0
    adopted: int = 0  # front-ends a driver killed left running, now this one's
    _asked: dict[int, tuple[ray.ObjectRef, float]] = field(default_factory=dict)
    _down_since: dict[int, float] = field(default_factory=dict)

    @property
    def addresses(self) -> list[str]:
        return [place.address for place in self.places]

    def check(self) -> list[str]:
        """Ask every front-end where it serves (one question each in flight, asked again
        after `WATCH_TIMEOUT_S`); returns lines to log (a front-end back, on which node).
        Raises `FrontendLost`."""
        now, lines = time.monotonic(), []
        for index, handle in enumerate(self.handles):
            if index not in self._asked:
                self._asked[index] = (handle.place.remote(), now)
            ref, asked_at = self._asked[index]
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._asked[index]
                line = self._answered(index, ref)
                if line:
                    lines.append(line)
            elif now - asked_at > WATCH_TIMEOUT_S:  # down: ask its next incarnation afresh
                self._down_since.setdefault(index, asked_at)
                self._asked[index] = (handle.place.remote(), now)
            self._check_down(index, now)
        return lines

    def _answered(self, index: int, ref: ray.ObjectRef) -> str:
        try:
            place = ray.get(ref)
        except ray.exceptions.ActorDiedError as exc:
            without = "" if self.config.journal.dir else " (no [journal] dir: what it held is lost)"
            raise FrontendLost(f"front-end {index} died for good{without}: {exc}") from None
        except ray.exceptions.RayError:  # unavailable: Ray is restarting it
            self._down_since.setdefault(index, time.monotonic())
            return ""
        if place.lost_reason:
            raise FrontendLost(f"front-end {index}: {place.lost_reason}")
        self._down_since.pop(index, None)
        before = self.places[index]
        self.places[index] = place
        if (place.pid, place.node_id) == (before.pid, before.node_id):
            return ""
        self.restarts += 1
        return f"front-end {index} restarted by Ray: {place.address} on node {place.node_id[:12]}"

    def _check_down(self, index: int, now: float) -> None:
        since = self._down_since.get(index)
        limit = self.config.frontends.serving_timeout_s
        if since is not None and now - since > limit:
            raise FrontendLost(
                f"front-end {index} has not served for {now - since:.0f} s "
                f"([frontends] serving_timeout_s = {limit:g}): no node to restart it on?"
            )

    def reload_tokens(self) -> None:
        """Every front-end re-reads the token file (SIGHUP to `rlfeed serve`); does not
        wait: a front-end restarting reads the file as it starts anyway."""
        for handle in self.handles:
            handle.reload_tokens.remote()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop every front-end (the scheduler actor first hears the whole sidecar stops,
        so none hands data over), then kill the actors."""
        if not self.handles:
            return
        with contextlib.suppress(Exception):  # gone already: nothing to hand over to
            ray.get(self.scheduler.stop_sidecar.remote(), timeout=10)
        stopping = [handle.stop.remote(grace_s) for handle in self.handles]
        with contextlib.suppress(Exception):  # a dead or wedged one is killed below
            ray.wait(stopping, num_returns=len(stopping), timeout=grace_s + 10)
        for handle in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        self.handles = []


def start_frontend_actors(
    config: SidecarConfig,
    scheduler: ray.actor.ActorHandle,
    detached: bool = False,
    adopted: list[ray.actor.ActorHandle] | None = None,
) -> FrontendActors:
    """Create `[frontends] count` front-end actors (`detached`: outliving this driver), or
    take `adopted` ones, and return once each serves. RuntimeError (every one killed)
    when one fails to start or does not serve within `[frontends] serving_timeout_s` (no
    node offers the resource, or the CPUs)."""
    actor_class = ray.remote(FrontendActor)
    timeout_s = config.frontends.serving_timeout_s
    handles = adopted or [
        actor_class.options(**_options(config, index, detached)).remote(config, index)
        for index in range(config.frontends.count)
    ]
    actors = FrontendActors(config, scheduler, handles, places=[], adopted=len(adopted or ()))
    try:
        refs = [handle.place.remote() for handle in handles]
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if waiting:
            wanted = config.frontends.resource
            where = f"a node offering resource {wanted!r}" if wanted else "a node with CPUs"
            unplaced = ", ".join(str(refs.index(ref)) for ref in waiting)
            raise RuntimeError(
                f"front-end(s) {unplaced} not serving after {timeout_s:.0f} s: does the Ray "
                f"cluster have {where} free for each of the {len(refs)} front-ends "
                f"([frontends] num_cpus = {config.frontends.num_cpus:g})?"
            )
        try:
            actors.places = ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a front-end failed to start: {exc}") from None
    except BaseException:
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        raise
    return actors

"""`FrontendActor`: one gRPC front-end living in a Ray actor, on the node Ray placed it.

It runs what `rlfeed serve` runs in-process (`start_server(join=True)`: the public port,
the peer port, the assembler, the watch on the scheduler actor) plus its metrics
endpoint. Ray restarts it when its process or its node dies (`max_restarts=-1` with a
journal); the new incarnation first declares the old one dead at the scheduler
(`orphan_slot`: handles naming its memory turn back into references to its journal
slot), then `start_server` claims the slot and loads it. The journal must therefore be on
a path every node that may host the front-end sees (shared storage), one writer per slot
folder (`flock`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import ray
from rlfeed.service.config import SidecarConfig
from rlfeed.service.frontend.journaling import frontend_slot

_log = logging.getLogger("rlfeed.service.scaleout.actor")
ORPHAN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FrontendPlace:
    """Where a front-end actor serves: for the driver's log and its restart check."""

    index: int
    address: str  # host:port clients reach
    node_id: str
    pid: int
    metrics_url: str  # "" without [server] metrics_port
    # Why it stopped serving for good ("" while it serves): the scheduler actor is gone and
    # there is no journal to come back from.
    lost_reason: str = ""


def frontend_config(config: SidecarConfig, index: int) -> SidecarConfig:
    """Front-end `index`'s config: its ports per `[frontends] ports`."""
    ports, server = config.frontends, config.server
    return replace(
        config,
        server=replace(
            server,
            port=ports.port_of(server.port, index),
            metrics_port=ports.port_of(server.metrics_port, index),
        ),
    )


class FrontendActor:
    """Ray actor body; `ray.remote(FrontendActor).options(...)` by `placement.py`."""

    def __init__(self, config: SidecarConfig, index: int) -> None:
        from rlfeed.service.frontend.server import start_server
        from rlfeed.service.metrics.exporter import SidecarExporter

        self.index, self.slot = index, frontend_slot(index)
        config = frontend_config(config, index)
        if ray.get_runtime_context().was_current_actor_reconstructed and config.journal.dir:
            scheduler = ray.get_actor(config.ray.actor_name, namespace=config.ray.namespace)
            dead = ray.get(scheduler.orphan_slot.remote(self.slot), timeout=ORPHAN_TIMEOUT_S)
            _log.warning("rlfeed: %s restarted by Ray; it takes over from %s", self.slot, dead)
        self._exporter = SidecarExporter(config) if config.server.metrics_port else None
        if self._exporter is not None:
            self._exporter.start(actor=None)
        try:
            self._sidecar = start_server(
                config,
                join=True,
                slot=self.slot,
                events=self._exporter.events if self._exporter is not None else None,
            )
        except BaseException:
            if self._exporter is not None:
                self._exporter.stop()
            raise
        if self._exporter is not None:
            self._exporter.attach(self._sidecar.actor)

    def place(self) -> FrontendPlace:
        sidecar = self._sidecar
        return FrontendPlace(
            index=self.index,
            address=sidecar.public_address,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            metrics_url=self._exporter.url if self._exporter is not None else "",
            lost_reason=sidecar.lost_reason if sidecar.lost.is_set() else "",
        )

    def reload_tokens(self) -> None:
        """Re-read `[security] auth_token_file` (the driver got SIGHUP: rotation)."""
        if self._sidecar.security.tokens is not None:
            self._sidecar.security.tokens.reload()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (the driver stops the sidecar: nothing to hand over)."""
        try:
            self._sidecar.stop(grace=grace_s)
        finally:
            if self._exporter is not None:
                self._exporter.stop()

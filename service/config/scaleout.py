"""`[frontends]`: how many front-ends run as Ray actors, and on which nodes.

With `count = 0` (the default) the front-end runs inside `rlfeed serve` itself (and
`[server] replicas` forks more on this machine). With `count = N`, `rlfeed serve` only
creates the scheduler actor and N front-end actors that Ray places and restarts: on nodes
offering `resource` (one unit each), else spread over the cluster. Every front-end binds
`[server] host` and port: the same port on every node (`ports = "same"`; front-ends
sharing a node share it with SO_REUSEPORT), or port + index (`"consecutive"`, for several
front-ends on one machine that clients address one by one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlfeed.service.config.fields import documented, requirement

PORT_MODES = ("same", "consecutive")


_require = requirement("frontends")


@dataclass(kw_only=True, frozen=True)
class FrontendsConfig:
    """Front-ends as Ray actors across the cluster (0 = in the `rlfeed serve` process)."""

    count: int = documented(
        0,
        "front-ends run as Ray actors placed by Ray, count; 0 = the front-end runs in the "
        "rlfeed serve process (and [server] replicas more on this machine)",
    )
    resource: str = documented(
        "",
        'custom Ray resource a node offers to host front-ends (e.g. "rlfeed_frontend"; '
        "each front-end takes one unit, so a node with 1 hosts at most one); empty = spread "
        "over every node",
    )
    ports: str = documented(
        "same",
        '"same": every front-end binds [server] port (one address per node, a headless '
        'Service in front); "consecutive": front-end i binds port + i (several on one host)',
    )
    num_cpus: float = documented(1.0, "CPUs Ray reserves for each front-end actor")
    serving_timeout_s: float = documented(
        120.0,
        "a front-end not serving within this many seconds of its start (not placed: no "
        "node offers the resource or the CPUs) or of its death (no node to restart it "
        "on) stops the sidecar, exit 1; seconds",
    )

    def __post_init__(self) -> None:
        _require(self.count >= 0, "count", "must be >= 0")
        _require(
            self.ports in PORT_MODES, "ports", f"must be one of {PORT_MODES}, got {self.ports!r}"
        )
        _require(self.num_cpus >= 0, "num_cpus", "must be >= 0")
        _require(self.serving_timeout_s > 0, "serving_timeout_s", "must be > 0")

    def port_of(self, base_port: int, index: int) -> int:
        """The gRPC (or metrics) port front-end `index` binds, from the configured one."""
        if base_port == 0 or self.ports == "same":
            return base_port
        return base_port + index


def embedded_cpus(num_cpus: int, frontends: FrontendsConfig) -> int:
    """The CPUs of an embedded local Ray: `[ray] num_cpus`, raised to what it must place
    (the scheduler actor's 1 CPU plus `num_cpus` for each front-end actor, which could
    never start otherwise). Ray's CPUs are a count for placement, not a limit on what the
    processes use. A named `resource` is not offered: no node of this cluster has it."""
    return max(num_cpus, 1 + math.ceil(frontends.count * frontends.num_cpus))

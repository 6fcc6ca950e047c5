"""`rlfeed serve` with `[frontends] count` > 0: this process is the Ray driver that owns
the scheduler actor and the front-end actors (`actor.py`, `placement.py`); it serves nothing
itself. It prints where each front-end listens, then one line

    rlfeed serve: listening on HOST:PORT,HOST:PORT (Ray at ..., 2 front-ends as Ray actors; TLS off,
        mTLS off, tokens off)

whose address list a client takes as it is (round-robin over the front-ends). It watches
the front-ends until told to stop (exit 0) or one is gone for good (exit 1, said why);
SIGHUP makes every front-end re-read the token file.
"""

from __future__ import annotations

import signal
import sys
import threading

import ray
from rlfeed.service.config import SidecarConfig


def serve_frontend_actors(
    config: SidecarConfig, ray_address: str | None, where: str, stop: threading.Event
) -> int:
    from rlfeed.service.frontend.server import connect_ray
    from rlfeed.service.scaleout.placement import FrontendLost, start_frontend_actors
    from rlfeed.service.scheduler.actor import create_scheduler_actor

    started_ray = connect_ray(config, ray_address)
    scheduler = actors = None
    try:
        scheduler = create_scheduler_actor(config, on_head=True)
        try:
            actors = start_frontend_actors(config, scheduler)
        except RuntimeError as exc:
            print(f"rlfeed serve: {exc}", file=sys.stderr)
            return 1
        for place in actors.places:
            metrics = f", metrics {place.metrics_url}/metrics" if place.metrics_url else ""
            print(
                f"rlfeed serve: front-end {place.index} on node {place.node_id[:12]} "
                f"serves {place.address}{metrics}",
                flush=True,
            )
        if hasattr(signal, "SIGHUP"):  # token rotation, as for in-process front-ends
            signal.signal(signal.SIGHUP, lambda signum, frame: actors.reload_tokens())
        addresses = ",".join(dict.fromkeys(actors.addresses))  # front-ends sharing a port: once
        count = len(actors.places)
        secured = config.security.summary()
        print(
            f"rlfeed serve: listening on {addresses} ({where}, {count} front-ends as Ray "
            f"actors; {secured})",
            flush=True,
        )
        while not stop.wait(1.0):
            try:
                for line in actors.check():
                    print(f"rlfeed serve: {line}", file=sys.stderr, flush=True)
            except FrontendLost as exc:
                print(f"rlfeed serve: {exc}; stopping the sidecar", file=sys.stderr)
                return 1
        print("rlfeed serve: stopping", flush=True)
        return 0
    finally:
        try:
            if actors is not None:
                actors.stop()
            if scheduler is not None:
                ray.kill(scheduler)
        finally:
            if started_ray:
                ray.shutdown()

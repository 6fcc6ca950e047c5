"""Shared fixtures for tests that need a real Ray and a real sidecar on loopback.

- `ray_local` (session): one local Ray for the whole run (num_cpus=2, no dashboard, worker
  logs not forwarded); shut down at the end. Started on first use only.
- `make_sidecar` (function): `make_sidecar(rollouts={...}, batching={...}, ...)` starts a
  real gRPC sidecar (`start_server`) on a free loopback port with those config sections
  overridden (each with its own scheduler actor); every sidecar it started is stopped when
  the test ends. Returns the `SidecarServer` (`.address`, `.config`, `.stop()`).
  `make_sidecar(events=factory, ...)` hands `start_server` the hooks `factory(config)`
  returns for the resolved config (e.g. `MetricsEvents`); reach them as
  `sidecar.frontend.events.inner`.
"""

from __future__ import annotations

import itertools

import pytest

_sidecar_numbers = itertools.count()


@pytest.fixture(scope="session")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlfeed")
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


@pytest.fixture
def make_sidecar(ray_local):
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.server import start_server

    started = []

    def make(*, events=None, **sections):
        sections = {name: dict(values) for name, values in sections.items()}
        sections.setdefault("server", {}).setdefault("port", 0)
        sections["server"].setdefault("host", "127.0.0.1")
        sections.setdefault("ray", {}).setdefault(
            "actor_name", f"rlfeed-scheduler-test-{next(_sidecar_numbers)}"
        )
        config = with_overrides(SidecarConfig(), **sections)
        sidecar = start_server(config, events=events(config) if events is not None else None)
        started.append(sidecar)
        return sidecar

    try:
        yield make
    finally:
        for sidecar in started:
            sidecar.stop(grace=0.5)

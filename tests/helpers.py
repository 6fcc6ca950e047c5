"""Helpers shared by tests (on sys.path through pytest's `pythonpath`): a free loopback
port and a bounded wait for a condition."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; free until someone binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(
    condition: Callable[[], object],
    what: str = "condition not met in time",
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
) -> None:
    """Poll `condition` until it is true; AssertionError(`what`) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(interval_s)

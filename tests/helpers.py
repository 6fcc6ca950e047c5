"""Helpers shared by tests (on sys.path through pytest's `pythonpath`): a free loopback
port, a bounded wait for a condition, `rlfeed serve` started in the background, and a
child's stdout read line by line with a bound on each wait."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
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


def serve_in_background(*arguments: str, timeout_s: float = 120.0):
    """`rlfeed serve ARGUMENTS --port 0` in the background, once it listens: (process, its
    address, the `listening on` line). The caller stops it (`stop_serve`)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "serve", *arguments, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            raise AssertionError(f"rlfeed serve exited during start-up ({server.returncode})")
        if line.startswith("rlfeed serve: listening on "):
            return server, line.split()[4], line
    stop_serve(server)
    raise AssertionError(f"rlfeed serve did not print its address within {timeout_s} s")


def stop_serve(server) -> None:
    """SIGTERM (its normal stop), then SIGKILL if it has not exited after 20 s."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


class Lines:
    """A child's stdout, line by line, each wait bounded (a reader thread: select() on a
    buffered pipe misses lines already read into the buffer)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self._lines = process, queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")

    def next(self, timeout_s: float, what: str) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{what}: nothing within {timeout_s} s") from None
        assert line, f"{what}: the process exited ({self.process.wait()})"
        return line

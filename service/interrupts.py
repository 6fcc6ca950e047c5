"""SIGINT and SIGTERM as exceptions in the main thread, so every `finally` runs.

Ctrl-C raises `KeyboardInterrupt` and SIGTERM (`docker stop`, Kubernetes, `kill`) raises
`Terminated`; both derive from BaseException, so an `except Exception` on the way does not
swallow them, and the `rlfeed` command turns them into one line and exit status 130 / 143
(128 + the signal number, the shell's convention). After the first signal, further ones are
ignored: the cleanup it started (trainer processes, the sidecar, Ray) runs to its end.

Ray replaces the SIGTERM handler while it starts (`ray.init`: a Python handler that exits,
and its core worker's C handler that dumps a stack and aborts), so a command that starts
Ray calls `raise_on_stop_signals()` again once it has. Main thread only (Python runs
handlers there, and only the main thread may install them).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

# Exit status of a command a signal stopped before its work was done: 128 + signal number.
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Terminated(BaseException):
    """SIGTERM arrived: unwind like KeyboardInterrupt does for Ctrl-C."""


def raise_on_stop_signals() -> dict:
    """From now on the first SIGINT raises KeyboardInterrupt and the first SIGTERM raises
    `Terminated` in the main thread; any signal after that first one is ignored. Returns
    the handlers it replaced (for `restore_handlers`)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("raise_on_stop_signals must be called from the main thread")

    def stop(signum, frame) -> None:
        for other in EXIT_STATUS:  # the cleanup this starts must not be cut short
            signal.signal(other, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated

    return {signum: signal.signal(signum, stop) for signum in EXIT_STATUS}


def restore_handlers(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """`raise_on_stop_signals()` for the body; the handlers before it are put back after
    (a caller such as a test runner keeps its own)."""
    previous = raise_on_stop_signals()
    try:
        yield
    finally:
        restore_handlers(previous)

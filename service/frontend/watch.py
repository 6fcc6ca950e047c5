"""`ActorWatch`: a front-end's eye on the scheduler actor, so it never lingers as a zombie.

Every second it asks the actor which start of it answers (`incarnation`). No answer:
health goes NOT_SERVING at once (probes and balancers stop sending here). Without a
journal a dead actor is final (Ray does not restart it: a new one would start empty under
the same name), so after `lost_after_s` the watch calls `on_lost` and `rlfeed serve` exits
1. With a journal Ray restarts the actor, which rebuilds itself from the journal; when
the watch sees the new incarnation it calls `rejoin` (register again and take this
front-end's journal slot back) and health goes SERVING again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray
from rlfeed.service.frontend.state import FrontendState

_log = logging.getLogger("rlfeed.service.frontend.watch")


class ActorWatch:
    """The watch thread of one front-end (see the module docstring)."""

    def __init__(
        self,
        frontend: FrontendState,
        *,
        set_serving: Callable[[bool], None],
        rejoin: Callable[[], None],
        on_lost: Callable[[str], None],
        maintain: Callable[[], None] | None = None,
        check_journal: Callable[[], None] | None = None,
        interval_s: float = 1.0,
        lost_after_s: float = 5.0,
        maintain_every_s: float = 10.0,
    ) -> None:
        self.frontend = frontend
        self._set_serving, self._rejoin, self._on_lost = set_serving, rejoin, on_lost
        # Periodic upkeep while the actor answers (the journal's retention).
        self._maintain, self.maintain_every_s = maintain, maintain_every_s
        self._check_journal = check_journal  # each interval: the journal's disk (`server.py`)
        self.interval_s, self.lost_after_s = interval_s, lost_after_s
        self.rejoins = 0  # restarts of the actor this front-end rejoined
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, incarnation: str) -> None:
        self._thread = threading.Thread(
            target=self._loop, args=(incarnation,), name="rlfeed-actor-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self, known: str) -> None:
        down_since: float | None = None
        maintained = time.monotonic()
        while not self._stop.wait(self.interval_s):
            if self._check_journal is not None:
                self._check_journal()
            try:
                current = self.frontend.scheduler.incarnation(timeout_s=5 * self.interval_s)
                if current != known:
                    self._set_serving(False)
                    self._rejoin()
                    _log.warning("rlfeed: the scheduler restarted; this front-end rejoined it")
                    known, down_since = current, None
                    self.rejoins += 1
                    self._set_serving(True)
                    continue
            except ray.exceptions.RayError as exc:
                down_since = self._down(down_since, exc)
                if down_since is None:
                    return  # lost for good: on_lost was called
                continue
            if down_since is not None:
                self._set_serving(True)
                down_since = None
            if self._maintain is not None and time.monotonic() - maintained > self.maintain_every_s:
                maintained = time.monotonic()
                try:
                    self._maintain()
                except Exception:  # upkeep never stops the watch; tried again later
                    _log.exception("rlfeed: front-end upkeep failed")

    def _down(self, since: float | None, error: Exception) -> float | None:
        """Note an unanswered check: NOT_SERVING at the first; None once lost for good."""
        now = time.monotonic()
        if since is None:
            self._set_serving(False)
            _log.warning("rlfeed: the scheduler does not answer (%s)", type(error).__name__)
            since = now
        if self.frontend.journal is None and now - since >= self.lost_after_s:
            self._on_lost(
                f"the scheduler actor is gone ({type(error).__name__}) and without "
                "[journal] dir it cannot come back with its state"
            )
            return None
        return since

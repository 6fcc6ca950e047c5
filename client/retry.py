"""How the clients ride through a sidecar that does not answer: a bounded, loud retry.

    budget              default   setting (argument, else environment)
    before any answer   30 s      connect_timeout_s    RLFEED_CONNECT_TIMEOUT_S
    after an answer     120 s     reconnect_timeout_s  RLFEED_RECONNECT_TIMEOUT_S

A client that has never been answered is most likely pointed at the wrong address, so it
gives up sooner; one that was answered before is most likely facing a restart (kill -9,
then `rlfeed serve` again: 13-22 s measured on a loaded box, Ray start-up included), so it
waits longer. Either way the first failure logs a warning naming the address and the
budget at once, another follows every 10 s, the end of the outage is logged (INFO) with
its length, and a budget spent raises `SidecarUnreachableError`: never a silent wait.

A failed TLS handshake (`TLSHandshakeError`: a CA, server name or client certificate that
does not fit) never heals, so it is raised at once, not retried; gRPC's weaker "Socket
closed" counts as one only while the sidecar has never answered this client and it has said
nothing else for `SUSPECT_FOR_S` (1.5 s).

Only idempotent calls are retried (`TRANSIENT_CODES`): a rollout batch re-sent with the
same rollout ids, a fetch of the same (step, rank), a cumulative acknowledgement, task
registration, a trainer report (it replaces the rank's previous one), a task sample.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from rlfeed.client.handshake import SUSPECT_FOR_S
from rlfeed.client.transport import (
    BufferFullError,
    SidecarError,
    SidecarUnreachableError,
    TLSHandshakeError,
)

_log = logging.getLogger(__name__)

ENV_CONNECT_TIMEOUT = "RLFEED_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT_S = 30.0
"""How long a client keeps asking a sidecar that has not answered it yet."""

ENV_RECONNECT_TIMEOUT = "RLFEED_RECONNECT_TIMEOUT_S"
DEFAULT_RECONNECT_TIMEOUT_S = 120.0
"""How long a client keeps asking a sidecar that answered it before (see the module
docstring: about 5x a measured restart)."""

TRANSIENT_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
"""Answers retried (for idempotent calls only): nothing answers (a restart, a front-end
leaving), or the call's deadline passed with its outcome unknown."""

# While a sidecar stays unreachable, a warning this often (the first one at once).
WARN_EVERY_S = 10.0

_MAX_FULL_PAUSE_S = 10.0  # cap on a sidecar's retry hint: never sleep long on one word
_T = TypeVar("_T")


def _seconds(value: float | None, env: str, default: float, name: str) -> float:
    if value is None:
        raw = os.environ.get(env, "")
        try:
            value = float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def connect_timeout(value: float | None) -> float:
    """`value` (seconds), else RLFEED_CONNECT_TIMEOUT_S, else 30 s; must be > 0."""
    return _seconds(value, ENV_CONNECT_TIMEOUT, DEFAULT_CONNECT_TIMEOUT_S, "connect_timeout_s")


def reconnect_timeout(value: float | None) -> float:
    """`value` (seconds), else RLFEED_RECONNECT_TIMEOUT_S, else 120 s; must be > 0."""
    return _seconds(
        value, ENV_RECONNECT_TIMEOUT, DEFAULT_RECONNECT_TIMEOUT_S, "reconnect_timeout_s"
    )


class RetryPolicy:
    """One client's retry budgets (module docstring) and whether the sidecar has answered
    it yet. Shared by the client's threads: `answered` only ever turns True."""

    def __init__(
        self,
        address: str,
        connect_timeout_s: float | None = None,
        reconnect_timeout_s: float | None = None,
    ) -> None:
        self.address = address
        self.connect_timeout_s = connect_timeout(connect_timeout_s)
        self.reconnect_timeout_s = reconnect_timeout(reconnect_timeout_s)
        self.answered = False

    def outage(self, codes: frozenset[str] = TRANSIENT_CODES, limit_s: float | None = None):
        """An `Outage` for one call retried under this policy, its budget the one that
        applies now, never more than `limit_s`."""
        if self.answered:
            budget, setting = self.reconnect_timeout_s, "reconnect_timeout_s"
        else:
            budget, setting = self.connect_timeout_s, "connect_timeout_s"
        if limit_s is not None and limit_s < budget:
            budget, setting = limit_s, "the call's timeout"
        return Outage(self.address, budget, codes, setting=setting, policy=self)

    def call(self, fn: Callable[[], _T], codes: frozenset[str] = TRANSIENT_CODES) -> _T:
        """fn() (an idempotent call), retried through an outage."""
        return self.outage(codes).call(fn)


class Outage:
    """One stretch of a sidecar not answering, as a client retries a call through it.

    `failed(exc)` records an UNAVAILABLE (or other `codes`) answer: the first one logs a
    warning naming `address` at once, another follows every 10 s, and once `timeout_s`
    have passed since the first it raises `SidecarUnreachableError` instead. Any other
    error is re-raised as is. `succeeded()` ends it (logged if it had begun). Retried
    calls must be idempotent.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float,
        codes: frozenset[str] = frozenset({"UNAVAILABLE"}),
        *,
        setting: str = "connect_timeout_s",
        policy: RetryPolicy | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.codes = codes
        self.setting = setting  # what to set to change timeout_s, named in the warning
        self._policy = policy
        self._since: float | None = None
        self._warned_at: float | None = None
        self._suspect_since: float | None = None  # "Socket closed" and nothing else since
        self.interrupted = False  # a retried failure was met (the sidecar may have restarted)

    def failed(self, exc: SidecarError) -> None:
        if isinstance(exc, SidecarUnreachableError):
            raise exc
        if exc.code not in self.codes:
            self.succeeded()  # an answer, if not a welcome one
            raise exc
        now = time.monotonic()
        self._raise_handshake(exc, now)
        self.interrupted = True
        if self._since is None:
            self._since = now
        waited = now - self._since
        if waited >= self.timeout_s:
            error = SidecarUnreachableError(exc.code, self.address, waited, exc.message)
            error.rollout_ids = exc.rollout_ids
            raise error from None
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            _log.warning(
                "rlfeed: the sidecar at %s does not answer (%s: %s); retrying, giving up "
                "after %.0f s (%s)",
                self.address,
                exc.code,
                exc.message,
                self.timeout_s,
                self.setting,
            )

    def _raise_handshake(self, exc: SidecarError, now: float) -> None:
        """Raise a handshake failure that cannot heal (module docstring)."""
        if not isinstance(exc, TLSHandshakeError):
            self._suspect_since = None
            return
        if exc.certain:
            raise exc
        if self._suspect_since is None:
            self._suspect_since = now
        answered = self._policy is not None and self._policy.answered
        if not answered and now - self._suspect_since >= SUSPECT_FOR_S:
            raise exc

    def succeeded(self) -> None:
        """The sidecar answered (anything but a retried failure)."""
        if self._policy is not None:
            self._policy.answered = True
        if self._since is not None:
            _log.info(
                "rlfeed: the sidecar at %s answers again after %.1f s",
                self.address,
                time.monotonic() - self._since,
            )
            self._since = self._warned_at = None
        self._suspect_since = None

    def call(self, fn: Callable[[], _T], pause_s: float = 0.1) -> _T:
        """fn(), asked again every `pause_s` while it fails with one of `codes`."""
        while True:
            try:
                result = fn()
            except SidecarError as exc:
                self.failed(exc)  # re-raises what is not retried, and a lasting outage
            else:
                self.succeeded()
                return result
            time.sleep(pause_s)


class FullSidecar:
    """One stretch of a sidecar refusing a batch as full (RESOURCE_EXHAUSTED), as a writer
    sends it again: `pause_s(exc)` says how long to wait first (the sidecar's retry hint,
    else `backoff_s` doubling up to 1 s) and logs a warning naming `address` and the
    sidecar's message (its bound and figures) at once and every 10 s, so a producer blocked
    by a full sidecar is never silent."""

    def __init__(self, address: str, backoff_s: float) -> None:
        self.address = address
        self._backoff_s = backoff_s
        self._since: float | None = None
        self._warned_at: float | None = None

    def pause_s(self, exc: BufferFullError) -> float:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            _log.warning(
                "rlfeed: the sidecar at %s is full and has refused this batch for %.0f s "
                "(RESOURCE_EXHAUSTED: %s); waiting for room and sending it again",
                self.address,
                now - self._since,
                exc.message,
            )
        if exc.retry_after_s is not None:
            return min(exc.retry_after_s, _MAX_FULL_PAUSE_S)
        pause, self._backoff_s = self._backoff_s, min(self._backoff_s * 2, 1.0)
        return pause

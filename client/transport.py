"""How the client library talks to a sidecar: a five-call interface, over gRPC or in-process.

`Transport` is what `RolloutWriter` and `BatchLoader` use; it speaks the `.proto` messages
(`rlfeed.v1`), so the wire contract stays the one definition of every field. `GrpcTransport`
calls a running sidecar; `rlfeed.service.inprocess.InProcessTransport` runs the sidecar's
own code in the calling process (no gRPC, no Ray), so client and trainer code is testable
without a server.

Errors are the same for both: `InvalidRolloutsError` (the server's INVALID_ARGUMENT to a
rollout batch, with its message), `InvalidRequestError` (INVALID_ARGUMENT to any other
call, e.g. a trainer's rank; `WorldSizeMismatchError` when the loader's world size is not
the sidecar's), `BufferFullError` (RESOURCE_EXHAUSTED: retry later), `StepReleasedError`
(NOT_FOUND: the step is no longer retained), `AuthenticationError` (UNAUTHENTICATED or
PERMISSION_DENIED: the token or certificate was refused), `SidecarError` for anything
else. A transport raises UNAVAILABLE as a plain `SidecarError`, at once; the clients
retry it for `connect_timeout_s` (`Outage`, with a warning naming the address), then
raise `SidecarUnreachableError`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

from rlfeed.client.arrow_codec import ServedResponse, parse_get_batch_response
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.metadata import RETRY_AFTER_MS

_log = logging.getLogger(__name__)

ENV_CONNECT_TIMEOUT = "RLFEED_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT_S = 30.0
"""How long a client keeps asking an unreachable sidecar (a restart takes seconds)."""

# While a sidecar stays unreachable, a warning this often (the first one at once).
_WARN_EVERY_S = 10.0
_MAX_FULL_PAUSE_S = 10.0  # cap on a sidecar's retry hint: never sleep long on one word

_T = TypeVar("_T")


class SidecarError(RuntimeError):
    """A call to the sidecar failed; `code` is the gRPC status name (e.g. 'UNAVAILABLE').
    Raised by a `RolloutWriter`, `rollout_ids` names the batch that was not delivered."""

    rollout_ids: tuple[str, ...] = ()

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidRolloutsError(SidecarError, ValueError):
    """The sidecar rejected a rollout batch as a whole (INVALID_ARGUMENT); `message` names
    the rollout id and the field, `rollout_ids` lists the batch that was dropped."""

    def __init__(self, message: str, rollout_ids: tuple[str, ...] = ()) -> None:
        super().__init__("INVALID_ARGUMENT", message)
        self.rollout_ids = rollout_ids


class InvalidRequestError(SidecarError, ValueError):
    """The sidecar refused a call other than a rollout batch as invalid (INVALID_ARGUMENT):
    a trainer's step or rank, a task id. `message` is the server's reason."""

    def __init__(self, message: str) -> None:
        super().__init__("INVALID_ARGUMENT", message)


class WorldSizeMismatchError(InvalidRequestError):
    """A `BatchLoader`'s world size (`world_size`, from WORLD_SIZE or its argument) is not
    the one the sidecar cuts steps for (`served_world_size`, its `[batching] world_size`;
    0 where the sidecar only said the rank is outside it)."""

    def __init__(self, world_size: int, served_world_size: int, rank: int) -> None:
        served = f"world_size={served_world_size}" if served_world_size else "fewer ranks"
        super().__init__(
            f"this loader (rank {rank}) has world_size={world_size} but the sidecar serves "
            f"{served} (set WORLD_SIZE, or [batching] world_size on the sidecar)"
        )
        self.world_size = world_size
        self.served_world_size = served_world_size


class SidecarUnreachableError(SidecarError, ConnectionError):
    """No sidecar answered at `address` for `waited_s` seconds (`code` UNAVAILABLE or
    DEADLINE_EXCEEDED: nothing listens there, the host name does not resolve, or the
    sidecar stopped). `message` ends with the last gRPC reason."""

    def __init__(self, code: str, address: str, waited_s: float, reason: str) -> None:
        super().__init__(
            code,
            f"cannot reach the sidecar at {address} (tried for {waited_s:.1f} s; is "
            f"`rlfeed serve` running there?): {reason}",
        )
        self.address = address
        self.waited_s = waited_s


class BufferFullError(SidecarError):
    """No room for more rollouts (the sidecar's buffer or the writer's own bound).
    `retry_after_s`: the wait the sidecar suggests before sending the batch again (its
    `rlfeed-retry-after-ms` trailing metadata), None when it gave none."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__("RESOURCE_EXHAUSTED", message)
        self.retry_after_s = retry_after_s


class StepReleasedError(SidecarError, LookupError):
    """The asked-for step is no longer retained by the sidecar (NOT_FOUND)."""

    def __init__(self, message: str) -> None:
        super().__init__("NOT_FOUND", message)


class AuthenticationError(SidecarError, PermissionError):
    """The sidecar refused the caller (`code` UNAUTHENTICATED: no token or an unknown one;
    PERMISSION_DENIED: the token's role may not make this call). The message names the
    sidecar's address and the server's reason, never the token. Not retried."""

    def __init__(self, code: str, message: str, address: str = "") -> None:
        where = f"sidecar {address} refused the call" if address else "the sidecar refused the call"
        super().__init__(code, f"{where}: {message}")
        self.address = address


@runtime_checkable
class Transport(Protocol):
    """The calls the client library makes. Every method may raise a `SidecarError`."""

    def submit(self, batch: pb.RolloutBatch) -> pb.SubmitAck: ...

    def register_tasks(self, task_ids: list[str]) -> pb.RegisterTasksResponse: ...

    def sample_tasks(self, n: int) -> pb.SampleTasksResponse: ...

    def get_batch(self, step: int, rank: int, wait_s: float) -> pb.GetBatchResponse:
        """Rank's microbatches of `step`; waits up to `wait_s` for assembly, then answers
        with `ready = False`."""
        ...

    def report(self, report: pb.TrainerReport) -> None: ...

    def status(self) -> pb.StatusResponse: ...

    def close(self) -> None: ...


class GrpcTransport:
    """`Transport` over a gRPC channel to `address` ("host:port").

    Message size limits are lifted on the client side (a step of long rollouts is tens of
    MiB); the server's own limit is its `[server] max_message_bytes`.

    token, tls_ca, tls_cert, tls_key, tls_server_name: the credentials of a secured sidecar
    (`client/auth.py`): each defaults to its environment variable (`RLFEED_TOKEN` or
    `RLFEED_TOKEN_FILE`, `RLFEED_TLS_CA`, ...), "" means none. TLS is on when a CA or a
    client certificate is given; the token is sent on every call.
    """

    def __init__(
        self,
        address: str,
        *,
        call_timeout_s: float = 60.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        import grpc
        from rlfeed.client.auth import ChannelSecurity, open_channel
        from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc

        security = ChannelSecurity.resolve(
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
        )
        self.address = address
        self.tls = security.tls
        self._grpc = grpc
        self._call_timeout_s = call_timeout_s
        self._channel = open_channel(
            address,
            security,
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
            ],
        )
        self._ingest = pb_grpc.RolloutIngestStub(self._channel)
        self._tasks = pb_grpc.TaskSamplingStub(self._channel)
        self._batches = pb_grpc.BatchServingStub(self._channel)
        self._status = pb_grpc.SidecarStatusStub(self._channel)
        self._submit_serialized = self._channel.unary_unary(
            "/rlfeed.v1.RolloutIngest/SubmitRolloutBatch",
            request_serializer=None,  # the caller serialized it
            response_deserializer=pb.SubmitAck.FromString,
        )
        self._get_batch_view = self._channel.unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=parse_get_batch_response,
        )

    def _call(self, method, request, timeout_s: float | None = None, *, ingest: bool = False):
        try:
            return method(request, timeout=timeout_s or self._call_timeout_s)
        except self._grpc.RpcError as exc:
            raise _sidecar_error(exc, self.address, ingest=ingest) from None

    def submit(self, batch: pb.RolloutBatch) -> pb.SubmitAck:
        return self._call(self._ingest.SubmitRolloutBatch, batch, ingest=True)

    def submit_serialized(self, request: bytes) -> pb.SubmitAck:
        """`submit` of a serialized `RolloutBatch` (`arrow_codec.encode_rollout_batch`,
        what `RolloutWriter` sends: the payload is not copied into a message first)."""
        return self._call(self._submit_serialized, request, ingest=True)

    def register_tasks(self, task_ids: list[str]) -> pb.RegisterTasksResponse:
        return self._call(self._tasks.RegisterTasks, pb.RegisterTasksRequest(task_ids=task_ids))

    def sample_tasks(self, n: int) -> pb.SampleTasksResponse:
        return self._call(self._tasks.SampleTasks, pb.SampleTasksRequest(n=n))

    def get_batch(self, step: int, rank: int, wait_s: float) -> pb.GetBatchResponse:
        request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=int(wait_s * 1000))
        return self._call(self._batches.GetBatch, request, timeout_s=wait_s + self._call_timeout_s)

    def get_batch_view(self, step: int, rank: int, wait_s: float) -> ServedResponse:
        """`get_batch`, answered as a `ServedResponse`: the Arrow payloads stay in the
        received bytes (what `BatchLoader` uses)."""
        request = pb.GetBatchRequest(step=step, rank=rank, timeout_ms=int(wait_s * 1000))
        return self._call(self._get_batch_view, request, timeout_s=wait_s + self._call_timeout_s)

    def report(self, report: pb.TrainerReport) -> None:
        self._call(self._batches.ReportTrainerMetrics, report)

    def status(self) -> pb.StatusResponse:
        return self._call(self._status.GetStatus, pb.GetStatusRequest())

    def close(self) -> None:
        self._channel.close()


def _sidecar_error(exc, address: str = "", *, ingest: bool = False) -> SidecarError:
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    message = exc.details() or str(exc)
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return AuthenticationError(code, message, address)
    if code == "INVALID_ARGUMENT":
        return InvalidRolloutsError(message) if ingest else InvalidRequestError(message)
    if code == "RESOURCE_EXHAUSTED":
        return BufferFullError(message, _retry_after_s(exc))
    if code == "NOT_FOUND":
        return StepReleasedError(message)
    return SidecarError(code, message)


def _retry_after_s(exc) -> float | None:
    """The `rlfeed-retry-after-ms` trailing metadata of a failed call, in seconds; None
    if absent or not a finite non-negative number."""
    trailing = getattr(exc, "trailing_metadata", None)
    for key, value in (trailing() if trailing else None) or ():
        if key == RETRY_AFTER_MS:
            try:
                milliseconds = float(value)
            except ValueError:
                return None
            return milliseconds / 1000 if 0 <= milliseconds < math.inf else None
    return None


def connect_timeout(value: float | None) -> float:
    """`value` (seconds), else the RLFEED_CONNECT_TIMEOUT_S environment variable, else
    `DEFAULT_CONNECT_TIMEOUT_S`; must be > 0."""
    if value is None:
        raw = os.environ.get(ENV_CONNECT_TIMEOUT, "")
        try:
            value = float(raw) if raw else DEFAULT_CONNECT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{ENV_CONNECT_TIMEOUT}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"connect_timeout_s must be > 0, got {value}")
    return float(value)


def address_of(transport: Transport) -> str:
    """What to call a transport's sidecar in a message: its "host:port", else its class."""
    return str(getattr(transport, "address", "") or f"<{type(transport).__name__}>")


class Outage:
    """One stretch of a sidecar not answering, as a client retries a call through it.

    `failed(exc)` records an UNAVAILABLE (or other `codes`) answer: the first one logs a
    warning naming `address` at once, another follows every 10 s, and once `timeout_s`
    have passed since the first it raises `SidecarUnreachableError` instead. Any other
    error is re-raised as is. Retried calls must be idempotent.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float,
        codes: frozenset[str] = frozenset({"UNAVAILABLE"}),
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.codes = codes
        self._since: float | None = None
        self._warned_at: float | None = None

    def failed(self, exc: SidecarError) -> None:
        if exc.code not in self.codes or isinstance(exc, SidecarUnreachableError):
            raise exc
        now = time.monotonic()
        if self._since is None:
            self._since = now
        waited = now - self._since
        if waited >= self.timeout_s:
            error = SidecarUnreachableError(exc.code, self.address, waited, exc.message)
            error.rollout_ids = exc.rollout_ids
            raise error from None
        if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            _log.warning(
                "rlfeed: the sidecar at %s does not answer (%s: %s); retrying, giving up "
                "after %.0f s (connect_timeout_s)",
                self.address,
                exc.code,
                exc.message,
                self.timeout_s,
            )

    def call(self, fn: Callable[[], _T], pause_s: float = 0.1) -> _T:
        """fn(), asked again every `pause_s` while it fails with one of `codes`."""
        while True:
            try:
                return fn()
            except SidecarError as exc:
                self.failed(exc)
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
        if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
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


def fast_variant(transport: Transport, plain: str, fast: str):
    """`transport.<fast>` (e.g. `get_batch_view` for `get_batch`) when the class that
    defines it also defines `<plain>`, else None: a subclass or wrapper that intercepts the
    plain call is never bypassed by a fast path it did not write."""
    mro = type(transport).__mro__
    fast_owner = next((cls for cls in mro if fast in vars(cls)), None)
    plain_owner = next((cls for cls in mro if plain in vars(cls)), None)
    if fast_owner is None or fast_owner is not plain_owner:
        return None
    return getattr(transport, fast)


def connect(
    address_or_transport: str | Transport, **credentials: str | None
) -> tuple[Transport, bool]:
    """(transport, owned): a `GrpcTransport` for an address string (owned: close it after
    use) with `credentials` (GrpcTransport's token and tls_* arguments; None = from the
    environment), or the given transport as is (not owned; it was given its credentials
    when made, so passing any here is a ValueError)."""
    if isinstance(address_or_transport, str):
        return GrpcTransport(address_or_transport, **credentials), True
    if any(value is not None for value in credentials.values()):
        named = ", ".join(sorted(k for k, v in credentials.items() if v is not None))
        raise ValueError(f"{named}: credentials go with an address, not with a Transport")
    if not isinstance(address_or_transport, Transport):
        raise TypeError(
            f"expected 'host:port' or a Transport, got {type(address_or_transport).__name__}"
        )
    return address_or_transport, False

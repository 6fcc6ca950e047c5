"""How the client library talks to a sidecar: a small call interface, over gRPC or in-process.

`Transport` is what `RolloutWriter` and `BatchLoader` use; it speaks the `.proto` messages
(`rlfeed.v1`), so the wire contract stays the one definition of every field. `GrpcTransport`
calls a running sidecar; `rlfeed.service.inprocess.InProcessTransport` runs the sidecar's
own code in the calling process (no gRPC, no Ray), so client and trainer code is testable
without a server.

Errors are the same for both: `InvalidRolloutsError` (the server's INVALID_ARGUMENT to a
rollout batch, with its message), `InvalidRequestError` (INVALID_ARGUMENT to any other
call, e.g. a trainer's rank; `WorldSizeMismatchError` when the loader's world size is not
the sidecar's), `BufferFullError` (RESOURCE_EXHAUSTED: the buffer is full or too many
calls are in flight, retry later), `MessageTooLargeError` (RESOURCE_EXHAUSTED from gRPC's
message size limit: never retried, the same bytes would be refused again), `StepReleasedError`
(NOT_FOUND: the step is no longer retained), `AuthenticationError` (UNAUTHENTICATED or
PERMISSION_DENIED: the token or certificate was refused), `TLSHandshakeError` (an
UNAVAILABLE whose reason is a failed TLS handshake: `client/handshake.py`), `SidecarError`
for anything else. A transport raises UNAVAILABLE as a plain `SidecarError`, at once; the clients
retry what is safe to retry (`client/retry.py`: a warning naming the address, then
`SidecarUnreachableError`).

Riding through a sidecar restart (kill -9, then `rlfeed serve` again on the same address):
the channel tries to reconnect at least once a second (`RECONNECT_CHANNEL_OPTIONS`; gRPC's
default backoff grows to 120 s, so a 20 s outage used to cost up to 17 s more), and every
retried call is idempotent: a rollout batch is re-sent with the same rollout ids (the
sidecar answers `duplicate` for those it has), a fetch asks for the same (step, rank), an
acknowledgement is cumulative.

Several front-ends (an address list or a name resolving to all of them, `client/
addressing.py`): any front-end takes any call, so when one goes away its calls fail
UNAVAILABLE, are retried as above, and round_robin sends them to a front-end that is up;
the reconnect settings apply to each front-end's connection, so one that comes back gets
calls again within about a second.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rlfeed.client.arrow_codec import ServedResponse, parse_get_batch_response
from rlfeed.client.auth import ChannelSecurity, Credentials, given_credentials
from rlfeed.client.handshake import Handshake, diagnose
from rlfeed.client.handshake import message as handshake_message
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.metadata import RETRY_AFTER_MS

if TYPE_CHECKING:
    from typing_extensions import Unpack

RECONNECT_CHANNEL_OPTIONS = (
    # A lost connection is tried again after 0.2 s, then at most every 1 s (gRPC defaults:
    # 1 s growing by 1.6x to 120 s), so a restarted sidecar is noticed within about a second.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # One connection attempt may take this long (gRPC's default is 20 s): a host that drops
    # packets fails calls, and so warns, within seconds, not after 20 s.
    ("grpc.min_reconnect_backoff_ms", 5000),
    # A name that resolves to a new address (a restarted pod) is looked up again within 1 s.
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
)


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


class TLSHandshakeError(SidecarError, ConnectionError):
    """The TLS handshake with the sidecar at `address` failed (code UNAVAILABLE): a CA,
    server name or client certificate that does not fit, or TLS on one side only. The
    message says what to check. `certain` False: gRPC only said "Socket closed", which a
    sidecar going down says too (`client/retry.py` decides). Not retried once certain."""

    def __init__(self, address: str, message: str, certain: bool = True) -> None:
        super().__init__("UNAVAILABLE", message)
        self.address = address
        self.certain = certain


class BufferFullError(SidecarError):
    """No room for more rollouts (the sidecar's buffer or the writer's own bound).
    `retry_after_s`: the wait the sidecar suggests before sending the batch again (its
    `rlfeed-retry-after-ms` trailing metadata), None when it gave none."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__("RESOURCE_EXHAUSTED", message)
        self.retry_after_s = retry_after_s


class MessageTooLargeError(SidecarError, ValueError):
    """A message over the sidecar's size limit (`[server] max_message_bytes`), refused by
    gRPC before any handler saw it; `size` and `limit` in bytes (0 where gRPC did not say,
    e.g. for a compressed message). Not retried: the same bytes would be refused again."""

    def __init__(self, details: str, size: int = 0, limit: int = 0) -> None:
        over = f"is {size:,} bytes, over the {limit:,} bytes" if limit else "is over the size"
        super().__init__(
            "RESOURCE_EXHAUSTED",
            f"the message {over} the sidecar accepts ([server] max_message_bytes): "
            f"send smaller batches (RolloutWriter max_batch_bytes / max_batch_rollouts) or "
            f"raise the limit ({details})",
        )
        self.size = size
        self.limit = limit


# gRPC core's words for a message over max_receive_message_length (after inflating).
_TOO_LARGE = re.compile(r"message larger than max(?: \((\d+) vs\. (\d+)\))?")


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
        with `ready = False`. A transport whose `ack_steps` answers `acks_with_get_batch`
        also takes `acked_through=` (an acknowledgement applied first, see `ack_steps`)."""
        ...

    def ack_steps(self, rank: int, through_step: int | None) -> pb.AckStepsResponse:
        """Rank `rank` is done with every step <= `through_step` (the sidecar may release
        them after its retention); cumulative and idempotent. None: none yet, but from now
        on only the rank's acknowledgements count, not its fetches."""
        ...

    def report(self, report: pb.TrainerReport) -> None: ...

    def status(self) -> pb.StatusResponse: ...

    def close(self) -> None: ...


class GrpcTransport:
    """`Transport` over a gRPC channel to `address`: "host:port", or several front-ends of
    one sidecar ("ip:port,ip:port", "dns:///name:port": `client/addressing.py`), each
    unary call then going to the next one that is up (round_robin).

    Message size limits are lifted on the client side (a step of long rollouts is tens of
    MiB); the server's own limit is its `[server] max_message_bytes`.

    token, tls_ca, tls_cert, tls_key, tls_server_name: the credentials of a secured sidecar
    (`client/auth.py` `Credentials`): each defaults to its environment variable
    (`RLFEED_TOKEN` or `RLFEED_TOKEN_FILE`, `RLFEED_TLS_CA`, ...), "" means none. TLS is on
    when a CA or a client certificate is given; the token is sent on every call.
    security: the same already resolved (`ChannelSecurity`), instead of those keywords.
    """

    def __init__(
        self,
        address: str,
        *,
        call_timeout_s: float = 60.0,
        security: ChannelSecurity | None = None,
        **credentials: Unpack[Credentials],
    ) -> None:
        import grpc
        from rlfeed.client.auth import channel_security, open_channel
        from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc

        security = channel_security(security, **credentials)
        self.address = address
        self.tls = security.tls
        self._handshake = Handshake.of(security)
        self._grpc = grpc
        self._call_timeout_s = call_timeout_s
        self._channel = open_channel(
            address,
            security,
            options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.max_receive_message_length", -1),
                *RECONNECT_CHANNEL_OPTIONS,
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
            raise _sidecar_error(
                exc, self.address, ingest=ingest, handshake=self._handshake
            ) from None

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

    def get_batch(
        self, step: int, rank: int, wait_s: float, acked_through: int | None = None
    ) -> pb.GetBatchResponse:
        """GetBatch; `acked_through` rides along as its `acked_through_step` (only for a
        sidecar whose AckSteps answer says `acks_with_get_batch`)."""
        request = _get_batch_request(step, rank, wait_s, acked_through)
        return self._call(self._batches.GetBatch, request, timeout_s=wait_s + self._call_timeout_s)

    def get_batch_view(
        self, step: int, rank: int, wait_s: float, acked_through: int | None = None
    ) -> ServedResponse:
        """`get_batch`, answered as a `ServedResponse`: the Arrow payloads stay in the
        received bytes (what `BatchLoader` uses)."""
        request = _get_batch_request(step, rank, wait_s, acked_through)
        return self._call(self._get_batch_view, request, timeout_s=wait_s + self._call_timeout_s)

    def ack_steps(self, rank: int, through_step: int | None) -> pb.AckStepsResponse:
        request = pb.AckStepsRequest(rank=rank, through_step=through_step)
        return self._call(self._batches.AckSteps, request)

    def report(self, report: pb.TrainerReport) -> None:
        self._call(self._batches.ReportTrainerMetrics, report)

    def status(self) -> pb.StatusResponse:
        return self._call(self._status.GetStatus, pb.GetStatusRequest())

    def close(self) -> None:
        self._channel.close()


def _get_batch_request(
    step: int, rank: int, wait_s: float, acked_through: int | None
) -> pb.GetBatchRequest:
    return pb.GetBatchRequest(
        step=step, rank=rank, timeout_ms=int(wait_s * 1000), acked_through_step=acked_through
    )


def _sidecar_error(
    exc, address: str = "", *, ingest: bool = False, handshake: Handshake | None = None
) -> SidecarError:
    code = exc.code().name if exc.code() is not None else "UNKNOWN"
    message = exc.details() or str(exc)
    if code == "UNAVAILABLE" and handshake is not None:
        diagnosis = diagnose(message, handshake)
        if diagnosis is not None:
            text = handshake_message(address, diagnosis, message)
            return TLSHandshakeError(address, text, diagnosis.certain)
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return AuthenticationError(code, message, address)
    if code == "INVALID_ARGUMENT":
        return InvalidRolloutsError(message) if ingest else InvalidRequestError(message)
    if code == "RESOURCE_EXHAUSTED":
        too_large = _TOO_LARGE.search(message)
        if too_large is not None:
            size, limit = (int(group or 0) for group in too_large.groups())
            return MessageTooLargeError(message, size, limit)
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


def address_of(transport: Transport) -> str:
    """What to call a transport's sidecar in a message: its "host:port", else its class."""
    return str(getattr(transport, "address", "") or f"<{type(transport).__name__}>")


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
    address_or_transport: str | Transport,
    security: ChannelSecurity | None = None,
    **credentials: Unpack[Credentials],
) -> tuple[Transport, bool]:
    """(transport, owned): a `GrpcTransport` for an address string (owned: close it after
    use) with `security` or `credentials` (GrpcTransport's token and tls_* arguments; None =
    from the environment), or the given transport as is (not owned; it was given its
    credentials when made, so passing any here is a ValueError)."""
    if isinstance(address_or_transport, str):
        return GrpcTransport(address_or_transport, security=security, **credentials), True
    named = given_credentials(security, credentials)
    if named:
        raise ValueError(f"{named}: credentials go with an address, not with a Transport")
    if not isinstance(address_or_transport, Transport):
        raise TypeError(
            f"expected 'host:port' or a Transport, got {type(address_or_transport).__name__}"
        )
    return address_or_transport, False

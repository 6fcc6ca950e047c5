"""Trainer side: `BatchLoader` iterates training steps and yields this rank's microbatches.

    loader = BatchLoader("sidecar:50051")          # rank / world size from torchrun's env
    for step in loader:                            # step 0, 1, 2, ...
        for mb in step:                            # microbatches_per_rank, same on all ranks
            ...                                    # mb.input_ids, mb.cu_seqlens, ...
        checkpoint(model, loader.state_dict())     # resume here after a restart

A step is fetched with `GetBatch(step, rank)` and decoded once (`arrow_codec.decode_step`:
tensors alias the Arrow buffers). While the trainer works on step s, a background thread
(`client/prefetch.py`) fetches steps s+1 .. s+prefetch; it starts at the first `iter()`,
never at import or construction, and `close()` (or leaving the `with` block) stops it.

Acknowledging: when the loop asks for step s + 1, this rank is done with step s (the
user's optimizer stepped on it), and the loader tells the sidecar: with its next fetch
(`client/acks.py`) where the sidecar takes it so, else by an `AckSteps` call of its own;
the loop's last step is acknowledged by a call when the loop ends (`ack()` always calls).
The sidecar keeps a step until every rank acknowledged it, then `[batching]
retained_steps` more steps, so a trainer resuming from a checkpoint that far back is
served its steps again. `auto_ack=False` leaves it to the user: `loader.ack(step)` after
each checkpoint keeps every step since the last one (at the cost of sidecar memory). At
its first fetch the loader tells the sidecar that this rank acknowledges (`AckSteps`
without a step), so its fetches and prefetches never count as done.

Riding through a restart, failing loud: a sidecar that does not answer (nothing listens at
the address, the host name does not resolve, the sidecar crashed or restarts mid-run) is
asked again (`client/retry.py`: for `connect_timeout_s`, 30 s, until it first answered,
then for `reconnect_timeout_s`, 120 s), with a warning naming the address logged at once
and every 10 s; then `SidecarUnreachableError` (a `SidecarError` and a `ConnectionError`)
names the address and how long it tried. Fetches, acknowledgements and reports are
idempotent, so they are simply asked again. A world size that is not the sidecar's raises
`WorldSizeMismatchError`, any other refused request `InvalidRequestError` (both
`ValueError`s).

Memory (opt-in): with `retained_free_mib` > 0, on glibc, the loader's first fetch sets
this process's malloc to keep up to that much freed memory for the next step's buffers
(`client.allocator`, the setting the sidecar's front-end uses for itself): each step's
response, gRPC's receive buffers and their copies then reuse pages the process already
has instead of being faulted in anew (in the 8k-token benchmark a rank's 2-28k page
faults per run fell under 5k at 256 MiB). It is off by default because it changes the
whole trainer process's allocator (it stays set) and no time saving has been measured
for a GPU trainer, whose step time the page faults of its batches hardly touch.

Resuming: `state_dict()` holds the next step to yield; a loader given that state by
`load_state_dict()` yields the same step next, and the sidecar answers a re-fetch of a
(step, rank) it still retains with byte-identical content, so a restarted trainer sees the
tensors it would have seen.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlfeed.client.acks import Acknowledgements
from rlfeed.client.allocator import MAX_RETAINED_BYTES, retain_freed_memory
from rlfeed.client.arrow_codec import MicrobatchTensors, ServedResponse, decode_step
from rlfeed.client.prefetch import Prefetcher, PrefetchStopped
from rlfeed.client.retry import TRANSIENT_CODES, RetryPolicy
from rlfeed.client.transport import (
    BufferFullError,
    InvalidRequestError,
    SidecarError,
    Transport,
    WorldSizeMismatchError,
    address_of,
    connect,
    fast_variant,
)
from rlfeed.proto import rlfeed_pb2 as pb

if TYPE_CHECKING:
    from rlfeed.client.auth import ChannelSecurity, Credentials
    from typing_extensions import Unpack

DEFAULT_RETAINED_FREE_MIB = 0
"""Opt-in (see the module docstring); 256 MiB holds a few steps' responses and gRPC's
buffers of them (tens of MiB each at most)."""

# The sidecar's message for a rank it does not serve: "rank 2 is outside [0, 2)".
_RANK_OUTSIDE = re.compile(r"rank (\d+) is outside \[0, (\d+)\)")

# Between asks after an UNAVAILABLE answer (a front-end leaving or restarting), at most.
_UNAVAILABLE_RETRY_S = 0.1
# A step not assembled yet is waited for up to `timeout_s` (600 s by default): a warning
# this often says so, so a trainer starved of data is never silent for minutes.
_STILL_WAITING_EVERY_S = 60.0

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainStep:
    """One rank's share of a training step: iterate it for its microbatches, in order."""

    step: int
    rank: int
    world_size: int
    policy_token_count: int  # global N over all ranks: the constant loss normalizer
    microbatches_per_rank: int
    policy_version: int  # newest policy version among the step's rollouts
    min_policy_version: int  # oldest
    num_rollouts: int  # rollouts in the step over all ranks
    microbatches: tuple[MicrobatchTensors, ...]

    def __iter__(self) -> Iterator[MicrobatchTensors]:
        return iter(self.microbatches)

    def __len__(self) -> int:
        return len(self.microbatches)

    def __getitem__(self, index: int) -> MicrobatchTensors:
        return self.microbatches[index]

    @property
    def num_tokens(self) -> int:
        """Tokens (positions) this rank computes in the step."""
        return sum(mb.num_tokens for mb in self.microbatches)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


class BatchLoader:
    """Iterates steps `start_step, start_step + 1, ...` (up to `stop_step`, exclusive).

    address_or_transport: "host:port" of a sidecar, several of its front-ends
      ("ip:port,ip:port" or "dns:///name:port": calls spread over them and move off one
      that goes away; `client/addressing.py`), or a `Transport`.
    rank, world_size: default to torchrun's RANK / WORLD_SIZE (0 / 1 when unset); checked
      against the sidecar's world size at the first fetch (`WorldSizeMismatchError`).
    prefetch: steps fetched ahead in the background (0 = fetch on demand, no thread).
    timeout_s: longest wait for one step to be assembled before TimeoutError.
    poll_s: longest single server-side wait; bounds how long `close()` takes.
    auto_ack: acknowledge step s when the loop asks for step s + 1 (module docstring);
      False: only `ack()` does, and nothing is released until it is called.
    connect_timeout_s: how long a sidecar that has not answered yet is asked again (a
      warning naming the address at once, then every 10 s) before
      `SidecarUnreachableError`; default RLFEED_CONNECT_TIMEOUT_S, else 30 s.
    reconnect_timeout_s: the same once it has answered (a restart); default
      RLFEED_RECONNECT_TIMEOUT_S, else 120 s. Neither is longer than `timeout_s`.
    retained_free_mib: free memory (MiB) a heap of this process may keep for reuse, set at
      the first fetch (process-wide; see the module docstring); 0 (the default) leaves
      glibc's defaults alone.
    token, tls_ca, tls_cert, tls_key, tls_server_name: a secured sidecar's credentials
      (see `GrpcTransport`; default: `RLFEED_TOKEN`, `RLFEED_TLS_CA`, ... from the
      environment). A refused credential raises `AuthenticationError`.
    security: the same already resolved (`client.auth.ChannelSecurity`), instead.
    """

    def __init__(
        self,
        address_or_transport: str | Transport,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        start_step: int = 0,
        stop_step: int | None = None,
        prefetch: int = 1,
        timeout_s: float = 600.0,
        poll_s: float = 0.5,
        auto_ack: bool = True,
        connect_timeout_s: float | None = None,
        reconnect_timeout_s: float | None = None,
        retained_free_mib: int = DEFAULT_RETAINED_FREE_MIB,
        security: ChannelSecurity | None = None,
        **credentials: Unpack[Credentials],
    ) -> None:
        self.rank = _env_int("RANK", 0) if rank is None else int(rank)
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if not 0 <= retained_free_mib <= MAX_RETAINED_BYTES >> 20:
            raise ValueError(
                f"retained_free_mib must be in [0, {MAX_RETAINED_BYTES >> 20}], "
                f"got {retained_free_mib}"
            )
        self._retained_free_bytes = retained_free_mib << 20
        self._transport, self._owns_transport = connect(
            address_or_transport, security, **credentials
        )
        # The in-place view where the transport offers one: tensors then alias the received
        # bytes instead of copies the generated message would make.
        self._get_batch = (
            fast_variant(self._transport, "get_batch", "get_batch_view")
            or self._transport.get_batch
        )
        self.prefetch = prefetch
        self.stop_step = stop_step
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.auto_ack = auto_ack
        self.address = address_of(self._transport)
        self._retry = RetryPolicy(self.address, connect_timeout_s, reconnect_timeout_s)
        self._next_step = start_step
        self._prefetcher: Prefetcher[TrainStep] | None = None
        self._declared = False  # told the sidecar this rank acknowledges (first fetch)
        self._acks = Acknowledgements(
            self._acknowledge, lambda step: self._transport.ack_steps(self.rank, step)
        )

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TrainStep]:
        self._stop_prefetcher()
        ended = False
        try:
            while self.stop_step is None or self._next_step < self.stop_step:
                if self.prefetch and self._prefetcher is None:
                    # (Re)started here, so load_state_dict() mid-iteration simply moves on.
                    self._prefetcher = Prefetcher(self, self._next_step, self.prefetch)
                prefetcher = self._prefetcher
                step = prefetcher.take() if prefetcher is not None else self.fetch(self._next_step)
                self._next_step = step.step + 1
                yield step
                if self.auto_ack:  # asked for the next step: this one is done
                    self._acks.done_with(step.step)
            ended = True
        finally:  # no fetch follows to carry what the loop is done with
            self._stop_prefetcher()
            self._acks.flush(retry=ended)  # a break or an error: one try

    @property
    def connect_timeout_s(self) -> float:
        return self._retry.connect_timeout_s

    @property
    def reconnect_timeout_s(self) -> float:
        return self._retry.reconnect_timeout_s

    def fetch(self, step: int) -> TrainStep:
        """Step `step` for this rank, waiting up to `timeout_s` for it to be assembled. An
        UNAVAILABLE answer (a front-end leaving, the sidecar restarting) is asked again
        under the retry policy (module docstring), with a warning, then
        `SidecarUnreachableError`; RESOURCE_EXHAUSTED (too many calls in flight there) is
        asked again until `timeout_s`: a fetch is idempotent, the answer byte-identical
        wherever it comes from. Fetching does not acknowledge the step (`ack`)."""
        if self._retained_free_bytes:
            retain_freed_memory(self._retained_free_bytes)
            self._retained_free_bytes = 0  # once: it stays set
        if not self._declared:  # before any fetch can count as done
            self._acks.declare()
            self._declared = True
        started = warned = time.monotonic()  # warned: the last "still waiting" warning
        deadline = started + self.timeout_s
        outage = self._retry.outage(TRANSIENT_CODES, limit_s=self.timeout_s)
        while True:
            wait = max(0.0, min(self.poll_s, deadline - time.monotonic()))
            acked = self._acks.unsent()
            try:  # the keyword only when set: a transport not taking it is never sent one
                if acked is None:
                    response = self._get_batch(step, self.rank, wait)
                else:
                    response = self._get_batch(step, self.rank, wait, acked_through=acked)
            except SidecarError as exc:
                if exc.code == "INVALID_ARGUMENT":
                    raise self._invalid_request(exc) from None
                busy = isinstance(exc, BufferFullError)  # its cap on waiting GetBatch calls
                if not (busy and time.monotonic() < deadline):
                    outage.failed(exc)  # re-raises anything else, and a lasting outage
                if self._prefetcher is not None and self._prefetcher.stopping:
                    raise PrefetchStopped from None
                time.sleep(min(self.poll_s, _UNAVAILABLE_RETRY_S))
                continue
            outage.succeeded()
            if acked is not None:
                self._acks.sent(acked)
            if response.ready:
                return self._decode(response, step)
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"step {step} rank {self.rank}: not assembled after {self.timeout_s} s"
                )
            if now - warned >= _STILL_WAITING_EVERY_S:
                warned = now
                self._still_waiting(step, now - started)
            if self._prefetcher is not None and self._prefetcher.stopping:
                raise PrefetchStopped

    def _still_waiting(self, step: int, waited_s: float) -> None:
        _log.warning(
            "rlfeed: rank %d has waited %.0f s for step %d, not assembled yet by the sidecar "
            "at %s (producers slow or stopped?); giving up after %.0f s (timeout_s)",
            self.rank,
            waited_s,
            step,
            self.address,
            self.timeout_s,
        )

    def _invalid_request(self, exc: SidecarError) -> InvalidRequestError:
        """The sidecar's INVALID_ARGUMENT to a fetch, as the trainer-side error it is."""
        outside = _RANK_OUTSIDE.search(exc.message)
        if outside is not None and int(outside.group(1)) == self.rank:
            served = int(outside.group(2))
            return WorldSizeMismatchError(self.world_size, served, self.rank)
        return exc if isinstance(exc, InvalidRequestError) else InvalidRequestError(exc.message)

    def _decode(self, response: pb.GetBatchResponse | ServedResponse, step: int) -> TrainStep:
        if response.world_size != self.world_size:
            raise WorldSizeMismatchError(self.world_size, int(response.world_size), self.rank)
        if response.step != step or response.rank != self.rank:
            raise ValueError(
                f"asked for step {step} rank {self.rank}, got step {response.step} "
                f"rank {response.rank}"
            )
        return TrainStep(
            step=int(response.step),
            rank=int(response.rank),
            world_size=int(response.world_size),
            policy_token_count=int(response.policy_token_count),
            microbatches_per_rank=int(response.microbatches_per_rank),
            policy_version=int(response.policy_version),
            min_policy_version=int(response.min_policy_version),
            num_rollouts=int(response.num_rollouts),
            microbatches=tuple(decode_step(response)),
        )

    def ack(self, step: int) -> int:
        """Tell the sidecar this rank is done with every step <= `step` (its optimizer
        stepped on them); returns the rank's acknowledged step (it only grows: an older or
        repeated acknowledgement changes nothing). Iterating does this by itself unless
        `auto_ack=False`. Retried like a fetch; `InvalidRequestError` if the sidecar has
        not assembled `step` (e.g. it restarted without a journal)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return int(self._acknowledge(int(step)).acked_through)

    def _acknowledge(self, through_step: int | None) -> pb.AckStepsResponse:
        try:
            return self._retry.call(lambda: self._transport.ack_steps(self.rank, through_step))
        except InvalidRequestError as exc:
            raise self._invalid_request(exc) from None

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """{"next_step": the step the next iteration yields, "rank", "world_size"}. The
        steps before next_step are done: acknowledged by the time the loop yields
        next_step, or, where fetches carry acknowledgements, by the next fetch (or when the
        loop ends or the loader closes); a loader resumed from this state is served them
        again while the sidecar retains them (`[batching] retained_steps` steps after every
        rank acknowledged them)."""
        return {"next_step": self._next_step, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["next_step"]`; the rank may differ (elastic restarts), the world
        size may not (the sidecar cuts steps for one world size)."""
        if int(state.get("world_size", self.world_size)) != self.world_size:
            raise ValueError(
                f"state was saved with world_size={state['world_size']}, "
                f"this loader has {self.world_size}"
            )
        next_step = int(state["next_step"])
        if next_step < 0:
            raise ValueError(f"next_step must be >= 0, got {next_step}")
        self._stop_prefetcher()
        self._next_step = next_step

    # -- metrics and lifetime -------------------------------------------------------------

    def report(
        self,
        step: int,
        *,
        loss: float,
        ratio_outlier_share: float | None = None,
        tokens_per_second: float = 0.0,
        step_seconds: float = 0.0,
        policy_version: int | None = None,
    ) -> None:
        """Send what this rank measured for `step` to the sidecar (becomes metrics);
        retried like a fetch (a report replaces the rank's previous one).
        ratio_outlier_share None or NaN: not measured this step (sent unset). The sidecar
        refuses other non-finite values (InvalidRequestError naming the field).
        policy_version: of the weights after this step's update; max_policy_lag then counts
        from it too (README "Policy versions"). One rank is enough; None: not published."""
        report = pb.TrainerReport(
            step=step,
            rank=self.rank,
            loss=float(loss),
            tokens_per_second=float(tokens_per_second),
            step_seconds=float(step_seconds),
        )
        if ratio_outlier_share is not None and not math.isnan(ratio_outlier_share):
            report.ratio_outlier_share = float(ratio_outlier_share)
        if policy_version is not None:
            if not 0 <= int(policy_version) < 2**63:
                raise ValueError(f"report: policy_version {policy_version} is outside [0, 2^63)")
            report.policy_version = int(policy_version)
        self._retry.call(lambda: self._transport.report(report))

    def close(self) -> None:
        """Stop the prefetch thread, send an acknowledgement no fetch carried (one try) and
        close an owned channel. Idempotent."""
        self._stop_prefetcher()
        self._acks.flush(retry=False)
        if self._owns_transport:
            self._transport.close()
            self._owns_transport = False

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stop_prefetcher(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = None

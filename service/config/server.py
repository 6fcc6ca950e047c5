"""`[server]`: where the gRPC front-end listens and what it spends on whom.

Besides the address and sizes, this section holds the limits that keep hostile or broken
clients from starving the rest (`frontend/call_guard.py` enforces them):

- **Calls in flight**, by kind: open `SubmitRollouts` streams, `GetBatch` long polls and
  the other unary calls, each capped in all (`max_streams`, `max_long_polls`,
  `max_unary_calls`) and per client address (`max_calls_per_client`). An admitted stream
  or unary call holds one of `max_workers` handler threads; the caps leave threads over
  for `GetStatus` (slots of its own) and the health service (never limited), so neither
  ever starves. A waiting GetBatch holds no thread (it waits on the asyncio server's event
  loop, `frontend/aio_host.py`), only memory, so its cap is sized by memory.
  A call over a cap answers RESOURCE_EXHAUSTED at once, naming the cap.
- **Time**: a call waiting longer than `request_idle_timeout_s` for its next request
  message is cancelled; idle connections are closed, dead peers found by keepalive.
- **Ids**: count per call and bytes per id, and the task pool's size.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfeed.client.allocator import MAX_RETAINED_BYTES
from rlfeed.service.config.fields import documented, requirement

_MAX_RETAINED_MIB = MAX_RETAINED_BYTES >> 20  # retained_free_mib in MiB fits mallopt's int
# GetStatus calls in flight at once (all clients): its own slots, so operators can always
# look, whatever streams and polls hold.
STATUS_SLOTS = 2
# Handler threads the caps must leave free: GetStatus's slots and 2 for health checks.
RESERVED_WORKERS = STATUS_SLOTS + 2
DEFAULT_MAX_IDS_PER_CALL = 100_000
DEFAULT_MAX_ID_BYTES = 256


_require = requirement("server")


@dataclass(kw_only=True, frozen=True)
class ServerConfig:
    """Where the gRPC front-end listens, how much it accepts and what one client may hold."""

    host: str = documented("127.0.0.1", "interface to bind; 0.0.0.0 to serve other machines")
    port: int = documented(50051, "gRPC port; 0 picks a free port (printed at start-up)")
    metrics_port: int = documented(
        0, "Prometheus /metrics (and /layout.png) port; 0 = no metrics endpoint"
    )
    metrics_host: str = documented(
        "127.0.0.1",
        "interface the metrics port binds, separate from host so it stays on loopback when "
        "gRPC serves other machines; 0.0.0.0 for a remote Prometheus",
    )
    max_message_bytes: int = documented(
        512 * 1024 * 1024, "largest gRPC message either way, bytes (a step of 8k-token rollouts)"
    )
    max_workers: int = documented(
        128,
        "gRPC handler threads (the public server's pool): every admitted stream or unary "
        "call holds one while it runs (an open SubmitRollouts stream for its whole life); a "
        "GetBatch only while it asks the scheduler actor or a peer, not while it waits. "
        f"Must leave {RESERVED_WORKERS} over max_streams + max_unary_calls (GetStatus and "
        "health)",
    )
    max_streams: int = documented(
        16,
        "SubmitRollouts streams open at once, all clients; one more answers "
        "RESOURCE_EXHAUSTED (RolloutWriter sends unary calls and opens none)",
    )
    max_long_polls: int = documented(
        4096,
        "GetBatch calls in flight at once, all clients (a BatchLoader rank has one); one "
        "more answers RESOURCE_EXHAUSTED, which BatchLoader retries. A waiting call holds "
        "no thread, only memory: about 26 KiB each (tests/bench/bench_long_poll.py, 256 and "
        "1024 calls), so 4096 waiting hold ~110 MiB",
    )
    max_unary_calls: int = documented(
        32,
        "other rlfeed.v1 calls in flight at once, all clients (SubmitRolloutBatch, "
        "RegisterTasks, SampleTasks, ReportTrainerMetrics); one more answers "
        f"RESOURCE_EXHAUSTED, which RolloutWriter retries. GetStatus has {STATUS_SLOTS} "
        "slots of its own; the health service is never limited",
    )
    max_calls_per_client: int = documented(
        32,
        "streams, long polls and unary calls one client address (IP, whatever the port) "
        "may have in flight together; one more answers RESOURCE_EXHAUSTED. Every process "
        "of a host behind one address (or a NAT) shares it; 0 = no per-client limit",
    )
    max_pending_calls: int = documented(
        8192,
        "calls in flight at once, all kinds, waiting long polls included (gRPC's "
        "maximum_concurrent_rpcs): beyond it any call, health included, answers "
        "RESOURCE_EXHAUSTED before a thread or memory is spent on it. Must be >= the sum "
        f"of the caps + {RESERVED_WORKERS}",
    )
    max_wait_seconds: float = documented(
        60.0, "upper bound on how long GetBatch waits for an unassembled step, seconds"
    )
    request_idle_timeout_s: float = documented(
        120.0,
        "a call waiting this long for its next request message is cancelled (CANCELLED), "
        "freeing its slot and thread: a SubmitRollouts stream that sends nothing, a unary "
        "call whose message does not arrive; seconds, 0 = never",
    )
    keepalive_time_s: float = documented(
        60.0,
        "the server pings a connection after this long without traffic, seconds "
        "(grpc.keepalive_time_ms), so the calls of a vanished client end; 0 = no pings",
    )
    keepalive_timeout_s: float = documented(
        20.0, "a connection whose ping is not answered within this long is closed, seconds"
    )
    max_connection_idle_s: float = documented(
        300.0,
        "a connection with no call for this long is closed (GOAWAY; clients reconnect on "
        "their next call), seconds; this also closes raw sockets that never speak "
        "HTTP/2; 0 = never",
    )
    max_connection_age_s: float = documented(
        0.0,
        "connections are closed after this long, seconds (calls in flight get "
        "max_connection_age_grace_s to finish; clients reconnect), e.g. to rebalance "
        "replicas; 0 = never",
    )
    max_connection_age_grace_s: float = documented(
        120.0,
        "how long calls in flight on a connection past max_connection_age_s may run on "
        "before they are cancelled, seconds (more than max_wait_seconds)",
    )
    handshake_timeout_s: float = documented(
        10.0, "a new connection must finish its TLS/HTTP2 handshake within this long, seconds"
    )
    max_ids_per_call: int = documented(
        DEFAULT_MAX_IDS_PER_CALL,
        "task ids in one RegisterTasks call, rollouts in one batch; more is INVALID_ARGUMENT",
    )
    max_id_bytes: int = documented(
        DEFAULT_MAX_ID_BYTES,
        "UTF-8 bytes of one task, group or rollout id; longer is INVALID_ARGUMENT",
    )
    max_tasks: int = documented(
        1_000_000,
        "task pool size (about 200 bytes per task in the scheduler actor); a RegisterTasks "
        "call that would grow it beyond this is INVALID_ARGUMENT, as a whole",
    )
    replicas: int = documented(
        1,
        "front-end processes (`rlfeed serve`) sharing the gRPC port (SO_REUSEPORT) and the "
        "scheduler actor: ingest and serving use that many interpreters' worth of cores",
    )
    max_held_response_bytes: int = documented(
        256 * 2**20,
        "bytes of stored steps' responses a front-end keeps in its own memory, served from "
        "there; beyond it the oldest still held move to the Ray object store (a few large "
        "moves down to 3/4 of it). Where they are, steps not yet fetched by every rank count "
        "towards [rollouts] max_buffered_bytes; retained_steps fetched ones come on top",
    )
    retained_free_mib: int = documented(
        1024,
        "MiB of free memory a heap of the front-end's process may hold at its top before "
        "glibc hands it back to the kernel (process-wide; buffers up to 32 MiB then come "
        "from the heap, and all threads share one heap): the same large buffers are "
        "allocated every step, and each fresh page costs a fault; at most "
        f"{_MAX_RETAINED_MIB}; 0 = glibc's defaults",
    )

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "port", f"must be in [0, 65535], got {self.port}")
        _require(self.replicas >= 1, "replicas", "must be >= 1")
        _require(0 <= self.metrics_port < 65536, "metrics_port", "must be in [0, 65535]")
        _require(bool(self.metrics_host), "metrics_host", "must not be empty")
        _require(self.max_message_bytes >= 1 << 20, "max_message_bytes", ">= 1 MiB")
        _require(self.max_wait_seconds >= 0, "max_wait_seconds", "must be >= 0")
        _require(self.max_held_response_bytes >= 0, "max_held_response_bytes", "must be >= 0")
        _require(
            0 <= self.retained_free_mib <= _MAX_RETAINED_MIB,
            "retained_free_mib",
            f"must be in [0, {_MAX_RETAINED_MIB}]",
        )
        self._check_limits()

    def _check_limits(self) -> None:
        for name in ("max_streams", "max_long_polls", "max_unary_calls", "max_ids_per_call"):
            _require(getattr(self, name) >= 1, name, "must be >= 1")
        _require(self.max_id_bytes >= 16, "max_id_bytes", "must be >= 16")
        _require(self.max_tasks >= 1, "max_tasks", "must be >= 1")
        _require(self.max_calls_per_client >= 0, "max_calls_per_client", "must be >= 0")
        threaded = self.max_streams + self.max_unary_calls
        _require(
            self.max_workers >= threaded + RESERVED_WORKERS,
            "max_workers",
            f"must be >= max_streams + max_unary_calls + {RESERVED_WORKERS} "
            f"= {threaded + RESERVED_WORKERS} (threads for GetStatus and health), got "
            f"{self.max_workers}",
        )
        in_flight = threaded + self.max_long_polls + RESERVED_WORKERS
        _require(
            self.max_pending_calls >= max(in_flight, self.max_workers),
            "max_pending_calls",
            f"must be >= max_streams + max_long_polls + max_unary_calls + {RESERVED_WORKERS} "
            f"= {in_flight} and >= max_workers ({self.max_workers})",
        )
        for name in (
            "request_idle_timeout_s",
            "keepalive_time_s",
            "max_connection_idle_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
        ):
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.keepalive_timeout_s > 0, "keepalive_timeout_s", "must be > 0")
        _require(self.handshake_timeout_s > 0, "handshake_timeout_s", "must be > 0")

    def grpc_options(self) -> list[tuple[str, int]]:
        """The public server's channel arguments for these limits (sizes, keepalive,
        idle and aged connections, handshakes)."""
        ms = lambda seconds: int(seconds * 1000)  # noqa: E731
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
        ]
        if self.keepalive_time_s:
            options += [
                ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
                ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
                # Keep pinging through a long poll (no data for up to max_wait_seconds).
                ("grpc.http2.max_pings_without_data", 0),
            ]
        if self.max_connection_idle_s:
            options.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)))
        if self.max_connection_age_s:
            options += [
                ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
                ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
            ]
        return options

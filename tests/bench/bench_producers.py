"""512 concurrent producers against `rlfeed serve` with 1, 2 and 4 front-ends.

Run:  .venv/bin/python tests/bench/bench_producers.py [--frontends 1,2,4] [--seconds 20]
      [--producers 512] [--processes 4] [--mode actors|replicas]
      [--serve-args "--ray-address auto"]
Cost: about 100 s on 2 cores (per front-end count: Ray and the sidecar start in ~5-15 s,
a few seconds of warm-up, the 20 s window, the stop).

Per front-end count, a fresh `rlfeed serve --frontends N` on a free loopback port (N
front-end Ray actors on this one node sharing the port with SO_REUSEPORT, one scheduler
actor; `--mode replicas`: `--replicas N`, processes forked by `rlfeed serve`).
`--processes` producer processes run `--producers` producers in all (asyncio, one gRPC
channel and connection each, so the kernel spreads them over the front-ends), each
submitting whole groups (8
rollouts of 64-256 tokens, 1/4 prompt; ~12 KB of Arrow IPC) with the unary
`SubmitRolloutBatch`, one batch in flight, the next as soon as the ack comes. Each producer
sends one batch untimed first (connections up, code warm); then every ack that comes back
in the `--seconds` window counts: accepted rollouts per second (all producers) and ack
latency percentiles (client-side, request sent to ack received). Then the CPU seconds each
kind of process used in the window (`e2e_processes.report_cpu`, as `bench_e2e_throughput.py`
reports it).

No trainer runs: steps never form (`prompts_per_step` x `group_size` is 2M rollouts, more
than a window takes), and `max_buffered_rollouts` and `max_buffered_bytes` hold every
rollout of the window, so the sidecar never refuses or expires for want of room. This
measures ingest alone (gRPC, decode, validation, the actor's bookkeeping, the ack), not
assembly or serving. `[server]` admits all 512 calls at once (`max_unary_calls` 640 per
front-end, no per-client cap: every producer comes from 127.0.0.1); a refusal would be
counted and printed.

These machines have 2 cores, shared by the producers, the front-ends and the actor: more
front-ends cannot add cores, so expect little gain, or a loss (more interpreters, the
same actor). On a bigger host the front-ends' decoding spreads over cores and the one
scheduler actor is what bounds ingest (see `bench_scheduler_scale.py`).

Seen on the shared 2-core dev machine (one run, defaults; other agents' tests running):

    front-ends  rollouts/s   acks/s   p50 ms   p99 ms rate / first p99 / first
             1       5,390      674    715.5   1110.3         1.00        1.00
             2       6,670      834    552.6   1293.2         1.24        1.16
             4       7,374      922    505.8   1409.5         1.37        1.27

Both cores are busy in every case (~34-41 CPU-s per 20 s window, other agents included).
With one front-end, its process used 16.6 CPU-s of the 20 s window: one interpreter
(decode, validation, gRPC) is the bottleneck, and the gain from more front-ends is that
work spreading over the second core, not new cores. The actor used 5.2-5.4 CPU-s per
window in every case, 0.29-0.40 ms per acknowledged 8-rollout batch: per call, not per
rollout, so larger batches amortize it. Latency is queueing: 512 producers with one batch
each in flight at ~700-900 acks/s wait ~0.5-0.7 s (Little's law), not slow handling.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from e2e_processes import cpu_snapshot, reap, report_cpu
from rlfeed.service.learning.processes import free_port

GROUP_SIZE = 8
LENGTHS = (64, 256)  # tokens per rollout, uniform in [64, 256]
TASKS = 512
START_TIMEOUT_S = 180.0  # Ray + sidecar start on a busy 2-core machine
CALL_TIMEOUT_S = 30.0


def serve_args(frontends: int, mode: str) -> list[str]:
    """The `rlfeed serve` flags that give `frontends` front-ends: Ray actors (`actors`,
    all on this one node, sharing the port with SO_REUSEPORT) or processes forked by
    `rlfeed serve` (`replicas`, the same sharing)."""
    return ["--frontends" if mode == "actors" else "--replicas", str(frontends)]


def config_text() -> str:
    """A config whose buffer holds every rollout a window takes and never assembles a step.
    Front-end actors reserve no CPU: the embedded Ray has as many CPUs as cores, and four
    front-ends must fit on this one node."""
    rollouts = 250_000 * GROUP_SIZE  # 2M: more than any window here takes
    return f"""
[frontends]
num_cpus = 0
[server]
max_workers = 800
max_unary_calls = 640
max_calls_per_client = 0
max_pending_calls = 8192

[rollouts]
prompts_per_step = {rollouts // GROUP_SIZE}
group_size = {GROUP_SIZE}
max_buffered_rollouts = {rollouts}
max_buffered_bytes = {8 * 2**30}
"""


class Sidecar:
    """`rlfeed serve` as a subprocess; its output is drained by a thread (and kept for an
    error message), so a full pipe never blocks it."""

    def __init__(self, frontends: int, mode: str, config: Path, extra: list[str]) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "rlfeed", "serve", "--port", str(self.port)]
        command += ["--config", str(config), *serve_args(frontends, mode), *extra]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                line = None
            if line is not None and "listening on" in line:
                print(f"  {line.strip()}")
                return
            if line is None and (self.process.poll() is not None or time.monotonic() > deadline):
                self.stop()
                raise RuntimeError(f"rlfeed serve did not start:\n{''.join(self.tail[-30:])}")

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.tail = [*self.tail[-199:], line]
            self.lines.put(line)
        self.lines.put(None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def register_tasks(address: str) -> None:
    import grpc
    from rlfeed.proto import rlfeed_pb2 as pb
    from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TaskSamplingStub(channel)
        stub.RegisterTasks(
            pb.RegisterTasksRequest(task_ids=[f"task-{i}" for i in range(TASKS)]), timeout=30
        )


# -- producer processes -------------------------------------------------------------------


@dataclass
class ProducerStats:
    """What one producer process saw in the window."""

    accepted: int = 0
    acks: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, one per ack
    errors: dict[str, int] = field(default_factory=dict)  # gRPC status -> count


def rollout_pool(rng: np.random.Generator, size: int = 64) -> list[tuple[np.ndarray, ...]]:
    """Token arrays to draw rollouts from (generation is not what is measured)."""
    pool = []
    for _ in range(size):
        length = int(rng.integers(LENGTHS[0], LENGTHS[1] + 1))
        mask = (np.arange(length) >= length // 4).astype(np.uint8)
        tokens = rng.integers(0, 32000, length, dtype=np.int32)
        pool.append((tokens, mask, np.where(mask > 0, -0.5, 0.0).astype(np.float32)))
    return pool


def group_payload(name: str, task: str, pool: list, rng: np.random.Generator) -> bytes:
    """One whole group of GROUP_SIZE rollouts as an Arrow IPC stream."""
    from rlfeed.client.arrow_codec import RolloutColumns, encode_rollouts

    columns = RolloutColumns.empty()
    for k, index in enumerate(rng.integers(0, len(pool), GROUP_SIZE).tolist()):
        tokens, mask, logprobs = pool[index]
        columns.append(
            rollout_id=f"{name}/{k}",
            task_id=task,
            group_id=name,
            policy_version=0,
            reward=float(k % 2),
            token_ids=tokens,
            action_mask=mask,
            sampler_logprobs=logprobs,
        )
    return encode_rollouts(columns)


async def submit_loop(stub, producer: int, end: float, stats: ProducerStats) -> None:
    """One producer: a group, its ack, the next group, until `end` (perf_counter)."""
    import grpc
    from rlfeed.proto import rlfeed_pb2 as pb

    rng = np.random.default_rng(producer)
    pool = rollout_pool(rng)
    task = f"task-{producer % TASKS}"
    sequence = 0
    while time.perf_counter() < end:
        payload = group_payload(f"p{producer}-{sequence}", task, pool, rng)
        request = pb.RolloutBatch(arrow_ipc=payload, sequence=sequence)
        sequence += 1
        started = time.perf_counter()
        try:
            ack = await stub.SubmitRolloutBatch(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            name = error.code().name
            stats.errors[name] = stats.errors.get(name, 0) + 1
            await asyncio.sleep(0.05)
            continue
        done = time.perf_counter()
        if done <= end:  # an ack after the window is not counted
            stats.accepted += ack.accepted
            stats.acks += 1
            stats.latencies.append(done - started)


async def run_producers(address: str, producers: range, seconds: float, ready, go) -> ProducerStats:
    import grpc
    from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc

    # A channel of its own per producer, on a connection of its own (no shared
    # subchannel), as separate inference servers have: the kernel picks a front-end per
    # connection.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in producers]
    try:
        stubs = [pb_grpc.RolloutIngestStub(channel) for channel in channels]
        await asyncio.gather(*(warm_up(stub, p) for stub, p in zip(stubs, producers, strict=True)))
        ready.put(os.getpid())
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        end = time.perf_counter() + seconds
        stats = ProducerStats()
        await asyncio.gather(
            *(submit_loop(stub, p, end, stats) for stub, p in zip(stubs, producers, strict=True))
        )
        return stats
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def warm_up(stub, producer: int) -> None:
    """One untimed group (other ids than the window's): connection up, code warm."""
    from rlfeed.proto import rlfeed_pb2 as pb

    rng = np.random.default_rng([producer, 1])
    payload = group_payload(
        f"warm-p{producer}", f"task-{producer % TASKS}", rollout_pool(rng, 4), rng
    )
    await stub.SubmitRolloutBatch(pb.RolloutBatch(arrow_ipc=payload), timeout=CALL_TIMEOUT_S)


def producer_main(address: str, producers: range, seconds: float, ready, go, results) -> None:
    stats = asyncio.run(run_producers(address, producers, seconds, ready, go))
    results.put(stats)


# -- one case per front-end count ---------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    frontends: int
    rollouts_per_s: float
    acks_per_s: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]


def run_case(frontends: int, args: argparse.Namespace, config: Path) -> CaseResult:
    print(f"\n{frontends} front-end(s): {args.producers} producers in {args.processes} processes")
    sidecar = Sidecar(frontends, args.mode, config, shlex.split(args.serve_args))
    context = mp.get_context("spawn")
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    shares = np.array_split(np.arange(args.producers), args.processes)
    processes = [
        context.Process(
            target=producer_main,
            args=(sidecar.address, range(s[0], s[-1] + 1), args.seconds, ready, go, results),
        )
        for s in shares
    ]
    try:
        register_tasks(sidecar.address)
        for process in processes:
            process.start()
        for _ in processes:
            ready.get(timeout=START_TIMEOUT_S)
        serve = "front-end 0 (rlfeed serve)" if args.mode == "replicas" else "rlfeed serve (driver)"
        roles = {sidecar.process.pid: serve}
        roles.update({p.pid: "producer process" for p in processes})
        before = cpu_snapshot()
        go.set()
        stats = [results.get(timeout=args.seconds + 2 * CALL_TIMEOUT_S) for _ in processes]
        report_cpu(before, cpu_snapshot(), args.seconds, roles)
    finally:
        go.set()
        reap(processes)
        sidecar.stop()
    latencies = np.concatenate([np.asarray(s.latencies) for s in stats]) * 1e3
    errors: dict[str, int] = {}
    for s in stats:
        for name, count in s.errors.items():
            errors[name] = errors.get(name, 0) + count
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies.size else (np.nan, np.nan)
    return CaseResult(
        frontends=frontends,
        rollouts_per_s=sum(s.accepted for s in stats) / args.seconds,
        acks_per_s=sum(s.acks for s in stats) / args.seconds,
        p50_ms=float(p50),
        p99_ms=float(p99),
        errors=errors,
    )


def print_table(results: list[CaseResult]) -> None:
    base = results[0]
    print(
        f"\n{'front-ends':>10} {'rollouts/s':>11} {'acks/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'rate / first':>12} {'p99 / first':>11}  errors"
    )
    for r in results:
        print(
            f"{r.frontends:>10} {r.rollouts_per_s:>11,.0f} {r.acks_per_s:>8,.0f} "
            f"{r.p50_ms:>8.1f} {r.p99_ms:>8.1f} {r.rollouts_per_s / base.rollouts_per_s:>12.2f} "
            f"{r.p99_ms / base.p99_ms:>11.2f}  {r.errors or '-'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frontends", default="1,2,4", help="front-end counts (default 1,2,4)")
    parser.add_argument("--seconds", type=float, default=20.0, help="window per case (20)")
    parser.add_argument("--producers", type=int, default=512, help="producers in all (512)")
    parser.add_argument("--processes", type=int, default=4, help="producer processes (4)")
    parser.add_argument(
        "--mode",
        choices=("actors", "replicas"),
        default="actors",
        help="front-ends as Ray actors (--frontends N, default) or forked processes",
    )
    parser.add_argument(
        "--serve-args", default="", help="extra `rlfeed serve` arguments, one shell string"
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.frontends.split(",")]
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "rlfeed.toml"
        config.write_text(config_text())
        for frontends in counts:
            results.append(run_case(frontends, args, config))
    print_table(results)
    print(f"{os.cpu_count()} cores; wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

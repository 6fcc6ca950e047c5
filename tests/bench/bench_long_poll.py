"""Hundreds of trainer ranks long-polling one step: latency to the last rank, and what each
waiting call costs the front-end.

Run:  .venv/bin/python tests/bench/bench_long_poll.py [--ranks 256] [--clients 4]
      [--hold 2.0] [--max-workers 128]
Cost: about 15-20 s on 2 cores (Ray start-up included).

What runs, on loopback: `start_server` in this process (embedded Ray; world_size = --ranks,
steps of --ranks rollouts of 64 tokens, token budget 1024, so every rank gets bytes; caps
raised so the ranks fit: `max_long_polls` = ranks + 8, `max_calls_per_client` = 0, since
every client is 127.0.0.1). --clients processes each open one asyncio gRPC channel and
issue their share of the ranks' GetBatch(step 0, timeout 60 s) calls at once. Once the
front-end counts every call in flight, the calls are held --hold seconds (the front-end's
threads, RSS and CPU seconds sampled), then a producer (a `RolloutWriter` in this process)
sends step 0's rollouts.

Ready = the front-end's `on_step` hook for step 0 (time.monotonic(), a clock all processes
of the machine share): the step is materialized and its bytes enter the front-end's memory
right after it. Each rank's latency = its receipt of the response (in its client process)
minus ready. Reported: p50 / p99 / max over the ranks, and the front-end process's threads
and RSS idle (sidecar up, no call) vs with every call waiting, per waiting call; its CPU
use while they wait (the calls re-ask the actor every POLL_SECONDS once a wait times out).

To compare with the threaded server of an earlier commit, run this same file against that
tree (the caps then need threads: `--max-workers` >= ranks + 60), e.g.
  git archive <commit> | tar -x -C /tmp/old  (and a dir with a symlink rlfeed -> /tmp/old)
  PYTHONPATH=<that dir> .venv/bin/python tests/bench/bench_long_poll.py --max-workers 320
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import threading
import time

import numpy as np

TOKENS = 64


def _threads() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads line in /proc/self/status")


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def client_main(address: str, ranks: list[int], out) -> None:
    """One client process: every rank of `ranks` long-polls step 0 on one aio channel."""
    import grpc
    from rlfeed.proto import rlfeed_pb2 as pb

    async def run() -> list[tuple[int, float, int]]:
        async with grpc.aio.insecure_channel(address) as channel:
            get_batch = channel.unary_unary(
                "/rlfeed.v1.BatchServing/GetBatch",
                request_serializer=pb.GetBatchRequest.SerializeToString,
                response_deserializer=None,  # the bytes, as a rank holds them before decoding
            )

            async def poll(rank: int) -> tuple[int, float, int]:
                while True:
                    request = pb.GetBatchRequest(step=0, rank=rank, timeout_ms=60_000)
                    raw = await get_batch(request, timeout=90)
                    received = time.monotonic()
                    if pb.GetBatchResponse.FromString(raw).ready:
                        return rank, received, len(raw)

            await channel.channel_ready()
            out.put(("connected", len(ranks)))
            return await asyncio.gather(*(poll(rank) for rank in ranks))

    out.put(("done", asyncio.run(run())))


def produce_step(address: str, ranks: int) -> None:
    from rlfeed.client.producer import RolloutWriter

    rng = np.random.default_rng(0)
    mask = np.ones(TOKENS, np.uint8)
    mask[: TOKENS // 4] = 0
    with RolloutWriter(address) as writer:
        for g in range(ranks // 8):
            for k in range(8):
                writer.write(
                    rollout_id=f"g{g}/{k}",
                    task_id=f"task-{g % 8}",
                    group_id=f"g{g}",
                    policy_version=0,
                    reward=float(rng.random() < 0.5),
                    token_ids=rng.integers(0, 1000, TOKENS, dtype=np.int32),
                    action_mask=mask,
                    sampler_logprobs=np.where(mask > 0, -0.5, 0.0).astype(np.float32),
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256, help="ranks (a multiple of 8)")
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--hold", type=float, default=2.0, help="seconds all calls wait")
    parser.add_argument("--max-workers", type=int, default=128, help="[server] max_workers")
    args = parser.parse_args()
    if args.ranks % 8:
        parser.error("--ranks: a multiple of 8 (groups of 8)")

    import ray
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.call_guard import CallKind
    from rlfeed.service.frontend.events import ServerEvents
    from rlfeed.service.frontend.server import start_server

    class ReadyTime(ServerEvents):
        def __init__(self) -> None:
            self.ready: dict[int, float] = {}

        def on_step(self, record, *, responses, ready_time) -> None:
            self.ready.setdefault(record.step, time.monotonic())

    ready = ReadyTime()
    config = with_overrides(
        SidecarConfig(),
        server={
            "port": 0,
            "max_workers": args.max_workers,
            "max_long_polls": args.ranks + 8,
            "max_calls_per_client": 0,
            "max_pending_calls": max(2 * args.ranks, 1024, args.max_workers),
        },
        batching={"token_budget": 1024, "world_size": args.ranks},
        rollouts={"prompts_per_step": args.ranks // 8, "group_size": 8},
    )
    started = time.monotonic()
    sidecar = start_server(config, events=ready)
    try:
        from rlfeed.client.producer import RolloutWriter

        with RolloutWriter(sidecar.address) as writer:
            writer.register_tasks([f"task-{t}" for t in range(8)])
        time.sleep(1.0)  # the writer's connection and threads gone
        idle_threads, idle_rss = _threads(), _rss()

        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        shares = [list(range(c, args.ranks, args.clients)) for c in range(args.clients)]
        clients = [ctx.Process(target=client_main, args=(sidecar.address, s, out)) for s in shares]
        for process in clients:
            process.start()
        deadline = time.monotonic() + 60
        while sidecar.guard.limits.in_flight().get(CallKind.LONG_POLL, 0) < args.ranks:
            if time.monotonic() > deadline:
                raise RuntimeError("the ranks' calls did not all arrive within 60 s")
            time.sleep(0.02)
        cpu_before, held_from = _cpu_seconds(), time.monotonic()
        peak_threads, peak_rss = _threads(), _rss()
        while time.monotonic() - held_from < args.hold:
            time.sleep(0.05)
            peak_threads, peak_rss = max(peak_threads, _threads()), max(peak_rss, _rss())
        cpu_waiting = (_cpu_seconds() - cpu_before) / (time.monotonic() - held_from)
        waiting = sidecar.guard.limits.in_flight().get(CallKind.LONG_POLL, 0)

        producer = threading.Thread(target=produce_step, args=(sidecar.address, args.ranks))
        producer.start()
        received: list[tuple[int, float, int]] = []
        done = 0
        while done < args.clients:
            kind, value = out.get(timeout=120)
            if kind == "done":
                received.extend(value)
                done += 1
        producer.join()
        for process in clients:
            process.join(timeout=30)
    finally:
        sidecar.stop()
        if ray.is_initialized():
            ray.shutdown()

    latencies = np.array([when - ready.ready[0] for _, when, _ in received]) * 1000
    sizes = np.array([size for _, _, size in received])
    print(
        f"{args.ranks} ranks long-polling step 0 from {args.clients} client processes "
        f"(max_workers {args.max_workers}); run {time.monotonic() - started:.1f} s"
    )
    print(
        f"  step ready -> rank holds its bytes: p50 {np.percentile(latencies, 50):.1f} ms, "
        f"p99 {np.percentile(latencies, 99):.1f} ms, max {latencies.max():.1f} ms "
        f"(first {latencies.min():.1f} ms; responses {sizes.mean() / 1024:.1f} KiB on average)"
    )
    print(
        f"  front-end process: threads {idle_threads} idle -> {peak_threads} with {waiting} "
        f"calls waiting ({(peak_threads - idle_threads) / args.ranks:.3f} per call); RSS "
        f"{idle_rss / 2**20:.1f} -> {peak_rss / 2**20:.1f} MiB "
        f"({(peak_rss - idle_rss) / args.ranks / 1024:.1f} KiB per call)"
    )
    print(f"  CPU while they wait: {cpu_waiting:.2f} CPU-s per second (front-end process)")


if __name__ == "__main__":
    main()

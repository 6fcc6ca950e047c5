"""What `rlfeed demo` runs: sidecar (unless given an address), fleet thread, trainer processes.

The fleet runs in this process (a thread) and stays at most two steps ahead of the trainers;
the two trainer ranks are separate processes (`python -m rlfeed.service.demo.trainer`) with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as torchrun would set them. Rank 0 prints
one line per step and appends its figures to a JSON-lines file, which the summary reads.
The fleet stops producing once the groups of the last step to train are in, so the sidecar
assembles exactly the steps trained (the summary and the metrics then count the same steps).
Every started thing is stopped on every path (`try/finally`).

The summary prices each trained step with `metric_figures.price_tokens` under the config's
`[accounting]`, the function and assumptions the metrics use: from the sidecar's own step
records when the demo runs it (embedded), else from rank 0's figures (a running sidecar:
positions computed = tokens, which is what the demo trainer's varlen attention computes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rlfeed.service.cli.demo import DEMO_OVERRIDES

# Sampled groups the fleet keeps in flight ahead of the trainers, in steps.
STEPS_AHEAD = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_config(config_path: str | None, metrics_port: int | None = None):
    from rlfeed.service.config import load_config, with_overrides

    config = load_config(config_path)
    if config_path is None:
        config = with_overrides(config, **DEMO_OVERRIDES)
    else:
        # A user's file keeps its values; the demo only needs a free port and two ranks.
        config = with_overrides(config, server={"port": 0}, batching={"world_size": 2})
    if metrics_port is not None:
        config = with_overrides(config, server={"metrics_port": metrics_port})
    return config


def run_demo(
    *,
    address: str | None,
    steps: int,
    config_path: str | None,
    seed: int,
    metrics_port: int | None = None,
) -> int:
    """Start what is missing, train `steps` steps, print the summary; 0 on success.
    `metrics_port` (embedded sidecar only) overrides `[server] metrics_port`."""
    import torch
    from rlfeed.client.producer import RolloutWriter
    from rlfeed.client.transport import GrpcTransport
    from rlfeed.service.demo.fleet import FleetConfig, FleetStats, SyntheticTasks, run_fleet
    from rlfeed.service.demo.trainer import TinyCausalLM, TinyModelConfig, sequence_log_probs

    torch.set_num_threads(1)
    started = time.monotonic()
    config = _load_config(config_path, metrics_port)
    sidecar = exporter = None
    if address is None:
        from rlfeed.service.frontend.server import start_server
        from rlfeed.service.metrics.exporter import SidecarExporter

        print("starting the sidecar on an embedded local Ray ...", flush=True)
        if config.server.metrics_port:
            exporter = SidecarExporter(config)
        sidecar = start_server(config, events=exporter.events if exporter else None)
        address = sidecar.address
    trainers: list[subprocess.Popen] = []
    stop_fleet = threading.Event()
    fleet_thread = None
    transport = None
    workdir = tempfile.TemporaryDirectory(prefix="rlfeed-demo-")
    try:
        if exporter is not None:
            try:
                exporter.start(sidecar.actor)
            except OSError as exc:  # names the address
                print(f"rlfeed demo: {exc}", file=sys.stderr)
                return 1
            print(
                f"metrics: {exporter.url}/metrics, layout picture: {exporter.url}/layout.png",
                flush=True,
            )
        transport = GrpcTransport(address)
        status = transport.status()
        world_size, start_step = int(status.world_size), int(status.next_step)
        print(
            f"sidecar {address}: world_size {world_size}, {status.prompts_per_step} prompts x "
            f"{status.group_size} rollouts per step, token budget {status.token_budget:,}",
            flush=True,
        )
        fleet_config = FleetConfig(
            group_size=int(status.group_size),
            tasks_per_request=int(status.prompts_per_step),
            max_tokens=min(2048, int(status.token_budget)),
            seed=seed,
        )
        tasks = SyntheticTasks(fleet_config)
        sampler = TinyCausalLM(TinyModelConfig(vocab_size=fleet_config.vocab_size, seed=seed))
        writer = RolloutWriter(transport, max_batch_rollouts=int(status.group_size) * 4)
        writer.register_tasks(tasks.task_ids)
        summary_path = Path(workdir.name) / "steps.jsonl"
        trainers = _start_trainers(address, world_size, steps, start_step, seed, summary_path)

        fleet_stats = FleetStats()
        fleet_failed = threading.Event()
        progress = {"version": start_step}

        def ready() -> bool:
            now = transport.status()
            progress["version"] = _trained_steps(now, world_size, start_step)
            coming = now.complete_groups / max(now.prompts_per_step, 1)  # steps' worth
            queued = now.next_step - progress["version"]
            # Nothing for steps nobody trains: a round adds at most one step's groups, so
            # the sidecar assembles exactly start_step + steps steps.
            needed = now.next_step + coming < start_step + steps
            return needed and queued + coming < STEPS_AHEAD

        def fleet() -> None:
            try:
                run_fleet(
                    writer,
                    tasks,
                    stop=stop_fleet,
                    policy_version=lambda: progress["version"],
                    score=lambda ids: sequence_log_probs(sampler, ids),
                    ready=ready,
                    stats=fleet_stats,
                )
            except Exception as exc:  # reported, and the run stops: trainers would starve
                print(f"fleet stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                fleet_failed.set()

        fleet_thread = threading.Thread(target=fleet, name="rlfeed-demo-fleet", daemon=True)
        fleet_thread.start()
        failed = _wait_for(trainers, abort=fleet_failed)
        stop_fleet.set()
        fleet_thread.join()
        writer.close()
        if fleet_failed.is_set():
            print("rlfeed demo: the synthetic fleet failed", file=sys.stderr)
            return 1
        if failed:
            print(f"rlfeed demo: trainer rank(s) {failed} failed", file=sys.stderr)
            return 1
        figures = [json.loads(line) for line in summary_path.read_text().splitlines()]
        records = {}
        if sidecar is not None:
            import ray

            records = {r.step: r for r in ray.get(sidecar.actor.step_records.remote(start_step))}
        _print_summary(
            figures, records, fleet_stats, transport.status(), config, time.monotonic() - started
        )
        return 0 if len(figures) == steps else 1
    finally:
        stop_fleet.set()
        for process in trainers:
            if process.poll() is None:
                process.kill()
            process.wait()
        if fleet_thread is not None:
            fleet_thread.join(timeout=10)
        if transport is not None:
            transport.close()
        try:
            if exporter is not None:
                exporter.stop()
        finally:
            if sidecar is not None:
                sidecar.stop(grace=1.0)
            workdir.cleanup()


def _trained_steps(status, world_size: int, start_step: int) -> int:
    """The step after the last one every rank has reported: the policy version the fleet
    samples with (reports of an earlier run against the same sidecar do not count)."""
    if len(status.last_reports) < world_size:
        return start_step
    return max(start_step, min(int(r.step) for r in status.last_reports) + 1)


def _start_trainers(address, world_size, steps, start_step, seed, summary_path):
    master_port = str(_free_port())
    processes = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=master_port,
            OMP_NUM_THREADS="1",
        )
        command = [
            sys.executable,
            "-m",
            "rlfeed.service.demo.trainer",
            f"--address={address}",
            f"--steps={steps}",
            f"--start-step={start_step}",
            f"--seed={seed}",
            f"--summary-file={summary_path}",
        ]
        # Rank 0's step lines go to our stdout; the others stay quiet unless they fail.
        output = None if rank == 0 else subprocess.DEVNULL
        processes.append(subprocess.Popen(command, env=env, stdout=output))
    return processes


def _wait_for(processes: list[subprocess.Popen], abort: threading.Event) -> list[int]:
    """Wait for every process; if one fails (or `abort` is set), stop the rest. Returns the
    failed ranks."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed or abort.is_set():
            for p in processes:
                if p.poll() is None:
                    p.kill()
            return failed
        if all(code == 0 for code in codes):
            return []
        time.sleep(0.1)


def _step_prices(figures, records, cost):
    """(real tokens, computed positions, padded positions, StepPrice) of every trained step:
    the sidecar's record of it when known (with its compute lockstep efficiency), else rank
    0's figures (priced at full lockstep)."""
    from rlfeed.service.metrics.figures import price_tokens

    steps = []
    for figure in figures:
        record = records.get(figure["step"])
        if record is not None:
            policy, real = record.policy_token_count, record.real_tokens
            computed, padded = record.computed_positions, record.padded_positions
            lockstep = record.compute_lockstep_efficiency
        else:
            policy, real = figure["policy_tokens"], figure["tokens"]
            computed, padded = real, figure["padded_positions"]
            lockstep = 1.0
        price = price_tokens(
            cost,
            policy_tokens=policy,
            real_tokens=real,
            computed_positions=computed,
            padded_positions=padded,
            lockstep_efficiency=lockstep,
        )
        steps.append((real, computed, padded, price))
    return steps


def _print_summary(figures, records, fleet_stats, status, config, seconds: float) -> None:
    from rlfeed.service.metrics.figures import SECONDS_PER_HOUR, share
    from rlfeed.service.metrics.recorder import MetricsConfig

    steps = len(figures)
    tokens = sum(f["tokens"] for f in figures)
    policy_tokens = sum(f["policy_tokens"] for f in figures)
    rollouts = sum(f["rollouts"] for f in figures)
    zero_share = fleet_stats.zero_advantage_groups / max(fleet_stats.groups, 1)
    uniform_share = fleet_stats.expected_uniform_zero_advantage_groups / max(fleet_stats.groups, 1)
    dropped = status.counters.zero_advantage_rollouts_dropped
    cost = MetricsConfig.from_sidecar_config(config).cost
    priced = _step_prices(figures, records, cost)
    real = sum(p[0] for p in priced)
    computed = sum(p[1] for p in priced)
    padded = sum(p[2] for p in priced)
    gpu_hours = sum(p[3].total_gpu_seconds for p in priced) / SECONDS_PER_HOUR / steps
    # The padded alternative trains every padded position: the plan's price plus the padding
    # packing avoided.
    avoided_hours = sum(p[3].padding_avoided_gpu_seconds for p in priced) / SECONDS_PER_HOUR
    padded_hours = gpu_hours + avoided_hours / steps
    lines = {
        "steps": f"{steps}",
        "rollouts trained": f"{rollouts:,}",
        "tokens": f"{tokens:,} ({policy_tokens:,} policy tokens)",
        "padding share": (
            f"{share(computed - real, computed):.1%} packed vs "
            f"{share(padded - real, padded):.1%} padded alternative ({padded:,} positions)"
        ),
        "zero-advantage share": (
            f"{zero_share:.1%} of {fleet_stats.groups} sampled groups; uniform sampling: "
            f"{uniform_share:.1%} expected ({dropped:,} rollouts dropped)"
        ),
        "rollouts saved by the filter": (
            f"{status.counters.rollouts_saved_by_filter:,} (tasks asked for but outside the "
            f"filter); revisits of excluded tasks cost "
            f"{status.counters.revisits_sampled * config.rollouts.group_size:,}"
        ),
        "step-0 ratio outlier share": f"{figures[0]['ratio_outlier_share']:.4f}",
        "final loss": f"{figures[-1]['loss']:+.4f}",
        "predicted GPU-hours per step": (
            f"{gpu_hours:.4g} packed vs {padded_hours:.4g} padded "
            f"({cost.model} on {cost.gpu}, at these steps' token counts)"
        ),
        "wall time": f"{seconds:.1f} s",
    }
    print("\nsummary")
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"  {key:<{width}}  {value}")
    sys.stdout.flush()

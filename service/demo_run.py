"""What `rlfeed demo` runs: sidecar (unless given an address), fleet thread, trainer processes.

The fleet runs in this process (a thread) and stays at most two steps ahead of the trainers;
the two trainer ranks are separate processes (`python -m rlfeed.service.demo_trainer`) with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as torchrun would set them. Rank 0 prints
one line per step and appends its figures to a JSON-lines file, which the summary reads.
Every started thing is stopped on every path (`try/finally`).
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

from rlfeed.service.commands.demo import DEMO_OVERRIDES

# Sampled groups the fleet keeps in flight ahead of the trainers, in steps.
STEPS_AHEAD = 2
# Episode shape of the GPU-hour estimate beyond the measured token counts (rlfeed.sched
# throughput defaults: decode batch 64 at a 16k context, decode GPUs busy half the time).
DECODE_BATCH, DECODE_CONTEXT, BUSY_FRACTION = 64, 16_384, 0.5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_config(config_path: str | None):
    from rlfeed.service.config import load_config, with_overrides

    config = load_config(config_path)
    if config_path is None:
        return with_overrides(config, **DEMO_OVERRIDES)
    # A user's file keeps its values; the demo only needs a free port and two ranks.
    return with_overrides(config, server={"port": 0}, batching={"world_size": 2})


def run_demo(*, address: str | None, steps: int, config_path: str | None, seed: int) -> int:
    """Start what is missing, train `steps` steps, print the summary; 0 on success."""
    import torch
    from rlfeed.client.producer import RolloutWriter
    from rlfeed.client.transport import GrpcTransport
    from rlfeed.service.demo_fleet import FleetConfig, FleetStats, SyntheticTasks, run_fleet
    from rlfeed.service.demo_trainer import TinyCausalLM, TinyModelConfig, sequence_log_probs

    torch.set_num_threads(1)
    started = time.monotonic()
    config = _load_config(config_path)
    sidecar = None
    if address is None:
        from rlfeed.service.server import start_server

        print("starting the sidecar on an embedded local Ray ...", flush=True)
        sidecar = start_server(config)
        address = sidecar.address
    trainers: list[subprocess.Popen] = []
    stop_fleet = threading.Event()
    fleet_thread = None
    transport = GrpcTransport(address)
    workdir = tempfile.TemporaryDirectory(prefix="rlfeed-demo-")
    try:
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
            queued = now.next_step - progress["version"]
            return queued + now.complete_groups / max(now.prompts_per_step, 1) < STEPS_AHEAD

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
        _print_summary(figures, fleet_stats, transport.status(), config, time.monotonic() - started)
        return 0 if len(figures) == steps else 1
    finally:
        stop_fleet.set()
        for process in trainers:
            if process.poll() is None:
                process.kill()
            process.wait()
        if fleet_thread is not None:
            fleet_thread.join(timeout=10)
        transport.close()
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
            "rlfeed.service.demo_trainer",
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


def _print_summary(figures, fleet_stats, status, config, seconds: float) -> None:
    from rlfeed.sched.throughput import GPUS, MODELS, step_cost_from_tokens

    steps = len(figures)
    tokens = sum(f["tokens"] for f in figures)
    policy_tokens = sum(f["policy_tokens"] for f in figures)
    padded = sum(f["padded_positions"] for f in figures)
    rollouts = sum(f["rollouts"] for f in figures)
    zero_share = fleet_stats.zero_advantage_groups / max(fleet_stats.groups, 1)
    uniform_share = fleet_stats.expected_uniform_zero_advantage_groups / max(fleet_stats.groups, 1)
    dropped = status.counters.zero_advantage_rollouts_dropped
    accounting = config.accounting
    arch, gpu = MODELS[accounting.model], GPUS[accounting.gpu]

    def cost(computed: int):
        return step_cost_from_tokens(
            arch,
            gpu,
            policy_tokens=policy_tokens // steps,
            total_tokens=tokens // steps,
            computed_positions=computed // steps,
            decode_batch=DECODE_BATCH,
            decode_context=DECODE_CONTEXT,
            busy_fraction=BUSY_FRACTION,
            mfu=accounting.mfu,
        )

    packed, padded_cost = cost(tokens), cost(max(padded, tokens))
    lines = {
        "steps": f"{steps}",
        "rollouts trained": f"{rollouts:,}",
        "tokens": f"{tokens:,} ({policy_tokens:,} policy tokens)",
        "padding share": (
            f"{0.0:.1%} packed vs {(padded - tokens) / max(padded, 1):.1%} padded alternative "
            f"({padded:,} positions)"
        ),
        "zero-advantage share": (
            f"{zero_share:.1%} of {fleet_stats.groups} sampled groups; uniform sampling: "
            f"{uniform_share:.1%} expected ({dropped:,} rollouts dropped)"
        ),
        "rollouts saved by the filter": (
            f"{status.counters.rollouts_saved_by_filter:,} (vs running every requested task; "
            "negative while revisits cost more)"
        ),
        "step-0 ratio outlier share": f"{figures[0]['ratio_outlier_share']:.4f}",
        "final loss": f"{figures[-1]['loss']:+.4f}",
        "predicted GPU-hours per step": (
            f"{packed.total_gpu_hours:.3g} packed vs {padded_cost.total_gpu_hours:.3g} padded "
            f"({accounting.model} on {accounting.gpu}, at this step's token counts)"
        ),
        "wall time": f"{seconds:.1f} s",
    }
    print("\nsummary")
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"  {key:<{width}}  {value}")
    sys.stdout.flush()

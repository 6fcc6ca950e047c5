"""What `rlfeed demo` runs: sidecar (unless given an address), fleet thread, trainer processes.

The fleet runs here on a thread, at most STEPS_AHEAD steps ahead of the trainers, and stops
once the last trained step's groups are in, so the sidecar assembles exactly the steps
trained; the ranks are `python -m rlfeed.service.demo.trainer` processes with torchrun's
variables. The summary prices each step with `metrics.figures.price_tokens` under
`[accounting]`, as the metrics do. Everything started is stopped on every path.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Sampled groups the fleet keeps in flight ahead of the trainers, in steps.
STEPS_AHEAD = 2
# The demo's sidecar settings where they differ from `rlfeed serve`'s defaults: a token
# budget the tiny model handles on CPU, the fleet's vocabulary, two ranks, and dropping
# zero-advantage groups so every step carries gradient. Defined here, the one module that
# uses them: `cli/demo.py` imports this module lazily, and nothing points back.
DEMO_OVERRIDES = {
    "server": {"port": 0},
    "batching": {"token_budget": 2048, "world_size": 2},
    "rollouts": {"prompts_per_step": 8, "group_size": 8, "vocab_size": 512},
    "advantages": {"drop_zero_advantage": True},
}


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

    torch.set_num_threads(1)
    started = time.monotonic()
    config = _load_config(config_path, metrics_port)
    sidecar = exporter = None
    if address is None:
        sidecar, exporter = _start_embedded_sidecar(config)
        address = sidecar.address
    running = _Running()
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
        return _train(
            running,
            address,
            steps=steps,
            seed=seed,
            workdir=Path(workdir.name),
            sidecar=sidecar,
            config=config,
            started=started,
        )
    finally:
        running.stop()
        try:
            if exporter is not None:
                exporter.stop()
        finally:
            if sidecar is not None:
                sidecar.stop(grace=1.0)
            workdir.cleanup()


def _start_embedded_sidecar(config):
    """(sidecar, exporter or None) on an embedded local Ray; the exporter not yet bound."""
    from rlfeed.service.frontend.server import start_server
    from rlfeed.service.metrics.exporter import SidecarExporter

    print("starting the sidecar on an embedded local Ray ...", flush=True)
    exporter = SidecarExporter(config) if config.server.metrics_port else None
    sidecar = start_server(config, events=exporter.events if exporter else None)
    return sidecar, exporter


@dataclass
class _Running:
    """What the demo started beside the sidecar, stopped on every path by `stop`."""

    stop_fleet: threading.Event = field(default_factory=threading.Event)
    trainers: list[subprocess.Popen] = field(default_factory=list)
    fleet_thread: threading.Thread | None = None
    transport: Any = None

    def stop(self) -> None:
        self.stop_fleet.set()
        for process in self.trainers:
            if process.poll() is None:
                process.kill()
            process.wait()
        if self.fleet_thread is not None:
            self.fleet_thread.join(timeout=10)
        if self.transport is not None:
            self.transport.close()


def _train(
    running: _Running, address: str, *, steps, seed, workdir: Path, sidecar, config, started
) -> int:
    """Fleet and trainers against the sidecar at `address` until `steps` steps are trained,
    then the summary; the exit status (a failure's reason on stderr)."""
    from rlfeed.client.transport import GrpcTransport

    running.transport = transport = GrpcTransport(address)
    status = transport.status()
    world_size, start_step = int(status.world_size), int(status.next_step)
    print(
        f"sidecar {address}: world_size {world_size}, {status.prompts_per_step} prompts x "
        f"{status.group_size} rollouts per step, token budget {status.token_budget:,}",
        flush=True,
    )
    fleet = _DemoFleet(transport, status, seed=seed, end_step=start_step + steps)
    summary_path = workdir / "steps.jsonl"
    running.trainers = _start_trainers(address, world_size, steps, start_step, seed, summary_path)
    running.fleet_thread = threading.Thread(
        target=fleet.run, args=(running.stop_fleet,), name="rlfeed-demo-fleet", daemon=True
    )
    running.fleet_thread.start()
    failed = _wait_for(running.trainers, abort=fleet.failed)
    running.stop_fleet.set()
    running.fleet_thread.join()
    fleet.writer.close()
    if fleet.failed.is_set():
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
    seconds = time.monotonic() - started
    _print_summary(figures, records, fleet.stats, transport.status(), config, seconds)
    return 0 if len(figures) == steps else 1


class _DemoFleet:
    """The synthetic fleet, run on a thread: it samples tasks and submits their groups with
    a `RolloutWriter`, at most STEPS_AHEAD steps ahead of the trainers."""

    def __init__(self, transport, status, *, seed: int, end_step: int) -> None:
        from rlfeed.client.producer import RolloutWriter
        from rlfeed.client.retry import RetryPolicy
        from rlfeed.client.transport import address_of
        from rlfeed.service.demo.fleet import FleetConfig, FleetStats, SyntheticTasks
        from rlfeed.service.demo.trainer import TinyCausalLM, TinyModelConfig

        config = FleetConfig(
            group_size=int(status.group_size),
            tasks_per_request=int(status.prompts_per_step),
            max_tokens=min(2048, int(status.token_budget)),
            seed=seed,
        )
        self.transport = transport
        self.world_size = int(status.world_size)
        self.start_step, self.end_step = int(status.next_step), end_step
        self.version = self.start_step  # the policy version the fleet samples with
        self.tasks = SyntheticTasks(config)
        self.sampler = TinyCausalLM(TinyModelConfig(vocab_size=config.vocab_size, seed=seed))
        self.writer = RolloutWriter(transport, max_batch_rollouts=int(status.group_size) * 4)
        self.writer.register_tasks(self.tasks.task_ids)
        # Status is asked as the writer asks: through a sidecar restart, under one policy.
        self.retry = RetryPolicy(address_of(transport))
        self.retry.answered = True  # `status` was: an outage now is a restart
        self.stats = FleetStats()
        self.failed = threading.Event()

    def ready(self) -> bool:
        now = self.retry.call(self.transport.status)
        self.version = _trained_steps(now, self.world_size, self.start_step)
        coming = now.complete_groups / max(now.prompts_per_step, 1)  # steps' worth
        queued = now.next_step - self.version
        # Nothing for steps nobody trains: a round adds at most one step's groups, so
        # the sidecar assembles exactly start_step + steps steps.
        needed = now.next_step + coming < self.end_step
        return needed and queued + coming < STEPS_AHEAD

    def run(self, stop: threading.Event) -> None:
        from rlfeed.service.demo.fleet import run_fleet
        from rlfeed.service.demo.trainer import sequence_log_probs

        try:
            run_fleet(
                self.writer,
                self.tasks,
                stop=stop,
                policy_version=lambda: self.version,
                score=lambda ids: sequence_log_probs(self.sampler, ids),
                ready=self.ready,
                stats=self.stats,
            )
        except Exception as exc:  # reported, and the run stops: trainers would starve
            print(f"fleet stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.failed.set()


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
        # A session of their own: a terminal's Ctrl-C reaches only `rlfeed demo`, which
        # stops them (no traceback from each rank); `_Running.stop` kills them on every path.
        processes.append(subprocess.Popen(command, env=env, stdout=output, start_new_session=True))
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


def _step_prices(figures, records, accounting):
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
            accounting,
            policy_tokens=policy,
            real_tokens=real,
            computed_positions=computed,
            padded_positions=padded,
            lockstep_efficiency=lockstep,
        )
        steps.append((real, computed, padded, price))
    return steps


def _print_summary(figures, records, fleet_stats, status, config, seconds: float) -> None:
    from rlfeed.sched.assembly import share
    from rlfeed.service.metrics.figures import SECONDS_PER_HOUR

    steps = len(figures)
    tokens = sum(f["tokens"] for f in figures)
    policy_tokens = sum(f["policy_tokens"] for f in figures)
    rollouts = sum(f["rollouts"] for f in figures)
    zero_share = fleet_stats.zero_advantage_groups / max(fleet_stats.groups, 1)
    uniform_share = fleet_stats.expected_uniform_zero_advantage_groups / max(fleet_stats.groups, 1)
    dropped = status.counters.zero_advantage_rollouts_dropped
    accounting = config.accounting
    priced = _step_prices(figures, records, accounting)
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
            f"({accounting.model} on {accounting.gpu}, at these steps' token counts)"
        ),
        "wall time": f"{seconds:.1f} s",
    }
    print("\nsummary")
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"  {key:<{width}}  {value}")
    sys.stdout.flush()

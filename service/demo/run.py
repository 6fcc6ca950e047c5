"""What `rlfeed demo` runs: a sidecar (unless given an address), then one of two workloads.

- By default a real policy learns through the sidecar (`demo/learn.py`): producer
  processes sample a Hugging Face model, trainer ranks train it on the served steps.
- `--synthetic`, and always with `--address`: the synthetic fleet (`demo/fleet.py`) on a
  thread here, load generation with fake learning, at most STEPS_AHEAD steps ahead of the
  trainers; it stops once the last trained step's groups are in, so the sidecar assembles
  exactly the steps trained. Its ranks are `python -m rlfeed.service.demo.trainer`
  processes with torchrun's variables.

The summary (`demo/summary.py`) prices each step under `[accounting]`, as the metrics do.
Everything started is stopped on every path.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from rlfeed.service.learning.pacing import should_sample, trained_steps
from rlfeed.service.learning.processes import Running, start_ranks, wait_for

# Sampled groups the fleet keeps in flight ahead of the trainers, in steps.
STEPS_AHEAD = 2
# The synthetic demo's sidecar settings where they differ from `rlfeed serve`'s defaults:
# a token budget the tiny model handles on CPU, the fleet's vocabulary, two ranks, and
# dropping zero-advantage groups so every step carries gradient. Defined here, the one
# module that uses them: `cli/demo.py` imports this module lazily, and nothing points back.
DEMO_OVERRIDES = {
    "server": {"port": 0},
    "batching": {"token_budget": 2048, "world_size": 2},
    "rollouts": {"prompts_per_step": 8, "group_size": 8, "vocab_size": 512},
    "advantages": {"drop_zero_advantage": True},
}


def _load_config(config_path: str | None, metrics_port: int | None, overrides: dict):
    from rlfeed.service.config import load_config, with_overrides

    config = load_config(config_path)
    if config_path is None:
        config = with_overrides(config, **overrides)
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
    synthetic: bool = False,
    train_tasks: int | None = None,
    summary_json: str | None = None,
) -> int:
    """Start what is missing, train `steps` steps, print the summary; 0 on success.
    `metrics_port` (embedded sidecar only) overrides `[server] metrics_port`. The policy
    learns unless `synthetic` or an `address` is given; `train_tasks` sizes its training
    split; `summary_json` is where the summary and per-step figures go as JSON."""
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    synthetic = synthetic or address is not None
    if synthetic:
        overrides = DEMO_OVERRIDES
    else:
        from rlfeed.service.demo import learn

        overrides = learn.LEARNING_OVERRIDES
    config = _load_config(config_path, metrics_port, overrides)
    sidecar = exporter = None
    if address is None:
        sidecar, exporter = _start_embedded_sidecar(config)
        address = sidecar.address
    running = Running()
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
        options = dict(
            steps=steps,
            seed=seed,
            workdir=Path(workdir.name),
            sidecar=sidecar,
            config=config,
            started=started,
            summary_json=summary_json,
        )
        if synthetic:
            return _train(running, address, **options)
        return learn.train_policy(running, address, train_tasks=train_tasks, **options)
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


def _train(
    running: Running,
    address: str,
    *,
    steps,
    seed,
    workdir: Path,
    sidecar,
    config,
    started,
    summary_json: str | None,
) -> int:
    """Synthetic fleet and trainers against the sidecar at `address` until `steps` steps
    are trained, then the summary; the exit status (a failure's reason on stderr)."""
    from rlfeed.client.transport import GrpcTransport
    from rlfeed.service.demo.summary import print_summary, summary_lines, write_summary_json

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
    trainer_args = [
        f"--address={address}",
        f"--steps={steps}",
        f"--start-step={start_step}",
        f"--seed={seed}",
        f"--summary-file={summary_path}",
    ]
    running.processes = start_ranks("rlfeed.service.demo.trainer", trainer_args, world_size)
    running.fleet_thread = threading.Thread(
        target=fleet.run, args=(running.stop_fleet,), name="rlfeed-demo-fleet", daemon=True
    )
    running.fleet_thread.start()
    failed = wait_for(running.processes, abort=fleet.failed)
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
    stats, now = fleet.stats, transport.status()
    groups = max(stats.groups, 1)
    zero_line = (
        f"{stats.zero_advantage_groups / groups:.1%} of {stats.groups} sampled groups; "
        f"uniform sampling: {stats.expected_uniform_zero_advantage_groups / groups:.1%} "
        f"expected ({now.counters.zero_advantage_rollouts_dropped:,} rollouts dropped)"
    )
    lines = summary_lines(figures, records, now, config, seconds, zero_advantage=zero_line)
    print_summary(lines)
    if summary_json is not None:
        per_step = [
            {
                "step": f["step"],
                "rollouts_trained": f["rollouts"],
                "mean_reward": None,  # the synthetic fleet's rewards teach nothing
                "held_out_pass_rate": None,
                "zero_advantage_share": None,
                "episodes_sampled": None,
                "loss": f["loss"],
            }
            for f in figures
        ]
        write_summary_json(summary_json, lines, per_step, fleet="synthetic", wall_time_s=seconds)
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
        # A round adds at most one step's groups, so the sidecar assembles exactly
        # start_step + steps steps.
        now = self.retry.call(self.transport.status)
        self.version = trained_steps(now, self.start_step)
        return should_sample(
            now, start_step=self.start_step, end_step=self.end_step, steps_ahead=STEPS_AHEAD
        )

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

"""`rlfeed demo`'s default workload: a Hugging Face policy learning through the sidecar.

Set-up: the gym's splits, the warm-started policy (cached per config and seed under
$RLFEED_CACHE_DIR or ~/.cache/rlfeed), published as version `start_step` into the run
directory. Then two trainer ranks (`rlfeed.service.learning.trainer`, DDP over gloo) and
`PRODUCERS` producer processes (`rlfeed.service.learning.producer`) run against the
sidecar; this process prints each step as rank 0 records it (rewards joined from the
producers' logs), stops the producers once the ranks are done (SIGTERM: they flush and
exit), and prints the summary with the learning line and the time split.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rlfeed.service.gym.tasks import VOCAB_SIZE
from rlfeed.service.learning.launch import prepare, run_workers
from rlfeed.service.learning.processes import Running

PRODUCERS = 2
DEFAULT_TRAIN_TASKS = 200
DEFAULT_STEPS = 60
# The learning demo's sidecar settings where they differ from `rlfeed serve`'s defaults:
# two ranks, the gym's vocabulary, 16 groups of 8 per step (more groups per step is a
# smoother gradient for the tiny model; 64 tokens of 8 x 16 rollouts stay far under the
# token budget), and zero-advantage groups kept so that each step's mean reward is the
# policy's, not that of the mixed groups only (the curriculum still filters tasks).
LEARNING_OVERRIDES = {
    "server": {"port": 0},
    "batching": {"token_budget": 4096, "world_size": 2},
    "rollouts": {"prompts_per_step": 32, "group_size": 8, "vocab_size": VOCAB_SIZE},
    "advantages": {"drop_zero_advantage": False},
}


def train_policy(
    running: Running,
    address: str,
    *,
    steps: int,
    seed: int,
    workdir: Path,
    sidecar,
    config,
    started: float,
    summary_json: str | None,
    train_tasks: int | None = None,
    cache_dir: Path | None = None,
) -> int:
    """Train the policy `steps` steps through the sidecar at `address`, print each step and
    the summary; the exit status (a failure's reason on stderr)."""
    from rlfeed.client.transport import GrpcTransport
    from rlfeed.service.learning.policy import PolicyConfig
    from rlfeed.service.learning.run_spec import RunSpec

    running.transport = transport = GrpcTransport(address)
    status = transport.status()
    spec = RunSpec(
        address=address,
        start_step=int(status.next_step),
        steps=steps,
        train_tasks=train_tasks or DEFAULT_TRAIN_TASKS,
        seed=seed,
        group_size=int(status.group_size),
        tasks_per_round=max(1, int(status.prompts_per_step) // PRODUCERS),
        producers=PRODUCERS,
        policy=PolicyConfig(seed=seed),  # initial weights and warm start, cached per seed
    )
    print(
        f"sidecar {address}: world_size {status.world_size}, {status.prompts_per_step} "
        f"prompts x {status.group_size} rollouts per step; {spec.train_tasks} training tasks, "
        f"{PRODUCERS} producers",
        flush=True,
    )
    prepare(spec, workdir, cache_dir)
    print(f"set-up done in {time.monotonic() - started:.1f} s", flush=True)
    progress = _Progress(workdir, spec)
    failure = run_workers(running, spec, workdir, int(status.world_size), tick=progress.show)
    if failure is not None:
        print(f"rlfeed demo: {failure}", file=sys.stderr)
        return 1
    progress.show()
    return _finish(spec, workdir, sidecar, config, transport.status(), started, summary_json)


class _Progress:
    """Prints each step once rank 0 recorded it, and the evaluation before the first."""

    def __init__(self, run_dir: Path, spec) -> None:
        from rlfeed.service.learning.run_records import RunRecords

        self.spec = spec
        self.records = RunRecords.load(run_dir, spec.producers)
        self.printed = 0
        self.before_shown = False

    def show(self) -> None:
        records = self.records
        records.update()  # only what was logged since the last tick
        before = records.evals.get(self.spec.start_step)
        if before is not None and not self.before_shown:
            self.before_shown = True
            print(f"held-out pass rate before training: {_rates(before['held_out'])}")
        for index in range(self.printed, len(records.steps)):
            record = records.steps[index]
            figures = records.step_figures(record, records.steps[index - 1] if index else None)
            line = (
                f"step {figures['step']:>3}  reward {figures['mean_reward']:.3f}  "
                f"rollouts {figures['rollouts_trained']:>4}  "
                f"zero-advantage {figures['zero_advantage_share']:.2f}  "
                f"loss {figures['loss']:+.4f}"
            )
            if figures["held_out_pass_rate"] is not None:
                line += f"  held-out pass rate {figures['held_out_pass_rate']:.3f}"
            print(line, flush=True)
        self.printed = len(records.steps)


def _rates(rates: dict) -> str:
    families = ", ".join(f"{k} {v:.2f}" for k, v in rates.items() if k != "all")
    return f"{rates['all']:.3f} ({families})"


def _finish(spec, run_dir, sidecar, config, status, started, summary_json) -> int:
    from rlfeed.service.demo.summary import print_summary, summary_lines, write_summary_json
    from rlfeed.service.learning.run_records import RunRecords, mean_of

    records = RunRecords.load(run_dir, spec.producers)
    sidecar_records = {}
    if sidecar is not None:
        import ray

        sidecar_records = {
            r.step: r for r in ray.get(sidecar.actor.step_records.remote(spec.start_step))
        }
    per_step = records.all_step_figures()
    groups, zero = records.sampled_groups()
    before = records.evals[spec.start_step]["held_out"]
    after = records.evals[spec.end_step]["held_out"]
    diffs = [f["max_abs_logprob_diff"] for f in per_step if f["max_abs_logprob_diff"] is not None]
    split = {key: mean_of(f[key] for f in per_step) for key in _SPLIT}
    rewards = [f["mean_reward"] for f in per_step]
    window = max(1, min(5, len(rewards) // 2))
    extra = {
        "training reward": (
            f"{mean_of(rewards[:window]):.3f} -> {mean_of(rewards[-window:]):.3f} (mean of the "
            f"first and last {window} steps' rollouts)"
        ),
        "held-out pass rate": f"{_rates(before)} -> {_rates(after)}",
        "step-0 ratio check": (
            f"max |trainer - sampler log-prob| {per_step[0]['max_abs_logprob_diff']:.2e} "
            f"(max {max(diffs):.2e} over the {len(diffs)} steps trained on their own version)"
            if per_step[0]["max_abs_logprob_diff"] is not None
            else "not measured (step 0 held rollouts of other versions)"
        ),
        "time per step": (
            f"decode {split['decode_s']:.3f} s (producers), sidecar {split['sidecar_s']:.3f} s "
            f"(acknowledged -> served), trainer {split['trainer_s']:.3f} s (compute), "
            f"{split['interval_s'] or 0:.3f} s between steps"
        ),
    }
    zero_line = (
        f"{zero / max(groups, 1):.1%} of {groups} sampled groups "
        f"({status.counters.zero_advantage_rollouts_dropped:,} rollouts dropped)"
    )
    steps = records.steps
    seconds = time.monotonic() - started
    lines = summary_lines(
        steps, sidecar_records, status, config, seconds, zero_advantage=zero_line, extra=extra
    )
    print_summary(lines)
    if summary_json is not None:
        write_summary_json(
            summary_json,
            lines,
            per_step,
            fleet="policy",
            held_out_pass_rate={"before": before, "after": after},
            episodes_sampled=sum(len(g["rewards"]) for g in records.groups.values()),
            time_split_mean_s=split,
            wall_time_s=seconds,
        )
    return 0 if len(steps) == spec.steps else 1


_SPLIT = ("decode_s", "sidecar_s", "trainer_s", "interval_s")

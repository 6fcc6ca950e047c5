"""A synthetic inference fleet for `rlfeed demo --synthetic` (and `--address`): tasks with
hidden pass rates, long-tailed episodes, binary rewards.

A task's hidden pass rate improves each time one of its groups has mixed rewards (a
learning signal). Episodes look like an agent's: a prompt, then policy turns (mask 1)
interleaved with tool output (mask 0), log-normal in length. Log-probs come from the
caller's `score` (the demo's initial policy, so the step-0 ratio is exactly 1 when packing
is correct).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# token_ids [L] int32 -> sampler log-prob of each token given its prefix, float32 [L].
Scorer = Callable[[list[np.ndarray]], list[np.ndarray]]


@dataclass(kw_only=True, frozen=True)
class FleetConfig:
    """The synthetic workload."""

    num_tasks: int = 300  # tasks in the pool; default 300
    group_size: int = 8  # episodes per sampled task (GRPO group); default 8
    tasks_per_request: int = 8  # tasks asked of the sidecar per SampleTasks call; default 8
    vocab_size: int = 512  # token ids are drawn from [1, vocab_size); default 512
    prompt_tokens: tuple[int, int] = (16, 64)  # prompt length range, tokens; default 16..64
    median_episode_tokens: int = 160  # median tokens after the prompt; default 160
    episode_sigma: float = 0.9  # log-normal shape of episode length (long tail); default 0.9
    max_tokens: int = 2048  # hard cap on a whole episode, tokens (<= token budget); 2048
    turn_tokens: int = 48  # mean policy tokens per turn before a tool output; default 48
    tool_tokens: int = 24  # mean tool-output tokens per turn; default 24
    initial_pass_rate: tuple[float, float] = (0.02, 0.9)  # hidden pass-rate range at start
    learning_rate: float = 0.35  # logit gain of a task's pass rate per mixed group; 0.35
    seed: int = 0  # RNG seed; default 0

    def __post_init__(self) -> None:
        for name in ("num_tasks", "group_size", "tasks_per_request", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"FleetConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 2:
            raise ValueError(f"FleetConfig.vocab_size must be >= 2, got {self.vocab_size}")
        if self.prompt_tokens[0] < 1 or self.prompt_tokens[1] >= self.max_tokens:
            raise ValueError(f"FleetConfig.prompt_tokens {self.prompt_tokens} out of range")


@dataclass
class Episode:
    """One synthetic rollout, before submission."""

    token_ids: np.ndarray  # int32 [L]
    action_mask: np.ndarray  # uint8 [L]; 0 on the prompt and tool output
    reward: float  # 0.0 or 1.0


class SyntheticTasks:
    """The task pool and its hidden, improving pass rates."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self.task_ids = [f"task-{j:04d}" for j in range(config.num_tasks)]
        self._index = {task_id: j for j, task_id in enumerate(self.task_ids)}
        # Logit-uniform initial pass rates: many near-impossible and near-solved tasks,
        # which is the shape that makes a pass-rate filter worth having.
        self._logits = self._initial_logits(config.num_tasks)

    def _initial_logits(self, n: int) -> np.ndarray:
        low, high = self.config.initial_pass_rate
        p = self._rng.uniform(low, high, n) ** 1.5
        return np.log(p / (1.0 - p))

    def _position(self, task_id: str) -> int:
        """The task's index; a task the sidecar holds but this fleet did not register (a
        deployment's own pool, `rlfeed demo --address`) joins with a drawn pass rate."""
        if task_id not in self._index:
            self._index[task_id] = len(self._logits)
            self._logits = np.concatenate([self._logits, self._initial_logits(1)])
        return self._index[task_id]

    def pass_rate(self, task_id: str) -> float:
        position = self._position(task_id)  # before reading _logits: it may grow
        return float(1.0 / (1.0 + np.exp(-self._logits[position])))

    def pass_rates(self) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self._logits))

    def expected_zero_advantage_groups(self, task_ids: list[str] | None = None) -> float:
        """Expected all-pass or all-fail groups among one group of each given task."""
        p = (
            self.pass_rates()
            if task_ids is None
            else np.array([self.pass_rate(t) for t in task_ids])
        )
        g = self.config.group_size
        return float(np.sum(p**g + (1.0 - p) ** g))

    def roll_group(self, task_id: str, rng: np.random.Generator) -> list[Episode]:
        """`group_size` episodes of one task; learning happens only on mixed groups."""
        p = self.pass_rate(task_id)
        rewards = (rng.random(self.config.group_size) < p).astype(np.float64)
        if 0.0 < rewards.mean() < 1.0:
            self._logits[self._index[task_id]] += self.config.learning_rate
        return [episode(self.config, rng, float(r)) for r in rewards]


def episode(config: FleetConfig, rng: np.random.Generator, reward: float) -> Episode:
    """A prompt followed by policy turns and tool outputs, long-tailed in total length."""
    prompt = int(rng.integers(config.prompt_tokens[0], config.prompt_tokens[1] + 1))
    body = int(rng.lognormal(np.log(config.median_episode_tokens), config.episode_sigma))
    length = int(min(max(prompt + max(body, 1), prompt + 1), config.max_tokens))
    mask = np.zeros(length, dtype=np.uint8)
    position = prompt
    while position < length:
        turn = max(1, int(rng.exponential(config.turn_tokens)))
        mask[position : position + turn] = 1
        position += turn + max(1, int(rng.exponential(config.tool_tokens)))
    token_ids = rng.integers(1, config.vocab_size, size=length, dtype=np.int32)
    return Episode(token_ids=token_ids, action_mask=mask, reward=reward)


def random_scores(token_ids: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Plausible sampler log-probs without a model: log of uniform(0.05, 1)."""
    return [np.log(rng.uniform(0.05, 1.0, t.size)).astype(np.float32) for t in token_ids]


@dataclass
class FleetStats:
    """What the fleet did, for the demo's summary."""

    groups: int = 0
    rollouts: int = 0
    tokens: int = 0
    zero_advantage_groups: int = 0
    # Expected zero-advantage groups had the same number of groups been drawn uniformly
    # from the whole pool at the same moments: the filter's saving is the difference.
    expected_uniform_zero_advantage_groups: float = 0.0


def run_fleet(
    writer,
    tasks: SyntheticTasks,
    *,
    stop: threading.Event,
    policy_version: Callable[[], int],
    score: Scorer | None = None,
    ready: Callable[[], bool] = lambda: True,
    stats: FleetStats | None = None,
) -> FleetStats:
    """Sample tasks from the sidecar and submit groups until `stop` is set.

    writer: a `RolloutWriter` (its `sample_tasks` asks the sidecar which tasks to run).
    `ready()` throttles the fleet (False = the sidecar has enough steps queued); the fleet
    polls it instead of producing without bound.
    """
    config = tasks.config
    rng = np.random.default_rng(config.seed + 1)
    stats = stats if stats is not None else FleetStats()
    while not stop.is_set():
        if not ready():
            time.sleep(0.02)
            continue
        task_ids = writer.sample_tasks(config.tasks_per_request)
        if not task_ids:
            time.sleep(0.05)
            continue
        stats.expected_uniform_zero_advantage_groups += (
            tasks.expected_zero_advantage_groups() * len(task_ids) / tasks.pass_rates().size
        )
        version = policy_version()
        for task_id in task_ids:
            group = tasks.roll_group(task_id, rng)
            token_ids = [e.token_ids for e in group]
            logprobs = score(token_ids) if score is not None else random_scores(token_ids, rng)
            group_key = f"{task_id}/{stats.groups}"
            rewards = [e.reward for e in group]
            stats.zero_advantage_groups += int(min(rewards) == max(rewards))
            for k, (ep, lp) in enumerate(zip(group, logprobs, strict=True)):
                writer.write(
                    rollout_id=f"{group_key}/{k}",
                    task_id=task_id,
                    group_id=group_key,
                    policy_version=version,
                    reward=ep.reward,
                    token_ids=ep.token_ids,
                    action_mask=ep.action_mask,
                    sampler_logprobs=np.where(ep.action_mask > 0, lp, 0.0).astype(np.float32),
                )
                stats.rollouts += 1
                stats.tokens += int(ep.token_ids.size)
            stats.groups += 1
        writer.flush()
    return stats

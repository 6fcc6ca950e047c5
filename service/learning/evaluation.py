"""Pass rates without sampling noise: the exact probability that a sampled episode passes.

An episode passes only if every policy token is the expected one, so at temperature 1 the
probability that a sampled episode of task j passes is the product, over the solved
episode's policy tokens, of the policy's probability of each given the solved prefix:
exp(sum of teacher-forced log-probs). That is the sampled pass rate (16 episodes per task
in the chapter) in expectation, with no sampling noise and at the cost of one packed
forward over all tasks' solved episodes (no generation). The held-out pass rate reported is
its mean over the held-out tasks; greedy decoding would report something else (a task
whose answer is merely the most likely token counts as solved).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from rlfeed.service.gym.tasks import Task, solved_episode
from rlfeed.service.learning.policy import packed_stream


@torch.no_grad()
def pass_probabilities(policy, tasks: Sequence[Task]) -> torch.Tensor:
    """float64 [n]: P(a temperature-1 episode of task i passes) under `policy`, a
    `PackedLogProbs` (or a module called the same way)."""
    if not tasks:
        return torch.zeros(0, dtype=torch.float64)
    episodes = [solved_episode(t) for t in tasks]
    stream = packed_stream(episodes)
    logprobs = policy(stream["input_ids"], stream["position_ids"], stream["target_ids"])
    per_token = torch.where(stream["loss_mask"], logprobs.double(), 0.0)
    lengths = torch.tensor([e.token_ids.size for e in episodes])
    episode_of = torch.repeat_interleave(torch.arange(len(episodes)), lengths)
    totals = torch.zeros(len(episodes), dtype=torch.float64).index_add(0, episode_of, per_token)
    return totals.exp()


def pass_rates(policy, tasks: Sequence[Task]) -> dict[str, float]:
    """{"all": mean pass probability, and one entry per family} over `tasks`."""
    probabilities = pass_probabilities(policy, tasks).tolist()
    by_family: dict[str, list[float]] = defaultdict(list)
    for task, p in zip(tasks, probabilities, strict=True):
        by_family[task.family].append(p)
    rates = {"all": sum(probabilities) / len(probabilities) if probabilities else 0.0}
    rates.update({family: sum(ps) / len(ps) for family, ps in sorted(by_family.items())})
    return rates

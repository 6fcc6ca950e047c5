"""Train, held-out and warm-start splits of the gym, disjoint by content, fixed by a seed.

Each family's content space is shuffled once by the seed and cut into three parts: the
first `HELD_OUT_PER_FAMILY` points are the held-out split, the next `TRAIN_PER_FAMILY`
the training reserve, the rest the warm-start (SFT) pool. A train split of N tasks takes
the reserve round-robin over the families (N = 20: five per family, the chapter's
setting; N = 200: the whole reserve), so the 20-task split is part of the 200-task one and
every pool size is measured against the same held-out tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from rlfeed.service.gym.tasks import FAMILIES, Task, family_space, make_task

HELD_OUT_PER_FAMILY = 25
TRAIN_PER_FAMILY = 50
MAX_TRAIN_TASKS = TRAIN_PER_FAMILY * len(FAMILIES)


@dataclass(frozen=True)
class GymSplit:
    """The tasks of one seed: `train` (N tasks), `held_out` (25 per family) and the
    warm-start pool (`sft_tasks` draws from it), pairwise disjoint by content."""

    seed: int
    train: tuple[Task, ...]
    held_out: tuple[Task, ...]
    sft_pool: dict[str, np.ndarray] = field(repr=False, compare=False)  # family -> points [n, k]

    def task(self, task_id: str) -> Task:
        """The train or held-out task with this id (KeyError naming it otherwise)."""
        try:
            return self._by_id[task_id]
        except KeyError:
            message = f"task_id {task_id!r} is not in the gym split of seed {self.seed}"
            raise KeyError(message) from None

    @cached_property
    def _by_id(self) -> dict[str, Task]:
        return {t.task_id: t for t in (*self.train, *self.held_out)}

    def sft_tasks(self, count: int, seed: int) -> list[Task]:
        """`count` warm-start examples, families in equal shares, points drawn with
        replacement from the SFT pool (never a train or held-out problem)."""
        rng = np.random.default_rng([self.seed, seed, 7])
        tasks = []
        for i in range(count):
            family = FAMILIES[i % len(FAMILIES)]
            pool = self.sft_pool[family]
            row = int(rng.integers(len(pool)))
            tasks.append(make_task(family, pool[row].tolist(), row, "sft"))
        return tasks


def make_split(num_train: int, seed: int = 0) -> GymSplit:
    """The gym split of `seed` with `num_train` training tasks (1 .. MAX_TRAIN_TASKS)."""
    if not 1 <= num_train <= MAX_TRAIN_TASKS:
        raise ValueError(f"num_train must be in [1, {MAX_TRAIN_TASKS}], got {num_train}")
    held_out, reserve, sft_pool = [], {}, {}
    for number, family in enumerate(FAMILIES):
        space = family_space(family)
        order = np.random.default_rng([seed, number]).permutation(len(space))
        points = space[order]
        cut = HELD_OUT_PER_FAMILY + TRAIN_PER_FAMILY
        held_out += [
            make_task(family, p.tolist(), i, "heldout")
            for i, p in enumerate(points[:HELD_OUT_PER_FAMILY])
        ]
        reserve[family] = points[HELD_OUT_PER_FAMILY:cut]
        sft_pool[family] = points[cut:]
    train = [
        make_task(family, reserve[family][i // len(FAMILIES)].tolist(), i // len(FAMILIES), "train")
        for i in range(num_train)
        for family in (FAMILIES[i % len(FAMILIES)],)
    ]
    return GymSplit(seed=seed, train=tuple(train), held_out=tuple(held_out), sft_pool=sft_pool)

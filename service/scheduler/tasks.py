"""The task pool: registered task ids, their pass-rate estimates and the sampling draws.

The curriculum's arithmetic is pure numpy in `sched.curriculum`; this class keeps its state
(the estimates and the random generator, both in a snapshot) and maps task ids to rows.
"""

from __future__ import annotations

import numpy as np
from rlfeed.sched.curriculum import (
    PassRates,
    grow,
    init_pass_rates,
    inside_filter,
    select_tasks,
    update_pass_rates,
)
from rlfeed.service.config import SidecarConfig
from rlfeed.service.scheduler.records import SampleResult


class TaskPool:
    """Task ids in registration order, and one pass-rate estimate per task."""

    def __init__(self, config: SidecarConfig) -> None:
        self._max_tasks = config.server.max_tasks
        self._curriculum = config.curriculum.curriculum_config()
        self._rng = np.random.default_rng(config.curriculum.seed)
        self.index: dict[str, int] = {}  # task id -> its row in the estimates
        self.ids: list[str] = []
        self._pass_rates = init_pass_rates(0, self._curriculum)

    def register(self, task_ids: list[str]) -> tuple[int, int]:
        """Add the unknown ids; returns (added, total). All or nothing: ValueError for an
        empty id or a pool that would outgrow `[server] max_tasks`."""
        if not all(task_ids):
            raise ValueError("task_ids: empty task id")
        new = [task_id for task_id in dict.fromkeys(task_ids) if task_id not in self.index]
        if len(self.ids) + len(new) > self._max_tasks:
            raise ValueError(
                f"task_ids: {len(new)} new tasks would grow the pool of {len(self.ids)} "
                f"beyond [server] max_tasks = {self._max_tasks}"
            )
        for task_id in new:
            self.index[task_id] = len(self.ids)
            self.ids.append(task_id)
        if new:
            self._pass_rates = grow(self._pass_rates, len(self.ids))
        return len(new), len(self.ids)

    def sample(self, n: int) -> SampleResult:
        """n tasks to roll out next (`curriculum.select_tasks`, one draw of the generator);
        n is at most the pool's size."""
        chosen = select_tasks(self._pass_rates, n, self._curriculum, self._rng)
        inside = inside_filter(self._pass_rates, self._curriculum)[chosen]
        return SampleResult(
            task_ids=[self.ids[i] for i in chosen.tolist()],
            revisit=(~inside).tolist(),
            pass_rate=self._pass_rates.estimate[chosen].tolist(),
            requested=n,
        )

    def update(self, task_ids: list[str], means: np.ndarray, group_size: int) -> None:
        """Fold completed groups' mean rewards (pass fractions in [0, 1]) into the
        estimates of their tasks. In place: this runs per ingest batch, and a copy would
        cost O(task pool) each time."""
        tasks = np.array([self.index[task_id] for task_id in task_ids], dtype=np.int64)
        self._pass_rates = update_pass_rates(
            self._pass_rates, tasks, means, group_size, self._curriculum, in_place=True
        )

    def inside_filter_count(self) -> int:
        return int(inside_filter(self._pass_rates, self._curriculum).sum())

    def estimates(self) -> np.ndarray:
        """float64 [tasks]: every task's pass-rate estimate, in registration order (a copy)."""
        return np.array(self._pass_rates.estimate, dtype=np.float64)

    # ---- snapshot ("pass_rates" and "rng"; "tasks" is `ids`) ---------------------------

    def pass_rates_state(self) -> list:
        rates = self._pass_rates
        return [
            *(a.tolist() for a in (rates.estimate, rates.visits, rates.alpha, rates.beta)),
            rates.last_visit.tolist(),
            rates.num_updates,
        ]

    def restore_pass_rates(self, saved: list) -> None:
        """Take back `pass_rates_state` (the tasks registered already)."""
        *arrays, last_visit, updates = saved
        self._pass_rates = PassRates(
            *(np.asarray(a, dtype=np.float64) for a in arrays[:1]),
            np.asarray(arrays[1], dtype=np.int64),
            *(np.asarray(a, dtype=np.float64) for a in arrays[2:]),
            np.asarray(last_visit, dtype=np.int64),
            num_updates=updates,
            prior_alpha=self._pass_rates.prior_alpha,
            prior_beta=self._pass_rates.prior_beta,
            initial_estimate=self._pass_rates.initial_estimate,
        )

    def rng_state(self) -> list[str]:
        """The PCG64 generator's state as strings (its integers have 128 bits; msgpack, 64)."""
        state = self._rng.bit_generator.state
        inner = state["state"]
        values = (inner["state"], inner["inc"], state["has_uint32"], state["uinteger"])
        return [state["bit_generator"], *map(str, values)]

    def restore_rng(self, saved: list[str]) -> None:
        name, state, inc, has_uint32, uinteger = saved
        if name != self._rng.bit_generator.state["bit_generator"]:
            raise ValueError(f"snapshot: random generator {name!r} is not this numpy's default")
        self._rng.bit_generator.state = {
            "bit_generator": name,
            "state": {"state": int(state), "inc": int(inc)},
            "has_uint32": int(has_uint32),
            "uinteger": int(uinteger),
        }

"""Per-step figures of a learning run, joined from what its processes logged.

The served batch carries rollout ids and advantages but not rewards, so rewards come from
the producers' logs (`producer-<i>.jsonl`, written before each group is submitted) joined
on rollout id with the trainer's step records (`steps.jsonl`, rank 0, all ranks' ids).

Per step:
- `mean_reward`: mean reward of the rollouts the step trained.
- `zero_advantage_share`: share of the step's groups whose rewards are all equal.
- `episodes_sampled`: episodes sampled with the weights the step started from (policy
  version = the trainer's version at that step), whether or not any step trained them.
- `held_out_pass_rate` / `train_pass_rate`: the exact temperature-1 pass probability
  (`evaluation.py`) after the step, where evaluated (None otherwise).
- the time split (issue item 7): `decode_s`, the producers' sampling time of the step's
  groups divided by the number of producers (they sample side by side); `sidecar_s`, from
  the moment both the step's last group was acknowledged and every rank asked for the
  step to the moment the last rank was served (the service's own latency, not time spent
  waiting for producers or trainers); `trainer_s`, the slowest rank's compute; `interval_s`,
  the time since the previous step was served.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rlfeed.service.learning.run_spec import STEPS_FILE, producer_log


class JsonLinesTail:
    """Reads the records another process appends to a JSON-lines file, each line once: a
    last line not yet complete is left for the next read."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line]


@dataclass
class RunRecords:
    """Everything the run's processes logged so far."""

    steps: list[dict] = field(default_factory=list)  # trainer step records, in order
    evals: dict[int, dict] = field(default_factory=dict)  # policy version -> evaluation
    groups: dict[str, dict] = field(default_factory=dict)  # group id -> producer record
    rollout_group: dict[str, str] = field(default_factory=dict)  # rollout id -> group id
    acks: list[dict] = field(default_factory=list)  # producer flush records
    acked_at: dict[str, float] = field(default_factory=dict)  # group id -> ack time
    producers: int = 1
    tails: list[JsonLinesTail] = field(default_factory=list, repr=False)

    @classmethod
    def load(cls, run_dir: Path, producers: int) -> RunRecords:
        """What was logged so far; `update()` adds what is logged later."""
        records = cls(producers=producers)
        records.tails = [JsonLinesTail(producer_log(run_dir, i)) for i in range(producers)]
        records.tails.append(JsonLinesTail(Path(run_dir) / STEPS_FILE))
        records.update()
        return records

    def update(self) -> None:
        """Read what the processes logged since the last call (each line once)."""
        *producers, steps = self.tails
        for tail in producers:
            for entry in tail.read_new():
                if "acked" in entry:
                    self.acks.append(entry)
                    self.acked_at.update(dict.fromkeys(entry["acked"], entry["t_acked"]))
                else:
                    self.groups[entry["group_id"]] = entry
                    self.rollout_group.update(
                        dict.fromkeys(entry["rollout_ids"], entry["group_id"])
                    )
        for entry in steps.read_new():
            if "step" in entry:
                self.steps.append(entry)
                if "eval" in entry:
                    self.evals[entry["trainer_version"] + 1] = entry["eval"]
            else:
                self.evals[entry["version"]] = entry["eval"]

    def trained_ids(self, record: dict) -> list[str]:
        return [rid for rank in record["ranks"] for rid in rank["rollout_ids"]]

    def reward(self, rollout_id: str) -> float:
        group = self.groups[self.rollout_group[rollout_id]]
        return group["rewards"][group["rollout_ids"].index(rollout_id)]

    def step_figures(self, record: dict, previous: dict | None) -> dict:
        """The figures of one step record (module docstring)."""
        ids = self.trained_ids(record)
        group_ids = sorted({self.rollout_group[rid] for rid in ids})
        rewards = [self.reward(rid) for rid in ids]
        zero = sum(len(set(self.groups[g]["rewards"])) == 1 for g in group_ids)
        version = record["trainer_version"]
        sampled = sum(
            len(g["rewards"]) for g in self.groups.values() if g["policy_version"] == version
        )
        after = self.evals.get(version + 1) if "eval" in record else None
        ranks = record["ranks"]
        served = max(r["t_served"] for r in ranks)
        acked = max((self.acked_at.get(g, math.nan) for g in group_ids), default=math.nan)
        ready = max(acked, min(r["t_asked"] for r in ranks))
        decode = sum(
            self.groups[g]["t_decode_end"] - self.groups[g]["t_decode_start"] for g in group_ids
        )
        return {
            "step": record["step"],
            "rollouts_trained": len(ids),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "zero_advantage_share": zero / len(group_ids) if group_ids else None,
            "episodes_sampled": sampled,
            "held_out_pass_rate": after["held_out"]["all"] if after else None,
            "train_pass_rate": after["train"]["all"] if after else None,
            "loss": record["loss"],
            "max_abs_logprob_diff": record["max_abs_logprob_diff"],
            "decode_s": decode / self.producers,
            "sidecar_s": max(0.0, served - ready) if not math.isnan(ready) else None,
            "trainer_s": max(r["t_trained"] - r["t_served"] for r in ranks),
            "interval_s": (
                served - max(r["t_served"] for r in previous["ranks"]) if previous else None
            ),
        }

    def all_step_figures(self) -> list[dict]:
        return [
            self.step_figures(record, self.steps[i - 1] if i else None)
            for i, record in enumerate(self.steps)
        ]

    def sampled_groups(self) -> tuple[int, int]:
        """(groups sampled, of which zero-advantage: all rewards equal)."""
        groups = list(self.groups.values())
        return len(groups), sum(len(set(g["rewards"])) == 1 for g in groups)

    def duplicates_trained(self) -> list[str]:
        """Rollout ids trained more than once (empty when exactly-once holds)."""
        counts = Counter(rid for record in self.steps for rid in self.trained_ids(record))
        return sorted(rid for rid, n in counts.items() if n > 1)


def mean_of(values) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None

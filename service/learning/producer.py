"""A producer process: samples groups from the newest policy it has and writes rollouts.

    python -m rlfeed.service.learning.producer --run-dir DIR --index 0

Each round it (1) waits while the sidecar already holds `steps_ahead` steps' worth of
groups (assembled and not trained, or complete and not assembled; `Pacer`), (2) loads the
newest published weights if newer than its own, (3) asks the sidecar's curriculum for
`tasks_per_round` tasks (`RolloutWriter.sample_tasks`), (4) samples one group per task
(`generation.sample_group`), scores it with the gym's verifier and writes its rollouts,
tagged with the version of the weights that sampled them, and (5) flushes. Every group is
logged to `producer-<index>.jsonl` before it is written (rewards, version, decode
times), and every flush after the sidecar acknowledged it (time, accepted / stale /
duplicate counts): the demo's per-step rewards and time split are joined from these.
SIGTERM (or SIGINT) ends it after the current round, with everything written flushed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from rlfeed.service.learning.pacing import Pacer
from rlfeed.service.learning.run_spec import WEIGHTS_DIR, RunSpec, producer_log

# How long a producer waits for the first published weights before giving up.
FIRST_WEIGHTS_TIMEOUT_S = 120.0


class Producer:
    """One producer's state: its model, weights reader, writer and log."""

    def __init__(self, run_dir: Path, index: int) -> None:
        from rlfeed.client.producer import RolloutWriter
        from rlfeed.client.transport import GrpcTransport
        from rlfeed.service.gym.splits import make_split
        from rlfeed.service.learning.policy import build_model
        from rlfeed.service.learning.weights import WeightsReader

        self.spec = spec = RunSpec.read(run_dir)
        self.index = index
        self.split = make_split(spec.train_tasks, spec.gym_seed)
        self.model = build_model(spec.policy).eval()
        self.version: int | None = None
        self.reader = WeightsReader(Path(run_dir) / WEIGHTS_DIR)
        self.generator = torch.Generator().manual_seed(spec.seed * 1000 + index)
        self.transport = GrpcTransport(spec.address)
        self.writer = RolloutWriter(
            self.transport, max_batch_rollouts=spec.group_size * spec.tasks_per_round
        )
        self.pacer = Pacer(
            self.transport,
            start_step=spec.start_step,
            end_step=spec.end_step,
            steps_ahead=spec.steps_ahead,
        )
        self.log = open(producer_log(run_dir, index), "a")  # noqa: SIM115 (closed in close())
        self.rounds = 0

    def load_newest_weights(self) -> None:
        update = self.reader.poll()
        if update is not None:
            self.version, state = update
            self.model.load_state_dict(state)

    def wait_for_first_weights(self, stop: threading.Event) -> None:
        deadline = time.monotonic() + FIRST_WEIGHTS_TIMEOUT_S
        while self.version is None and not stop.is_set():
            self.load_newest_weights()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"producer {self.index}: no weights published in {self.reader.directory} "
                    f"after {FIRST_WEIGHTS_TIMEOUT_S:.0f} s"
                )
            if self.version is None:
                time.sleep(0.05)

    def run(self, stop: threading.Event) -> None:
        self.writer.register_tasks([task.task_id for task in self.split.train])
        self.wait_for_first_weights(stop)
        while not stop.is_set():
            if not self.pacer.ready():
                time.sleep(0.02)
                continue
            self.load_newest_weights()
            task_ids = self.writer.sample_tasks(self.spec.tasks_per_round)
            if not task_ids:
                time.sleep(0.05)
                continue
            self.round(task_ids)

    def round(self, task_ids: list[str]) -> None:
        from rlfeed.service.learning.generation import sample_group

        group_ids = []
        for task_id in task_ids:
            task = self.split.task(task_id)
            started = time.time()
            episodes = sample_group(self.model, task, self.spec.group_size, self.generator)
            decoded = time.time()
            group_id = f"p{self.index}-r{self.rounds}-{task_id}"
            rollout_ids = [f"{group_id}/{k}" for k in range(len(episodes))]
            self._log(
                group_id=group_id,
                task_id=task_id,
                family=task.family,
                policy_version=self.version,
                rewards=[e.episode.reward for e in episodes],
                rollout_ids=rollout_ids,
                tokens=sum(int(e.episode.token_ids.size) for e in episodes),
                t_decode_start=started,
                t_decode_end=decoded,
            )
            for rollout_id, sampled in zip(rollout_ids, episodes, strict=True):
                self.writer.write(
                    rollout_id=rollout_id,
                    task_id=task_id,
                    group_id=group_id,
                    policy_version=self.version,
                    reward=sampled.episode.reward,
                    token_ids=sampled.episode.token_ids,
                    action_mask=sampled.episode.action_mask,
                    sampler_logprobs=sampled.sampler_logprobs,
                )
            group_ids.append(group_id)
        acks = self.writer.flush()
        self._log(
            acked=group_ids,
            t_acked=time.time(),
            accepted=sum(int(a.accepted) for a in acks),
            stale=sum(int(a.stale) for a in acks),
            duplicate=sum(int(a.duplicate) for a in acks),
        )
        self.rounds += 1

    def _log(self, **record) -> None:
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            self.transport.close()
            self.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfeed.service.learning.producer")
    parser.add_argument("--run-dir", required=True, help="the run directory (run.json)")
    parser.add_argument("--index", type=int, required=True, help="this producer's number")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # several producers, trainer ranks and the sidecar share cores
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    producer = Producer(Path(args.run_dir), args.index)
    try:
        producer.run(stop)
    finally:
        producer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

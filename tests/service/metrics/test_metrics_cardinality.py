"""The number of exported series does not grow with the number of tasks in use."""

from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rlfeed.sched.curriculum import CurriculumConfig, init_pass_rates, update_pass_rates
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta
from rlfeed.service.config import BatchingConfig, RolloutsConfig, SidecarConfig
from rlfeed.service.inprocess import assemble_ready_steps
from rlfeed.service.metrics.recorder import MetricsConfig, SidecarMetrics
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import synthetic_groups


def exported_series(num_tasks: int, steps: int = 3) -> tuple[int, set[str]]:
    """Run `steps` steps of a sidecar's scheduler over `num_tasks` registered tasks, feeding
    every metrics path; returns (series count, every label value exported)."""
    config = SidecarConfig(
        batching=BatchingConfig(token_budget=1024, world_size=2),
        rollouts=RolloutsConfig(prompts_per_step=4, group_size=4),
    )
    scheduler = Scheduler(config)
    task_ids = [f"task-{i:06d}" for i in range(num_tasks)]
    scheduler.register_tasks(task_ids)
    metrics = SidecarMetrics(MetricsConfig.from_sidecar_config(config))
    rng = np.random.default_rng(0)
    for step in range(steps):
        sample = scheduler.sample_tasks(4)
        metrics.on_task_sample(
            requested=4,
            returned=len(sample.task_ids),
            revisits=sum(sample.revisit),
            group_size=4,
        )
        rollouts = synthetic_groups(
            num_groups=4, group_size=4, rng=rng, tasks=sample.task_ids, prefix=f"s{step}-"
        )
        arrays = decode_rollout_batch(rollouts.encode())
        result = scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
        metrics.on_ingest(
            accepted=result.accepted,
            accepted_tokens=int(arrays.lengths.sum()),
            ack_seconds=0.001,
            buffered_rollouts=result.buffered_rollouts,
        )
        for assembled in assemble_ready_steps(scheduler):
            metrics.on_step(scheduler.step_records[-1], ready_time=0.0)
            for rank in range(2):
                payload = scheduler.fetch_batch(assembled, rank).response
                metrics.on_served(assembled, rank, response=payload, now=1.0)
                metrics.on_trainer_report(
                    step=assembled, rank=rank, loss=0.1, ratio_outlier_share=0.0,
                    tokens_per_second=1e4, step_seconds=0.5,
                )  # fmt: skip
    metrics.on_reject("unknown_task", rollouts=4)
    # Every task visited by the curriculum: estimates spread over the whole [0, 1] range.
    curriculum = CurriculumConfig(estimator="last")
    state = init_pass_rates(num_tasks, curriculum)
    state = update_pass_rates(
        state, np.arange(num_tasks), rng.integers(0, 5, num_tasks) / 4, 4, curriculum
    )
    metrics.on_status(scheduler.status(), pass_rates=state.estimate)
    series, label_values = 0, set()
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            series += 1
            label_values.update(sample.labels.values())
    return series, label_values


def test_series_count_is_the_same_for_100_and_100000_tasks():
    few, few_labels = exported_series(100)
    many, many_labels = exported_series(100_000)
    assert few == many
    assert few_labels == many_labels
    assert not [v for v in many_labels if v.startswith("task-")]
    assert few > 100  # the exporter did export the whole set

"""The exported metrics equal the quantities computed independently from served steps."""

from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.sched.assembly import (
    StepConfig,
    StepRollouts,
    TokenColumns,
    assemble_step,
    materialize_microbatch,
)
from rlfeed.sched.curriculum import CurriculumConfig, init_pass_rates, select_tasks
from rlfeed.sched.models import GPUS, MODELS, kv_bytes_per_token, param_count
from rlfeed.service.cli.status import status_text
from rlfeed.service.codec.messages import decode_rollout_batch, step_stats_to_proto
from rlfeed.service.codec.rollout_batch import batch_meta, decode_batch
from rlfeed.service.codec.validation import validate_rollout_batch
from rlfeed.service.config import (
    AccountingConfig,
    BatchingConfig,
    RolloutsConfig,
    SidecarConfig,
)
from rlfeed.service.errors import BackpressureError, InvalidBatchError, RejectReason, reject_reason
from rlfeed.service.inprocess import assemble_ready_steps
from rlfeed.service.metrics.http import MetricsServer
from rlfeed.service.metrics.layout_plot import layout_from_plan
from rlfeed.service.metrics.recorder import (
    PASS_RATE_BUCKETS,
    REJECT_REASONS,
    MetricsConfig,
    SidecarMetrics,
)
from rlfeed.service.scheduler.actor import SchedulerActor
from rlfeed.service.scheduler.records import IngestKind, StepRecord
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import step_record, synthetic_groups


def make_step(rng: np.random.Generator, groups: int, group_size: int, max_len: int = 400):
    """Random rollouts (prompt, then policy tokens) with some all-equal reward groups."""
    n = groups * group_size
    lengths = rng.integers(2, max_len, size=n)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    action_mask = np.zeros(offsets[-1], dtype=np.uint8)
    for start, length in zip(offsets[:-1], lengths, strict=True):
        action_mask[start + rng.integers(1, length) : start + length] = 1
    columns = TokenColumns(
        offsets,
        rng.integers(0, 1000, size=offsets[-1]).astype(np.int32),
        action_mask,
        np.where(action_mask > 0, -rng.random(offsets[-1]), 0.0).astype(np.float32),
    )
    rewards = rng.integers(0, 2, size=n).astype(np.float64)
    rewards[:group_size] = 1.0  # group 0 all pass
    rewards[group_size : 2 * group_size] = 0.0  # group 1 all fail
    rollouts = StepRollouts(
        lengths=lengths,
        policy_tokens=np.add.reduceat(action_mask.astype(np.int64), offsets[:-1]),
        rewards=rewards,
        group_ids=np.repeat(np.arange(groups), group_size),
    )
    return rollouts, columns


def record_from_plan(plan, step: int, zero_advantage_groups_dropped: int = 0) -> StepRecord:
    """The service's record of an assembled step (what the scheduler hands the metrics)."""
    return StepRecord.from_plan(
        plan,
        step=step,
        zero_advantage_groups_dropped=zero_advantage_groups_dropped,
        policy_versions=(0, 0),
    )


def served_microbatches(plan, columns):
    return [
        [materialize_microbatch(columns, plan.microbatches[m], plan.advantages) for m in rank]
        for rank in plan.ranks
    ]


def value(metrics: SidecarMetrics, name: str, **labels: str) -> float:
    sample = metrics.registry.get_sample_value(name, labels)
    assert sample is not None, f"{name}{labels} is not exported"
    return sample


@pytest.mark.parametrize("cost_model", ["packed", "padded"])
def test_step_metrics_equal_what_the_served_microbatches_contain(cost_model):
    rollouts, columns = make_step(np.random.default_rng(0), groups=12, group_size=4)
    budget, world = 1600, 3
    config = StepConfig(token_budget=budget, world_size=world, cost_model=cost_model)
    plan = assemble_step(rollouts, config)
    served = served_microbatches(plan, columns)
    metrics = SidecarMetrics(MetricsConfig(world_size=world, token_budget=budget))
    metrics.on_step(record_from_plan(plan, step=7))

    rows = [mb for rank in served for mb in rank]
    seq_lengths = np.concatenate([np.diff(mb.cu_seqlens) for mb in rows])
    real = sum(mb.num_tokens for mb in rows)
    if cost_model == "packed":  # one flat row per microbatch
        computed = real
    else:  # each microbatch padded to its longest member
        computed = sum((mb.cu_seqlens.size - 1) * mb.max_seqlen for mb in rows)
    padded = seq_lengths.size * seq_lengths.max()
    assert value(metrics, "rlfeed_step") == 7
    assert value(metrics, "rlfeed_step_real_tokens") == real
    assert value(metrics, "rlfeed_step_policy_tokens") == sum(
        int(mb.loss_mask.sum()) for mb in rows
    )
    assert value(metrics, "rlfeed_step_policy_tokens") == int(columns.action_mask.sum())
    assert value(metrics, "rlfeed_step_computed_positions") == computed
    assert value(metrics, "rlfeed_step_padded_positions") == padded
    assert value(metrics, "rlfeed_step_padding_ratio") == pytest.approx(
        (computed - real) / computed
    )
    assert value(metrics, "rlfeed_step_padded_alternative_padding_ratio") == pytest.approx(
        (padded - real) / padded
    )
    assert value(metrics, "rlfeed_step_microbatches") == len(rows)
    assert value(metrics, "rlfeed_step_microbatches_per_rank") == len(served[0])
    assert value(metrics, "rlfeed_step_fill_ratio") == pytest.approx(real / (len(rows) * budget))
    largest = max(
        mb.num_tokens if cost_model == "packed" else (mb.cu_seqlens.size - 1) * mb.max_seqlen
        for mb in rows
    )
    assert value(metrics, "rlfeed_step_largest_microbatch_positions") == largest
    assert value(metrics, "rlfeed_step_rollouts") == seq_lengths.size
    assert value(metrics, "rlfeed_real_tokens_total") == real


def zero_advantage_share_by_loop(rewards, group_ids) -> float:
    groups: dict[int, list[float]] = {}
    for reward, group in zip(rewards.tolist(), group_ids.tolist(), strict=True):
        groups.setdefault(group, []).append(reward)
    return sum(len(set(r)) == 1 for r in groups.values()) / len(groups)


def test_zero_advantage_share_per_step_and_over_the_trailing_window():
    metrics = SidecarMetrics(MetricsConfig(zero_advantage_window_steps=3, token_budget=2000))
    rng = np.random.default_rng(1)
    shares, counts = [], []
    for step in range(5):
        rollouts, _ = make_step(rng, groups=6 + step, group_size=4)
        plan = assemble_step(rollouts, StepConfig(token_budget=2000))
        metrics.on_step(record_from_plan(plan, step=step))
        share = zero_advantage_share_by_loop(rollouts.rewards, rollouts.group_ids)
        shares.append(share)
        counts.append((round(share * (6 + step)), 6 + step))
        assert value(metrics, "rlfeed_step_zero_advantage_groups_ratio") == pytest.approx(share)
    window = counts[-3:]
    assert value(metrics, "rlfeed_zero_advantage_groups_window_ratio") == pytest.approx(
        sum(z for z, _ in window) / sum(g for _, g in window)
    )
    assert value(metrics, "rlfeed_groups_total") == sum(g for _, g in counts)
    assert value(metrics, "rlfeed_zero_advantage_groups_total") == sum(z for z, _ in counts)


def test_groups_dropped_for_zero_advantage_count_towards_the_share():
    rollouts, _ = make_step(np.random.default_rng(2), groups=8, group_size=4)
    config = StepConfig(token_budget=2000, drop_zero_advantage=True)
    plan = assemble_step(rollouts, config)
    metrics = SidecarMetrics()
    metrics.on_step(record_from_plan(plan, step=0, zero_advantage_groups_dropped=3))
    expected = (plan.zero_advantage_groups + 3) / (plan.num_groups + 3)
    assert value(metrics, "rlfeed_step_zero_advantage_groups_ratio") == pytest.approx(expected)


def hand_priced_gpu_hours(cost: AccountingConfig, *, policy, real, computed, padded, lockstep):
    """Chapter 14.6 by hand: decode reads 2N + b c s_kv bytes per b tokens; training costs
    6N FLOPs per position at mfu; each log-prob pass 2N; every rank is paid for while it
    waits in lockstep, so training and log-prob passes take 1 / lockstep as long."""
    arch, gpu = MODELS[cost.model], GPUS[cost.gpu]
    n_params = param_count(arch)
    step_seconds = (
        n_params * arch.weight_bytes_per_param
        + cost.decode_batch * cost.decode_context * kv_bytes_per_token(arch)
    ) / gpu.memory_bandwidth_bytes_per_s
    decode_rate = cost.decode_batch / step_seconds
    decode = policy / (decode_rate * cost.busy_fraction) / 3600
    per_position = 6 * n_params / (cost.mfu * gpu.dense_bf16_flops_per_s) / 3600
    logprob_factor = cost.logprob_forward_passes * 2 / 6
    return {
        "decode": decode,
        "train": computed * per_position / lockstep,
        "logprob": computed * per_position * logprob_factor / lockstep,
        "idle": computed * per_position * (1 + logprob_factor) * (1 / lockstep - 1),
        "padding": (computed - real) * per_position * (1 + logprob_factor),
        "avoided": (padded - computed) * per_position * (1 + logprob_factor),
    }


def test_predicted_gpu_hours_of_a_known_step_match_the_roofline_by_hand():
    cost = AccountingConfig(model="qwen3-8b", gpu="h200", mfu=0.4, busy_fraction=0.5)
    record = step_record(
        num_rollouts=512,
        num_groups=64,
        policy_token_count=512 * 5900,
        real_tokens=512 * 23_600,
        computed_positions=512 * 23_600 + 100_000,
        padded_positions=512 * 60_000,
        microbatches_per_rank=24,
        lockstep_efficiency=0.999,
        compute_lockstep_efficiency=0.9,
    )
    metrics = SidecarMetrics(MetricsConfig(accounting=cost))
    metrics.on_step(record)
    metrics.on_step(record)  # cumulative counters add up
    hours = hand_priced_gpu_hours(
        cost,
        policy=record.policy_token_count,
        real=record.real_tokens,
        computed=record.computed_positions,
        padded=record.padded_positions,
        lockstep=record.compute_lockstep_efficiency,
    )
    for phase in ("decode", "train", "logprob"):
        step = value(metrics, "rlfeed_step_predicted_gpu_seconds", phase=phase) / 3600
        total = value(metrics, "rlfeed_predicted_gpu_seconds_total", phase=phase) / 3600
        assert step == pytest.approx(hours[phase], rel=1e-9)
        assert total == pytest.approx(2 * hours[phase], rel=1e-9)
    assert value(metrics, "rlfeed_padding_gpu_seconds_total") / 3600 == pytest.approx(
        2 * hours["padding"], rel=1e-9
    )
    assert value(metrics, "rlfeed_step_padding_avoided_gpu_seconds") / 3600 == pytest.approx(
        hours["avoided"], rel=1e-9
    )
    assert value(metrics, "rlfeed_lockstep_idle_gpu_seconds_total") / 3600 == pytest.approx(
        2 * hours["idle"], rel=1e-9
    )
    # The chapter's step of this shape costs about 1.6 GPU-hours (at full lockstep).
    at_full_lockstep = hours["decode"] + 0.9 * (hours["train"] + hours["logprob"])
    assert 1.2 < at_full_lockstep < 2.0


def test_step_balance_is_published_in_tokens_and_in_compute():
    record = step_record(
        rank_imbalance=1.01,
        lockstep_efficiency=0.98,
        compute_rank_imbalance=1.2,
        compute_lockstep_efficiency=0.8,
    )
    metrics = SidecarMetrics()
    metrics.on_step(record)
    # One definition of rank imbalance (max / mean, sched.balance.rank_imbalance): the
    # metric is the figure `rlfeed status` prints, not a re-derived one.
    assert value(metrics, "rlfeed_step_rank_imbalance") == pytest.approx(1.01)
    assert value(metrics, "rlfeed_step_lockstep_efficiency_ratio") == pytest.approx(0.98)
    assert value(metrics, "rlfeed_step_compute_rank_imbalance") == pytest.approx(1.2)
    status = pb.StatusResponse(last_step=step_stats_to_proto(record))
    assert "rank imbalance 1.010 in tokens, 1.200 in compute" in status_text(
        "x:1", "SERVING", status
    )
    assert value(metrics, "rlfeed_step_compute_lockstep_efficiency_ratio") == pytest.approx(0.8)
    # Training and log-prob GPU time follow compute lockstep, not token lockstep.
    even = SidecarMetrics()
    even.on_step(step_record(compute_lockstep_efficiency=1.0))
    for phase, ratio in (("decode", 1.0), ("train", 1 / 0.8), ("logprob", 1 / 0.8)):
        seconds = value(metrics, "rlfeed_step_predicted_gpu_seconds", phase=phase)
        assert seconds == pytest.approx(
            ratio * value(even, "rlfeed_step_predicted_gpu_seconds", phase=phase)
        )


def test_decode_is_priced_on_the_generated_tokens_when_the_record_has_them():
    record = step_record(policy_token_count=2000, real_tokens=8000, computed_positions=8000)
    plain, generated = SidecarMetrics(), SidecarMetrics()
    plain.on_step(record)
    generated.on_step(record, generated_policy_tokens=3000, generated_tokens=12000)
    ratio = value(generated, "rlfeed_step_predicted_gpu_seconds", phase="decode") / value(
        plain, "rlfeed_step_predicted_gpu_seconds", phase="decode"
    )
    assert ratio == pytest.approx(1.5)
    assert value(generated, "rlfeed_step_predicted_gpu_seconds", phase="train") == value(
        plain, "rlfeed_step_predicted_gpu_seconds", phase="train"
    )


def test_ingest_counters_and_every_reject_reason_exists_from_the_start():
    metrics = SidecarMetrics()
    for reason in REJECT_REASONS:
        assert value(metrics, "rlfeed_ingest_rollouts_rejected_total", reason=reason) == 0
    metrics.on_ingest(
        accepted=10, accepted_tokens=1000, duplicate=2, stale=3, stale_tokens=300, expired=5,
        ack_seconds=0.004, buffered_rollouts=10, buffered_bytes=6000,
    )  # fmt: skip
    metrics.on_reject("too_long", rollouts=4, tokens=90_000)
    metrics.on_reject("some new check", rollouts=1)
    metrics.on_stale(rollouts=8, tokens=800)
    assert value(metrics, "rlfeed_ingest_rollouts_accepted_total") == 10
    assert value(metrics, "rlfeed_ingest_tokens_accepted_total") == 1000
    assert value(metrics, "rlfeed_ingest_rollouts_duplicate_total") == 2
    assert value(metrics, "rlfeed_ingest_rollouts_stale_total") == 11
    assert value(metrics, "rlfeed_ingest_tokens_stale_total") == 1100
    assert value(metrics, "rlfeed_ingest_rollouts_expired_total") == 5
    assert value(metrics, "rlfeed_ingest_rollouts_rejected_total", reason="too_long") == 4
    assert value(metrics, "rlfeed_ingest_tokens_rejected_total", reason="too_long") == 90_000
    assert value(metrics, "rlfeed_ingest_batches_rejected_total", reason="other") == 1
    assert value(metrics, "rlfeed_ingest_ack_latency_seconds_count") == 1
    assert value(metrics, "rlfeed_buffered_bytes") == 6000


def test_rollouts_saved_is_requested_minus_filtered_tasks_times_group_size():
    config = CurriculumConfig(estimator="last", revisits=1)
    state = init_pass_rates(50, config)
    state = type(state)(**{**vars(state), "estimate": np.linspace(0, 1, 50)})
    metrics = SidecarMetrics()
    rng = np.random.default_rng(0)
    expected_saved, returned_total = 0, 0
    for n in (8, 60, 5, 48):
        chosen = select_tasks(state, n, config, rng)
        revisits = int(np.sum((state.estimate[chosen] <= 0) | (state.estimate[chosen] >= 1)))
        metrics.on_task_sample(requested=n, returned=chosen.size, revisits=revisits, group_size=8)
        expected_saved += (n - (chosen.size - revisits)) * 8
        returned_total += chosen.size
    assert expected_saved != 0
    assert value(metrics, "rlfeed_curriculum_rollouts_saved_total") == expected_saved
    assert value(metrics, "rlfeed_curriculum_tasks_sampled_total") == returned_total
    assert value(metrics, "rlfeed_curriculum_rollouts_requested_total") == 121 * 8


def test_pass_rate_histogram_counts_tasks_at_or_below_each_bucket():
    rates = np.random.default_rng(3).random(1000)
    rates[:100] = 0.0
    rates[100:150] = 1.0
    metrics = SidecarMetrics()
    metrics.on_curriculum(tasks_inside=850, tasks_outside=150, pass_rates=rates)
    for bound in PASS_RATE_BUCKETS:
        expected = sum(1 for r in rates.tolist() if r <= bound)
        assert value(metrics, "rlfeed_curriculum_pass_rate_bucket", le=repr(bound)) == expected
    assert value(metrics, "rlfeed_curriculum_pass_rate_bucket", le="+Inf") == 1000
    assert value(metrics, "rlfeed_curriculum_pass_rate_gsum") == pytest.approx(rates.sum())
    assert value(metrics, "rlfeed_curriculum_tasks", filter="outside") == 150


def test_steps_served_latency_and_trainer_lag_follow_the_slowest_rank():
    metrics = SidecarMetrics(MetricsConfig(world_size=2))
    for step in range(4):
        metrics.on_step(step_record(step=step), ready_time=100.0 + step)
    assert value(metrics, "rlfeed_trainer_lag_steps") == 4  # nobody fetched: 3 - (-1)
    for step in range(3):
        metrics.on_served(step, 0, now=110.0)
    metrics.on_served(0, 1, now=112.5)
    metrics.on_served(0, 1, now=113.0)  # a restarted rank asks again
    assert value(metrics, "rlfeed_steps_served_total") == 1
    assert value(metrics, "rlfeed_batch_fetches_total") == 4
    assert value(metrics, "rlfeed_batch_refetches_total") == 1
    assert value(metrics, "rlfeed_trainer_lag_steps") == 3  # newest 3, rank 1 at step 0
    assert value(metrics, "rlfeed_steps_waiting") == 3
    assert value(metrics, "rlfeed_step_latency_seconds_sum") == pytest.approx(12.5)
    assert value(metrics, "rlfeed_step_latency_seconds_count") == 1
    with pytest.raises(ValueError, match="rank 2"):
        metrics.on_served(1, 2)


def test_trainer_reports_are_labelled_by_rank_only():
    metrics = SidecarMetrics(MetricsConfig(world_size=2))
    metrics.on_trainer_report(
        step=3, rank=1, loss=0.25, ratio_outlier_share=0.0, tokens_per_second=5000.0,
        step_seconds=1.5,
    )  # fmt: skip
    assert value(metrics, "rlfeed_trainer_loss", rank="1") == 0.25
    assert value(metrics, "rlfeed_trainer_tokens_per_second", rank="1") == 5000.0
    assert value(metrics, "rlfeed_trainer_ratio_outlier_ratio", rank="1") == 0.0
    with pytest.raises(ValueError, match="rank 5 outside"):
        metrics.on_trainer_report(
            step=3, rank=5, loss=0.0, ratio_outlier_share=0.0, tokens_per_second=1.0
        )


def test_metric_names_follow_prometheus_conventions_and_stay_off_the_global_registry():
    metrics = SidecarMetrics()
    families = list(text_string_to_metric_families(metrics.exposition().decode()))
    assert families
    for family in families:
        # ours, and prometheus_client's process health collectors
        assert family.name.startswith(("rlfeed_", "process_", "python_")), family.name
        assert "percent" not in family.name and "gib" not in family.name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples)  # no _created
        for sample in family.samples:
            if sample.name.endswith("_ratio"):
                assert 0.0 <= sample.value <= 1.0
    assert not [n for n in REGISTRY._names_to_collectors if n.startswith("rlfeed_")]
    SidecarMetrics()  # a second instance in the same process does not collide


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def test_the_exporter_serves_process_health_and_the_build_version():
    from rlfeed import __version__
    from rlfeed.service.metrics.exporter import SidecarExporter

    exporter = SidecarExporter(SidecarConfig())
    exporter.start(actor=None, port=0)
    try:
        status, _, body = get(f"{exporter.url}/metrics")
    finally:
        exporter.stop()
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds",
        "process_open_fds",
        "process_start_time_seconds",
        "python_info",
        "python_gc_collections",
    ):
        assert name in families, f"/metrics lacks {name}"
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    (build,) = families["rlfeed_build_info"].samples
    assert (build.name, build.labels, build.value) == (
        "rlfeed_build_info",
        {"version": __version__},
        1.0,
    )


def test_metrics_server_serves_metrics_and_the_newest_layout_on_loopback():
    pytest.importorskip("matplotlib")
    rollouts, columns = make_step(np.random.default_rng(4), groups=4, group_size=4)
    plan = assemble_step(rollouts, StepConfig(token_budget=1200, world_size=2))
    metrics = SidecarMetrics(MetricsConfig(world_size=2))
    with MetricsServer(metrics) as server:
        assert server.host == "127.0.0.1"
        status, content_type, body = get(f"{server.url}/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert b"rlfeed_steps_assembled_total 0.0" in body
        assert get(f"{server.url}/layout.png")[0] == 404
        calls = []

        def layout():
            calls.append(1)
            return layout_from_plan(
                plan, rollouts.lengths, token_budget=1200, offsets=columns.offsets,
                action_mask=columns.action_mask, step=0,
            )  # fmt: skip

        metrics.on_step(record_from_plan(plan, step=0), layout=layout)
        assert calls == []  # rendered lazily
        status, content_type, png = get(f"{server.url}/layout.png")
        assert status == 200 and content_type == "image/png"
        assert png.startswith(b"\x89PNG")
        assert get(f"{server.url}/layout.png")[2] == png and calls == [1]  # cached
        assert get(f"{server.url}/healthz")[0] == 200
    server.stop()  # idempotent


def rejected(config, rollouts, mutate=None) -> ValueError:
    """The error the sidecar's own checks raise for `rollouts` (after `mutate`)."""
    scheduler = Scheduler(config)
    scheduler.register_tasks([*sorted(set(rollouts.task_ids)), "known"])
    if mutate is not None:
        mutate(rollouts)
    try:
        arrays = decode_rollout_batch(rollouts.encode())
        validate_rollout_batch(
            arrays,
            token_budget=config.batching.token_budget,
            vocab_size=config.rollouts.vocab_size,
        )
        scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
    except (ValueError, BackpressureError) as exc:
        return exc
    raise AssertionError("the batch was accepted")


def _actor_reply(config, registered, rollouts):
    """The scheduler actor's reply to the batch (its class run in this process, no Ray);
    None when the front-end's own validation refuses the batch before the actor sees it."""
    actor = SchedulerActor(config)
    actor.register_tasks(registered)
    arrays = decode_rollout_batch(rollouts.encode())
    try:
        validate_rollout_batch(
            arrays,
            token_budget=config.batching.token_budget,
            vocab_size=config.rollouts.vocab_size,
        )
    except InvalidBatchError:
        return None
    [reply] = actor.ingest("front-end", [], [(batch_meta(arrays), None)])
    assert reply.kind is IngestKind.INVALID
    return reply


def _tokens(row, token_ids):
    def mutate(rollouts):
        rollouts.token_ids[row] = np.asarray(token_ids, np.int32)
        rollouts.action_mask[row] = np.zeros(len(token_ids), np.uint8)
        rollouts.sampler_logprobs[row] = np.zeros(len(token_ids), np.float32)

    return mutate


def _set(name, row, value):
    def mutate(rollouts):
        getattr(rollouts, name)[row] = value

    return mutate


@pytest.mark.parametrize(
    ("expected", "mutate"),
    [
        ("too_long", _tokens(0, np.ones(300))),
        ("length_mismatch", _set("action_mask", 1, np.zeros(1, np.uint8))),
        ("non_finite", _set("rewards", 2, float("nan"))),
        ("token_out_of_range", _tokens(3, np.full(5, 5000))),
        ("unknown_task", _set("task_ids", 0, "nobody-registered-me")),
        ("duplicate_in_batch", _set("rollout_ids", 1, "g0-r0")),
        ("group_overflow", _set("group_ids", 4, "g0")),
        ("group_overflow", _set("task_ids", 1, "known")),
        ("malformed", _set("rollout_ids", 2, "")),
        ("bad_action_mask", lambda rollouts: rollouts.action_mask[5].__setitem__(0, 1)),
        ("bad_policy_version", _set("policy_versions", 6, -1)),
        # the first rollout sets the baseline; one far ahead of it is refused
        ("bad_policy_version", _set("policy_versions", 6, 10**12)),
    ],
)
def test_reject_reason_names_what_the_sidecars_own_checks_found(expected, mutate):
    config = SidecarConfig(
        batching=BatchingConfig(token_budget=256), rollouts=RolloutsConfig(vocab_size=1000)
    )
    rollouts = synthetic_groups(
        num_groups=2, group_size=4, rng=np.random.default_rng(0), max_length=64
    )
    registered = [*sorted(set(rollouts.task_ids)), "known"]
    error = rejected(config, rollouts, mutate)
    assert error.reason == expected  # named where the check failed
    assert reject_reason(error) == expected
    # Across the actor boundary the reason travels as a value, not rebuilt from the message.
    reply = _actor_reply(config, registered, rollouts)
    if reply is not None:
        assert reply.reason == expected
        assert reject_reason(InvalidBatchError(reply.message, reason=reply.reason)) == expected


def test_reject_reason_of_undecodable_bytes_and_a_full_buffer():
    with pytest.raises(InvalidBatchError) as info:
        decode_batch(b"not arrow")
    assert reject_reason(info.value) == "malformed"
    assert reject_reason(BackpressureError("buffer full: 10 rollouts buffered")) == "buffer_full"
    assert reject_reason(RuntimeError("something new")) is RejectReason.OTHER


def test_served_responses_become_the_layout_picture_once_every_rank_fetched():
    pytest.importorskip("matplotlib")
    config = SidecarConfig(
        batching=BatchingConfig(token_budget=512, world_size=2),
        rollouts=RolloutsConfig(prompts_per_step=4, group_size=4),
    )
    scheduler = Scheduler(config)
    rollouts = synthetic_groups(
        num_groups=4, group_size=4, rng=np.random.default_rng(5), max_length=200
    )
    scheduler.register_tasks(sorted(set(rollouts.task_ids)))
    arrays = decode_rollout_batch(rollouts.encode())
    scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
    assert assemble_ready_steps(scheduler) == [0]
    metrics = SidecarMetrics(MetricsConfig.from_sidecar_config(config))
    metrics.on_step(scheduler.step_records[-1], ready_time=0.0)
    payload = scheduler.fetch_batch(0, 0).response
    metrics.on_served(0, 0, response=payload, now=1.0)
    assert metrics.latest_layout_png() is None  # rank 1 has not fetched it yet
    metrics.on_served(0, 1, response=scheduler.fetch_batch(0, 1).response, now=2.0)
    step, png = metrics.latest_layout_png()
    assert step == 0 and png.startswith(b"\x89PNG")
    assert value(metrics, "rlfeed_step_latency_seconds_sum") == 2.0
    record = scheduler.step_records[-1]
    assert value(metrics, "rlfeed_step_real_tokens") == record.real_tokens
    assert value(metrics, "rlfeed_step_fill_ratio") == pytest.approx(
        record.real_tokens / (2 * record.microbatches_per_rank * 512)
    )


def test_refresh_pulls_levels_before_a_scrape_at_most_once_per_interval():
    config = SidecarConfig()
    scheduler = Scheduler(config)
    scheduler.register_tasks([f"t{i}" for i in range(30)])
    metrics = SidecarMetrics(MetricsConfig(refresh_interval_s=3600))
    calls = []

    def refresh():
        calls.append(1)
        metrics.on_status(scheduler.status())
        raise RuntimeError("a failing pull is logged, the scrape still answers")

    metrics.set_refresh(refresh)
    assert b"rlfeed_curriculum_tasks" in metrics.exposition()
    metrics.exposition()
    assert calls == [1]
    assert value(metrics, "rlfeed_curriculum_tasks", filter="inside") == 30

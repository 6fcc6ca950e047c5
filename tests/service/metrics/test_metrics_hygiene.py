"""What an operator's dashboards and alerts read: a full buffer is backpressure, not a
rejection; no `*_created` series; HELP texts that say what is counted and in which unit;
whether token ids are checked against a vocabulary."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rlfeed.service.codec.messages import decode_rollout_batch
from rlfeed.service.codec.rollout_batch import batch_meta, validate_batch
from rlfeed.service.config import BatchingConfig, RolloutsConfig, SidecarConfig
from rlfeed.service.errors import BackpressureError, InvalidBatchError
from rlfeed.service.inprocess import assemble_ready_steps
from rlfeed.service.metrics.exporter import MetricsEvents
from rlfeed.service.metrics.recorder import REJECT_REASONS, MetricsConfig, SidecarMetrics
from rlfeed.service.scheduler.state import Scheduler
from rlfeed.service.testing import synthetic_groups


def _value(metrics: SidecarMetrics, name: str, **labels: str) -> float:
    sample = metrics.registry.get_sample_value(name, labels)
    assert sample is not None, f"{name}{labels} is not exported"
    return sample


def _families(metrics: SidecarMetrics):
    return list(text_string_to_metric_families(metrics.exposition().decode()))


def _refusal(scheduler: Scheduler, rollouts) -> Exception:
    arrays = decode_rollout_batch(rollouts.encode())
    with pytest.raises((BackpressureError, InvalidBatchError)) as info:
        validate_batch(arrays, scheduler.config)
        scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
    return info.value


def test_a_full_buffer_is_counted_as_backpressure_not_as_a_rejected_batch():
    config = SidecarConfig(
        batching=BatchingConfig(token_budget=1024),
        rollouts=RolloutsConfig(prompts_per_step=2, group_size=2, max_buffered_rollouts=4),
    )
    scheduler = Scheduler(config)
    rng = np.random.default_rng(0)
    first = synthetic_groups(num_groups=2, group_size=2, rng=rng, prefix="a-")
    scheduler.register_tasks([*sorted(set(first.task_ids)), "t-late"])
    arrays = decode_rollout_batch(first.encode())
    scheduler.ingest_batch(batch_meta(arrays), arrays.columns)
    assert assemble_ready_steps(scheduler) == [0]  # a step waits for its rank: no room
    metrics = SidecarMetrics(MetricsConfig.from_sidecar_config(config))
    events = MetricsEvents(metrics, config)

    late = synthetic_groups(num_groups=1, group_size=2, rng=rng, prefix="b-", tasks=["t-late"])
    full = _refusal(scheduler, late)
    assert isinstance(full, BackpressureError)
    events.on_reject(full, rollouts=2, tokens=100)
    events.on_reject(full, rollouts=2, tokens=100)  # the producer retried, still full

    assert _value(metrics, "rlfeed_ingest_batches_backpressured_total") == 2
    assert "buffer_full" not in REJECT_REASONS
    for reason in REJECT_REASONS:
        assert _value(metrics, "rlfeed_ingest_batches_rejected_total", reason=reason) == 0
    assert (
        metrics.registry.get_sample_value(
            "rlfeed_ingest_batches_rejected_total", {"reason": "buffer_full"}
        )
        is None
    )

    bad = synthetic_groups(num_groups=1, group_size=2, rng=rng, prefix="c-", tasks=["t-late"])
    bad.rewards[0] = float("nan")
    invalid = _refusal(scheduler, bad)
    events.on_reject(invalid, rollouts=2, tokens=50)
    assert _value(metrics, "rlfeed_ingest_batches_rejected_total", reason="non_finite") == 1
    assert _value(metrics, "rlfeed_ingest_batches_backpressured_total") == 2


def test_no_created_series_are_exported_and_other_registries_keep_theirs():
    metrics = SidecarMetrics()
    metrics.on_reject("too_long", rollouts=1, tokens=10)
    metrics.on_ingest(accepted=1, ack_seconds=0.01)
    text = metrics.exposition().decode()
    assert "_created" not in text
    assert 'rlfeed_ingest_batches_rejected_total{reason="too_long"} 1.0' in text
    assert "rlfeed_ingest_ack_latency_seconds_count 1.0" in text
    # Filtered on the way out, not switched off for the whole process.
    other = CollectorRegistry()
    Counter("someone_elses", "A counter of another library.", registry=other).inc()
    assert b"someone_elses_created" in generate_latest(other)


def test_every_help_text_is_a_sentence_that_names_the_unit():
    for family in _families(SidecarMetrics()):
        if not family.name.startswith("rlfeed_"):
            continue  # prometheus_client's process_* and python_* collectors
        doc = family.documentation
        assert re.fullmatch(r"[A-Z].*[.)]", doc), (family.name, doc)
        assert len(doc.split()) >= 4, (family.name, doc)
        for suffix, unit in (
            ("_seconds", "second"),
            ("_bytes", "byte"),
            ("_tokens", "token"),
            ("_positions", "position"),
            ("_per_second", "per second"),
        ):
            if family.name.removesuffix("_total").endswith(suffix):
                assert unit in doc.lower(), (family.name, doc)


@pytest.mark.parametrize("vocab_size", [0, 151_936])
def test_the_vocab_size_checked_is_exported_and_zero_means_unchecked(vocab_size: int):
    config = SidecarConfig(rollouts=RolloutsConfig(vocab_size=vocab_size))
    metrics = SidecarMetrics(MetricsConfig.from_sidecar_config(config))
    assert _value(metrics, "rlfeed_rollouts_vocab_size") == vocab_size
    (family,) = [f for f in _families(metrics) if f.name == "rlfeed_rollouts_vocab_size"]
    assert "0 means" in family.documentation and "[rollouts] vocab_size" in family.documentation

"""A live sidecar's metrics equal what its clients submitted and its trainer ranks were served.

Real gRPC on loopback and a real Ray actor, with the front-end's hooks wired to the metrics
by `MetricsEvents` and read back over the metrics HTTP endpoint, as Prometheus reads them.
Every expected value is computed independently: token counts, padding and zero-advantage
shares from the GetBatch responses the ranks received (and the rewards submitted), GPU time
by hand from the roofline, pass-rate buckets from the rewards of each task's group.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc
from rlfeed.sched.compute import model_attention_weight
from rlfeed.sched.models import GPUS, MODELS, kv_bytes_per_token, param_count
from rlfeed.service.codec.messages import decode_microbatch
from rlfeed.service.metrics.exporter import SidecarExporter
from rlfeed.service.testing import SyntheticRollouts, synthetic_groups

ACCOUNTING = {  # deliberately not the defaults: the [accounting] section must reach pricing
    "model": "qwen3-0.6b",
    "gpu": "h100",
    "mfu": 0.3,
    "decode_batch": 32,
    "decode_context": 8192,
    "busy_fraction": 0.25,
    "logprob_forward_passes": 1,
}


@pytest.fixture
def live_sidecar(make_sidecar):
    """live_sidecar(**sections) -> (sidecar, exporter serving /metrics on a free port)."""
    exporters: list[SidecarExporter] = []

    def events(config):
        exporters.append(SidecarExporter(config))
        return exporters[-1].events

    def make(**sections):
        sidecar = make_sidecar(events=events, **sections)
        exporters[-1].start(sidecar.actor, port=0)
        return sidecar, exporters[-1]

    try:
        yield make
    finally:
        for exporter in exporters:  # before make_sidecar stops the actors
            exporter.stop()


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.ingest = pb_grpc.RolloutIngestStub(self.channel)
        self.tasks = pb_grpc.TaskSamplingStub(self.channel)
        self.batches = pb_grpc.BatchServingStub(self.channel)
        self.status = pb_grpc.SidecarStatusStub(self.channel)

    def submit(self, rollouts: SyntheticRollouts, rows=None) -> pb.SubmitAck:
        batch = pb.RolloutBatch(arrow_ipc=rollouts.encode(rows))
        return self.ingest.SubmitRolloutBatch(batch, timeout=30)

    def step(self, step: int, world_size: int) -> list[pb.GetBatchResponse]:
        return [
            self.batches.GetBatch(
                pb.GetBatchRequest(step=step, rank=rank, timeout_ms=10_000), timeout=30
            )
            for rank in range(world_size)
        ]


@pytest.fixture
def client_for():
    clients: list[Client] = []

    def make(sidecar) -> Client:
        clients.append(Client(sidecar.address))
        return clients[-1]

    yield make
    for client in clients:
        client.channel.close()


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, keyed by (name, labels)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_after_steps(url: str, steps: int, timeout_s: float = 10.0) -> dict:
    """A scrape once `steps` steps were reported assembled (the step hook may run just after
    the step became fetchable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if metric(samples, "rlfeed_steps_assembled_total") >= steps:
            return samples
        assert time.monotonic() < deadline, f"{steps} steps never reported"
        time.sleep(0.1)


def metric(samples: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"{name}{labels} is not exported"
    return samples[key]


def served_step_figures(responses: list[pb.GetBatchResponse], submitted: SyntheticRollouts):
    """The step's figures, counted one served sequence at a time."""
    row_of = submitted.row_of()
    lengths, microbatch_tokens, policy_tokens, rewards_of_group = [], [], 0, {}
    slot_tokens = np.zeros((len(responses), len(responses[0].microbatches)))  # [rank, slot]
    slot_compute = np.zeros_like(slot_tokens)  # tokens + w L^2 with the model's own weight
    weight = model_attention_weight(ACCOUNTING["model"])
    for rank, response in enumerate(responses):
        for slot, message in enumerate(response.microbatches):
            arrays = decode_microbatch(message)
            cu = arrays["cu_seqlens"]
            microbatch_tokens.append(int(cu[-1]))
            slot_tokens[rank, slot] = cu[-1]  # a packed microbatch's cost: its tokens
            policy_tokens += int(arrays["loss_mask"].sum())
            for k, rollout_id in enumerate(message.rollout_ids):
                lengths.append(int(cu[k + 1] - cu[k]))
                slot_compute[rank, slot] += lengths[-1] + weight * lengths[-1] ** 2
                row = row_of[rollout_id]
                rewards_of_group.setdefault(submitted.group_ids[row], set()).add(
                    submitted.rewards[row]
                )
    real = sum(lengths)
    return {
        "rollouts": len(lengths),
        "real": real,
        "computed": sum(microbatch_tokens),  # packed rows compute exactly their tokens
        "padded": len(lengths) * max(lengths),
        "policy": policy_tokens,
        "microbatches": len(microbatch_tokens),
        "largest": max(microbatch_tokens),
        "groups": len(rewards_of_group),
        "zero_groups": sum(len(r) == 1 for r in rewards_of_group.values()),
        "imbalance": slot_tokens.sum(axis=1).max() / slot_tokens.sum(axis=1).mean(),
        # Ranks wait for each other at every slot: time is the slot's costliest microbatch.
        "lockstep": slot_tokens.sum() / (len(responses) * slot_tokens.max(axis=0).sum()),
        "compute_imbalance": slot_compute.sum(axis=1).max() / slot_compute.sum(axis=1).mean(),
        "compute_lockstep": slot_compute.sum() / (len(responses) * slot_compute.max(axis=0).sum()),
    }


def hand_priced_gpu_seconds(step: dict) -> dict[str, float]:
    """The roofline by hand (chapter 14.6) under ACCOUNTING: decode reads the weights and
    b x c KV entries per b tokens; training 6N FLOPs per position at mfu; a log-prob pass 2N;
    ranks idle in lockstep are paid for, so training and log-prob passes take 1 / (compute
    lockstep efficiency) as long."""
    policy, computed, padded = step["policy"], step["computed"], step["padded"]
    arch, gpu = MODELS[ACCOUNTING["model"]], GPUS[ACCOUNTING["gpu"]]
    n_params, b = param_count(arch), ACCOUNTING["decode_batch"]
    seconds_per_decode_step = (
        n_params * arch.weight_bytes_per_param
        + b * ACCOUNTING["decode_context"] * kv_bytes_per_token(arch)
    ) / gpu.memory_bandwidth_bytes_per_s
    train_per_position = 6 * n_params / (ACCOUNTING["mfu"] * gpu.dense_bf16_flops_per_s)
    logprob_factor = ACCOUNTING["logprob_forward_passes"] * 2 / 6
    return {
        "decode": policy * seconds_per_decode_step / b / ACCOUNTING["busy_fraction"],
        "train": computed * train_per_position / step["compute_lockstep"],
        "logprob": computed * train_per_position * logprob_factor / step["compute_lockstep"],
        "idle": computed
        * train_per_position
        * (1 + logprob_factor)
        * (1 / step["compute_lockstep"] - 1),
        "avoided": (padded - computed) * train_per_position * (1 + logprob_factor),
    }


def test_live_metrics_equal_what_the_served_microbatches_contain(live_sidecar, client_for):
    world_size, budget, group_size = 2, 512, 4
    sidecar, exporter = live_sidecar(
        rollouts={"prompts_per_step": 4, "group_size": group_size, "vocab_size": 1000},
        batching={"world_size": world_size, "token_budget": budget},
        curriculum={"estimator": "last"},  # a visited task's estimate = its group's mean
        accounting=ACCOUNTING,
    )
    client = client_for(sidecar)
    tasks = [f"t{j}" for j in range(10)]  # t8, t9 stay unvisited
    client.tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=tasks), timeout=10)
    rollouts = synthetic_groups(
        num_groups=8, group_size=group_size, rng=np.random.default_rng(3), tasks=tasks[:8]
    )
    rollouts.rewards[0:4] = [1.0] * 4  # t0 all pass
    rollouts.rewards[20:24] = [0.0] * 4  # t5 all fail
    for rows in (range(0, 11), range(11, 21), range(21, 32)):  # groups span batches
        client.submit(rollouts, rows)
    steps = [client.step(step, world_size) for step in (0, 1)]
    figures = [served_step_figures(responses, rollouts) for responses in steps]
    sampled = client.tasks.SampleTasks(pb.SampleTasksRequest(n=3), timeout=10)
    for step, outliers in ((0, {"ratio_outlier_share": 0.02}), (1, {})):  # unset: not measured
        client.batches.ReportTrainerMetrics(
            pb.TrainerReport(
                step=step, rank=1, loss=0.5 - step, **outliers,
                tokens_per_second=1000.0 * (step + 1), step_seconds=0.25,
            ),
            timeout=10,
        )  # fmt: skip
    m = scrape_after_steps(exporter.url, 2)
    newest, both = figures[1], {k: sum(f[k] for f in figures) for k in figures[0]}

    # Ingest, as submitted.
    assert metric(m, "rlfeed_ingest_batches_total") == 3
    assert metric(m, "rlfeed_ingest_rollouts_accepted_total") == 32
    assert metric(m, "rlfeed_ingest_tokens_accepted_total") == sum(
        t.size for t in rollouts.token_ids
    )
    assert metric(m, "rlfeed_ingest_ack_latency_seconds_count") == 3
    assert metric(m, "rlfeed_buffered_rollouts") == 0 and metric(m, "rlfeed_buffered_bytes") == 0
    # The newest step's gauges, as served.
    assert metric(m, "rlfeed_step") == 1
    assert metric(m, "rlfeed_step_rollouts") == newest["rollouts"] == 16
    assert metric(m, "rlfeed_step_real_tokens") == newest["real"]
    assert metric(m, "rlfeed_step_policy_tokens") == newest["policy"]
    assert newest["policy"] == steps[1][0].policy_token_count
    assert metric(m, "rlfeed_step_computed_positions") == newest["computed"] == newest["real"]
    assert metric(m, "rlfeed_step_padded_positions") == newest["padded"]
    assert metric(m, "rlfeed_step_padding_ratio") == 0.0
    assert metric(m, "rlfeed_step_padded_alternative_padding_ratio") == pytest.approx(
        (newest["padded"] - newest["real"]) / newest["padded"]
    )
    assert metric(m, "rlfeed_step_microbatches") == newest["microbatches"]
    assert metric(m, "rlfeed_step_microbatches_per_rank") == len(steps[1][0].microbatches)
    assert metric(m, "rlfeed_step_largest_microbatch_positions") == newest["largest"]
    assert metric(m, "rlfeed_step_fill_ratio") == pytest.approx(
        newest["real"] / (newest["microbatches"] * budget)
    )
    assert metric(m, "rlfeed_step_rank_imbalance") == pytest.approx(newest["imbalance"])
    assert metric(m, "rlfeed_step_lockstep_efficiency_ratio") == pytest.approx(newest["lockstep"])
    assert metric(m, "rlfeed_step_compute_rank_imbalance") == pytest.approx(
        newest["compute_imbalance"]
    )
    assert metric(m, "rlfeed_step_compute_lockstep_efficiency_ratio") == pytest.approx(
        newest["compute_lockstep"]
    )
    assert metric(m, "rlfeed_step_zero_advantage_groups_ratio") == pytest.approx(
        newest["zero_groups"] / newest["groups"]
    )
    # Counters over both steps, and the trailing window (both steps are inside it).
    assert metric(m, "rlfeed_steps_assembled_total") == 2
    assert metric(m, "rlfeed_real_tokens_total") == both["real"]
    assert metric(m, "rlfeed_policy_tokens_total") == both["policy"]
    assert metric(m, "rlfeed_padded_alternative_positions_total") == both["padded"]
    assert metric(m, "rlfeed_groups_total") == both["groups"] == 8
    assert metric(m, "rlfeed_zero_advantage_groups_total") == both["zero_groups"] >= 2
    assert metric(m, "rlfeed_zero_advantage_groups_window_ratio") == pytest.approx(
        both["zero_groups"] / both["groups"]
    )
    # Predicted GPU time of the newest step, and of both.
    step_hand = hand_priced_gpu_seconds(newest)
    priced = [hand_priced_gpu_seconds(f) for f in figures]
    total_hand = {k: sum(p[k] for p in priced) for k in step_hand}
    for phase in ("decode", "train", "logprob"):
        assert metric(m, "rlfeed_step_predicted_gpu_seconds", phase=phase) == pytest.approx(
            step_hand[phase], rel=1e-9
        )
        assert metric(m, "rlfeed_predicted_gpu_seconds_total", phase=phase) == pytest.approx(
            total_hand[phase], rel=1e-9
        )
    assert metric(m, "rlfeed_step_padding_avoided_gpu_seconds") == pytest.approx(
        step_hand["avoided"], rel=1e-9
    )
    assert metric(m, "rlfeed_padding_avoided_gpu_seconds_total") == pytest.approx(
        total_hand["avoided"], rel=1e-9
    )
    assert metric(m, "rlfeed_lockstep_idle_gpu_seconds_total") == pytest.approx(
        total_hand["idle"], rel=1e-9
    )
    # Serving health: both ranks fetched both steps once.
    assert metric(m, "rlfeed_steps_served_total") == 2
    assert metric(m, "rlfeed_batch_fetches_total") == 4
    assert metric(m, "rlfeed_step_latency_seconds_count") == 2
    assert metric(m, "rlfeed_trainer_lag_steps") == 0 and metric(m, "rlfeed_steps_waiting") == 0
    # Curriculum: the filter and the histogram from each task's group mean (0.5 unvisited).
    estimates = {task: 0.5 for task in tasks}
    for g in range(8):
        estimates[tasks[g]] = float(np.mean(rollouts.rewards[g * group_size :][:group_size]))
    values = np.array(list(estimates.values()))
    inside = int(((values > 0) & (values < 1)).sum())
    assert metric(m, "rlfeed_curriculum_tasks", filter="inside") == inside
    assert metric(m, "rlfeed_curriculum_tasks", filter="outside") == len(tasks) - inside
    for bucket in (0.0, 0.2, 0.3, 0.5, 0.7, 0.9999, 1.0):
        assert metric(m, "rlfeed_curriculum_pass_rate_bucket", le=repr(bucket)) == int(
            (values <= bucket).sum()
        ), bucket
    assert metric(m, "rlfeed_curriculum_pass_rate_gcount") == len(tasks)
    assert metric(m, "rlfeed_curriculum_pass_rate_gsum") == pytest.approx(values.sum())
    returned = len(sampled.task_ids)
    assert metric(m, "rlfeed_curriculum_tasks_requested_total") == 3
    assert metric(m, "rlfeed_curriculum_revisits_total") == sum(sampled.revisit)
    filtered = returned - sum(sampled.revisit)
    assert metric(m, "rlfeed_curriculum_rollouts_saved_total") == (3 - filtered) * group_size
    # Trainer reports: the NaN of step 1 left step 0's outlier share in place.
    assert metric(m, "rlfeed_trainer_ratio_outlier_ratio", rank="1") == pytest.approx(0.02)
    assert metric(m, "rlfeed_trainer_loss", rank="1") == -0.5
    assert metric(m, "rlfeed_trainer_tokens_per_second", rank="1") == 2000.0
    assert metric(m, "rlfeed_trainer_step", rank="1") == 1


def test_stale_and_rejected_rollouts_are_counted_with_their_tokens_and_reasons(
    live_sidecar, client_for
):
    sidecar, exporter = live_sidecar(
        rollouts={"prompts_per_step": 2, "group_size": 4, "max_policy_lag": 2},
        batching={"token_budget": 256},
    )
    client = client_for(sidecar)
    client.tasks.RegisterTasks(pb.RegisterTasksRequest(task_ids=["t0", "t1"]), timeout=10)
    rng = np.random.default_rng(5)

    def group(prefix: str, version: int, task: str = "t0") -> SyntheticRollouts:
        return synthetic_groups(
            num_groups=1, group_size=4, rng=rng, tasks=[task], prefix=prefix,
            max_length=64, policy_version=version,
        )  # fmt: skip

    def tokens(rollouts: SyntheticRollouts, rows=range(4)) -> int:
        return sum(rollouts.token_ids[row].size for row in rows)

    partial = group("a-", version=0)
    client.submit(partial, range(2))  # buffered, waiting for its other two rollouts
    ack = client.submit(group("b-", version=5))  # newest 5: the partial group went stale
    assert (ack.accepted, ack.stale) == (4, 0)
    late = group("c-", version=1)
    assert client.submit(late).stale == 4  # itself stale
    too_long = group("d-", version=5)
    too_long.token_ids[2] = np.ones(300, np.int32)  # > token budget 256: rejected up front
    too_long.action_mask[2] = np.zeros(300, np.uint8)
    too_long.sampler_logprobs[2] = np.zeros(300, np.float32)
    unknown = group("e-", version=5, task="nobody-registered-me")  # rejected by the actor
    for rollouts in (too_long, unknown):
        with pytest.raises(grpc.RpcError) as info:
            client.submit(rollouts)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    m = scrape(exporter.url)
    status = client.status.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert metric(m, "rlfeed_ingest_rollouts_stale_total") == 2 + 4
    assert status.counters.rollouts_stale == 6
    assert metric(m, "rlfeed_ingest_tokens_stale_total") == tokens(partial, range(2)) + tokens(late)
    for reason, rollouts in (("too_long", too_long), ("unknown_task", unknown)):
        assert metric(m, "rlfeed_ingest_batches_rejected_total", reason=reason) == 1
        assert metric(m, "rlfeed_ingest_rollouts_rejected_total", reason=reason) == 4
        assert metric(m, "rlfeed_ingest_tokens_rejected_total", reason=reason) == tokens(rollouts)
    assert metric(m, "rlfeed_ingest_batches_rejected_total", reason="other") == 0


@pytest.mark.slow
def test_rlfeed_serve_metrics_port_serves_on_loopback_until_sigterm(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        metrics_port = sock.getsockname()[1]
    config = tmp_path / "rlfeed.toml"
    config.write_text('[server]\nhost = "0.0.0.0"\n\n[ray]\nactor_name = "serve-metrics"\n')
    command = [sys.executable, "-m", "rlfeed.service.cli", "serve", "--config", str(config)]
    process = subprocess.Popen(
        [*command, "--port", "0", "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        output = "".join(lines)
        # gRPC serves other machines, the metrics port stays on loopback.
        assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in output, output
        url = f"http://127.0.0.1:{metrics_port}"
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as response:
            assert response.read() == b"ok\n"
        samples = scrape(url)
        assert metric(samples, "rlfeed_curriculum_tasks", filter="inside") == 0
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{url}/layout.png", timeout=10)
        assert info.value.code == 404  # no step yet
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=30)
        assert process.returncode == 0, output + rest
        assert "rlfeed serve: stopped" in rest
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/healthz", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_a_taken_metrics_port_is_an_error_naming_the_address() -> None:
    import socket

    from rlfeed.service.config import SidecarConfig, with_overrides

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = SidecarExporter(with_overrides(SidecarConfig(), server={"metrics_port": port}))
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}: "):
            exporter.start(actor=None)


def test_rlfeed_serve_with_a_taken_metrics_port_fails_before_starting_anything() -> None:
    """`rlfeed serve` binds its metrics endpoint first: with the port taken it exits 1
    naming the address, before Ray or the gRPC port start (a replica so fails before it
    registers with the actor)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        serve = subprocess.run(
            [sys.executable, "-m", "rlfeed", "serve", "--port", "0", "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert serve.returncode == 1, serve.stderr[-2000:]
    assert f"cannot serve metrics on 127.0.0.1:{port}" in serve.stderr
    assert "Started a local Ray instance" not in serve.stderr
    assert "listening on" not in serve.stdout

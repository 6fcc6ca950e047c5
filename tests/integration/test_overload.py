"""Overload: producers far faster than the trainer, against a real `rlfeed serve` with a
small `[rollouts] max_buffered_bytes`. The memory of the sidecar's processes (the serve
process and every Ray process under it: VmRSS from /proc) stays under its idle figure plus
the bound plus a stated overhead; every refusal is RESOURCE_EXHAUSTED; nothing accepted is
lost (accepted = trained + buffered + expired, and every step is served).

The slow test: three phases on one sidecar, each 10 s long: two writers of complete
groups of 8k-token rollouts and no trainer; the same plus a writer that sends only the
first rollout of every group (never completing one) and a slow trainer; 64k-token
complete groups, the partial writer and the slow trainer. Then the trainer drains what the
writers still hold. The default run's short tests share one run (about 20 s, most of it
start-up): the first two phases, 3 s each, 8k tokens only, under a 64 MiB bound. Its
memory check is an expected failure for now: the serve process grows while it refuses
batches (the xfail's reason has the figures).

Run: pytest -m slow tests/integration/test_overload.py -s (it prints the RSS figures).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rlfeed.client.producer import RolloutWriter
from rlfeed.client.transport import BufferFullError, GrpcTransport, SidecarError

_spec = importlib.util.spec_from_file_location(
    "sidecar_memory", Path(__file__).with_name("sidecar_memory.py")
)
sidecar_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sidecar_memory)
MIB, Sampler = sidecar_memory.MIB, sidecar_memory.Sampler
GROUP_SIZE = 8
RETAINED_STEPS, RETAINED_FREE_MIB = 2, 64


def step_bytes(tokens: int) -> int:
    """The responses of a step of 64 `tokens`-token rollouts, 21 B a token."""
    return 64 * tokens * 21


def overhead(largest_step: int, writers: int) -> int:
    """What the sidecar holds beyond its idle processes and the bound, all in the serve
    process: the `retained_steps` steps every rank fetched, the responses of the steps the
    last batch taken completed (the bound's stated slack) and one response on its way to
    the trainer (gRPC's copy): a largest step each; glibc's retained free heap
    (`retained_free_mib`); the batches in flight, on the wire and decoded (writers x
    max_in_flight 2 x 8 MiB, twice); and 128 MiB for the allocator's fragmentation and
    transient copies."""
    return (RETAINED_STEPS + 2) * largest_step + (
        RETAINED_FREE_MIB + writers * 2 * 8 * 2 + 128
    ) * MIB


def config_text(bound: int) -> str:
    """The sidecar's config; a message fits the bound (batches are 8 MiB at most)."""
    return f"""
[server]
max_message_bytes = {min(bound, 128 * MIB)}
retained_free_mib = {RETAINED_FREE_MIB}
[ray]
actor_name = "overload-under-test"
[batching]
world_size = 1
token_budget = 65536
retained_steps = {RETAINED_STEPS}
[rollouts]
prompts_per_step = 8
group_size = {GROUP_SIZE}
max_buffered_bytes = {bound}
"""


class Refusals(GrpcTransport):
    """A GrpcTransport counting every error a submission got, by gRPC code, and timing
    every submission acknowledged."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.codes: dict[str, int] = {}
        self.acked: list[tuple[float, float, int]] = []  # (sent at, seconds to ack, accepted)
        self._lock = threading.Lock()

    def _counted(self, submit, request):
        started = time.monotonic()
        try:
            ack = submit(request)
        except SidecarError as exc:
            with self._lock:
                self.codes[exc.code] = self.codes.get(exc.code, 0) + 1
            raise
        with self._lock:
            self.acked.append((started, time.monotonic() - started, ack.accepted))
        return ack

    def submit(self, batch):
        return self._counted(super().submit, batch)

    def submit_serialized(self, request):
        return self._counted(super().submit_serialized, request)


class Producer(threading.Thread):
    """Writes groups of `length`-token rollouts as fast as it can until stopped; with
    `partial`, only the first rollout of every group. Blocks in `write()` while the
    sidecar is full, waking every second to see whether it should stop."""

    def __init__(self, name: str, transport: Refusals, length: int, partial: bool) -> None:
        super().__init__(name=name, daemon=True)
        self.transport, self.length, self.partial = transport, length, partial
        self.stop = threading.Event()
        self.written = 0
        self.error: BaseException | None = None
        self.writer = RolloutWriter(
            transport,
            max_batch_rollouts=64,
            max_buffered_rollouts=128,
            max_in_flight=2,
            block_timeout_s=1.0,
        )
        rng = np.random.default_rng(len(name))
        self.tokens = rng.integers(0, 1000, length).astype(np.int32)
        self.mask = np.r_[np.zeros(length // 4, np.uint8), np.ones(length - length // 4, np.uint8)]
        self.logprobs = np.where(self.mask == 1, -0.5, 0.0).astype(np.float32)

    def run(self) -> None:
        try:
            group = 0
            while not self.stop.is_set():
                for k in range(1 if self.partial else GROUP_SIZE):
                    self._write(group, k)
                group += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _write(self, group: int, k: int) -> None:
        """Rollout k of `group`, waiting while the writer is full (unless stopped)."""
        while not self.stop.is_set():
            try:
                self.writer.write(
                    rollout_id=f"{self.name}-g{group}-r{k}",
                    task_id=f"task-{group % 4}",
                    group_id=f"{self.name}-g{group}",
                    policy_version=0,
                    reward=float(k % 2),
                    token_ids=self.tokens,
                    action_mask=self.mask,
                    sampler_logprobs=self.logprobs,
                )
                self.written += 1
                return
            except BufferFullError:  # the writer's own bound: the sidecar refuses its batches
                continue


class SlowTrainer(threading.Thread):
    """Fetches steps one at a time, `pause_s` apart (rank 0 of world size 1)."""

    def __init__(self, address: str, pause_s: float) -> None:
        super().__init__(name="slow-trainer", daemon=True)
        self.transport = GrpcTransport(address)
        self.pause_s = pause_s
        self.stop = threading.Event()
        self.next_step = 0

    def run(self) -> None:
        while not self.stop.is_set():
            if self.transport.get_batch_view(self.next_step, 0, 1.0).ready:
                self.next_step += 1
                self.stop.wait(self.pause_s)


@dataclass(frozen=True)
class Phase:
    """Writers started when the phase begins: (name, rollout tokens, partial groups only)."""

    writers: list[tuple[str, int, bool]]
    trainer: bool = False  # the slow trainer starts with this phase
    stop: tuple[str, ...] = ()  # writers that stop when this phase begins


FULL_8K = [("full-8k-a", 8192, False), ("full-8k-b", 8192, False)]
PARTIAL_8K = [("partial-8k", 8192, True)]


@contextlib.contextmanager
def overloaded_serve(
    directory: Path, bound: int, launcher: tuple[str, ...] = ("-m", "rlfeed"), *flags: str
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A real `rlfeed serve` with `[rollouts] max_buffered_bytes = bound`: (process,
    address); stopped (SIGTERM, then kill) on the way out. `python LAUNCHER serve ...
    FLAGS`: another launcher (`slow_disk_serve.py`), more flags."""
    config = directory / "overload.toml"
    config.write_text(config_text(bound))
    command = [
        sys.executable, *launcher, "serve", "--config", str(config), "--port", "0", *flags
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        address = None
        while address is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line or server.poll() is None, "rlfeed serve exited during start-up"
            if line.startswith("rlfeed serve: listening on "):
                address = line.split()[4]
        assert address is not None, "rlfeed serve did not print its address"
        yield server, address
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_stays_under_the_byte_bound_when_producers_outrun_the_trainer(
    tmp_path, caplog
) -> None:
    phases = [
        Phase(FULL_8K),
        Phase(PARTIAL_8K, trainer=True),
        # The 8k writers of complete groups stop; the others go on.
        Phase([("full-64k", 65536, False)], stop=("full-8k-a", "full-8k-b")),
    ]
    bound = 256 * MIB
    with (
        overloaded_serve(tmp_path, bound) as (server, address),
        caplog.at_level(logging.WARNING, logger="rlfeed.client.transport"),
    ):
        outcome = overload(server, address, phases, 10.0)
    outcome.check_refusals_and_nothing_lost()
    outcome.check_memory(bound, overhead(step_bytes(65536), writers=4))
    assert any("is full" in record.getMessage() for record in caplog.records)


SHORT_BOUND = 64 * MIB


@pytest.fixture(scope="module")
def short_overload(tmp_path_factory) -> Outcome:
    """The slow test's first two phases, 3 s each, 8k tokens, a 64 MiB bound: one run
    (about 20 s, most of it start-up) for the checks below."""
    with overloaded_serve(tmp_path_factory.mktemp("overload"), SHORT_BOUND) as (server, address):
        return overload(server, address, [Phase(FULL_8K), Phase(PARTIAL_8K, trainer=True)], 3.0)


@pytest.mark.timeout(120)
def test_a_short_overload_refuses_only_resource_exhausted_and_loses_nothing(
    short_overload,
) -> None:
    short_overload.check_refusals_and_nothing_lost(expiry_seen=False)


@pytest.mark.timeout(120)
@pytest.mark.xfail(
    reason="issue 27: the serve process grows ~30 MiB/s while it refuses every batch (held_bytes "
    "flat at 53 MiB), to a plateau ~520 MiB over its idle figure after ~12 s (the same with "
    "retained_free_mib 0): more than a 64 MiB bound plus the stated overhead (330 MiB)",
    strict=False,
)
def test_a_short_overload_keeps_memory_within_the_bound_and_the_stated_overhead(
    short_overload,
) -> None:
    short_overload.check_memory(SHORT_BOUND, overhead(step_bytes(8192), writers=3))


@dataclass
class Outcome:
    """What an overload run saw: the sidecar's memory, the refusals the writers got, the
    rollouts written, and the sidecar's final status."""

    memory: Sampler
    refusals: dict[str, int]
    acked: list[tuple[float, float, int]]  # (sent at, seconds to ack, accepted) a batch
    written: int
    written_partial: int
    trained_through: int  # the trainer's next step
    final: Any  # StatusResponse after the drain

    def check_refusals_and_nothing_lost(self, expiry_seen: bool = True) -> None:
        """`expiry_seen`: the run was long enough for the bound to drop open groups (a
        short one may end first)."""
        counters = self.final.counters
        assert set(self.refusals) == {"RESOURCE_EXHAUSTED"} and self.refusals["RESOURCE_EXHAUSTED"]
        assert counters.rollouts_received == self.written  # every write acknowledged
        assert counters.rollouts_accepted == (
            counters.rollouts_trained + self.final.buffered_rollouts + counters.rollouts_expired
        )
        # Only groups that never complete are dropped (the bound's rule), none complete.
        assert expiry_seen <= counters.rollouts_expired <= self.written_partial
        assert list(self.final.steps_waiting) == []
        assert self.trained_through == self.final.next_step

    def check_memory(self, bound: int, stated_overhead: int) -> None:
        print(
            f"\n{self.memory.report()}\nbound {bound / MIB:.0f} MiB + overhead "
            f"{stated_overhead / MIB:.0f} MiB"
        )
        assert self.memory.peak <= self.memory.idle + bound + stated_overhead


def overload(
    server: subprocess.Popen,
    address: str,
    phases: list[Phase],
    phase_s: float,
    *,
    trainer_pause_s: float = 0.5,
    on_phase: Callable[[int], None] = lambda number: None,
    samples: list | None = None,
) -> Outcome:
    """Run `phases`, `phase_s` each, sampling the sidecar's RSS every 0.25 s; let the
    trainer drain what the writers hold; print the figures. `on_phase(number)` runs as
    each phase begins; `samples` gets (phase, seconds, held bytes, writers' unacknowledged
    rollouts) at each sample."""
    status = GrpcTransport(address)
    status.register_tasks([f"task-{k}" for k in range(4)])
    time.sleep(2.0)  # let start-up settle before the idle figure
    memory = Sampler(server.pid)
    refusals = Refusals(address)
    trainer = SlowTrainer(address, pause_s=trainer_pause_s)
    producers: list[Producer] = []
    for number, phase in enumerate(phases):
        on_phase(number)
        if phase.trainer:
            trainer.start()
        for producer in producers:
            if producer.name in phase.stop:
                producer.stop.set()
        for name, length, partial in phase.writers:
            producers.append(Producer(name, refusals, length, partial))
            producers[-1].start()
        ends = time.monotonic() + phase_s
        while time.monotonic() < ends:
            memory.sample(number)
            if samples is not None:
                held = status.status().held_bytes
                unacked = [producer.writer.unacknowledged for producer in producers]
                samples.append((number, time.monotonic(), held, unacked))
            time.sleep(0.25)
    for producer in producers:
        producer.stop.set()
    # Drain: the trainer fetches (faster now) while the writers flush what they hold.
    trainer.pause_s = 0.0
    for producer in producers:
        producer.join(timeout=60)
        producer.writer.close()
        assert producer.error is None, f"{producer.name}: {producer.error!r}"
    deadline = time.monotonic() + 60
    while trainer.next_step < status.status().next_step:
        assert time.monotonic() < deadline, "the trainer did not drain the steps"
        time.sleep(0.1)
    trainer.stop.set()
    trainer.join(timeout=10)
    final = status.status()
    counters = final.counters
    print(
        f"\n{memory.report()}\naccepted {counters.rollouts_accepted}, trained "
        f"{counters.rollouts_trained}, buffered {final.buffered_rollouts}, expired "
        f"{counters.rollouts_expired}, stale {counters.rollouts_stale}; refusals "
        f"{refusals.codes}; steps {final.next_step}"
    )
    return Outcome(
        memory=memory,
        refusals=dict(refusals.codes),
        acked=list(refusals.acked),
        written=sum(producer.written for producer in producers),
        written_partial=sum(producer.written for producer in producers if producer.partial),
        trained_through=trainer.next_step,
        final=final,
    )

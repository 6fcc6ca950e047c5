"""Overload: producers far faster than the trainer, against a real `rlfeed serve` with a
small `[rollouts] max_buffered_bytes`. The memory of the sidecar's processes (the serve
process and every Ray process under it: VmRSS from /proc) stays under its idle figure plus
the bound plus a stated overhead; every refusal is RESOURCE_EXHAUSTED; nothing accepted is
lost (accepted = trained + buffered + expired, and every step is served).

Three phases on one sidecar, each `PHASE_S` long: two writers of complete groups of
8k-token rollouts and no trainer; the same plus a writer that sends only the first rollout
of every group (never completing one) and a slow trainer; 64k-token complete groups, the
partial writer and the slow trainer. Then the trainer drains what the writers still hold.

Run: pytest -m slow tests/integration/test_overload.py -s (it prints the RSS figures).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from rlfeed.client.producer import RolloutWriter
from rlfeed.client.transport import BufferFullError, GrpcTransport, SidecarError

MIB = 2**20
BOUND = 256 * MIB
PHASE_S = 10.0
GROUP_SIZE = 8
RETAINED_STEPS, RETAINED_FREE_MIB = 2, 64
STEP_64K = 64 * 65536 * 21  # the responses of a step of 64 64k-token rollouts, 21 B a token
# What the sidecar holds beyond its idle processes and the bound, all in the serve process:
# the `retained_steps` steps every rank fetched, the responses of the steps the last batch
# taken completed (the bound's stated slack) and one response on its way to the trainer
# (gRPC's copy): a 64k step each; glibc's retained free heap (`retained_free_mib`); the
# batches in flight, on the wire and decoded (4 writers x max_in_flight 2 x 8 MiB, twice);
# and 128 MiB for the allocator's fragmentation and transient copies.
OVERHEAD = (RETAINED_STEPS + 2) * STEP_64K + (RETAINED_FREE_MIB + 4 * 2 * 8 * 2 + 128) * MIB

CONFIG = f"""
[server]
max_message_bytes = {128 * MIB}
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
max_buffered_bytes = {BOUND}
"""


def process_tree(root: int) -> list[int]:
    """`root` and every process under it (from /proc/*/stat's parent pids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def memory_of(pid: int) -> dict[str, int]:
    """VmRSS and its shared-memory part RssShmem, bytes, and the name of a process ({} if
    it exited meanwhile)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()[-40:]
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    figures = {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssShmem")}
    return {**figures, "name": name}


def rss_bytes(pids: list[int]) -> int:
    """The sum of the processes' VmRSS (shared pages count in each process mapping them)."""
    return sum(memory_of(pid).get("VmRSS", 0) for pid in pids)


class Refusals(GrpcTransport):
    """A GrpcTransport counting every error a submission got, by gRPC code."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.codes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _counted(self, submit, request):
        try:
            return submit(request)
        except SidecarError as exc:
            with self._lock:
                self.codes[exc.code] = self.codes.get(exc.code, 0) + 1
            raise

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


@pytest.fixture
def overloaded_serve(tmp_path):
    config = tmp_path / "overload.toml"
    config.write_text(CONFIG)
    command = [sys.executable, "-m", "rlfeed", "serve", "--config", str(config), "--port", "0"]
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
def test_memory_stays_under_the_byte_bound_when_producers_outrun_the_trainer(
    overloaded_serve, caplog
) -> None:
    server, address = overloaded_serve
    status = GrpcTransport(address)
    status.register_tasks([f"task-{k}" for k in range(4)])
    time.sleep(2.0)  # let start-up settle before the idle figure
    idle = rss_bytes(process_tree(server.pid))
    peak, samples, at_peak = idle, [], []
    refusals = Refusals(address)
    trainer = SlowTrainer(address, pause_s=0.5)
    phases = [
        [("full-8k-a", 8192, False), ("full-8k-b", 8192, False)],
        [("partial-8k", 8192, True)],
        [("full-64k", 65536, False)],
    ]
    producers: list[Producer] = []
    with caplog.at_level(logging.WARNING, logger="rlfeed.client.transport"):
        for number, phase in enumerate(phases):
            if number == 1:
                trainer.start()
            if number == 2:  # the 8k writers of complete groups stop; the others go on
                for producer in producers[:2]:
                    producer.stop.set()
            for name, length, partial in phase:
                producer = Producer(name, refusals, length, partial)
                producer.start()
                producers.append(producer)
            ends = time.monotonic() + PHASE_S
            while time.monotonic() < ends:
                tree = process_tree(server.pid)
                rss = rss_bytes(tree)
                if rss > peak:
                    peak, at_peak = rss, [memory_of(pid) for pid in tree]
                samples.append((number, rss))
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

    per_phase = {n: max(rss for p, rss in samples if p == n) for n in range(len(phases))}
    print(
        f"\nsidecar RSS idle {idle / MIB:.0f} MiB, peak {peak / MIB:.0f} MiB "
        f"(per phase {[round(v / MIB) for v in per_phase.values()]} MiB); bound "
        f"{BOUND / MIB:.0f} MiB + overhead {OVERHEAD / MIB:.0f} MiB; accepted "
        f"{counters.rollouts_accepted}, trained {counters.rollouts_trained}, buffered "
        f"{final.buffered_rollouts}, expired {counters.rollouts_expired}, stale "
        f"{counters.rollouts_stale}; refusals {refusals.codes}; steps {final.next_step}"
    )
    for figures in sorted(at_peak, key=lambda f: -f.get("VmRSS", 0))[:6]:
        if figures:
            print(
                f"  at peak: {figures['name']}: VmRSS {figures['VmRSS'] / MIB:.0f} MiB "
                f"(RssShmem {figures['RssShmem'] / MIB:.0f} MiB)"
            )
    assert peak <= idle + BOUND + OVERHEAD
    assert set(refusals.codes) == {"RESOURCE_EXHAUSTED"} and refusals.codes["RESOURCE_EXHAUSTED"]
    written = sum(producer.written for producer in producers)
    assert counters.rollouts_received == written  # every write acknowledged, none refused
    assert counters.rollouts_accepted == (
        counters.rollouts_trained + final.buffered_rollouts + counters.rollouts_expired
    )
    partial = sum(producer.written for producer in producers if producer.partial)
    assert 0 < counters.rollouts_expired <= partial  # only groups that never complete
    assert list(final.steps_waiting) == [] and trainer.next_step == final.next_step
    assert any("is full" in record.getMessage() for record in caplog.records)

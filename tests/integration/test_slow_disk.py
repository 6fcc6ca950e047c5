"""A slow disk under a real `rlfeed serve --journal-dir`: every fsync of the front-end's
journal 200 ms late (`slow_disk_serve.py`, the fault layer of `faulty_disk.py` in the
sidecar's own process). Two writers send complete groups of 2k-token rollouts as fast as
they can and one trainer fetches every step at once; for PHASE_S the disk is fast, then
for PHASE_S slow, then fast again while everything drains.

What must hold: an acknowledgement never comes before its batch is on disk (each one on
the slow disk took at least the delay); the writers are held back by their own bounded
buffers (`write()` waits; the sidecar does not buffer for them); the sidecar's memory
(its process tree's RSS) stays under its idle figure plus `[rollouts]
max_buffered_bytes` plus the overload test's stated overhead, and the bytes it counts
against the bound never pass it; nothing acknowledged is lost. The throughput figures of
both phases are printed (not asserted: this machine is shared).

Run: pytest -m slow tests/integration/test_slow_disk.py -s
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import pytest


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


overload_test = _load("test_overload")
MIB, Phase = overload_test.MIB, overload_test.Phase
PHASE_S, DELAY_S = 8.0, 0.2
BOUND = 128 * MIB
WRITERS = [("slow-disk-a", 2048, False), ("slow-disk-b", 2048, False)]
FULL = 128  # the overload test's writers' max_buffered_rollouts
LAUNCHER = str(Path(__file__).with_name("slow_disk_serve.py"))


def _phase_figures(outcome, samples: list, phase: int, starts: dict[int, float]) -> dict:
    """Acks of batches sent from 0.5 s into the phase to its end (earlier ones may have
    met the other disk), and the writers' fill at the samples."""
    begin = starts[phase] + 0.5
    end = starts.get(phase + 1, float("inf"))
    acked = [(seconds, n) for sent, seconds, n in outcome.acked if begin <= sent < end]
    fills = [unacked for number, _, _, unacked in samples if number == phase and unacked]
    return {
        "batches": len(acked),
        "rollouts_per_s": sum(n for _, n in acked) / (min(end, begin + PHASE_S) - begin),
        "ack_seconds_median": statistics.median(s for s, _ in acked),
        "ack_seconds_min": min(s for s, _ in acked),
        # Samples with a writer at its max_buffered_rollouts: its write() waits.
        "writers_full_share": sum(max(fill) >= FULL for fill in fills) / len(fills),
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_slow_disk_slows_the_acks_holds_the_writers_back_and_keeps_memory_bounded(
    tmp_path,
) -> None:
    delay_file = tmp_path / "fsync_delay_s"
    delay_file.write_text("0")
    starts: dict[int, float] = {}
    samples: list = []

    def on_phase(number: int) -> None:
        delay_file.write_text(str(DELAY_S if number == 1 else 0))
        starts[number] = time.monotonic()

    journal = ("--journal-dir", str(tmp_path / "journal"))
    with overload_test.overloaded_serve(tmp_path, BOUND, (LAUNCHER, str(delay_file)), *journal) as (
        server,
        address,
    ):
        outcome = overload_test.overload(
            server,
            address,
            [Phase(WRITERS, trainer=True), Phase([])],
            PHASE_S,
            trainer_pause_s=0.0,
            on_phase=on_phase,
            samples=samples,
        )
    fast, slow = (_phase_figures(outcome, samples, phase, starts) for phase in (0, 1))
    print(f"\nfast disk: {fast}\nslow disk ({DELAY_S} s fsyncs): {slow}")

    assert slow["ack_seconds_min"] >= DELAY_S  # acknowledged only once on disk
    assert slow["writers_full_share"] > 0  # write() waited: the writers were held back
    assert max(held for _, _, held, _ in samples) <= BOUND
    outcome.check_memory(BOUND, overload_test.overhead(overload_test.step_bytes(2048), 2))
    counters, final = outcome.final.counters, outcome.final
    assert set(outcome.refusals) <= {"RESOURCE_EXHAUSTED"}, outcome.refusals
    assert counters.rollouts_received == counters.rollouts_accepted == outcome.written
    assert counters.rollouts_accepted == counters.rollouts_trained + final.buffered_rollouts
    assert counters.rollouts_expired == 0 and outcome.trained_through == final.next_step

"""The chaos benchmark for half a minute (`tests/bench/bench_chaos.py --minutes 0.5`), as a
user runs it: one fault of each kind (the driver, the scheduler actor, a front-end, a
worker node, a producer, a trainer rank) on a Ray cluster of a head and three workers,
then the exactly-once check over the whole history. About 2-3 minutes here (start-up,
a fault every ~3 s plus its recovery, the drain).

Run: pytest -m slow tests/integration/test_chaos_smoke.py -s
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench" / "bench_chaos.py"
KINDS = {"driver", "scheduler", "frontend", "node", "producer", "trainer"}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_half_a_minute_of_chaos_loses_nothing_and_serves_nothing_twice(tmp_path) -> None:
    figures = tmp_path / "chaos.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--minutes", "0.5", "--interval", "3", "--seed", "7",
         "--out", str(tmp_path / "run"), "--json", str(figures)],
        capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(figures.read_text())
    survived = {kind for kind, f in result["faults_survived"].items() if f["count"] >= 1}
    assert survived == KINDS and not result["failure"]
    assert result["exactly_once"] == "held"
    assert result["rollouts_acknowledged"] == result["rollouts_served"] > 0
    assert result["steps"] * 8 == result["rollouts_served"]  # 2 groups of 4 a step
    assert result["clients_died_on_their_own"] == []

"""Chaos: producers and trainer ranks run against a sidecar on a multi-node Ray cluster while
its parts are killed at random, one at a time; over the whole history, exactly once.

Run:  .venv/bin/python tests/bench/bench_chaos.py [--minutes 30] [--seed 0] [--interval 30]
      [--json out.json] [--out DIR] [--workers 3] [--producers 2] [--pace 0.2]
Cost: --minutes of chaos plus about 1-3 min of start-up and drain; a Ray cluster of a head
and --workers worker nodes on this machine (about 0.4 GiB each), the sidecar, and
--producers + 2 client processes (the ranks import torch: about 0.4 GiB each). Not in
`make bench` (`make chaos` runs the 30 minutes); a 30 s smoke run is the slow test
`tests/integration/test_chaos_smoke.py`.

What runs: `ray.cluster_utils.Cluster` in this process (a head, and worker nodes offering
the custom resource `rlfeed_frontend`); `rlfeed serve --ray-address` on it with
`--journal-dir`, `--frontends 2 --frontend-resource rlfeed_frontend` (the scheduler actor
on the head, one front-end actor per worker, consecutive ports) and the exactly-once
tests' config (`tests/integration/exactly_once.py`: world size 2, groups of 4, 2 per step);
producers on the real `RolloutWriter` and two ranks on the real `BatchLoader`, each a
process of its own (`chaos_clients.py`). Every --interval seconds (uniform 0.5-1.5x), one
fault, the kinds taken in a random order, each once per round:

- driver: SIGKILL to `rlfeed serve`, then start it again on the same journal. As of this
  branch the actors it owns die with it and the new one recovers them from the journal;
  a driver that adopts a detached control plane instead passes the same way.
- scheduler: `ray.kill(scheduler actor, no_restart=False)`: Ray restarts it from the journal.
- frontend: `ray.kill(front-end actor, no_restart=False)`: Ray restarts it on its slot.
- node: the worker node of a front-end removed (its processes SIGKILLed, as a machine
  lost), the front-end restarted by Ray on the spare worker, then a new worker added.
- producer: SIGKILL, restarted; it resends what it had not seen acknowledged.
- trainer: SIGKILL to a rank, restarted; it resumes from its last checkpoint and ack.

Each fault waits for recovery (the sidecar serving on every front-end again, or the
client's next ack or step) before the next interval; the time is reported. The run lasts
--minutes and until every kind happened once. Then the producers stop at a group
boundary, the ranks are served every step, and the existing checker
(`exactly_once.check_exactly_once`) runs over the whole history: every acknowledged
rollout served in exactly one step, nothing served that was not acknowledged, no (step,
rank) served with two contents (a rank resuming re-fetches steps; their digests must
match). Reported (and `--json`): faults survived by kind with recovery seconds, rollouts
acknowledged and served, the longest gap in serving (between consecutive steps served to
any rank), the RSS of the sidecar's processes (driver, scheduler actor, front-ends, Ray's
own) at the start and at the end of the chaos, client processes that died on their own
(none expected), and the load average. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import chaos_faults  # next to this file: a script's siblings
import chaos_sidecar


def _load(name: str):
    path = Path(__file__).parents[1] / "integration" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KINDS = ("driver", "scheduler", "frontend", "node", "producer", "trainer")
RECOVERY_TIMEOUT_S = 300.0


def chaos(world, args, rng: random.Random, faults: dict, fault_log: list) -> str:
    """Faults until --minutes passed and every kind happened; "" or what did not recover."""
    ends = time.monotonic() + 60 * args.minutes
    pending: list[str] = []
    while time.monotonic() < ends or any(not times for times in faults.values()):
        world.supervise_for(rng.uniform(0.5, 1.5) * args.interval)
        if not pending:
            pending = rng.sample(KINDS, len(KINDS))
        kind = pending.pop()
        at = time.time()
        try:
            seconds = chaos_faults.fault(world, kind, rng, RECOVERY_TIMEOUT_S)
        except TimeoutError as exc:
            fault_log.append((at, kind, None))
            print(f"chaos: {kind}: not recovered: {exc}", flush=True)
            return f"{kind}: not recovered: {exc}"
        faults[kind].append(seconds)
        fault_log.append((at, kind, seconds))
        print(f"chaos: {kind} killed, recovered after {seconds:.1f} s", flush=True)
    return ""


def run(args: argparse.Namespace, out: Path) -> dict:
    exactly_once = _load("exactly_once")
    rng = random.Random(args.seed)
    load_at_start = os.getloadavg()
    world = chaos_sidecar.World(out, args, exactly_once.CONFIG, exactly_once.WORLD_SIZE)
    faults: dict[str, list[float]] = {kind: [] for kind in KINDS}
    fault_log: list[tuple[float, str, float | None]] = []  # (time, kind, recovered after)
    history, rollouts, steps = exactly_once.History(), [], None
    try:
        world.start()
        world.wait_for_first_steps()
        memory_start = world.memory()
        chaos_start = time.time()
        failure = chaos(world, args, rng, faults, fault_log)
        chaos_end = time.time()
        memory_end = world.memory()
        try:
            steps = world.drain()
            history, rollouts = world.history(history)
        except TimeoutError as exc:
            failure = failure or f"drain: {exc}"
    finally:
        world.stop()
    if steps is None:
        exactly_once_result = "not checked: the drain did not finish"
    else:
        try:
            check = {"history": history, "rollouts": rollouts, "steps": steps}
            exactly_once.check_exactly_once(check)
            exactly_once_result = "held"
        except AssertionError as exc:
            exactly_once_result = f"FAILED: {exc}"
    served_at = sorted(t for t in world.served_times() if chaos_start <= t <= chaos_end)
    gaps = [(b - a, a) for a, b in itertools.pairwise(served_at)]
    gap, gap_at = max(gaps, default=(0.0, chaos_start))
    # The faults done while serving stood still (or the second before it stopped).
    gap_during = [kind for at, kind, _ in fault_log if gap_at - 1.0 <= at <= gap_at + gap]
    return {
        "minutes": args.minutes,
        "seed": args.seed,
        "chaos_seconds": round(chaos_end - chaos_start, 1),
        "faults_survived": {
            kind: {
                "count": len(times),
                "recovery_s_min": round(min(times), 1) if times else None,
                "recovery_s_median": round(sorted(times)[len(times) // 2], 1) if times else None,
                "recovery_s_max": round(max(times), 1) if times else None,
            }
            for kind, times in faults.items()
        },
        "fault_log": [
            {"at": round(at - chaos_start, 1), "kind": kind, "recovered_s": seconds}
            for at, kind, seconds in fault_log
        ],
        "failure": failure,
        "rollouts_acknowledged": len(history.acknowledged),
        "rollouts_served": len({i for ids in history.rollouts_of.values() for i in ids}),
        "steps": steps,
        "exactly_once": exactly_once_result,
        "longest_serving_gap_s": round(gap, 1),
        "longest_gap_starts_s": round(gap_at - chaos_start, 1),
        "longest_gap_during": gap_during,
        "rss_mib_start": memory_start,
        "rss_mib_end": memory_end,
        "clients_died_on_their_own": world.unexpected_exits,
        "load_average_start": [round(x, 1) for x in load_at_start],
        "load_average_end": [round(x, 1) for x in os.getloadavg()],
    }


def report(result: dict) -> str:
    lines = [f"chaos for {result['chaos_seconds']:.0f} s (seed {result['seed']})"]
    for kind, figures in result["faults_survived"].items():
        if figures["count"]:
            lines.append(
                f"  {kind:9s} x{figures['count']}: recovered after "
                f"{figures['recovery_s_min']}-{figures['recovery_s_max']} s "
                f"(median {figures['recovery_s_median']})"
            )
    lines += [
        f"  rollouts acknowledged {result['rollouts_acknowledged']}, served "
        f"{result['rollouts_served']}, in {result['steps']} steps; exactly once: "
        f"{result['exactly_once']}",
        f"  longest gap in serving {result['longest_serving_gap_s']} s (from "
        f"{result['longest_gap_starts_s']} s into the chaos; faults then: "
        f"{', '.join(result['longest_gap_during']) or 'none'})",
        f"  RSS MiB at start {result['rss_mib_start']}",
        f"  RSS MiB at end   {result['rss_mib_end']}",
        f"  clients that died on their own: {result['clients_died_on_their_own'] or 'none'}",
        f"  load average {result['load_average_start']} -> {result['load_average_end']}",
    ]
    if result["failure"]:
        lines.append(f"  FAILURE: {result['failure']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="of chaos (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="of the fault order and timing")
    parser.add_argument("--interval", type=float, default=30.0, help="mean s between faults")
    parser.add_argument("--json", metavar="FILE", help="write the figures there too")
    parser.add_argument("--out", metavar="DIR", help="logs and client state (default: temp)")
    parser.add_argument("--workers", type=int, default=3, help="worker nodes (>= 2)")
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--pace", type=float, default=0.2, help="s a producer rests per flush")
    args = parser.parse_args()
    if args.workers < 2:
        parser.error("--workers: at least 2 (two front-ends, one per worker)")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rlfeed-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    # Before Ray is imported (it reads them once): this run's own cluster, never another
    # session's, with a token of its own that every process of it inherits.
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex())
    print(f"chaos: logs and client state in {out}", flush=True)
    result = run(args, out)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    survived = not result["failure"] and not result["clients_died_on_their_own"]
    return 0 if survived and result["exactly_once"] == "held" else 1


if __name__ == "__main__":
    sys.exit(main())

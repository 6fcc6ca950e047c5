"""The Figure 14.3 analogue of the curriculum experiment: held-out pass rate against
cumulative episodes sampled (left), and each run's episodes against its final held-out
pass rate (right). matplotlib (the `plot` extra), imported when drawing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlfeed.service.learning.experiment import RunResult


def held_out_curve(result: RunResult) -> tuple[list[int], list[float]]:
    """(cumulative episodes, held-out pass rate) at each evaluation of one run; the
    evaluation after k steps sits at the episodes of those k steps."""
    cumulative = [0]
    for episodes in result.episodes_per_step:
        cumulative.append(cumulative[-1] + episodes)
    steps = sorted(result.held_out)
    return [cumulative[s] for s in steps], [result.held_out[s] for s in steps]


def draw(results: Sequence[RunResult], path: Path, title: str) -> Path:
    """Write the two panels to `path` (its extension picks the format)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r.arm for r in results))
    colours = {arm: f"C{i}" for i, arm in enumerate(arms)}
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for result in results:
        x, y = held_out_curve(result)
        label = (
            result.arm
            if result.seed == min(r.seed for r in results if r.arm == result.arm)
            else None
        )
        left.plot(x, y, color=colours[result.arm], alpha=0.75, marker=".", label=label)
        right.scatter(result.episodes, result.final_held_out, color=colours[result.arm], s=30)
    left.set_xlabel("episodes sampled (cumulative)")
    left.set_ylabel("held-out pass rate")
    left.legend(fontsize=8)
    right.set_xlabel("episodes sampled per run")
    right.set_ylabel("final held-out pass rate")
    right.set_title("each run is a point", fontsize=9)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

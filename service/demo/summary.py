"""The summary `rlfeed demo` prints at the end (both fleets), and its JSON form.

Each step is priced with `metrics.figures.price_tokens` under `[accounting]`, as the
metrics do: from the sidecar's record of the step when known (with its compute lockstep
efficiency), else from rank 0's figures (priced at full lockstep).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def step_prices(figures, records, accounting):
    """(real tokens, computed positions, padded positions, StepPrice) of every trained step:
    the sidecar's record of it when known (with its compute lockstep efficiency), else rank
    0's figures (priced at full lockstep)."""
    from rlfeed.service.metrics.figures import price_tokens

    steps = []
    for figure in figures:
        record = records.get(figure["step"])
        if record is not None:
            policy, real = record.policy_token_count, record.real_tokens
            computed, padded = record.computed_positions, record.padded_positions
            lockstep = record.compute_lockstep_efficiency
        else:
            policy, real = figure["policy_tokens"], figure["tokens"]
            computed, padded = real, figure["padded_positions"]
            lockstep = 1.0
        price = price_tokens(
            accounting,
            policy_tokens=policy,
            real_tokens=real,
            computed_positions=computed,
            padded_positions=padded,
            lockstep_efficiency=lockstep,
        )
        steps.append((real, computed, padded, price))
    return steps


def summary_lines(
    figures, records, status, config, seconds: float, *, zero_advantage: str, extra=None
) -> dict[str, str]:
    """The summary as {label: text}: `zero_advantage` is the zero-advantage line (what the
    caller knows about its groups), `extra` lines come before the wall time."""
    from rlfeed.sched.assembly import share
    from rlfeed.service.metrics.figures import SECONDS_PER_HOUR

    steps = len(figures)
    tokens = sum(f["tokens"] for f in figures)
    policy_tokens = sum(f["policy_tokens"] for f in figures)
    rollouts = sum(f["rollouts"] for f in figures)
    accounting = config.accounting
    priced = step_prices(figures, records, accounting)
    real = sum(p[0] for p in priced)
    computed = sum(p[1] for p in priced)
    padded = sum(p[2] for p in priced)
    gpu_hours = sum(p[3].total_gpu_seconds for p in priced) / SECONDS_PER_HOUR / steps
    # The padded alternative trains every padded position: the plan's price plus the padding
    # packing avoided.
    avoided_hours = sum(p[3].padding_avoided_gpu_seconds for p in priced) / SECONDS_PER_HOUR
    padded_hours = gpu_hours + avoided_hours / steps
    lines = {
        "steps": f"{steps}",
        "rollouts trained": f"{rollouts:,}",
        "tokens": f"{tokens:,} ({policy_tokens:,} policy tokens)",
        "padding share": (
            f"{share(computed - real, computed):.1%} packed vs "
            f"{share(padded - real, padded):.1%} padded alternative ({padded:,} positions)"
        ),
        "zero-advantage share": zero_advantage,
        "rollouts saved by the filter": (
            f"{status.counters.rollouts_saved_by_filter:,} (tasks asked for but outside the "
            f"filter); revisits of excluded tasks cost "
            f"{status.counters.revisits_sampled * config.rollouts.group_size:,}"
        ),
        "step-0 ratio outlier share": f"{figures[0]['ratio_outlier_share']:.4f}",
        "final loss": f"{figures[-1]['loss']:+.4f}",
        "predicted GPU-hours per step": (
            f"{gpu_hours:.4g} packed vs {padded_hours:.4g} padded "
            f"({accounting.model} on {accounting.gpu}, at these steps' token counts)"
        ),
        **(extra or {}),
        "wall time": f"{seconds:.1f} s",
    }
    return lines


def print_summary(lines: dict[str, str]) -> None:
    print("\nsummary")
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"  {key:<{width}}  {value}")
    sys.stdout.flush()


def write_summary_json(path: str, lines: dict[str, str], steps: list[dict], **figures) -> None:
    """The summary lines, the run's figures and the per-step figures as strict JSON (every
    non-finite number written as null): {"summary": {...}, "steps": [...], ...figures}."""
    document = _strict({"summary": lines, **figures, "steps": steps})
    Path(path).write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value

"""Checks of the small requests (RegisterTasks, TrainerReport) and of ids, against the
`[server]` caps, before the scheduler sees them: ValueError naming the field, which the
handlers answer INVALID_ARGUMENT (the in-process transport raises InvalidRequestError).

Ids cost the scheduler actor memory for the rest of the run (~200 bytes per task id), so
their count per call and their size are bounded here, where a refusal costs nothing;
the pool's total (`max_tasks`) is the scheduler's check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.service.config.server import ServerConfig

# A UTF-8 character takes at most this many bytes: ids this many times shorter than the
# cap in characters are within it without being encoded.
_MAX_UTF8_BYTES = 4


def first_long_id(ids: Sequence[str], max_bytes: int) -> int | None:
    """Index of the first id over `max_bytes` UTF-8 bytes, or None."""
    short = max_bytes // _MAX_UTF8_BYTES
    for index, value in enumerate(ids):
        if len(value) > short and len(value.encode("utf-8", "surrogatepass")) > max_bytes:
            return index
    return None


def check_task_ids(task_ids: Sequence[str], config: ServerConfig) -> None:
    """A RegisterTasks request's ids: at most max_ids_per_call, each of at most
    max_id_bytes."""
    if len(task_ids) > config.max_ids_per_call:
        raise ValueError(
            f"task_ids: {len(task_ids)} ids in one call; at most {config.max_ids_per_call} "
            "([server] max_ids_per_call): register them in several calls"
        )
    index = first_long_id(task_ids, config.max_id_bytes)
    if index is not None:
        raise ValueError(
            f"task_ids[{index}]: {len(task_ids[index].encode('utf-8', 'surrogatepass'))} "
            f"bytes; at most {config.max_id_bytes} ([server] max_id_bytes)"
        )


# TrainerReport's measurements and the range each must lie in.
_REPORT_RANGES = {
    "loss": (-math.inf, math.inf),
    "ratio_outlier_share": (0.0, 1.0),
    "tokens_per_second": (0.0, math.inf),
    "step_seconds": (0.0, math.inf),
}


def trainer_report_of(request: pb.TrainerReport) -> dict[str, float]:
    """The report's fields as the scheduler keeps them; ValueError naming the first
    field that is not finite or outside its range (a share in [0, 1], rates and
    durations >= 0): metrics and status show what ranks report, never NaN or nonsense.
    An unset ratio_outlier_share (not measured) is kept as NaN, which status leaves unset;
    an unset policy_version (not published) is left out."""
    report: dict[str, float] = {"step": int(request.step)}
    for name, (low, high) in _REPORT_RANGES.items():
        if name == "ratio_outlier_share" and not request.HasField(name):
            report[name] = math.nan  # not measured: NaN inside (metrics leave the gauge)
            continue
        value = getattr(request, name)
        if not math.isfinite(value):
            problem = "is not finite"
        elif not low <= value <= high:
            problem = f"is outside [{low}, {high}]"
        else:
            report[name] = value
            continue
        raise ValueError(f"trainer report of rank {request.rank}: field {name}: {value} {problem}")
    if request.HasField("policy_version"):
        if request.policy_version > _INT64_MAX:
            raise ValueError(
                f"trainer report of rank {request.rank}: field policy_version: "
                f"{request.policy_version} is over 2^63 - 1 (rollouts' versions are int64)"
            )
        report["policy_version"] = int(request.policy_version)
    return report


_INT64_MAX = 2**63 - 1

"""Pacing producers: sample only while the sidecar holds fewer than `steps_ahead` steps.

Producers that run free fill the sidecar with rollouts of ever older policies (dropped
once `[rollouts] max_policy_lag` versions behind) and make steps the trainers never take.
The sidecar's status says how far ahead the data is: steps assembled but not yet reported
trained by every rank, plus complete groups not yet assembled (in steps' worth). This is
what the synthetic fleet paces itself by too (`demo/run.py`).
"""

from __future__ import annotations


class Pacer:
    """Whether to sample another round: the sidecar holds fewer than `steps_ahead` steps'
    worth of groups beyond what the trainers finished, and the run still needs groups."""

    def __init__(self, transport, *, start_step: int, end_step: int, steps_ahead: int) -> None:
        from rlfeed.client.retry import RetryPolicy
        from rlfeed.client.transport import address_of

        self.transport = transport
        self.start_step, self.end_step, self.steps_ahead = start_step, end_step, steps_ahead
        # Status is asked as a writer asks: through a sidecar restart, under one policy.
        self.retry = RetryPolicy(address_of(transport))

    def ready(self) -> bool:
        return should_sample(
            self.retry.call(self.transport.status),
            start_step=self.start_step,
            end_step=self.end_step,
            steps_ahead=self.steps_ahead,
        )


def should_sample(status, *, start_step: int, end_step: int, steps_ahead: float) -> bool:
    """Whether a sidecar in `status` needs another round: fewer than `steps_ahead` steps'
    worth of data queued beyond the trained steps, and fewer than `end_step` steps made
    or coming (nothing for steps nobody trains)."""
    trained = trained_steps(status, start_step)
    coming = status.complete_groups / max(status.prompts_per_step, 1)  # steps' worth
    queued = status.next_step - trained
    needed = status.next_step + coming < end_step
    return needed and queued + coming < steps_ahead


def trained_steps(status, start_step: int) -> int:
    """The step after the last one every rank reported: the policy version trained so far
    (reports of an earlier run against the same sidecar do not count)."""
    if len(status.last_reports) < int(status.world_size):
        return start_step
    return max(start_step, min(int(r.step) for r in status.last_reports) + 1)

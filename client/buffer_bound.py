"""`RolloutWriter`'s bound on what it holds unacknowledged (pending + queued + in flight):
at most `max_buffered_rollouts` rollouts and `max_buffered_bytes` of their token payload."""

from __future__ import annotations


class BufferBound:
    """Counts of unacknowledged rollouts and their token bytes, against the two bounds.
    Not thread-safe: the writer holds its condition around every call."""

    def __init__(self, max_rollouts: int, max_bytes: int) -> None:
        self.max_rollouts = max_rollouts
        self.max_bytes = max_bytes
        self.rollouts = 0
        self.nbytes = 0

    def full(self, nbytes: int) -> bool:
        """No room for one more rollout of `nbytes` token payload bytes (one larger than
        the byte bound fits once nothing is held: it could never fit otherwise)."""
        if self.rollouts >= self.max_rollouts:
            return True
        return self.rollouts > 0 and self.nbytes + nbytes > self.max_bytes

    def add(self, nbytes: int) -> None:
        self.rollouts += 1
        self.nbytes += nbytes

    def acknowledged(self, rollouts: int, nbytes: int) -> None:
        """A batch left the writer: answered, or failed with its error surfaced."""
        self.rollouts -= rollouts
        self.nbytes -= nbytes

    def held(self) -> str:
        return (
            f"{self.rollouts} unacknowledged rollouts of {self.nbytes} token bytes "
            f"(max_buffered_rollouts={self.max_rollouts}, "
            f"max_buffered_bytes={self.max_bytes})"
        )

"""`NewestLayout`: the picture /layout.png serves, of the newest step that has one.

A step's layout comes from the scheduler (a `StepLayout`, or a callable that builds one) or,
failing that, from the responses every rank fetched. Either way it is kept as a source and
rendered on the first request only, then cached: a matplotlib render is not free and most
steps are never looked at. Only the newest steps' responses are held (memory), and none of
a step older than the newest layout.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfeed.service.metrics.layout_plot import StepLayout


class NewestLayout:
    """The newest step's layout source and its rendered PNG; thread-safe."""

    def __init__(self, world_size: int, token_budget: int) -> None:
        self._world_size = world_size
        self._token_budget = token_budget
        self._lock = threading.Lock()  # _layout, _png, _responses
        self._layout: tuple[int, Any] | None = None  # (step, StepLayout or callable)
        self._png: tuple[int, bytes] | None = None
        self._responses: dict[int, dict[int, Any]] = {}  # step -> rank -> response
        self._render_lock = threading.Lock()

    def set(self, step: int, source: Any) -> None:
        """`source` (a StepLayout or a zero-argument callable returning one or None) draws
        step `step`, unless a newer step's layout is already kept."""
        with self._lock:
            self._set(step, source)

    def add_response(self, step: int, rank: int, response: Any) -> None:
        """Rank `rank`'s response for `step` (its GetBatchResponse or the bytes), kept
        until every rank's is there (`served`)."""
        with self._lock:
            if step >= self._newest_step():
                self._responses.setdefault(step, {})[rank] = response

    def served(self, step: int) -> None:
        """Every rank fetched `step`: its responses, if all were kept, become its layout."""
        with self._lock:
            responses = self._responses.pop(step, {})
            if len(responses) == self._world_size:
                self._set(step, _ResponsesLayout(responses, self._token_budget))

    def forget_old(self) -> None:
        """Drop the responses of all but the two newest steps that have some."""
        with self._lock:
            while len(self._responses) > 2:
                del self._responses[min(self._responses)]

    def png(self) -> tuple[int, bytes] | None:
        """(step, PNG) of the newest step with a layout, rendered on first request and
        cached; None when there is none. Raises ImportError without matplotlib."""
        with self._lock:
            latest, cached = self._layout, self._png
        if latest is None:
            return None
        step, source = latest
        if cached is not None and cached[0] == step:
            return cached
        from rlfeed.service.metrics.layout_plot import StepLayout, render_layout

        with self._render_lock:  # one render at a time; matplotlib is not free
            layout = source if isinstance(source, StepLayout) else source()
            if layout is None:
                return None
            png = (step, render_layout(layout))
        with self._lock:
            if self._layout is not None and self._layout[0] == step:
                self._png = png
        return png

    def _newest_step(self) -> int:
        return self._layout[0] if self._layout is not None else -1

    def _set(self, step: int, source: Any) -> None:
        if step >= self._newest_step():
            self._layout, self._png = (step, source), None
            for old in [s for s in self._responses if s <= step]:
                del self._responses[old]


class _ResponsesLayout:
    """A lazy layout source: every rank's GetBatchResponse of one step."""

    def __init__(self, responses: dict[int, Any], token_budget: int) -> None:
        self.responses = [responses[rank] for rank in sorted(responses)]
        self.token_budget = token_budget

    def __call__(self) -> StepLayout:
        from rlfeed.service.metrics.layout_plot import layout_from_batch_responses

        return layout_from_batch_responses(self.responses, token_budget=self.token_budget)

"""The chapter's Figure 14.1 for a real step: the padded layout beside the packed one.

Left, one row per sequence padded to the step's longest; right, one row per microbatch,
rank by rank, as the step computes it. Both panels share one scale, so area is compute.
Policy tokens blue, other tokens aqua, padding grey, unused budget white, sequence
boundaries as dark ticks. `StepLayout` is plain numpy data, built from a plan, from served
microbatches or from lengths; `render_layout` imports matplotlib lazily and draws on the
Agg canvas, never pyplot, so a server thread may call it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from rlfeed.sched.assembly import StepPlan

# Cell categories of the raster, in drawing priority order.
EMPTY, PADDING, OTHER, POLICY = 0, 1, 2, 3
COLORS = ("#ffffff", "#c9c9c9", "#6cc9c4", "#2b62b0")  # white, grey, aqua, blue
BOUNDARY_COLOR = "#151515"
WIDTH_PX = 1600
DPI = 100
# A panel is never narrower than this share of the plot width: with a token budget far wider
# than the longest sequence, exact scale would leave the padded panel a sliver. The title
# says so when it happens.
MIN_PANEL_SHARE = 0.15


@dataclass(frozen=True)
class StepLayout:
    """One step's sequences and its packed rows.

    lengths:     int64 [n] tokens of each sequence of the step.
    action_mask: uint8 [sum(lengths)] per-token policy mask of the sequences back to back
                 (sequence 0 first), or None when unknown (then all tokens count as 'other').
    rows:        microbatches in rank order (rank 0's in run order, then rank 1's, ...), each
                 an int64 array of sequence indices in row order; an empty row is a no-op.
    row_ranks:   int64 [len(rows)], the rank that runs each row.
    token_budget: tokens per microbatch (the packed panel's width).
    """

    lengths: np.ndarray
    action_mask: np.ndarray | None
    rows: list[np.ndarray]
    row_ranks: np.ndarray
    token_budget: int
    step: int | None = None

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
            raise ValueError("StepLayout.lengths must be a 1-d array of positive lengths")
        if self.action_mask is not None and self.action_mask.size != int(lengths.sum()):
            raise ValueError(
                f"StepLayout.action_mask has {self.action_mask.size} entries, "
                f"not sum(lengths) = {int(lengths.sum())}"
            )
        if len(self.rows) != len(self.row_ranks):
            raise ValueError("StepLayout.rows and row_ranks differ in length")
        placed = np.sort(np.concatenate([np.asarray(r, np.int64) for r in self.rows] or [[]]))
        if not np.array_equal(placed, np.arange(lengths.size)):
            raise ValueError("StepLayout.rows must place every sequence exactly once")
        row_tokens = [int(lengths[r].sum()) for r in self.rows]
        if row_tokens and max(row_tokens) > self.token_budget:
            raise ValueError(
                f"StepLayout row {int(np.argmax(row_tokens))} holds {max(row_tokens)} tokens, "
                f"more than token_budget {self.token_budget}"
            )

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_positions(self) -> int:
        return int(self.lengths.size * self.lengths.max()) if self.lengths.size else 0

    @property
    def world_size(self) -> int:
        return int(self.row_ranks.max()) + 1 if self.row_ranks.size else 1


def layout_from_plan(
    plan: StepPlan,
    lengths: ArrayLike,
    *,
    token_budget: int,
    offsets: ArrayLike | None = None,
    action_mask: ArrayLike | None = None,
    step: int | None = None,
) -> StepLayout:
    """Layout of an assembled step. `lengths` [n] are the plan's input rollouts; `offsets`
    [n+1] and `action_mask` [total] (a `TokenColumns`' fields) add the policy tokens."""
    from rlfeed.sched.assembly import gather_token_ranges

    lengths = np.asarray(lengths, dtype=np.int64)
    position_of = np.full(lengths.size, -1, dtype=np.int64)
    position_of[plan.kept] = np.arange(plan.kept.size)
    rows, row_ranks = [], []
    for rank, microbatch_ids in enumerate(plan.ranks):
        for m in microbatch_ids:
            rows.append(position_of[plan.microbatches[m]])
            row_ranks.append(rank)
    mask = None
    if action_mask is not None:
        if offsets is None:
            raise ValueError("layout_from_plan: action_mask needs its offsets")
        positions = gather_token_ranges(np.asarray(offsets, dtype=np.int64), plan.kept)
        mask = np.asarray(action_mask, dtype=np.uint8)[positions]
    return StepLayout(
        lengths=lengths[plan.kept],
        action_mask=mask,
        rows=rows,
        row_ranks=np.asarray(row_ranks, dtype=np.int64),
        token_budget=int(token_budget),
        step=step,
    )


def layout_from_microbatches(
    ranks: Sequence[Sequence[tuple[ArrayLike, ArrayLike]]],
    *,
    token_budget: int,
    step: int | None = None,
) -> StepLayout:
    """Layout of served microbatches: ranks[r] = [(cu_seqlens [k+1], loss_mask [T]), ...].

    The loss mask is in next-token layout (entry t = action mask of token t+1 of the same
    sequence, 0 at each sequence's end), so a token's own policy mask is the loss mask one
    position earlier, and a sequence's first token is never a policy token.
    """
    lengths, masks, rows, row_ranks = [], [], [], []
    for rank, microbatches in enumerate(ranks):
        for cu_seqlens, loss_mask in microbatches:
            cu = np.asarray(cu_seqlens, dtype=np.int64)
            loss = np.asarray(loss_mask, dtype=np.uint8)
            if loss.size != (cu[-1] if cu.size else 0):
                raise ValueError(f"rank {rank}: loss_mask has {loss.size} entries, not {cu[-1]}")
            own = np.zeros_like(loss)
            own[1:] = loss[:-1]
            own[cu[:-1]] = 0  # first token of every sequence: nothing predicted it
            first = len(lengths)
            lengths.extend(np.diff(cu).tolist())
            masks.append(own)
            rows.append(np.arange(first, len(lengths), dtype=np.int64))
            row_ranks.append(rank)
    return StepLayout(
        lengths=np.asarray(lengths, dtype=np.int64),
        action_mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
        rows=rows,
        row_ranks=np.asarray(row_ranks, dtype=np.int64),
        token_budget=int(token_budget),
        step=step,
    )


def layout_from_batch_responses(
    responses: Sequence[Any], *, token_budget: int, step: int | None = None
) -> StepLayout:
    """Layout of one step from every rank's GetBatchResponse (messages or their bytes),
    ranks in order: what the trainers received."""
    from rlfeed.proto import rlfeed_pb2 as pb
    from rlfeed.service.codec.messages import decode_microbatch

    ranks = []
    for response in responses:
        if isinstance(response, bytes | bytearray | memoryview):
            response = pb.GetBatchResponse.FromString(bytes(response))
        if not response.ready:
            raise ValueError(f"rank {response.rank}: step {response.step} is not ready")
        step = int(response.step) if step is None else step
        rows = []
        for message in response.microbatches:
            arrays = decode_microbatch(message)
            rows.append((arrays["cu_seqlens"], arrays["loss_mask"]))
        ranks.append(rows)
    return layout_from_microbatches(ranks, token_budget=token_budget, step=step)


def layout_from_lengths(
    lengths: ArrayLike,
    *,
    token_budget: int,
    world_size: int = 1,
    action_masks: Sequence[ArrayLike] | None = None,
    packing_method: str = "ffd",
    step: int | None = None,
) -> StepLayout:
    """Plan a step from sequence lengths alone (no server) and lay it out.

    action_masks: optional per-sequence policy masks (each of its sequence's length).
    """
    from rlfeed.sched.assembly import StepConfig, StepRollouts, assemble_step

    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    mask = None
    if action_masks is not None:
        if len(action_masks) != lengths.size:
            raise ValueError(f"{len(action_masks)} action masks for {lengths.size} lengths")
        for i, m in enumerate(action_masks):
            if len(m) != lengths[i]:
                raise ValueError(f"action_masks[{i}] has {len(m)} entries, not {lengths[i]}")
        mask = np.concatenate([np.asarray(m, np.uint8) for m in action_masks] or [[]])
    policy = (
        np.add.reduceat(mask.astype(np.int64), offsets[:-1])
        if mask is not None and lengths.size
        else np.zeros(lengths.size, np.int64)
    )
    rollouts = StepRollouts(
        lengths=lengths,
        policy_tokens=policy,
        rewards=np.zeros(lengths.size),
        group_ids=np.arange(lengths.size),
    )
    config = StepConfig(
        token_budget=token_budget, world_size=world_size, packing_method=packing_method
    )
    plan = assemble_step(rollouts, config)
    return layout_from_plan(
        plan, lengths, token_budget=token_budget, offsets=offsets, action_mask=mask, step=step
    )


def _sequence_categories(layout: StepLayout) -> list[np.ndarray]:
    """Per sequence, the category of each of its tokens (POLICY or OTHER)."""
    offsets = np.concatenate(([0], np.cumsum(layout.lengths)))
    if layout.action_mask is None:
        return [np.full(int(n), OTHER, np.int8) for n in layout.lengths]
    cats = np.where(layout.action_mask > 0, POLICY, OTHER).astype(np.int8)
    return [cats[offsets[i] : offsets[i + 1]] for i in range(layout.lengths.size)]


def _show(ax: Any, image: np.ndarray, width: int, rows: int, cmap: Any) -> None:
    """Draw a category raster spanning [0, width) x rows: one colour per token category,
    no smoothing between them."""
    ax.imshow(
        image,
        cmap=cmap,
        vmin=0,
        vmax=len(COLORS) - 1,
        aspect="auto",
        interpolation="nearest",
        extent=(0, width, rows, 0),
    )


def _raster(rows: list[np.ndarray], width: int, columns: int) -> np.ndarray:
    """[len(rows), columns] categories: each row's tokens (rest EMPTY), binned to `columns`
    cells by the majority category of each bin's tokens."""
    factor = max(1, -(-width // columns))
    cells = -(-width // factor)
    out = np.zeros((len(rows), cells), dtype=np.int8)
    for i, row in enumerate(rows):
        full = np.zeros(cells * factor, dtype=np.int8)
        full[: row.size] = row
        if factor == 1:
            out[i] = full
            continue
        binned = full.reshape(cells, factor)
        counts = np.stack([(binned == c).sum(axis=1) for c in range(len(COLORS))])
        out[i] = counts.argmax(axis=0)
    return out


def figure_size_px(layout: StepLayout) -> tuple[int, int]:
    """(width, height) in pixels of the rendered PNG: fixed width, height from the rows."""
    rows = max(layout.lengths.size, len(layout.rows), 1)
    plot_height = int(np.clip(rows * 10, 300, 1000))
    return WIDTH_PX, plot_height + 190


def render_layout(layout: StepLayout, image_format: str = "png") -> bytes:
    """The padded-vs-packed picture of `layout` (see `figure_size_px`) in `image_format`, a
    format of matplotlib's Agg canvas ("png", "jpeg", "svg", "pdf", ...)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    width_px, height_px = figure_size_px(layout)
    figure = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    FigureCanvasAgg(figure)
    categories = _sequence_categories(layout)
    n = layout.lengths.size
    longest = int(layout.lengths.max()) if n else 1
    budget = layout.token_budget
    share = longest / (longest + budget)
    to_scale = MIN_PANEL_SHARE <= share <= 1 - MIN_PANEL_SHARE
    share = float(np.clip(share, MIN_PANEL_SHARE, 1 - MIN_PANEL_SHARE))
    left, right, bottom, top, gap = 0.06, 0.99, 90 / height_px, 1 - 100 / height_px, 0.05
    plot_width = right - left - gap
    padded_ax = figure.add_axes((left, bottom, plot_width * share, top - bottom))
    packed_ax = figure.add_axes(
        (left + plot_width * share + gap, bottom, plot_width * (1 - share), top - bottom)
    )
    num_rows = max(n, len(layout.rows), 1)
    cmap = ListedColormap(COLORS)
    panel_px = plot_width * width_px

    padded_rows = [
        np.concatenate([c, np.full(longest - c.size, PADDING, np.int8)]) for c in categories
    ]
    _show(padded_ax, _raster(padded_rows, longest, int(panel_px * share)), longest, n, cmap)
    packed_rows, ticks = [], []
    for i, row in enumerate(layout.rows):
        packed_rows.append(np.concatenate([categories[s] for s in row] or [np.zeros(0, np.int8)]))
        bounds = np.cumsum(layout.lengths[row])[:-1]
        ticks.extend(((b, i), (b, i + 1)) for b in bounds.tolist())
    image = _raster(packed_rows, budget, int(panel_px * (1 - share)))
    _show(packed_ax, image, budget, len(layout.rows), cmap)
    packed_ax.add_collection(
        LineCollection(ticks, colors=BOUNDARY_COLOR, linewidths=1.6 if len(ticks) < 400 else 0.8)
    )
    # Each packed row's budget as a light frame, so unused budget reads as white space.
    packed_ax.add_collection(
        PatchCollection(
            [Rectangle((0, i), budget, 1) for i in range(len(layout.rows))],
            facecolor="none",
            edgecolor="#b0b0b0",
            linewidth=0.6,
        )
    )
    for ax, width, count in ((padded_ax, longest, n), (packed_ax, budget, len(layout.rows))):
        if num_rows <= 200:  # white rules keep neighbouring rows apart
            ax.hlines(np.arange(1, count), 0, width, colors="white", linewidth=0.8)
        ax.set_xlim(0, width)
        ax.set_ylim(num_rows, 0)
        ax.set_xlabel("token position")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    # Rank bands: a rule between ranks and the rank name on the y axis.
    starts = np.flatnonzero(np.diff(layout.row_ranks, prepend=-1))
    ends = np.append(starts[1:], len(layout.rows))
    for s in starts[1:].tolist():
        packed_ax.axhline(s, color="#555555", linewidth=0.8, linestyle="--")
    packed_ax.set_yticks([(s + e) / 2 for s, e in zip(starts, ends, strict=True)])
    packed_ax.set_yticklabels([f"rank {int(layout.row_ranks[s])}" for s in starts], fontsize=8)
    padded_ax.set_ylabel("sequence (one row each)")
    real = layout.real_tokens
    padded = layout.padded_positions
    if len(layout.rows) < num_rows / 2:  # say what the empty space means
        packed_ax.text(
            budget / 2,
            (len(layout.rows) + num_rows) / 2,
            f"{len(layout.rows)} packed rows instead of {n} padded ones:\n"
            f"the padded layout computes {padded / max(real, 1):.1f}x the positions",
            ha="center",
            va="center",
            color="#777777",
            fontsize=11,
        )

    policy = int(layout.action_mask.sum()) if layout.action_mask is not None else None
    slots = max(len(layout.rows), 1) * budget
    scale_note = "" if to_scale else "  (widths not to scale)"
    padded_ax.set_title(
        f"Padded: {n} rows × {longest:,} = {padded:,} positions\n"
        f"{(padded - real) / max(padded, 1):.0%} padding{scale_note}",
        fontsize=10,
        loc="left",
    )
    per_rank = len(layout.rows) // max(layout.world_size, 1)
    packed_ax.set_title(
        f"Packed: {len(layout.rows)} microbatches ({layout.world_size} ranks × {per_rank}) "
        f"of ≤ {budget:,} tokens = {real:,} positions\n"
        f"0% padding, {real / slots:.0%} of the token budget filled",
        fontsize=10,
        loc="left",
    )
    step = "" if layout.step is None else f"Step {layout.step}: "
    policy_text = "" if policy is None else f" ({policy:,} policy tokens)"
    figure.suptitle(
        f"{step}{n} sequences, {real:,} real tokens{policy_text}; same scale, area is compute",
        fontsize=12,
        x=left,
        y=1 - 12 / height_px,
        va="top",
        ha="left",
    )
    other_label = "prompt / tool tokens" if policy is not None else "tokens (no policy mask)"
    handles = [
        *([Patch(color=COLORS[POLICY], label="policy tokens")] if policy is not None else []),
        Patch(color=COLORS[OTHER], label=other_label),
        Patch(color=COLORS[PADDING], label="padding"),
        Patch(facecolor=COLORS[EMPTY], edgecolor="#999999", label="unused token budget"),
        Patch(color=BOUNDARY_COLOR, label="sequence boundary"),
    ]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=9)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=image_format, dpi=DPI)
    return buffer.getvalue()

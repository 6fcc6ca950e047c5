"""Verifiable tasks for a tiny policy: four families, a 20-token vocabulary, binary rewards.

Every episode is a prompt, then policy turns (action_mask 1) of a length fixed per family,
with environment output (action_mask 0) between turns, so a group of one task is a
rectangle that can be generated as one batch. The families span difficulty for a small
model after a short supervised warm start:

- ``pick``: ``BOS PICK d0 d1 d2 d3 k SEP`` -> ``d_k EOS`` (copy by index; easiest).
- ``add``: ``BOS ADD a b SEP`` -> ``(a + b) mod 10, EOS`` (a 100-entry table: the warm start
  sees a quarter of it and nothing generalizes from there, so held-out ``add`` tasks stay
  hard for a whole run).
- ``reverse``: ``BOS REVERSE d0 d1 d2 SEP`` -> ``d2 d1 d0 EOS`` (three answer tokens, all
  of them must be right).
- ``lookup``: ``BOS LOOKUP k SEP`` -> the policy must first emit ``TOOL_CALL``; the
  environment then appends ``TOOL_RESULT d0 d1 d2 d3 TOOL_END`` (mask 0: tool output is
  context, not action) and the policy answers ``d_k EOS`` in a second turn. No call, no
  tool output: the episode ends after the first turn with reward 0.

The verifier is exact match of every policy turn (EOS included): reward 1.0 or 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Token ids: digits are their own ids, then the specials.
DIGITS = tuple(range(10))
BOS, SEP, EOS, TOOL_CALL, TOOL_RESULT, TOOL_END = 10, 11, 12, 13, 14, 15
FAMILY_MARKERS = {"pick": 16, "add": 17, "reverse": 18, "lookup": 19}
VOCAB_SIZE = 20
FAMILIES = tuple(FAMILY_MARKERS)
TOKEN_NAMES = {
    **{d: str(d) for d in DIGITS},
    BOS: "<bos>",
    SEP: "<sep>",
    EOS: "<eos>",
    TOOL_CALL: "<tool_call>",
    TOOL_RESULT: "<tool_result>",
    TOOL_END: "<tool_end>",
    **{marker: f"<{name}>" for name, marker in FAMILY_MARKERS.items()},
}


@dataclass(frozen=True)
class Task:
    """One task instance. `answer` is the final policy turn the verifier expects (EOS
    included); `tool_output` is what the environment appends after a correct tool call
    (empty for single-turn families)."""

    task_id: str
    family: str
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    tool_output: tuple[int, ...] = ()

    @property
    def multi_turn(self) -> bool:
        return bool(self.tool_output)

    @property
    def turn_lengths(self) -> tuple[int, ...]:
        """Policy tokens generated per turn (fixed per family: groups stay rectangular)."""
        return (1, len(self.answer)) if self.multi_turn else (len(self.answer),)

    def expected_turns(self) -> tuple[tuple[int, ...], ...]:
        """The policy turns that earn reward 1 (what the warm start imitates)."""
        return ((TOOL_CALL,), self.answer) if self.multi_turn else (self.answer,)

    def tool_response(self, turn: Sequence[int]) -> tuple[int, ...] | None:
        """What the environment appends after the policy's first turn of a multi-turn
        task: the tool output when the turn is the call, None (episode over) otherwise."""
        return self.tool_output if tuple(int(t) for t in turn) == (TOOL_CALL,) else None


def content_key(task: Task) -> tuple:
    """What makes two tasks the same problem (ids aside): splits are disjoint on this."""
    return (task.family, task.prompt, task.tool_output)


def verify(task: Task, turns: Sequence[Sequence[int]]) -> float:
    """Binary reward: 1.0 iff every policy turn equals the expected one, else 0.0.

    turns: the policy's turns in order (a multi-turn episode that did not call the tool
    has one turn). Lengths other than the family's simply fail."""
    got = tuple(tuple(int(t) for t in turn) for turn in turns)
    return 1.0 if got == task.expected_turns() else 0.0


@dataclass(frozen=True)
class Episode:
    """One finished episode in the wire layout: token_ids int32 [L], action_mask uint8 [L]
    (1 on policy tokens), and the verifier's reward."""

    token_ids: np.ndarray
    action_mask: np.ndarray
    reward: float


def assemble(task: Task, turns: Sequence[Sequence[int]]) -> Episode:
    """Prompt + policy turns + tool output between them, with its mask and reward.

    A multi-turn episode whose first turn is not the tool call ends there (its later turns,
    if given, are ignored): the environment never answered."""
    tokens = list(task.prompt)
    mask = [0] * len(task.prompt)
    kept = [tuple(int(t) for t in turns[0])]
    tokens += kept[0]
    mask += [1] * len(kept[0])
    if task.multi_turn:
        response = task.tool_response(kept[0])
        if response is not None and len(turns) > 1:
            second = tuple(int(t) for t in turns[1])
            tokens += list(response) + list(second)
            mask += [0] * len(response) + [1] * len(second)
            kept.append(second)
    return Episode(
        token_ids=np.asarray(tokens, dtype=np.int32),
        action_mask=np.asarray(mask, dtype=np.uint8),
        reward=verify(task, kept),
    )


def solved_episode(task: Task) -> Episode:
    """The episode of a perfect policy (reward 1): the warm start's training example."""
    return assemble(task, task.expected_turns())


def make_task(family: str, values: Sequence[int], index: int, prefix: str) -> Task:
    """The task of `family` for one point of its content space (`family_space`)."""
    if family not in FAMILY_MARKERS:
        raise ValueError(f"unknown task family {family!r}; expected one of {FAMILIES}")
    marker = FAMILY_MARKERS[family]
    task_id = f"{prefix}-{family}-{index:04d}"
    if family == "pick":
        *digits, k = values
        return Task(task_id, family, (BOS, marker, *digits, k, SEP), (digits[k], EOS))
    if family == "add":
        a, b = values
        return Task(task_id, family, (BOS, marker, a, b, SEP), ((a + b) % 10, EOS))
    if family == "reverse":
        return Task(task_id, family, (BOS, marker, *values, SEP), (*values[::-1], EOS))
    k, *digits = values  # lookup
    tool = (TOOL_RESULT, *digits, TOOL_END)
    return Task(task_id, family, (BOS, marker, k, SEP), (digits[k], EOS), tool)


def family_space(family: str) -> np.ndarray:
    """Every content point of a family, [n, k] int: pick (d0..d3, k) 40,000; add (a, b)
    100; reverse (d0, d1, d2) 1,000; lookup (k, d0..d3) 40,000."""
    if family == "pick":
        digits = _grid(4)
        return np.concatenate(
            [np.column_stack([digits, np.full(len(digits), k)]) for k in range(4)]
        )
    if family == "add":
        return _grid(2)
    if family == "reverse":
        return _grid(3)
    if family == "lookup":
        digits = _grid(4)
        return np.concatenate(
            [np.column_stack([np.full(len(digits), k), digits]) for k in range(4)]
        )
    raise ValueError(f"unknown task family {family!r}; expected one of {FAMILIES}")


def _column(length: int, value: int) -> np.ndarray:
    return np.full(length, value)


def _grid(width: int) -> np.ndarray:
    return np.array(np.unravel_index(np.arange(10**width), (10,) * width)).T


def render(tokens: Sequence[int]) -> str:
    """Readable tokens, for logs and error messages."""
    return " ".join(TOKEN_NAMES.get(int(t), f"?{int(t)}") for t in tokens)

"""Producer-side sampling: a group of one task as one batch, KV-cached, with tool turns.

    episodes = sample_group(model, task, group_size=8, generator=g)

The prompt is repeated `group_size` times and run once with the cache on; each policy
token is then one cached forward of the batch's newest tokens. Every sampled token's
log-prob is recorded as the sampler saw it: `log_softmax` of the raw float32 logits at
temperature 1, the distribution the token was drawn from. Between turns the environment's
tokens (tool output) are fed through the cache as one chunk; they get action_mask 0 and
log-prob 0. The families' fixed turn lengths keep the batch rectangular: no padding, no
attention mask. A row whose first turn of a tool task is not the call still runs the tool
output (the batch stays rectangular) but its episode is cut after that turn, so nothing it
keeps depends on what followed (causal attention).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from rlfeed.service.gym.tasks import Episode, Task, assemble


@dataclass(frozen=True)
class SampledEpisode:
    """An episode and its sampler log-probs: float32 [L], the log-prob of token t given
    tokens < t under the sampling policy where action_mask is 1, 0 elsewhere."""

    episode: Episode
    sampler_logprobs: np.ndarray


def _forward_keywords(model) -> tuple[str, dict]:
    """The forward's name for the KV cache (`cache` in recent transformers 5,
    `past_key_values` before, deprecated there) and its keyword computing only the last
    position's logits, where it has one."""
    parameters = inspect.signature(model.forward).parameters
    keep = {name: 1 for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters}
    return ("cache" if "cache" in parameters else "past_key_values"), dict(list(keep.items())[:1])


class _CachedDecoder:
    """Feeds token chunks of a [B, *] batch through the model, keeping the KV cache."""

    def __init__(self, model) -> None:
        self.model = model
        self.keyword, self.last_only = _forward_keywords(model)
        self.cache = None

    def feed(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """float32 log-probs [B, V] of the next token after `tokens_BT` [B, T]."""
        kwargs = {} if self.cache is None else {self.keyword: self.cache}
        out = self.model(input_ids=tokens_BT, use_cache=True, **self.last_only, **kwargs)
        # The output names the cache as the input does (`cache` or `past_key_values`).
        self.cache = out.get(self.keyword)
        return torch.log_softmax(out.logits[:, -1].float(), dim=-1)


@torch.inference_mode()
def sample_group(
    model, task: Task, group_size: int, generator: torch.Generator
) -> list[SampledEpisode]:
    """`group_size` episodes of `task` sampled at temperature 1 (model in eval mode)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    decoder = _CachedDecoder(model)
    logprobs_BV = decoder.feed(torch.tensor(task.prompt).repeat(group_size, 1))
    turns: list[torch.Tensor] = []  # per turn: sampled tokens [B, n]
    turn_logprobs: list[torch.Tensor] = []  # per turn: their log-probs [B, n]
    lengths = task.turn_lengths
    for index, length in enumerate(lengths):
        if index > 0:
            logprobs_BV = decoder.feed(torch.tensor(task.tool_output).repeat(group_size, 1))
        tokens, logprobs = [], []
        for position in range(length):
            token_B = torch.multinomial(logprobs_BV.exp(), 1, generator=generator)[:, 0]
            tokens.append(token_B)
            logprobs.append(logprobs_BV.gather(1, token_B[:, None])[:, 0])
            if position + 1 < length or index + 1 < len(lengths):
                logprobs_BV = decoder.feed(token_B[:, None])
        turns.append(torch.stack(tokens, dim=1))
        turn_logprobs.append(torch.stack(logprobs, dim=1))
    return [
        _episode(task, [t[row] for t in turns], [lp[row] for lp in turn_logprobs])
        for row in range(group_size)
    ]


def _episode(task: Task, turns: list[torch.Tensor], logprobs: list[torch.Tensor]):
    episode = assemble(task, [turn.tolist() for turn in turns])
    sampler = np.zeros(episode.token_ids.size, dtype=np.float32)
    # The kept policy tokens, in order, are the first turns' tokens: place their log-probs.
    kept = np.concatenate([lp.numpy() for lp in logprobs])[: int(episode.action_mask.sum())]
    sampler[episode.action_mask.astype(bool)] = kept
    return SampledEpisode(episode=episode, sampler_logprobs=sampler)

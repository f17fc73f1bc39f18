"""Scoring text: the log-likelihood the model gives each token of a window, for perplexity and evaluations.

A plain function of the model: one forward pass over the window from position 0 (the KV cache is filled as by a
prefill and not reused), then a log-softmax over the vocabulary in chunks of positions, so that float32
log-probabilities of a long window of a large vocabulary never exist all at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpt_fast.generation.decode import cache_length
from gpt_fast.model.transformer import Transformer

LOG_SOFTMAX_ROWS = 256  # positions turned into float32 log-probabilities at a time


@torch.no_grad()
def token_scores(model: Transformer, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(ids[i] | ids[:i])`` for ``i = 1 .. len(ids) - 1`` (float32 [len(ids) - 1], on the CPU), and whether
    each ``ids[i]`` is the model's most likely token there (bool, the same shape): an evaluation asks whether
    greedy decoding would write a continuation."""
    assert len(ids) >= 2, "a window of at least two tokens"
    device = model.norm.weight.device
    model.setup_caches(1, cache_length(len(ids), 0, model.config.block_size))
    window = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
    logits = model(window, torch.arange(len(ids), device=device))[0, :-1]  # [T - 1, V]: predictions of ids[1:]
    targets = window[0, 1:, None]  # [T - 1, 1]
    scores, greedy = [], []
    for start in range(0, len(ids) - 1, LOG_SOFTMAX_ROWS):
        rows = logits[start : start + LOG_SOFTMAX_ROWS].float().log_softmax(dim=-1)
        chosen = rows.gather(1, targets[start : start + LOG_SOFTMAX_ROWS])
        scores.append(chosen)
        greedy.append(chosen >= rows.max(dim=-1, keepdim=True).values)
    return torch.cat(scores)[:, 0].cpu(), torch.cat(greedy)[:, 0].cpu()

"""Next-token sampling: greedy, temperature, top-k and top-p, as plain functions of the logits.

Randomness comes from torch's global generator (seeded by ``--seed``), drawn with the exponential trick
(argmax of p / Exp(1) is a sample from p), which needs no host round-trip and compiles into the decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Below this temperature sampling is greedy: the limit of the distribution as the temperature goes to 0, and dividing
# the logits by an ever smaller number would overflow to infinities (and NaN probabilities).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8  # 0 (or below MIN_TEMPERATURE) = greedy argmax
    top_k: int | None = 200  # None = the whole vocabulary
    top_p: float = 1.0  # 1 = no nucleus filtering
    # Whether top-p filters: a plain bool, because torch.compile may treat the floats above as symbolic values,
    # and the branches below must not depend on those.
    nucleus: bool = field(init=False)

    def __post_init__(self) -> None:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "nucleus", self.top_p < 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def top_p_filter(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) all but the smallest prefix of descending-sorted logits [B, K] whose probability reaches top_p."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above each one
    return sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))


def candidates(logits: torch.Tensor, config: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, filtered logits over the candidate tokens, and the candidates' vocabulary ids (None = all, in order).

    With top-k the candidates are the k best, sorted, so top-p works on k values instead of the whole vocabulary.
    """
    logits = logits.float() / config.temperature  # [B, V]
    index = None
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        # Only top-p needs the candidates in order; sorting them costs a kernel as long as the rest of sampling.
        logits, index = torch.topk(logits, config.top_k, dim=-1, sorted=config.nucleus)  # [B, k]
    elif config.nucleus:
        logits, index = torch.sort(logits, dim=-1, descending=True)
    if config.nucleus:
        logits = top_p_filter(logits, config.top_p)
    return logits, index


def sample(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Next token ids [B] (int64) from the last position's logits [B, V]."""
    if config.greedy:
        return logits.argmax(dim=-1)
    scores, index = candidates(logits, config)
    choice = sample_weights(torch.softmax(scores, dim=-1))  # [B]
    return choice if index is None else index.gather(-1, choice[:, None]).squeeze(-1)


def sample_weights(weights: torch.Tensor) -> torch.Tensor:
    """An index along the last dimension of ``weights`` [..., N] (non-negative, not necessarily normalized) drawn
    in proportion to them: the exponential trick, argmax of w / Exp(1). Returns int64 [...]."""
    return torch.argmax(weights / torch.empty_like(weights).exponential_(1), dim=-1)


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The distribution :func:`sample` draws from, over the whole vocabulary: float32 [..., V] for logits
    [..., V], zero outside the top-k / top-p candidates. Not for greedy configs (their distribution is the argmax).

    Speculative sampling needs the draft's and the target's distributions themselves, not only a sample."""
    assert not config.greedy, "greedy sampling has no distribution to speak of: use the argmax"
    scores, index = candidates(logits, config)
    probs = torch.softmax(scores, dim=-1)
    return probs if index is None else torch.zeros_like(logits, dtype=probs.dtype).scatter_(-1, index, probs)

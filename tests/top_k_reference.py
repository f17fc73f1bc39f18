"""Top-k sampling by our Triton kernels against a PyTorch reference of the same semantics, shared by the interpreter
test (run as a script in a process of its own, with ``TRITON_INTERPRET=1``: prints the mismatches as JSON) and the
GPU test (imported).

The reference: the candidates are the ``k`` largest logits, of those tied at the k-th largest the lowest ids (a
stable sort); the token is the candidate of the largest ``logit * (1 / temperature) - log(noise[id])`` in float32,
the lowest id of equal scores.
"""

from __future__ import annotations

import json
import sys

import torch

# (rows, vocabulary, k, scale of the logits, dtype): normal logits times the scale, or for a negative scale eight
# levels that far apart. Small scales and levels tie many logits at the k-th largest, spread over several programs'
# chunks, of which only the lowest ids are candidates.
CASES = [
    (2, 3000, 200, 3.0, torch.bfloat16),
    (1, 5000, 50, 0.05, torch.bfloat16),
    (1, 4500, 300, 0.01, torch.bfloat16),
    (2, 6000, 5, -0.5, torch.bfloat16),
    (1, 6000, 900, -0.5, torch.float16),
    (1, 700, 1, 3.0, torch.bfloat16),  # the argmax
    (1, 300, 299, 3.0, torch.bfloat16),  # all but one
    (3, 2500, 40, 2.0, torch.float16),
]


def reference(logits: torch.Tensor, noise: torch.Tensor, k: int, temperature: float) -> list[int]:
    """Token ids, one per row of ``logits`` [B, V], under the module's semantics."""
    tokens = []
    for row, draws in zip(logits.float().cpu(), noise.cpu(), strict=True):
        candidates = torch.sort(-row, stable=True).indices[:k].sort().values
        score = row[candidates] * (1.0 / temperature) - torch.log(draws[candidates])
        tokens.append(int(candidates[int(torch.argmax(score))]))
    return tokens


def mismatches(device: str, trials: int = 5) -> list[str]:
    """The cases (with their trial) where the kernels' tokens differ from the reference's on ``device``."""
    from gpt_fast.kernels.triton_top_k import top_k_sample

    generator = torch.Generator().manual_seed(0)
    wrong = []
    for rows, vocab, k, scale, dtype in CASES:
        for trial in range(trials):
            if scale > 0:
                logits = (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)
            else:
                logits = (torch.randint(0, 8, (rows, vocab), generator=generator) * -scale).to(dtype)
            noise = torch.empty(rows, vocab).exponential_(generator=generator)
            got = top_k_sample(logits.to(device), noise.to(device), k, 0.8).tolist()
            if got != reference(logits, noise, k, 0.8):
                wrong.append(f"{rows}x{vocab} k={k} scale={scale} {dtype} trial {trial}")
    return wrong


if __name__ == "__main__":
    json.dump(mismatches(sys.argv[1] if len(sys.argv) > 1 else "cpu"), sys.stdout)

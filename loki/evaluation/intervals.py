"""95% confidence intervals of the suite's measurements.

- :func:`paired_increase`: the perplexity increase of a method over a reference measured on the same tokens,
  ``exp(mean(nll_method - nll_ref)) - 1``, with a paired block bootstrap: the per-token NLL differences are cut
  into contiguous blocks inside each window (neighbouring tokens are correlated, so single tokens would give too
  narrow an interval), blocks are resampled with replacement, and the 2.5 / 97.5 percentiles of the resampled
  mean difference give the interval.
- :func:`wilson_interval`: a binomial proportion (accuracy over n samples).
- :func:`paired_difference`: the difference of two accuracies on the same samples (Newcombe's hybrid score
  interval for paired proportions).

Every function is deterministic (a fixed seed) so a report and its gates do not change between runs of the same
measurements.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK_TOKENS", "BOOTSTRAP_SAMPLES", "Z95", "paired_difference", "paired_increase", "wilson_interval"]

#: Tokens per bootstrap block of :func:`paired_increase`.
BLOCK_TOKENS = 128
#: Bootstrap resamples.
BOOTSTRAP_SAMPLES = 2000
#: The normal quantile of a two-sided 95% interval.
Z95 = 1.959963984540054


def _block_sums(diff: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """diff [N, T] -> per-block sums and token counts (blocks of ``block`` tokens inside each window)."""
    N, T = diff.shape
    nb = -(-T // block)
    pad = nb * block - T
    d = torch.nn.functional.pad(diff, (0, pad))
    counts = torch.nn.functional.pad(torch.ones_like(diff), (0, pad))
    return d.view(N * nb, block).sum(-1), counts.view(N * nb, block).sum(-1)


def paired_increase(nll: torch.Tensor, nll_ref: torch.Tensor, *, block: int = BLOCK_TOKENS,
                    samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict[str, float]:
    """Relative perplexity increase of ``nll`` over ``nll_ref`` (both ``[N, T]`` per-token NLLs of the same
    tokens) with its 95% paired block-bootstrap interval: ``{"increase", "lo", "hi"}``."""
    a, b = torch.as_tensor(nll, dtype=torch.float64), torch.as_tensor(nll_ref, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"nll and nll_ref must be [N, T] of one shape, got {list(a.shape)} and {list(b.shape)}")
    if block < 1 or samples < 1:
        raise ValueError(f"block and samples must be >= 1, got {block} and {samples}")
    sums, counts = _block_sums(a - b, block)
    mean = float(sums.sum() / counts.sum())
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, sums.numel(), (samples, sums.numel()), generator=g)
    boot = sums[pick].sum(-1) / counts[pick].sum(-1)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"increase": math.expm1(mean), "lo": math.expm1(lo), "hi": math.expm1(hi)}


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (``(0, 1)`` for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def paired_difference(a, b, z: float = Z95) -> dict:
    """Difference of two paired proportions, mean(a) - mean(b), over the same samples (``a``, ``b``: 0/1 per
    sample), with Newcombe's hybrid score interval (1998, method 10: Wilson intervals of both margins combined
    with the continuity-corrected phi correlation)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    n = len(a)
    both = sum(1 for x, y in zip(a, b) if x and y)
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    neither = n - both - only_a - only_b
    out = {"diff": 0.0, "lo": -1.0, "hi": 1.0, "n": n, "only_a": only_a, "only_b": only_b}
    if n == 0:
        return out
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    l1, u1 = wilson_interval(both + only_a, n, z)
    l2, u2 = wilson_interval(both + only_b, n, z)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = 0.0
    if margins > 0:
        cross = both * neither - only_a * only_b
        corrected = cross - n / 2 if cross > n / 2 else (cross if cross < 0 else 0.0)
        phi = corrected / math.sqrt(margins)
    d = p1 - p2
    lo = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = d + math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    out.update(diff=d, lo=max(-1.0, lo), hi=min(1.0, hi))
    return out

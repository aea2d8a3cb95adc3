"""95% confidence intervals of the suite's measurements.

- :func:`paired_increase`: the perplexity increase of a method over a reference measured on the same tokens,
  ``exp(mean(nll_method - nll_ref)) - 1``, with a paired block bootstrap: the per-token NLL differences are cut
  into contiguous blocks inside each window (neighbouring tokens are correlated, so single tokens would give too
  narrow an interval), blocks are resampled with replacement, and the 2.5 / 97.5 percentiles of the resampled
  mean difference give the interval.
- :func:`wilson_interval`: a binomial proportion (accuracy over n samples).
- :func:`paired_difference`: the difference of two accuracies on the same samples, bootstrap over samples.

Every function is deterministic (a fixed seed) so a report and its gates do not change between runs of the same
measurements.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK_TOKENS", "BOOTSTRAP_SAMPLES", "paired_difference", "paired_increase", "wilson_interval"]

#: Tokens per bootstrap block of :func:`paired_increase`.
BLOCK_TOKENS = 128
#: Bootstrap resamples.
BOOTSTRAP_SAMPLES = 2000
_Z95 = 1.959963984540054


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


def wilson_interval(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion ``successes / n`` (``(0, 1)`` for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must lie in [0, n={n}], got {successes}")
    p = successes / n
    z2 = _Z95 * _Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = _Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(correct: torch.Tensor, correct_ref: torch.Tensor, *, samples: int = BOOTSTRAP_SAMPLES,
                      seed: int = 0) -> dict[str, float]:
    """Accuracy difference ``mean(correct) - mean(correct_ref)`` of two 0/1 vectors over the same samples, with
    its 95% bootstrap interval (samples resampled together): ``{"difference", "lo", "hi"}``."""
    a, b = torch.as_tensor(correct, dtype=torch.float64), torch.as_tensor(correct_ref, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 1 or a.numel() == 0:
        raise ValueError(f"correct and correct_ref must be non-empty vectors of one length, got {list(a.shape)} "
                         f"and {list(b.shape)}")
    d = a - b
    g = torch.Generator().manual_seed(seed)
    boot = d[torch.randint(0, d.numel(), (samples, d.numel()), generator=g)].mean(-1)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"difference": float(d.mean()), "lo": lo, "hi": hi}

"""Eigen-spectra of key covariances: PCA with a deterministic sign convention, explained-variance curves and
Rank@v (used by :class:`loki.basis.PCABasis` and by calibration, :mod:`loki.calibration.pca`).

Shape letters: L = decoder layers, HKV = key/value heads, D = head dim; ``...`` = any leading dims.

Convention: components are the *columns* of ``P: [D, D]`` so that ``x_hat = x @ P``; they are sorted by
decreasing eigenvalue, so the first ``d`` columns span the best rank-``d`` subspace.  Each column's sign is fixed
so that its entry of largest magnitude is positive (the first such entry on ties): the same statistics give the
same basis bit for bit on CPU.

The basis is fit on the *centred* covariance, but keys are **not** centred at inference: by Lemma 1 of the Loki
paper, for orthogonal ``P`` we have ``(q P)(K P)^T = q K^T`` exactly, so no centring is needed for correctness
(the paper's code loads the means and never uses them).  The means are kept for analysis only.
"""

from __future__ import annotations

import torch

__all__ = ["explained_variance_ratio", "fix_signs", "mean_rank_per_layer", "pca", "pca_from_statistics", "rank_at"]

def fix_signs(components: torch.Tensor) -> torch.Tensor:
    """Flip columns of ``components: [..., D, D]`` so the entry of largest ``|.|`` in each column is positive."""
    idx = components.abs().argmax(dim=-2, keepdim=True)  # [..., 1, D]
    pivot = components.gather(-2, idx)
    signs = torch.where(pivot < 0, -1.0, 1.0).to(components.dtype)
    return components * signs


def pca(covariance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of ``covariance: [..., D, D]`` in float64.

    Returns ``(eigenvalues [..., D], components [..., D, D])``, both float64, eigenvalues in decreasing order and
    components as columns with the deterministic sign convention of :func:`fix_signs`.
    """
    cov = covariance.to(torch.float64)
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    eigenvalues, vectors = torch.linalg.eigh(cov)
    eigenvalues = eigenvalues.flip(-1)
    vectors = vectors.flip(-1)
    return eigenvalues, fix_signs(vectors)


def pca_from_statistics(stats, centered: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PCA of each (layer, KV head) of ``stats`` (a :class:`~loki.calibration.stats.KeyStatistics`).

    Returns ``(components [L, HKV, D, D] float64, eigenvalues [L, HKV, D] float64, means [L, HKV, D] float64)``.
    """
    eigenvalues, components = pca(stats.covariance(centered=centered))
    return components, eigenvalues, stats.mean


def explained_variance_ratio(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Cumulative explained-variance ratio ``[..., D]`` of eigenvalues ``[..., D]`` sorted in decreasing order.

    Entry ``i`` is the fraction of the total variance captured by the first ``i + 1`` components; the last entry
    is exactly 1 (tiny negative eigenvalues from round-off are clamped to 0).  An all-zero spectrum gives ones.
    """
    ev = eigenvalues.to(torch.float64).clamp_min(0.0)
    cumulative = ev.cumsum(dim=-1)
    total = cumulative[..., -1:]
    safe = torch.where(total > 0, total, torch.ones_like(total))
    ratio = torch.where(total > 0, cumulative / safe, torch.ones_like(cumulative))
    return ratio


def rank_at(eigenvalues: torch.Tensor, v: float) -> torch.Tensor:
    """Rank@v of the Loki paper: the minimum number of principal components whose eigenvalues sum to at least
    ``v`` percent of the total variance.

    Args:
        eigenvalues: ``[..., D]`` sorted in decreasing order (e.g. ``[L, HKV, D]``).
        v: percentage in ``(0, 100]``, e.g. 90.

    Returns:
        ``[...]`` int64 ranks in ``[1, D]``.
    """
    v = float(v)
    if not 0.0 < v <= 100.0:
        raise ValueError(f"v must be a percentage in (0, 100], got {v}")
    ratio = explained_variance_ratio(eigenvalues)
    D = ratio.shape[-1]
    below = (ratio < v / 100.0).sum(dim=-1)
    return (below + 1).clamp_max(D).to(torch.int64)


def mean_rank_per_layer(eigenvalues: torch.Tensor, v: float) -> torch.Tensor:
    """Rank@v averaged over KV heads: ``eigenvalues [L, HKV, D]`` -> ``[L]`` float64."""
    if eigenvalues.ndim != 3:
        raise ValueError(f"eigenvalues must have shape [L, HKV, D], got {list(eigenvalues.shape)}")
    return rank_at(eigenvalues, v).to(torch.float64).mean(dim=-1)

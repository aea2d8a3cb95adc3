"""PCA of key statistics, Rank@v and explained-variance curves (defined in :mod:`loki.spectrum`, beside the
basis that uses them; calibration fits its bases with them).

Shape letters: L = decoder layers, HKV = key/value heads, D = head dim; ``...`` = any leading dims.
"""

from __future__ import annotations

from loki.spectrum import (
    explained_variance_ratio,
    fix_signs,
    mean_rank_per_layer,
    pca,
    pca_from_statistics,
    rank_at,
)

__all__ = ["explained_variance_ratio", "fix_signs", "mean_rank_per_layer", "pca", "pca_from_statistics", "rank_at"]

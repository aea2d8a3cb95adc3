"""Calibration of Loki's low-rank key bases: key capture, streamed statistics, PCA and Rank@v.

See :mod:`loki.calibration.calibrate` for the entry point :func:`calibrate`, and :mod:`loki.basis` for the
:class:`~loki.basis.PCABasis` it returns.  Keys are never written to disk; only float64 statistics are kept.
"""

from loki.calibration.calibrate import (
    BASIS_NAMES,
    CALIBRATION_KINDS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_NUM_TOKENS,
    DEFAULT_SEQ_LEN,
    ROTARY_MODES,
    calibrate,
    collect_key_statistics,
    fit_bases,
    iter_token_batches,
    model_context_length,
)
from loki.calibration.channels import channel_basis, label_channels
from loki.calibration.collect import collect_statistics
from loki.calibration.hooks import (
    SUPPORTED_ARCHITECTURES,
    KeyLayout,
    PreRotaryKeyHooks,
    batch_keys,
    cache_keys,
    key_layout,
    positions_from_mask,
)
from loki.calibration.pca import (
    explained_variance_ratio,
    fix_signs,
    mean_rank_per_layer,
    pca,
    pca_from_statistics,
    rank_at,
)
from loki.calibration.stats import KeyStatistics

__all__ = [
    "BASIS_NAMES",
    "CALIBRATION_KINDS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_NUM_TOKENS",
    "DEFAULT_SEQ_LEN",
    "ROTARY_MODES",
    "SUPPORTED_ARCHITECTURES",
    "KeyLayout",
    "KeyStatistics",
    "PreRotaryKeyHooks",
    "batch_keys",
    "cache_keys",
    "calibrate",
    "channel_basis",
    "collect_key_statistics",
    "collect_statistics",
    "explained_variance_ratio",
    "fit_bases",
    "fix_signs",
    "iter_token_batches",
    "key_layout",
    "label_channels",
    "mean_rank_per_layer",
    "model_context_length",
    "pca",
    "pca_from_statistics",
    "positions_from_mask",
    "rank_at",
]

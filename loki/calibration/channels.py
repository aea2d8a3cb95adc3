"""Double Sparsity's label channels (Yang et al. 2024, "Post-Training Sparse Attention with Double Sparsity") as a
Loki basis.

Double Sparsity ranks tokens by approximate scores computed from ``r`` of the ``D`` channels of the query and the
keys, the *label channels*, chosen offline per layer and head as the channels of largest calibrated contribution
to ``q . k``: the mean over calibration tokens of ``|q_j k_j|`` (query and key of the same token, post-rotary, as the
paper's calibration computes it; here per KV head, the group's query heads averaged).  Then top-k and exact
attention.  That is Loki with an orthogonal basis that permutes the channels so the label channels come first and
``d = r``: ``k_hat = k P`` with ``P[:, i] = e_{c_i}`` (``c_0, c_1, ...`` the channels by decreasing contribution)
gives ``q_hat[:r] . k_hat[:r] = sum_{j in labels} q_j k_j``, and ``P`` is orthogonal, so Lemma 1 holds and the Loki
kernels, caches and engine run it unchanged, with Loki's bytes (``r / (2D) + k``).  The basis is a
:class:`~loki.basis.PCABasis` of ``kind="channels"`` whose ``eigenvalues`` hold the sorted contributions.

The paper also stores the label cache in 4 bits; that changes its bytes, not its selection, and is left out.

Shape letters: L layers, HQ query heads, HKV key/value heads (G = HQ // HKV), D head dim, N tokens.
"""

from __future__ import annotations

import torch

from loki._hf import config_identity
from loki.basis import PCABasis
from loki.calibration.stats import KeyStatistics

__all__ = ["CHANNEL_STATISTIC", "channel_basis", "channel_contributions", "label_channels"]

#: What the channel statistics average, as recorded in a basis' ``extra["statistic"]``.
CHANNEL_STATISTIC = "mean over calibration tokens of |q_j k_j| (query and key of the same token, post-rotary; " \
                    "the group's query heads averaged)"


def channel_contributions(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Per token and KV head, each channel's contribution ``|q_j k_j|`` averaged over the group's query heads.

    query: [N, HQ, D]; key: [N, HKV, D] (the same N tokens) -> [N, HKV, D] (the vectors whose mean
    :class:`~loki.calibration.stats.KeyStatistics` keeps for kind "channels")."""
    N, HQ, D = query.shape
    HKV = key.shape[1]
    return (query.reshape(N, HKV, HQ // HKV, D) * key[:, :, None]).abs().mean(dim=2)


def label_channels(components: torch.Tensor) -> torch.Tensor:
    """The channels of a channel basis in its order: ``components`` [..., D, D] (permutation matrices,
    ``P[:, i] = e_{c_i}``) -> [..., D] int64, ``c_i`` (the label channels of ``r`` are the first ``r``)."""
    return components.abs().argmax(dim=-2)


def channel_basis(channels: KeyStatistics, keys: KeyStatistics | None = None, *, config=None,
                  model_name: str | None = None, corpus: str | None = None, seq_len: int | None = None,
                  model_dtype=None, max_positions: int | None = None) -> PCABasis:
    """The :class:`~loki.basis.PCABasis` of kind "channels" from channel statistics (kind "channels" of
    :func:`~loki.calibration.collect.collect_statistics`): per layer and KV head the permutation that orders the
    channels by decreasing mean contribution (ties to the lower channel), ``eigenvalues`` the sorted contributions,
    ``means`` the mean key of ``keys`` (post-rotary key statistics; zeros without them; for analysis only).

    Statistics holding NaN or inf raise ``ValueError`` naming the layer and KV head."""
    channels.check_finite("query-key products")
    contrib = channels.mean  # [L, HKV, D] float64
    order = torch.sort(contrib, dim=-1, descending=True, stable=True)
    L, HKV, D = contrib.shape
    eye = torch.eye(D, dtype=torch.float32)
    components = eye[:, order.indices].permute(1, 2, 0, 3).contiguous()  # [L, HKV, D, D]: column i = e_{c_i}
    means = keys.mean.cpu() if keys is not None else torch.zeros(L, HKV, D, dtype=torch.float64)
    return PCABasis(
        components=components,
        eigenvalues=order.values.cpu().contiguous(),
        means=means,
        kind="channels",
        rotary="post",
        **config_identity(config, model_name),
        corpus=corpus,
        num_tokens=channels.num_tokens,
        seq_len=seq_len,
        max_positions=max_positions,
        model_dtype=None if model_dtype is None else str(model_dtype).replace("torch.", ""),
        centered=False,
        extra={"statistic": CHANNEL_STATISTIC, "method": "double_sparsity"},
    )

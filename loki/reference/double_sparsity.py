"""Double Sparsity (Yang et al. 2024, "Post-Training Sparse Attention with Double Sparsity"), in plain PyTorch, on
its own terms: approximate scores from the ``r`` label channels of each KV head, ``sum_{j in labels} q_j k_j``,
then top-k and exact attention over the selected tokens.

The evaluation runs Double Sparsity as Loki with a channel-permutation basis
(:func:`loki.calibration.channels.channel_basis`): this function is the direct channel-subset form the tests hold
that basis against (same selection, same output).

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim, r label
channels, K selected tokens, H the selection's head axis (HQ or HKV).
"""

from __future__ import annotations

import torch

from .._checks import check_decode_inputs, valid_token_mask
from .common import default_scale
from .selection import GQA_AGGREGATES, GQA_SELECT_MODES, budget, group_selection
from .sparse import select_and_attend

__all__ = ["double_sparsity_attention", "label_scores"]


def label_scores(q: torch.Tensor, k_cache: torch.Tensor, channels: torch.Tensor,
                 compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unscaled approximate scores from the label channels: ``sum_{j in channels[h]} q_j k_j``.

    q: [B, HQ, D]; k_cache: [B, HKV, S, D]; channels: [HKV, r] int (the label channels of each KV head, shared by
    its query heads) -> [B, HQ, S] in ``compute_dtype``."""
    B, HQ, D = q.shape
    HKV, S = k_cache.shape[1], k_cache.shape[2]
    if channels.dim() != 2 or channels.shape[0] != HKV:
        raise ValueError(f"channels must have shape [HKV, r] with HKV={HKV}, got {list(channels.shape)}")
    r = channels.shape[1]
    if not 1 <= r <= D or int(channels.min()) < 0 or int(channels.max()) >= D:
        raise ValueError(f"channels must hold 1 <= r <= D={D} channel indices in [0, {D}), got {channels.tolist()}")
    c = channels.to(device=q.device, dtype=torch.long)
    G = HQ // HKV
    qc = torch.gather(q.to(compute_dtype).view(B, HKV, G, D), -1, c[None, :, None, :].expand(B, HKV, G, r))
    kc = torch.gather(k_cache.to(compute_dtype), -1, c[None, :, None, :].expand(B, HKV, S, r))
    return torch.einsum("bhgr,bhsr->bhgs", qc, kc).reshape(B, HQ, S)


def double_sparsity_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    channels: torch.Tensor,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    gqa_select: str,
    aggregate: str,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_indices: bool = False,
):
    """Double Sparsity: top-k of the label-channel scores (:func:`label_scores`), exact attention over the selection.

    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D] (post-rotary, the coordinates the channels were calibrated in);
    channels: [HKV, r] int; ``k`` a count or a fraction (the one budget rule); ``gqa_select`` / ``aggregate`` as in
    :func:`~loki.reference.methods.loki_attention`.  Returns out [B, HQ, D] (and ``(idx [B, H, K], counts)``)."""
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    if gqa_select not in GQA_SELECT_MODES:
        raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {gqa_select!r}")
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")
    valid = valid_token_mask(lengths, starts, S)
    heads = s = label_scores(q, k_cache, channels, compute_dtype).masked_fill(~valid[:, None, :], float("-inf"))
    counts = budget(k, lengths, starts, B, S, q.device)
    if gqa_select == "kv":
        s, counts = group_selection(heads, counts, HKV, aggregate, valid, lengths - starts, default_scale(D, scale))
    out, idx = select_and_attend(s, counts, q, k_cache, v_cache, lengths - starts, scale=scale,
                                 compute_dtype=compute_dtype)
    return (out, (idx, counts)) if return_indices else out

"""Masks over the tokens of score rows, shared by the references that select by mask (the teacher-forced rows) and
by the selection diagnostics (:mod:`.accounting`): the top-k set of a row as a mask (ties to the lowest index), a
shared selection read by every query head of its group, and a softmax over the allowed entries.

Shape letters: B batch, HQ query heads, HKV key/value heads, R rows, S keys.
"""

from __future__ import annotations

import torch

__all__ = ["masked_softmax", "per_query_head", "topk_mask"]

_NEG_INF = float("-inf")


def topk_mask(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The ``counts`` largest entries of every row of ``scores`` as a bool mask, ties to the lowest index.

    scores: [..., N] (``-inf`` marks entries that may not be chosen); counts: scores.shape[:-1] (or
    broadcastable to it) int, ``0 <= counts <= `` the finite entries of the row -> [..., N] bool with exactly
    ``counts`` True entries per row.
    """
    counts = counts.long().expand(scores.shape[:-1])
    kmax = int(counts.max()) if counts.numel() else 0
    if kmax == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    top = torch.topk(scores, kmax, dim=-1, sorted=True).values
    thr = top.gather(-1, (counts - 1).clamp(min=0)[..., None])  # the counts-th largest value of each row
    thr = thr.masked_fill(counts[..., None] == 0, float("inf"))  # a row with no budget selects nothing
    mask = scores > thr
    need = counts[..., None] - mask.sum(-1, keepdim=True)  # threshold entries still to take
    eq = (scores == thr) & (need > 0)
    n_eq = eq.sum(-1, keepdim=True)
    partial = (n_eq > need).squeeze(-1)  # rows whose ties straddle the budget: the first `need` in index order
    mask |= eq & ~partial[..., None]
    if bool(partial.any()):
        where = partial.nonzero(as_tuple=True)
        eq_rows = eq[where]
        take = eq_rows & (eq_rows.cumsum(-1) <= need[where])
        mask[where] |= take
    return mask


def per_query_head(mask: torch.Tensor, HQ: int) -> torch.Tensor:
    """[B, HKV, R, S] -> [B, HQ, R, S] (each KV head's entry repeated over its query heads)."""
    B, HKV = mask.shape[:2]
    if HKV == HQ:
        return mask
    return mask[:, :, None].expand(B, HKV, HQ // HKV, *mask.shape[2:]).reshape(B, HQ, *mask.shape[2:])


def masked_softmax(s: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed entries of each row, zeros for a row with none.  Differentiable: the NaN rows
    are zeroed in place only when no gradient is recorded (softmax's backward reads its output)."""
    p = torch.softmax(s.masked_fill(~allowed, _NEG_INF), dim=-1)
    return p.nan_to_num(0.0) if p.requires_grad else p.nan_to_num_(0.0)

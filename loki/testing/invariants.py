"""Selection invariants (the FlashInfer way of testing top-k): checked per row, not by exact indices."""

from __future__ import annotations

import torch

__all__ = ["check_selection"]


def check_selection(idx: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor, *, slack: float = 0.0) -> int:
    """Assert the invariants of a top-k selection and return the number of rows checked.

    idx: [B, H, K] (entries after ``counts[b]`` must be -1); scores: [B, H, S] (-inf = not selectable);
    counts: [B].  Per row: padding is -1, indices in range, no duplicates, no masked token, and every selected
    score >= the counts[b]-th largest score minus ``slack`` (ties allowed; ``slack`` for scores computed in
    another order or precision).
    """
    B, H, S = scores.shape
    idx, scores, counts = idx.cpu().long(), scores.cpu().double(), counts.cpu()
    checked = 0
    for b in range(B):
        c = int(counts[b])
        kth = torch.topk(scores[b], c, dim=-1).values[:, -1]  # [H]
        for h in range(H):
            sel = idx[b, h, :c]
            assert bool((idx[b, h, c:] == -1).all()), f"row ({b},{h}): padding after counts[b]={c} is not -1"
            assert bool(((sel >= 0) & (sel < S)).all()), f"row ({b},{h}): index out of range: {sel.tolist()[:8]}"
            assert sel.unique().numel() == c, f"row ({b},{h}): duplicate indices"
            vals = scores[b, h, sel]
            assert bool(torch.isfinite(vals).all()), f"row ({b},{h}): selected an invalid token"
            assert bool((vals >= kth[h] - slack).all()), f"row ({b},{h}): a selected score is below the k-th largest"
            checked += 1
    return checked

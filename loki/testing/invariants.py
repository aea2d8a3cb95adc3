"""Selection invariants (the FlashInfer way of testing top-k): checked per row, not by exact indices."""

from __future__ import annotations

import torch

__all__ = ["assert_same_sets", "check_selection"]


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


def assert_same_sets(idx: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor) -> None:
    """idx selects exactly the reference's set in every row (any order), -1 after counts[b], no poisoned slot."""
    from loki.kernels.launch import POISON_INT

    idx, ref = idx.cpu().long(), ref.cpu().long()
    assert not (idx == POISON_INT).any(), "an output slot was never written"
    for b in range(idx.shape[0]):
        c = int(counts[b])
        assert bool((idx[b, :, c:] == -1).all()), f"batch {b}: padding after counts[b]={c} is not -1"
        got, want = idx[b, :, :c].sort(-1).values, ref[b, :, :c].sort(-1).values
        bad = (got != want).any(-1).nonzero().flatten().tolist()
        assert not bad, f"batch {b}: rows {bad[:8]} select another set than the reference"

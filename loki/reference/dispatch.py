"""One decode step of any method on a batch of rows, by name: the PyTorch references of :mod:`.methods` behind one
call (the reference route of the transformers integration, and the evaluation engine's single-row steps).

Shape letters: R rows (sequences), HQ query heads, HKV key/value heads, S keys, D head dim.
"""

from __future__ import annotations

import torch

from .dense import dense_attention
from .methods import (
    exact_topk_attention,
    h2o_attention,
    loki_attention,
    pcaattn_attention,
    sparq_attention,
)
from .quest import quest_attention

__all__ = ["decode_rows"]


def decode_rows(method: str, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, *, k, d, lengths: torch.Tensor,
                starts: torch.Tensor, gqa_select: str, aggregate: str, scale: float | None,
                counts: torch.Tensor | None = None, acc: torch.Tensor | None = None, recent_fraction: float = 0.5,
                score_format: str = "native"):
    """One decode step of ``method`` for rows q [R, HQ, D] (rotated into the basis for "loki" and "pcaattn") over
    kc, vc [R, HKV, S, D] (keys in the basis for those methods), valid tokens ``starts <= s < lengths`` ([R] int).

    ``k`` and ``d`` as resolved settings give them (``d`` a count); ``counts`` ([R] int, optional): Loki's budgets
    already resolved (``loki._checks.budget_counts``), used instead of ``k``.  ``acc`` ([R, HQ, S]): H2O's
    accumulated attention (H2O returns ``(out, weights)``).  ``score_format``: Loki's score copy
    (:mod:`.score_formats`).  Returns out [R, HQ, D].
    """
    lengths = lengths.to(torch.int32)
    starts = starts.to(torch.int32)
    if method == "loki":
        budget = {"counts": counts} if counts is not None else {"k": k}
        return loki_attention(q, kc, vc, d=d, lengths=lengths, starts=starts, gqa_select=gqa_select,
                              aggregate=aggregate, scale=scale, score_format=score_format, **budget)
    if method == "exact_topk":
        return exact_topk_attention(q, kc, vc, k=k, lengths=lengths, starts=starts, gqa_select=gqa_select,
                                    aggregate=aggregate, scale=scale)
    if method == "pcaattn":
        return pcaattn_attention(q, kc, vc, d=d, lengths=lengths, starts=starts, scale=scale)
    if method == "dense":
        return dense_attention(q, kc, vc, lengths, starts, scale=scale)
    if method == "sparq":
        return sparq_attention(q, kc, vc, r=d, k=k, lengths=lengths, starts=starts, scale=scale)
    if method == "quest":
        return quest_attention(q, kc, vc, k=k, lengths=lengths, starts=starts, gqa_select=gqa_select,
                               aggregate=aggregate, scale=scale)
    if method == "h2o":
        return h2o_attention(q, kc, vc, acc, k=k, lengths=lengths, starts=starts, scale=scale,
                             recent_fraction=recent_fraction, return_weights=True)
    raise ValueError(f"unknown method {method!r}")

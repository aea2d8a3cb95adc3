"""Top-k agreement of Loki's selection with the exact top-k, per layer and head, on a real model.

For every query row i of a window (decode-time semantics: row i sees the i + 1 tokens up to itself and selects
k_i = ceil(k_f * (i + 1)) of them) this measures

- the Jaccard index |A ∩ E| / |A ∪ E| of Loki's selection A (approximate scores from d principal dims) and the
  exact top-k selection E (exact scores q . K^T), and
- the attention mass captured: the sum of the exact attention probabilities over A (1 would be lossless; the
  same quantity for E is the best any selection of k_i tokens can do).

Rows where k_i = i + 1 (everything selected) carry no information and are left out of the averages.
Queries and keys are captured post-rotary (as the KV cache stores them) from one forward pass with a temporary
attention function; the bases rotate both (Lemma 1), whichever keys (pre or post rotary) they were fit on.

Shape letters: L layers, HQ query heads, HKV key/value heads, T window tokens, D head dim, H the selection's head
axis (HQ for ``gqa_select="query"``, HKV for ``"kv"``).
"""

from __future__ import annotations

import math

import torch

from loki.basis import PCABasis
from loki.reference import (
    aggregate_group_scores,
    approx_scores,
    budget,
    exact_scores,
    expand_to_query_heads,
    rotate_keys,
    rotate_query,
    select_topk,
)

__all__ = ["capture_qk", "selection_agreement", "topk_agreement"]

@torch.no_grad()
def capture_qk(model, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-rotary queries ``[B, HQ, T, D]`` and keys ``[B, HKV, T, D]`` of every layer for ``input_ids [B, T]``
    (one causal forward pass)."""
    from loki.calibration.hooks import AttentionRecorder

    store: dict = {}

    def keep(layer, query, key):
        store[layer] = (query.detach().clone(), key.detach().clone())

    with AttentionRecorder(model, keep):
        model(input_ids=input_ids.to(model.device), use_cache=False)
    return store


def _mask_from_idx(idx: torch.Tensor, S: int) -> torch.Tensor:
    m = torch.zeros(*idx.shape[:2], S + 1, dtype=torch.bool, device=idx.device)
    m.scatter_(-1, torch.where(idx < 0, S, idx), True)
    return m[..., :S]


@torch.no_grad()
def selection_agreement(
    q: torch.Tensor,
    k: torch.Tensor,
    P: torch.Tensor,
    *,
    k_f: float,
    d: int | float,
    gqa_select: str = "query",
    aggregate: str = "sum",
    P_q: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Agreement of Loki and exact top-k over the rows of one layer of one sequence.

    q: [HQ, T, D]; k: [HKV, T, D] (post-rotary); P: [HKV, D, D] (the key transform); P_q: the query transform
    of a score basis (default P).  Returns per-head means over informative rows:
    ``jaccard`` [H], ``mass`` [HQ] (exact attention mass on Loki's selection), ``mass_exact`` [HQ] (on the exact
    top-k), and ``rows`` (the number of informative rows).
    """
    HQ, T, D = q.shape
    HKV = k.shape[0]
    qr = q.transpose(0, 1).float()  # [T, HQ, D]: one decode step per row
    kc = k.float()[None].expand(T, HKV, T, D)
    lengths = torch.arange(1, T + 1, dtype=torch.int32)
    s = exact_scores(qr, kc, lengths)  # [T, HQ, T]
    probs = torch.softmax(s / math.sqrt(D), dim=-1)
    counts = budget(k_f, lengths, None, T, T)
    sel_scores = aggregate_group_scores(s, HKV, aggregate) if gqa_select == "kv" else s
    exact_idx = select_topk(sel_scores, counts)
    q_hat = rotate_query(qr, (P if P_q is None else P_q).float())
    k_hat = rotate_keys(k.float()[None], P.float()).expand(T, HKV, T, D)
    approx = approx_scores(q_hat, k_hat, d, lengths, gqa_select=gqa_select, aggregate=aggregate)
    loki_idx = select_topk(approx, counts)
    m_exact, m_loki = _mask_from_idx(exact_idx, T), _mask_from_idx(loki_idx, T)
    inter = (m_exact & m_loki).sum(-1).double()
    union = (m_exact | m_loki).sum(-1).double()
    rows = counts < lengths.long()  # [T] informative rows
    n = int(rows.sum())
    if n == 0:
        raise ValueError("no informative rows: every row selects all of its tokens (raise T or lower k_f)")
    jac = (inter / union)[rows].mean(0)
    mass = (probs * expand_to_query_heads(m_loki, HQ)).sum(-1)[rows].double().mean(0)
    mass_exact = (probs * expand_to_query_heads(m_exact, HQ)).sum(-1)[rows].double().mean(0)
    return {"jaccard": jac, "mass": mass, "mass_exact": mass_exact, "rows": n}


@torch.no_grad()
def topk_agreement(
    model,
    windows: torch.Tensor,
    bases: dict[str, PCABasis],
    *,
    k_f: float = 0.25,
    d: int | float = 0.25,
    gqa_select: str = "query",
    aggregate: str = "sum",
    progress: bool = True,
) -> dict[str, dict]:
    """Jaccard and captured attention mass of Loki vs exact top-k for every basis, per layer and head.

    windows: [N, T] token ids.  Returns ``{basis name: {"jaccard": [L, H] mean over windows, "mass": [L, HQ],
    "mass_exact": [L, HQ], "jaccard_mean", "mass_mean", "mass_exact_mean"}}`` with tensors as nested lists.
    """
    from tqdm.auto import tqdm

    acc: dict[str, dict[str, list]] = {name: {"jaccard": [], "mass": [], "mass_exact": []} for name in bases}
    for w in tqdm(windows, desc="top-k agreement", unit="window", disable=not progress):
        qk = capture_qk(model, w[None])
        per: dict[str, dict[str, list]] = {name: {"jaccard": [], "mass": [], "mass_exact": []} for name in bases}
        for layer in sorted(qk):
            q, k = qk[layer]
            for name, basis in bases.items():
                r = selection_agreement(q[0], k[0], basis.layer(layer), k_f=k_f, d=d, gqa_select=gqa_select,
                                        aggregate=aggregate, P_q=basis.query_layer(layer))
                for key in ("jaccard", "mass", "mass_exact"):
                    per[name][key].append(r[key])
        for name in bases:
            for key in ("jaccard", "mass", "mass_exact"):
                acc[name][key].append(torch.stack(per[name][key]))  # [L, H]
    out = {}
    for name in bases:
        entry = {}
        for key in ("jaccard", "mass", "mass_exact"):
            t = torch.stack(acc[name][key]).mean(0)
            entry[key] = [[round(float(x), 5) for x in row] for row in t]
            entry[f"{key}_mean"] = float(t.mean())
            entry[f"{key}_per_layer"] = [round(float(x), 5) for x in t.mean(dim=1)]
        out[name] = entry
    return out

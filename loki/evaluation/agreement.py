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

from loki._checks import resolve_d, resolve_k
from loki.basis import PCABasis
from loki.calibration.hooks import AttentionRecorder
from loki.reference import aggregate_group_scores
from loki.reference.teacher_forced import grouped_scores, masked_softmax, per_query_head, topk_mask

__all__ = ["capture_qk", "selection_agreement", "topk_agreement"]


@torch.no_grad()
def capture_qk(model, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-rotary queries ``[B, HQ, T, D]`` and keys ``[B, HKV, T, D]`` of every layer for ``input_ids [B, T]``
    (one causal forward pass)."""
    store: dict = {}

    def keep(layer, query, key):
        store[layer] = (query.detach().clone(), key.detach().clone())

    with AttentionRecorder(model, keep):
        model(input_ids=input_ids.to(model.device), use_cache=False)
    return store


def _group_select(s: torch.Tensor, vis: torch.Tensor, HKV: int, gqa_select: str, aggregate: str,
                  scale: float) -> torch.Tensor:
    """Selection scores [HQ, R, S] of rows that see ``vis`` [1, R, S] -> [H, R, S] (per KV head, combined over
    the group, for "kv"), -inf where a row sees nothing."""
    s = s.masked_fill(~vis, float("-inf"))
    if gqa_select == "query":
        return s
    if gqa_select != "kv":
        raise ValueError(f"gqa_select must be 'query' or 'kv', got {gqa_select!r}")
    return aggregate_group_scores(s[None], HKV, aggregate, scale=scale)[0].masked_fill(~vis, float("-inf"))


@torch.no_grad()
def selection_agreement(
    q: torch.Tensor,
    k: torch.Tensor,
    P: torch.Tensor,
    *,
    k_f: float,
    d: int | float,
    gqa_select: str,
    aggregate: str,
    P_q: torch.Tensor | None = None,
    block_rows: int = 1024,
) -> dict[str, torch.Tensor]:
    """Agreement of Loki and exact top-k over the rows of one layer of one sequence.

    q: [HQ, T, D]; k: [HKV, T, D] (post-rotary); P: [HKV, D, D] (the key transform); P_q: the query transform
    of a score basis (default P).  Rows are processed in blocks of ``block_rows`` (selections as masks, ties to
    the lowest index, as the teacher-forced methods).  Returns per-head means over informative rows:
    ``jaccard`` [H], ``mass`` [HQ] (exact attention mass on Loki's selection), ``mass_exact`` [HQ] (on the exact
    top-k), and ``rows`` (the number of informative rows).
    """
    HQ, T, D = q.shape
    HKV = k.shape[0]
    G = HQ // HKV
    dd = resolve_d(d, D)
    P_q = P if P_q is None else P_q
    qf, kf = q.float()[None], k.float()[None]  # [1, HQ, T, D], [1, HKV, T, D]
    q_hat = (qf.view(1, HKV, G, T, D) @ P_q.float().to(q.device)[None, :, None]).view(1, HQ, T, D)
    k_hat = kf @ P.float().to(k.device)[None]
    n = torch.arange(1, T + 1, device=q.device)
    counts = resolve_k(k_f, n, T)  # [T]
    informative = counts < n
    if not bool(informative.any()):
        raise ValueError("no informative rows: every row selects all of its tokens (raise T or lower k_f)")
    H = HKV if gqa_select == "kv" else HQ
    jac = torch.zeros(H, dtype=torch.float64, device=q.device)
    mass = torch.zeros(HQ, dtype=torch.float64, device=q.device)
    mass_exact = torch.zeros(HQ, dtype=torch.float64, device=q.device)
    pos = torch.arange(T, device=q.device)
    for r0 in range(0, T, block_rows):
        r1 = min(T, r0 + block_rows)
        vis = (pos[None, :r1] <= pos[r0:r1, None])[None]  # [1, R, S]: causal
        rows = informative[r0:r1]
        c = counts[r0:r1][None]
        s = grouped_scores(qf[:, :, r0:r1], kf[:, :, :r1])[0]  # [HQ, R, S]
        probs = masked_softmax(s / math.sqrt(D), vis)
        exact = topk_mask(_group_select(s, vis, HKV, gqa_select, aggregate, 1 / math.sqrt(D)), c)
        approx = grouped_scores(q_hat[:, :, r0:r1, :dd], k_hat[:, :, :r1, :dd])[0]
        loki = topk_mask(_group_select(approx, vis, HKV, gqa_select, aggregate, 1 / math.sqrt(D)), c)
        inter, union = (exact & loki).sum(-1).double(), (exact | loki).sum(-1).double()
        jac += (inter / union)[:, rows].sum(-1)
        mass += (probs * per_query_head(loki[None], HQ)[0]).sum(-1)[:, rows].double().sum(-1)
        mass_exact += (probs * per_query_head(exact[None], HQ)[0]).sum(-1)[:, rows].double().sum(-1)
    m = int(informative.sum())
    return {"jaccard": (jac / m).cpu(), "mass": (mass / m).cpu(), "mass_exact": (mass_exact / m).cpu(), "rows": m}


@torch.no_grad()
def topk_agreement(
    model,
    windows: torch.Tensor,
    bases: dict[str, PCABasis],
    *,
    k_f: float = 0.25,
    d: int | float = 0.25,
    gqa_select: str,
    aggregate: str,
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

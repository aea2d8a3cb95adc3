"""Score-aware bases: choose the key/query transform that best preserves the attention *scores*.

Loki ranks tokens by ``q_hat[:d] . k_hat[:d]``.  The paper's PCA basis keeps the ``d`` directions of largest key
variance, whatever the queries look like.  What the ranking needs is the best rank-``d`` approximation of the
bilinear form ``q . k`` over the queries and keys the model produces.  Lemma 1 only needs
``q_hat . k_hat = q . k``, which any invertible pair ``k_hat = k P_k``, ``q_hat = q P_q`` with
``P_q P_k^T = I`` satisfies, so the kernels and the rotated cache stay as they are.

With ``M_q = E[q q^T]`` (uncentred: the query's own direction matters) and ``C_k`` the *centred* key covariance
(a per-query constant shift ``q . mu`` moves every score of a row alike and never changes a top-k), the expected
squared error of the rank-``d`` score approximation,
``E_q Var_k[q^T k - q_hat[:d] . k_hat[:d]]``, is minimised (Eckart-Young) by the SVD
``M_q^{1/2} C_k^{1/2} = U S V^T``:

    P_q = M_q^{-1/2} U S^{1/2},    P_k = C_k^{-1/2} V S^{1/2},    P_q P_k^T = I,

optimal for every ``d`` at once (singular values sorted).  Statistics are per layer and KV head; the queries of
a GQA group are pooled, as they share the KV head's keys.  Queries and keys are post-rotary (what attention
sees); ``eps`` floors the eigenvalues of both moments at ``eps`` times the largest, so the inverses stay finite.

A shared selection (one per KV group, :func:`loki.reference.aggregate_group_scores`) ranks tokens by each head's
softmax-normalised scores, so a head matters by how well its own order is kept, not by the size of its scores.
Pooling ``M_q`` over the group weighs a head by its query energy: the heads with the widest score spread (which a
given absolute error disturbs least) dominate the fit.  The group-normalised variant (basis ``"score-group"``,
:func:`group_query_moment`) pools ``M_h / tr(M_h C_k)`` instead: every query head's expected score variance
``E_q Var_k[q^T k] = tr(M_h C_k)`` is made 1, so the fit minimises the sum over the group's heads of each head's
error relative to its own score spread.

Shape letters: L layers, HQ query heads, HKV KV heads (G = HQ // HKV), B batch, S sequence length, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from loki._hf import config_identity
from loki.basis import PCABasis, constant_heads
from loki.calibration.collect import collect_statistics
from loki.calibration.stats import KeyStatistics

__all__ = ["collect_score_statistics", "group_query_moment", "score_aware_pair", "score_aware_basis"]


def _sym_pow(m: torch.Tensor, power: float, eps: float) -> torch.Tensor:
    w, v = torch.linalg.eigh(0.5 * (m + m.transpose(-1, -2)))
    w = w.clamp_min(eps * w.amax(dim=-1, keepdim=True).clamp_min(1e-300))
    return (v * w.pow(power).unsqueeze(-2)) @ v.transpose(-1, -2)


def score_aware_pair(
    query_moment: torch.Tensor, key_covariance: torch.Tensor, eps: float = 1e-4,
    identity: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P_q, P_k, s)`` for ``query_moment, key_covariance: [..., D, D]`` (float64): ``P_q, P_k [..., D, D]``
    with ``P_q P_k^T = I`` and the singular values ``s [..., D]`` in decreasing order.

    Heads where either matrix is zero (no key variance, no query energy: every score of a row is the same), and
    those marked in ``identity`` (``[...]`` bool), get the identity pair with ``s = 0``: the inverse square roots
    would be unbounded there, and any pair ranks equal scores alike."""
    mq = query_moment.to(torch.float64)
    ck = key_covariance.to(torch.float64)
    D = mq.shape[-1]
    eye = torch.eye(D, dtype=torch.float64, device=mq.device)
    flat = (torch.linalg.eigvalsh(mq).amax(dim=-1) <= 0) | (torch.linalg.eigvalsh(ck).amax(dim=-1) <= 0)
    if identity is not None:
        flat = flat | identity.to(device=flat.device, dtype=torch.bool)
    if bool(flat.any()):  # well-conditioned stand-ins; their outputs are replaced below
        mq = torch.where(flat[..., None, None], eye, mq)
        ck = torch.where(flat[..., None, None], eye, ck)
    a, a_inv = _sym_pow(mq, 0.5, eps), _sym_pow(mq, -0.5, eps)
    b, b_inv = _sym_pow(ck, 0.5, eps), _sym_pow(ck, -0.5, eps)
    u, s, vh = torch.linalg.svd(a @ b)
    root = s.clamp_min(1e-300).sqrt().unsqueeze(-2)
    pq = a_inv @ u * root
    pk = b_inv @ vh.transpose(-1, -2) * root
    # deterministic signs: the largest-|.| entry of each key column positive (the query column flips with it)
    idx = pk.abs().argmax(dim=-2, keepdim=True)
    sign = torch.where(pk.gather(-2, idx) < 0, -1.0, 1.0).to(pk.dtype)
    pq, pk = pq * sign, pk * sign
    if bool(flat.any()):
        pq = torch.where(flat[..., None, None], eye, pq)
        pk = torch.where(flat[..., None, None], eye, pk)
        s = torch.where(flat[..., None], torch.zeros_like(s), s)
    return pq, pk, s


def group_query_moment(query_heads: KeyStatistics, key_covariance: torch.Tensor) -> torch.Tensor:
    """The group-normalised query moment ``[L, HKV, D, D]`` (float64): the mean over each KV group's query heads
    of ``M_h / tr(M_h C_k)``, from per-query-head statistics (``query_heads`` of shape [L, HQ, D], kind
    "query-heads" of :func:`~loki.calibration.collect.collect_statistics`) and the centred key covariance
    ``key_covariance [L, HKV, D, D]``.  A head whose expected score variance is 0 (no query energy along the keys'
    spread) adds nothing."""
    L, HQ, D = query_heads.shape
    HKV = key_covariance.shape[1]
    if HQ % HKV:
        raise ValueError(f"the query statistics have {HQ} heads, not a multiple of the keys' {HKV} KV heads")
    m = query_heads.second_moment()  # [L, HQ, D, D]
    c = key_covariance.to(m).repeat_interleave(HQ // HKV, dim=1)
    spread = torch.einsum("lhij,lhji->lh", m, c)  # E_q[q^T C_k q] per query head
    w = torch.where(spread > 0, 1.0 / spread.clamp_min(1e-300), 0.0)
    return (m * w[..., None, None]).view(L, HKV, HQ // HKV, D, D).mean(dim=2)


def collect_score_statistics(
    model: nn.Module, batches: Iterable, *, num_tokens: int | None = None, max_positions: int | None = None,
    progress: bool = True,
) -> tuple[KeyStatistics, KeyStatistics]:
    """Stream post-rotary key and query statistics of ``model`` over ``batches`` (as
    :func:`~loki.calibration.collect.collect_statistics` takes them).  Returns ``(keys, queries)``; query
    statistics are per KV head, pooled over the group's query heads (``count`` = tokens x G)."""
    stats = collect_statistics(model, batches, kinds=("post", "query"), num_tokens=num_tokens,
                               max_positions=max_positions, progress=progress, desc="calibrating queries and keys")
    return stats["post"], stats["query"]


def score_aware_basis(keys: KeyStatistics, queries: KeyStatistics, *, eps: float = 1e-4, config=None,
                      model_name: str | None = None, corpus: str | None = None, seq_len: int | None = None,
                      model_dtype=None, max_positions: int | None = None, group_normalised: bool = False):
    """A :class:`~loki.basis.PCABasis` of kind "score" from post-rotary key and query statistics.

    ``queries``: per KV head with the group pooled ("query" statistics), or with ``group_normalised=True`` per
    query head ("query-heads"), pooled by :func:`group_query_moment` (recorded as ``extra["query_moment"]``).

    A KV head whose keys have no variance (constant keys, or a single token) or whose queries are all zero gets
    the identity pair with zero singular values, and a warning names it; statistics with NaN or inf, or without
    key variance in any head, raise :class:`~loki.basis.BasisError` naming the layer and KV head
    (:func:`loki.basis.constant_heads`).  The result never holds NaN."""
    flat = constant_heads(keys, "keys")
    constant_heads(queries, "queries", rel_tol=-1.0)  # NaN or inf; all-zero queries everywhere
    cov = keys.covariance(centered=True)
    mq = group_query_moment(queries, cov) if group_normalised else queries.second_moment()
    pq, pk, s = score_aware_pair(mq, cov, eps=eps, identity=flat)
    return PCABasis(
        components=pk.to(torch.float32).contiguous(),
        query_components=pq.to(torch.float32).contiguous(),
        eigenvalues=s.contiguous(),
        means=keys.mean.cpu(),
        kind="score",
        rotary="post",
        **config_identity(config, model_name),
        corpus=corpus,
        num_tokens=keys.num_tokens,
        seq_len=seq_len,
        max_positions=max_positions,
        model_dtype=None if model_dtype is None else str(model_dtype).replace("torch.", ""),
        centered=True,
        extra={"eps": eps, **({"query_moment": "group-normalised"} if group_normalised else {})},
    )

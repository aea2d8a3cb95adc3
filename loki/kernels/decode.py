"""One decode step of Loki attention (Algorithm 1), the entry point of the kernels for a whole step:
``decode_attention`` validates its inputs and runs the PyTorch reference or the kernels; ``loki_decode_step``
runs the kernels on inputs already validated (the transformers integration's hot loop, the benchmarks).
The stages are public in ``loki.kernels`` too, each beside its reference.

Stages: approximate scores from the first d rotated dims (``approx_scores``), top-k selection
(``select_topk``), exact attention over the selected tokens (``sparse_attention``); scores and selection
fused in one kernel (``score_select``) where it pays.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
d leading principal dims, K the bound on the per-sequence selection counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loki._checks import (
    budget_bound,
    check_budget,
    check_count,
    check_decode_inputs,
    check_no_grad,
    resolve_d,
    resolve_scale,
)
from loki.reference.methods import loki_attention as loki_attention_reference
from loki.reference.selection import GQA_AGGREGATES, GQA_SELECT_MODES, budget, check_kernel_aggregate

from . import launch as _launch_mod
from ._common import check_triton_device
from .approx_scores import _check_key_prefix, _launch_approx_scores, _launch_softmax_group_scores
from .group_softmax import SOFTMAX_AGGREGATES
from .launch import DecodePlan, new_output, recording, tensor_key
from .score_select import score_select, score_select_fusable
from .score_select_softmax import SOFTMAX_FUSED_DEFAULTS, score_select_softmax
from .select import SELECT_METHODS, TRITON_SELECT_MAX_S, resolve_select_method, select_topk
from .sparse_attention import sparse_attention

__all__ = ["BACKENDS", "DecodeTuning", "StepReplay", "decode_attention", "loki_attention_reference",
           "loki_decode_step", "selection_bound", "selection_width"]

class StepReplay:
    """Recorded launches of the decode step, owned by the caller (one model forward, one benchmark loop): the
    explicit replay object of :func:`loki_decode_step`.

    The second call with an argument signature (shapes, strides, dtypes, pointer alignment and options; not the
    addresses) launches normally while recording a ``DecodePlan``; later calls with that signature call the
    compiled kernels directly with fresh buffers (~4x less host time per step).  Nothing is shared between
    owners: a replay object lives as long as its owner keeps it (the transformers integration makes one per
    forward, so layers 3+ of a step replay and nothing outlives the step), and nothing is recorded or replayed
    while a CUDA graph is being captured.
    """

    __slots__ = ("plans", "seen", "max_plans")

    def __init__(self, max_plans: int = 8):
        self.plans: dict = {}
        self.seen: set = set()
        self.max_plans = max_plans

    def clear(self) -> None:
        self.plans.clear()
        self.seen.clear()


BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True, slots=True)
class DecodeTuning:
    """Launch choices of ``loki_decode_step`` beside its defaults (tuning and tests; the defaults are what the
    integration runs).

    ``num_splits`` (an int >= 1): the attention kernel's split of the selection (default: ``choose_num_splits``).
    ``fuse_select``: score and select in one kernel (``score_select``: one launch instead of two;
    ``score_select_softmax`` for a softmax aggregate of a "kv" selection: one instead of four).  True forces and
    False forbids it wherever a fused kernel applies (the Triton select, S <= ``TRITON_SELECT_MAX_S``, and at most
    16 query heads per KV head for a softmax aggregate; elsewhere the unfused path runs either way); None decides
    by ``score_select_fusable`` (enough rows to fill the GPU, S not too long), for every aggregate.  ``reuse_scores``
    (per-query-head selections): the attention kernel takes the first d dims of each selected score from the
    approximate scores instead of re-reading K[t, :d].  ``use_plan``: record and replay the step's launches
    (``DecodePlan``).  ``attn_options``: extra keyword arguments for ``sparse_attention`` (calls with them
    always take the normal launch path).
    """

    num_splits: int | None = None
    fuse_select: bool | None = None
    reuse_scores: bool = True
    use_plan: bool = True
    attn_options: Mapping | None = None


_DEFAULT_TUNING = DecodeTuning()


def selection_bound(k: int | float, S: int) -> int:
    """An int K >= every per-sequence count ``budget(k, ...)`` can give over a cache of S tokens, known without a
    device sync (``loki._checks.budget_bound``: an int count above S is capped at S)."""
    return budget_bound(k, S)


def selection_width(k: int | float, S: int) -> int:
    """The selection width K of a decode step over a cache of S tokens: ``selection_bound`` rounded up to a
    multiple of 16 (at most S).  Entries past each sequence's count are -1 and never read; a cache that grows by one
    token per step then keeps the same Triton specialisation of the index rows' stride."""
    return min(S, -(-selection_bound(k, S) // 16) * 16)


def decode_attention(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    d: int | float,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
    gqa_select: str = "query",
    aggregate: str = "sum",
    scale: float | None = None,
    select_method: str = "auto",
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_indices: bool = False,
    check_values: bool = True,
    k_prefix: torch.Tensor | None = None,
):
    """Loki decode attention on keys stored in the PCA basis.

    q_hat: [B, HQ, D] (q P); k_hat: [B, HKV, S, D] (K P); v_cache: [B, HKV, S, D]; lengths, starts: [B]
    int (valid tokens ``starts[b] <= s < lengths[b]``; default all S); d: leading dims for the
    approximate scores (int count or fraction of D); k: tokens to attend (int count, capped at each
    sequence's length, or a fraction of it).  Returns out [B, HQ, D] in q_hat's dtype (and
    ``(idx [B, H, K], counts [B])`` when ``return_indices``; H = HQ for ``gqa_select="query"``, HKV for
    ``"kv"``, whose group scores are combined by ``aggregate``).  These kernel-level defaults ("query", "sum") take
    no model into account; the library's default on a GQA model, which ``enable_loki`` resolves and the
    end-to-end benchmark times, is ``gqa_select="kv", aggregate="softmax-max"``
    (``loki.integrations.transformers.enable.default_gqa_mode``).

    ``backend``: "torch" runs ``loki_attention_reference`` (differentiable); "triton" the kernels (CUDA
    tensors, or CPU tensors under ``TRITON_INTERPRET=1``; no backward: inputs that require grad are refused
    while autograd is enabled); "auto" picks triton for CUDA tensors that need no gradient, torch otherwise.
    Both backends select the same tokens (ties go to the lowest position) and give an empty output for an
    empty batch (B = 0).  ``scale`` (default ``1/sqrt(D)``) must be a finite number > 0; ``num_splits`` (an
    int >= 1, triton backend) overrides the attention kernel's split of the selection.
    ``select_method``: "auto" (the default: "triton" on CUDA tensors, "torch" otherwise), "torch"
    (``torch.topk`` on tie-broken keys) or "triton" (exact threshold select).  ``k_prefix`` (optional, triton backend):
    [B, HKV, S, dp] with dp >= d, the first dp rotated key dims stored contiguously (a cache-layout option,
    ``loki.kernels.make_key_prefix``), from which the approximate scores read exactly d/D of the key bytes.
    The triton path issues no host sync of its own beyond the input validation (the selection width K is
    bounded on the host from k and S; counts stay on the device).

    ``check_values=False`` skips the checks of the lengths/starts values, which are host syncs, for hot loops
    whose positions are known to be valid.  Preconditions the caller then guarantees (nothing checks them):
    ``lengths`` and ``starts`` are integer tensors of shape [B] on q_hat's device with
    ``0 <= starts[b] < lengths[b] <= S`` for every b.  The kernels bound their reads by these values, so a
    violation reads outside the cache: undefined results on the CPU interpreter, garbage or a memory fault on a
    GPU.  Shapes, dtypes, devices, d, k and scale are checked either way.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if gqa_select not in GQA_SELECT_MODES:
        raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {gqa_select!r}")
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")
    if select_method not in SELECT_METHODS:
        raise ValueError(f"select_method must be one of {SELECT_METHODS}, got {select_method!r}")
    select_method = resolve_select_method(select_method, q_hat)
    num_splits = check_count(num_splits, "num_splits")
    if backend == "auto":  # the kernels have no backward: inputs that need a gradient take the reference
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (q_hat, k_hat, v_cache))
        backend = "triton" if q_hat.is_cuda and not needs_grad else "torch"
    if backend == "torch":
        res = loki_attention_reference(q_hat, k_hat, v_cache, d=d, k=k, lengths=lengths, starts=starts,
                                       gqa_select=gqa_select, aggregate=aggregate, scale=scale,
                                       return_indices=return_indices)
        if out is None:
            return res
        out.copy_(res[0] if return_indices else res)  # the result is ``out``, as on the triton backend
        return (out, res[1]) if return_indices else out
    check_kernel_aggregate(aggregate, "decode_attention(backend='triton')")
    k = check_budget(k)
    uniform = lengths is None and starts is None
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q_hat, k_hat, v_cache, lengths, starts,
                                                            check_values=check_values)
    dd = resolve_d(d, D)
    resolve_scale(scale, D)
    check_triton_device(q_hat, "decode_attention(backend='triton')")
    check_no_grad("decode_attention(backend='triton')", q_hat=q_hat, k_hat=k_hat, v_cache=v_cache,
                  k_prefix=k_prefix)
    if k_prefix is not None:
        k_prefix = _check_key_prefix(k_prefix, k_hat, dd)
    counts = budget(k, lengths, starts, B, S, q_hat.device)
    K = selection_bound(k, S)
    tuning = _DEFAULT_TUNING if num_splits is None else DecodeTuning(num_splits=num_splits)
    idx, res = loki_decode_step(q_hat, k_hat, v_cache, lengths, starts, counts, d=dd, k_max=K,
                                gqa_select=gqa_select, aggregate=aggregate, scale=scale,
                                select_method=select_method, uniform=uniform, out=out, k_prefix=k_prefix,
                                tuning=tuning)
    return (res, (idx, counts)) if return_indices else res


def loki_decode_step(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    *,
    d: int,
    k_max: int,
    gqa_select: str = "query",
    aggregate: str = "sum",
    scale: float | None = None,
    select_method: str = "auto",
    uniform: bool = False,
    out: torch.Tensor | None = None,
    k_prefix: torch.Tensor | None = None,
    tuning: DecodeTuning = _DEFAULT_TUNING,
    replay: StepReplay | None = None,
):
    """The three Triton stages on already-validated inputs, with no host sync (for the integration's hot
    loop and the benchmarks; ``decode_attention`` validates and calls this).  Three or four kernel launches
    (scores and select, fused or not; attention splits; merge), all capturable in a CUDA graph.  A softmax
    ``aggregate`` of a "kv" selection selects on probabilities (``group_softmax.py``): fused, its scores, group
    softmax and select are one kernel (``score_select_softmax``); unfused, they take two launches more than the
    raw sum (per-query-head scores, then the two of ``group_softmax``), then the select.  ``tuning.fuse_select``
    chooses as for the raw aggregates (:class:`DecodeTuning`).

    lengths, starts, counts: [B] int32/int64 on the device, ``0 <= starts[b] < lengths[b] <= S`` and
    ``1 <= counts[b] <= lengths[b] - starts[b]`` (trusted: they bound the kernels' reads); d: int (1 <= d <= D);
    k_max: int bound K >= max(counts); ``uniform``: every count equals k_max; ``k_prefix``: optional
    [B, HKV, S, dp >= d] contiguous copy of the first dims of k_hat (validated by the caller).  ``tuning``:
    launch choices other than the defaults (:class:`DecodeTuning`).  Returns ``(idx [B, H, K], out [B, HQ, D])``,
    both freshly allocated on every call (or ``out`` itself when given).

    ``replay`` (a :class:`StepReplay` the caller owns): the second call with a given argument signature
    launches normally and records a ``DecodePlan`` in it; later calls with that signature replay the recorded
    launches with fresh buffers.  Without one (or with ``tuning.use_plan=False``, ``tuning.attn_options``, or
    while a CUDA graph is being captured) every call launches normally.
    """
    t = tuning
    num_splits, reuse_scores, attn_options, fuse_select = t.num_splits, t.reuse_scores, t.attn_options, t.fuse_select
    if (replay is not None and t.use_plan and attn_options is None
            and not (q_hat.is_cuda and torch.cuda.is_current_stream_capturing())):
        key = (tensor_key(q_hat), tensor_key(k_hat), tensor_key(v_cache), tensor_key(k_prefix),
               tensor_key(lengths), tensor_key(starts), tensor_key(counts), tensor_key(out), d, k_max,
               gqa_select, aggregate, scale, select_method, uniform, num_splits, reuse_scores, fuse_select,
               _launch_mod.PDL)
        plan = replay.plans.get(key)
        if plan:
            bufs = plan((q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, out))
            return bufs[plan.ret_idx], (out if plan.ret_out is None else bufs[plan.ret_out])
        recordable = plan is None and resolve_select_method(select_method, q_hat) == "triton" and \
            k_hat.shape[2] <= TRITON_SELECT_MAX_S
        if recordable and key not in replay.seen:  # first call of this signature: the normal path, remembered
            replay.seen.add(key)
            recordable = False
        if recordable and len(replay.plans) < replay.max_plans:
            with recording() as rec:
                idx, res = _decode_step_launches(q_hat, k_hat, v_cache, lengths, starts, counts, d, k_max,
                                                 gqa_select, aggregate, scale, select_method, uniform, out,
                                                 num_splits, k_prefix, reuse_scores, None, fuse_select)
            plan = DecodePlan(rec.launches, (q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, out),
                              rec.buffers)
            ids = [id(b) for b in rec.buffers]
            plan.ret_idx = ids.index(id(idx)) if id(idx) in ids else None
            plan.ret_out = ids.index(id(res)) if id(res) in ids else None
            if plan.ret_idx is None or (plan.ret_out is None and res is not out):
                plan.ok = False
            replay.plans[key] = plan if plan.ok else False
            return idx, res
    return _decode_step_launches(q_hat, k_hat, v_cache, lengths, starts, counts, d, k_max, gqa_select, aggregate,
                                 scale, select_method, uniform, out, num_splits, k_prefix, reuse_scores,
                                 attn_options, fuse_select)


def _decode_step_launches(q_hat, k_hat, v_cache, lengths, starts, counts, d, k_max, gqa_select, aggregate, scale,
                          select_method, uniform, out, num_splits, k_prefix, reuse_scores, attn_options,
                          fuse_select=None):
    B, HQ, D = q_hat.shape
    _, HKV, S, _ = k_hat.shape
    if k_hat.stride(-1) != 1:
        k_hat = k_hat.contiguous()
    if q_hat.stride(-1) != 1:
        q_hat = q_hat.contiguous()
    H = HQ if gqa_select == "query" else HKV
    k_src = k_hat if k_prefix is None else k_prefix
    method = resolve_select_method(select_method, q_hat)
    softmax = gqa_select == "kv" and aggregate in SOFTMAX_AGGREGATES  # probability scores (group_softmax.py)
    if fuse_select is None:
        fuse_select = method == "triton" and score_select_fusable(B * H, S, q_hat.device)
    fusable = method == "triton" and S <= TRITON_SELECT_MAX_S and (
        not softmax or HQ // HKV <= SOFTMAX_FUSED_DEFAULTS["max_group"])
    # the scores' rows start at multiples of 16 elements: a cache that grows by one token per step then keeps
    # the same Triton specialisation of the row stride (no recompilation every time S crosses a multiple of 16)
    S16 = -(-S // 16) * 16
    scores = new_output((B, H, S16), torch.float32, q_hat.device)[:, :, :S]
    if fuse_select and fusable and softmax:  # per-query-head scratch rows padded as ``scores``
        heads = new_output((B, HQ, S16), torch.float32, q_hat.device)[:, :, :S]
        scores, idx = score_select_softmax(q_hat, k_src, d, lengths, starts, counts, k_max, aggregate=aggregate,
                                           scale=resolve_scale(scale, D), scores=scores, heads=heads)
    elif fuse_select and fusable:
        scores, idx = score_select(q_hat, k_src, d, lengths, starts, counts, k_max, gqa_select=gqa_select,
                                   aggregate=aggregate, scores=scores)
    else:
        if gqa_select == "query":
            _launch_approx_scores(q_hat, k_src, d, lengths, starts, scores, None, aggregate)
        elif softmax:  # per-query-head scores (rows padded as ``scores``), then the group's softmax aggregate
            heads = new_output((B, HQ, S16), torch.float32, q_hat.device)[:, :, :S]
            _launch_softmax_group_scores(q_hat, k_src, d, lengths, starts, heads, scores, HKV, aggregate,
                                         resolve_scale(scale, D))
        else:
            _launch_approx_scores(q_hat, k_src, d, lengths, starts, None, scores, aggregate)
        idx = select_topk(scores, counts, k_max=k_max, method=method, uniform=uniform)
    extra = dict(attn_options or {})
    if reuse_scores and gqa_select == "query" and d < D:
        extra.setdefault("prefix_scores", scores)
        extra.setdefault("prefix_dims", d)
    res = sparse_attention(q_hat, k_hat, v_cache, idx, counts, scale=scale, out=out, num_splits=num_splits,
                           **extra)
    return idx, res

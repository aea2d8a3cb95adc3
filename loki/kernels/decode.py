"""One decode step of Loki attention (Algorithm 1), the entry point of the kernels for a whole step:
``decode_attention`` validates its inputs and runs the PyTorch reference or the kernels; ``launch_decode_step`` is
the one launch sequence of the kernels on inputs already validated, which ``plan_decode``'s
:class:`~loki.kernels.plan.DecodeRun` records and replays (the transformers integration's hot loop, the
benchmarks) and the ``loki::decode_step`` op runs inside compiled graphs.  The stages are public in
``loki.kernels`` too, each beside its reference.

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
    check_count,
    check_decode_inputs,
    check_no_grad,
    resolve_d,
    resolve_scale,
)
from loki.reference.methods import loki_attention as loki_attention_reference
from loki.reference.selection import budget
from loki.settings import SOFTMAX_AGGREGATES, GQAMode, LokiSettings

from .approx_scores import check_key_prefix, launch_approx_scores, launch_softmax_group_scores
from .common import check_triton_device
from .launch import new_output
from .score_select import score_select, score_select_fusable
from .score_select_softmax import SOFTMAX_FUSED_DEFAULTS, score_select_softmax
from .select import STEP_SELECT_METHODS, TRITON_SELECT_MAX_S, resolve_select_method, select_topk
from .sparse_attention import sparse_attention

__all__ = ["DecodeTuning", "decode_attention", "launch_decode_step", "loki_attention_reference", "selection_bound",
           "selection_width"]


@dataclass(frozen=True, slots=True)
class DecodeTuning:
    """Launch choices of :func:`launch_decode_step` beside its defaults (tuning and tests; the defaults are what the
    integration runs).

    ``num_splits`` (an int >= 1): the attention kernel's split of the selection (default: ``choose_num_splits``).
    ``fuse_select``: score and select in one kernel (``score_select``: one launch instead of two;
    ``score_select_softmax`` for a softmax aggregate of a "kv" selection: one instead of four).  True forces and
    False forbids it wherever a fused kernel applies (the Triton select, S <= ``TRITON_SELECT_MAX_S``, and at most
    16 query heads per KV head for a softmax aggregate; elsewhere the unfused path runs either way); None decides
    by ``score_select_fusable`` (enough rows to fill the GPU, S not too long), for every aggregate.  ``reuse_scores``
    (per-query-head selections): the attention kernel takes the first d dims of each selected score from the
    approximate scores instead of re-reading K[t, :d].  ``use_plan``: let a :class:`~loki.kernels.plan.DecodeRun`
    record and replay the step's launches.  ``attn_options``: extra keyword arguments for ``sparse_attention``
    (a run with them always takes the normal launch path).
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
    gqa_select: str = "auto",
    aggregate: str = "auto",
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
    ``"kv"``, whose group scores are combined by ``aggregate``).  ``gqa_select`` and ``aggregate`` default to
    "auto", decided as ``enable_loki`` decides them (:class:`loki.LokiSettings`): one selection per KV group with
    "softmax-max" when q_hat has more heads than k_hat, per query head otherwise.

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
    bounded on the host from k and S; counts stay on the device).  For many steps over one cache,
    :func:`loki.kernels.plan_decode` checks once and replays the launches.

    ``check_values=False`` skips the checks of the lengths/starts values, which are host syncs, for hot loops
    whose positions are known to be valid.  Preconditions the caller then guarantees (nothing checks them):
    ``lengths`` and ``starts`` are integer tensors of shape [B] on q_hat's device with
    ``0 <= starts[b] < lengths[b] <= S`` for every b.  The kernels bound their reads by these values, so a
    violation reads outside the cache: undefined results on the CPU interpreter, garbage or a memory fault on a
    GPU.  Shapes, dtypes, devices, d, k and scale are checked either way.
    """
    if select_method not in STEP_SELECT_METHODS:
        raise ValueError(f"select_method must be one of {STEP_SELECT_METHODS}, got {select_method!r}")
    num_splits = check_count(num_splits, "num_splits")
    uniform = lengths is None and starts is None
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q_hat, k_hat, v_cache, lengths, starts,
                                                            check_values=check_values)
    resolve_d(d, D)  # the count's range against D, named in the error
    settings = LokiSettings(k=k, d=d, gqa_select=gqa_select, aggregate=aggregate, backend=backend,
                            score_format="native").resolve_shapes(
        num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, where=f"decode_attention(backend={backend!r})",
        device=q_hat.device if backend == "auto" else None)
    resolve_scale(scale, D)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q_hat, k_hat, v_cache))
    if not settings.use_kernels(cuda=q_hat.is_cuda, needs_grad=needs_grad):
        res = loki_attention_reference(q_hat, k_hat, v_cache, d=settings.d, k=settings.k, lengths=lengths,
                                       starts=starts, scale=scale, return_indices=return_indices,
                                       **settings.kernel_args())
        if out is None:
            return res
        out.copy_(res[0] if return_indices else res)  # the result is ``out``, as on the triton backend
        return (out, res[1]) if return_indices else out
    select_method = resolve_select_method(select_method, q_hat)
    check_triton_device(q_hat, "decode_attention(backend='triton')")
    check_no_grad("decode_attention(backend='triton')", q_hat=q_hat, k_hat=k_hat, v_cache=v_cache,
                  k_prefix=k_prefix)
    if k_prefix is not None:
        k_prefix = check_key_prefix(k_prefix, k_hat, settings.d)
    counts = budget(settings.k, lengths, starts, B, S, q_hat.device)
    tuning = _DEFAULT_TUNING if num_splits is None else DecodeTuning(num_splits=num_splits)
    idx, res = launch_decode_step(
        q_hat=q_hat, k_hat=k_hat, v_cache=v_cache, k_prefix=k_prefix, lengths=lengths, starts=starts, counts=counts,
        d=settings.d, width=selection_bound(settings.k, S), scale=scale, select_method=select_method,
        uniform=uniform, out=out, tuning=tuning, **settings.kernel_args())
    return (res, (idx, counts)) if return_indices else res


def launch_decode_step(
    *,
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    k_prefix: torch.Tensor | None,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    d: int,
    width: int,
    gqa_select: str,
    aggregate: str,
    scale: float | None,
    select_method: str = "triton",
    uniform: bool = False,
    out: torch.Tensor | None = None,
    tuning: DecodeTuning = _DEFAULT_TUNING,
    prefix_scale: torch.Tensor | None = None,
    score_format: str = "native",
):
    """The launches of one decode step on validated inputs, with no host sync: the one launch sequence that
    ``decode_attention``, :class:`~loki.kernels.plan.DecodeRun` (which records and replays it) and the
    ``loki::decode_step`` op (inside CUDA graphs) run.  Three or four kernel launches (scores and select, fused or
    not; attention splits; merge).  A softmax ``aggregate`` of a "kv" selection selects on probabilities
    (``group_softmax.py``): fused, its scores, group softmax and select are one kernel (``score_select_softmax``);
    unfused, they take two launches more than the raw sum (per-query-head scores, then the two of
    ``group_softmax``), then the select.  ``tuning.fuse_select`` chooses as for the raw aggregates
    (:class:`DecodeTuning`).

    lengths, starts, counts: [B] int32/int64 on the device, ``0 <= starts[b] < lengths[b] <= S`` and
    ``1 <= counts[b] <= lengths[b] - starts[b]`` (trusted: they bound the kernels' reads); d: int (1 <= d <= D);
    width: int bound K >= max(counts) (``selection_width``); ``uniform``: every count equals width; ``k_prefix``:
    optional [B, HKV, S, dp >= d] contiguous copy of the first dims of k_hat (validated by the caller);
    gqa_select, aggregate: resolved modes (``ResolvedSettings.kernel_args()``).  ``prefix_scale``: optional
    [B, HKV, S] bf16, making ``k_prefix`` the "int8" score copy (int8 codes, ``encode_int8_score_keys``): the scores
    then take the unfused launches unless ``tuning.fuse_select`` is True (the fused kernels read the copy too,
    slower than the unfused launches on an H100) and the attention re-reads the keys' first d dims (the
    approximate scores are rounded: never reused as exact ones).  ``score_format="int8"`` without ``prefix_scale``
    (a cache that keeps no copy): the scores kernel rounds the keys' first d dims to the copy as it reads them in
    place (``launch_approx_scores(quantize=True)``: the copy's codes and scales, unfused).  Returns
    ``(idx [B, H, K], out [B, HQ, D])``, both freshly allocated on every call (or ``out`` itself when given).
    """
    t = tuning
    if score_format not in ("native", "int8"):
        raise ValueError(f"the kernels score a 'native' or 'int8' copy, got score_format={score_format!r}")
    int8 = prefix_scale is not None or score_format == "int8"
    in_place = int8 and prefix_scale is None  # the int8 copy computed from the keys as they are read
    if prefix_scale is not None and k_prefix is None:
        raise ValueError("prefix_scale is the scale of an int8 score copy: pass the copy's codes as k_prefix")
    if in_place:
        k_prefix = None  # a 16-bit prefix would be read as the keys' own dims: the rounding reads the keys
    B, HQ, D = q_hat.shape
    _, HKV, S, _ = k_hat.shape
    if k_hat.stride(-1) != 1:
        k_hat = k_hat.contiguous()
    if q_hat.stride(-1) != 1:
        q_hat = q_hat.contiguous()
    H = HQ if gqa_select == GQAMode.QUERY else HKV
    k_src = k_hat if k_prefix is None else k_prefix
    method = resolve_select_method(select_method, q_hat)
    softmax = gqa_select == GQAMode.KV and aggregate in SOFTMAX_AGGREGATES  # probability scores (group_softmax.py)
    fuse_select = t.fuse_select
    if fuse_select is None:
        fuse_select = method == "triton" and score_select_fusable(B * H, S, q_hat.device)
    fusable = method == "triton" and S <= TRITON_SELECT_MAX_S and (
        not softmax or HQ // HKV <= SOFTMAX_FUSED_DEFAULTS["max_group"])
    if int8 and (t.fuse_select is not True or in_place):  # an int8 copy takes the fused kernels only when asked
        fusable = False  # (slower on an H100); computed in place, never (the fused kernels read a stored copy)
    # the scores' rows start at multiples of 16 elements: a cache that grows by one token per step then keeps
    # the same Triton specialisation of the row stride (no recompilation every time S crosses a multiple of 16)
    S16 = -(-S // 16) * 16
    scores = new_output((B, H, S16), torch.float32, q_hat.device)[:, :, :S]
    if fuse_select and fusable and softmax:  # per-query-head scratch rows padded as ``scores``
        heads = new_output((B, HQ, S16), torch.float32, q_hat.device)[:, :, :S]
        scores, idx = score_select_softmax(q_hat, k_src, d, lengths, starts, counts, width, aggregate=aggregate,
                                           scale=resolve_scale(scale, D), scores=scores, heads=heads,
                                           prefix_scale=prefix_scale)
    elif fuse_select and fusable:
        scores, idx = score_select(q_hat, k_src, d, lengths, starts, counts, width, gqa_select=gqa_select,
                                   aggregate=aggregate, scores=scores, prefix_scale=prefix_scale)
    else:
        if gqa_select == GQAMode.QUERY:
            launch_approx_scores(q_hat, k_src, d, lengths, starts, scores, None, aggregate, prefix_scale=prefix_scale,
                                 quantize=in_place)
        elif softmax:  # per-query-head scores (rows padded as ``scores``), then the group's softmax aggregate
            heads = new_output((B, HQ, S16), torch.float32, q_hat.device)[:, :, :S]
            launch_softmax_group_scores(q_hat, k_src, d, lengths, starts, heads, scores, HKV, aggregate,
                                        resolve_scale(scale, D), prefix_scale=prefix_scale, quantize=in_place)
        else:
            launch_approx_scores(q_hat, k_src, d, lengths, starts, None, scores, aggregate, prefix_scale=prefix_scale,
                                 quantize=in_place)
        idx = select_topk(scores, counts, k_max=width, method=method, uniform=uniform)
    extra = dict(t.attn_options or {})
    if t.reuse_scores and gqa_select == GQAMode.QUERY and d < D and not int8:  # int8 scores are rounded
        extra.setdefault("prefix_scores", scores)
        extra.setdefault("prefix_dims", d)
    res = sparse_attention(q_hat, k_hat, v_cache, idx, counts, scale=scale, out=out, num_splits=t.num_splits,
                           **extra)
    return idx, res

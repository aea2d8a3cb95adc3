"""The attention function registered as ``"loki"``: dense causal prefill (the causal mask applied here), and
every decode step through the selected method; Loki decode steps on the Triton kernels take a fast path with
as little host work as possible (:func:`_loki_decode_fast`).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim.
"""

from __future__ import annotations

import math
import warnings

import torch

from loki._checks import resolve_d
from loki.kernels import decode as kernel_decode  # looked up per call: the step can be swapped (tests spy on it)
from loki.reference import budget, expand_to_query_heads

from .config import LokiError, LokiState
from .rows import (
    allowed_mask,
    check_triton_inputs,
    mask_intervals,
    rotate_rows,
    row_intervals,
    triton_backend,
)
from .static import static_decode
from .teacher_forced import decode_rows, teacher_forced_attention

__all__ = ["loki_attention_forward"]


def loki_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``"loki"`` (transformers' AttentionInterface signature).

    query: [B, HQ, L, D]; key, value: [B, HKV, S, D] (post-rotary, including the cache; keys are in the PCA
    basis when the cache is a Loki cache of a basis method); attention_mask: [B, 1, L, S] bool or None.
    Returns (out [B, L, HQ, D], None).
    """
    state: LokiState | None = getattr(module, "_loki_config", None)
    if state is None:
        raise LokiError(
            f"{type(module).__name__} runs with attn_implementation='loki' but Loki is not enabled on its model "
            "(two models sharing one config object? deep-copy the config, or call enable_loki on this model)"
        )
    cfg = state.config
    B, HQ, L, D = query.shape
    S = key.shape[2]
    layer_idx = module.layer_idx
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(D)
    cache = state.current_cache
    layer = cache.layers[layer_idx] if cache is not None and layer_idx < len(cache.layers) else None
    if L == 1 and cfg.method == "loki" and getattr(layer, "loki_static", False) and layer.loki_P is not None:
        # a static cache (preallocated, compiled and CUDA-graph friendly): tensor ops and one custom op only
        use_kernels = triton_backend(cfg.backend, query)
        if cfg.backend == "triton" and not torch.compiler.is_compiling():
            check_triton_inputs(query, key, value)
        return static_decode(state, layer, query, key, value, attention_mask, scale, use_kernels), None
    if cfg.covered_positions is not None and S > cfg.covered_positions and not state.warned_positions:
        state.warned_positions = True
        warnings.warn(
            f"the KV cache holds {S} tokens but the Loki basis was calibrated on positions below "
            f"{cfg.covered_positions}: post-rotary keys past them are described less well (calibrate with "
            f"max_positions >= the longest context used)", RuntimeWarning, stacklevel=2)
    keys_rotated = layer is not None and getattr(layer, "loki_P", None) is not None
    P = state.layer_basis(layer_idx, query.device) if (cfg.rotates or keys_rotated) else None
    P_q = state.layer_query_basis(layer_idx, query.device) if P is not None else None

    if L > 1 and cfg.semantics == "generate" or cfg.method == "dense" and cfg.semantics == "generate":
        allowed = allowed_mask(attention_mask, B, L, S, query.device)
        q_use = rotate_rows(query, P_q) if keys_rotated else query
        want = cfg.method == "h2o"
        out, p = _dense_prefill(q_use, key, value, allowed, scale, want_weights=want)
        if want:
            if layer is None:
                raise LokiError("method='h2o' needs a KV cache (use_cache=True)")
            acc = p.sum(dim=2)  # [B, HQ, S]: attention each token received
            prev = layer.loki_acc
            if prev is not None and prev.shape[-1] == S - L:
                acc[..., : S - L] += prev
            layer.loki_acc = acc
        return out.transpose(1, 2).contiguous(), None

    if cfg.method == "h2o":
        if layer is None:
            raise LokiError("method='h2o' needs a KV cache (use_cache=True)")
        if getattr(layer, "is_sliding", False):
            raise LokiError("method='h2o' is not supported with sliding-window caches")
        starts, lengths, _ = row_intervals(allowed_mask(attention_mask, B, L, S, query.device))
        acc = layer.loki_acc
        if acc is None or acc.shape[-1] > S:
            acc = torch.zeros(B, HQ, S, device=query.device, dtype=torch.float32)
        elif acc.shape[-1] < S:
            acc = torch.nn.functional.pad(acc, (0, S - acc.shape[-1]))
        out, w = decode_rows("h2o", query[:, :, 0], key, value, k=cfg.k, d=cfg.d, lengths=lengths[:, 0],
                             starts=starts[:, 0], gqa_select=cfg.gqa_select, aggregate=cfg.aggregate,
                             scale=scale, backend=cfg.backend, acc=acc, recent_fraction=cfg.h2o_recent_fraction)
        layer.loki_acc = acc + w
        return out[:, None].contiguous(), None

    if cfg.backend == "triton" and cfg.method == "loki":
        check_triton_inputs(query, key, value)
    prefix = getattr(layer, "loki_prefix", None) if L == 1 and keys_rotated else None
    if prefix is not None and prefix.shape[-2] != S:
        prefix = None  # out of step with the keys (e.g. a cache edited outside Loki): read the keys in place
    if (L == 1 and cfg.method == "loki" and keys_rotated and P_q is not None
            and triton_backend(cfg.backend, query)):
        return _loki_decode_fast(state, cfg, query, key, value, attention_mask, P_q, scale, prefix), None
    out = teacher_forced_attention(
        query, key, value, method=cfg.method, k=cfg.k, d=cfg.d, P=P, P_q=P_q, keys_rotated=keys_rotated,
        attention_mask=attention_mask, scale=scale, gqa_select=cfg.gqa_select, aggregate=cfg.aggregate,
        backend=cfg.backend, chunk_elements=cfg.chunk_elements, k_prefix=prefix,
        intervals_cache=state.intervals_cache,
    )
    return out.transpose(1, 2).contiguous(), None


def _loki_decode_fast(state, cfg, query, key, value, attention_mask, P_q, scale, prefix):
    """One decode step (L = 1) of Loki on the Triton kernels with as little host work as possible: the rows'
    visible ranges, per-sequence budgets and the selection bound are computed once per forward (every layer
    shares them) and the kernels are called through ``loki_decode_step`` (whose recorded launches replay from
    the third layer of a step on).  Same result as ``teacher_forced_attention`` on this path.
    Returns [B, 1, HQ, D]."""
    B, HQ, _, D = query.shape
    S = key.shape[2]
    memo = state.intervals_cache if state.intervals_cache is not None else {}
    mkey = ("decode", id(attention_mask), B, S, query.device)
    hit = memo.get(mkey)
    if hit is None or hit[0] is not attention_mask:
        st, ln, any_ = mask_intervals(attention_mask, B, 1, S, query.device, memo)
        starts, lengths = st[:, 0].to(torch.int32), ln[:, 0].to(torch.int32)
        any_ = None if any_ is None else any_[:, 0]
        counts = budget(cfg.k, lengths, starts, B, S, query.device)
        K = kernel_decode.selection_width(cfg.k, S)
        hit = (attention_mask, starts, lengths, any_, counts, K, resolve_d(cfg.d, D))
        memo[mkey] = hit
    _, starts, lengths, any_, counts, K, dd = hit
    q_hat = rotate_rows(query, P_q)[:, :, 0]  # [B, HQ, D]
    _, out = kernel_decode.loki_decode_step(q_hat, key, value, lengths, starts, counts, d=dd, k_max=K,
                                            gqa_select=cfg.gqa_select, aggregate=cfg.aggregate, scale=scale,
                                            select_method="triton", k_prefix=prefix)
    if any_ is not None:
        out = out.masked_fill(~any_[:, None, None], 0)
    return out.to(query.dtype)[:, None]


def _dense_prefill(query, key, value, allowed, scale, want_weights=False):
    """Dense attention with a [B, L, S] bool mask; fully masked rows give zeros. Returns [B, HQ, L, D]."""
    HQ = query.shape[1]
    k_rep = expand_to_query_heads(key, HQ)
    v_rep = expand_to_query_heads(value, HQ)
    any_ = allowed.any(-1)  # [B, L]
    if want_weights:
        s = torch.matmul(query.float(), k_rep.float().transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out = torch.matmul(p, v_rep.float()).to(query.dtype)
        return out, p
    out = torch.nn.functional.scaled_dot_product_attention(query, k_rep, v_rep, attn_mask=allowed[:, None],
                                                           scale=scale)
    return out.masked_fill(~any_[:, None, :, None], 0), None

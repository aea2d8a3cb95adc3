"""The attention function registered as ``"loki"``: dense causal prefill, and every decode step through the
selected method, each layer reading what its query rows see from the forward's step metadata
(:mod:`.metadata`, built once by the decoder's pre-hook); Loki decode steps on the Triton kernels take a fast
path with as little host work as possible (:func:`_loki_decode_fast`), and static caches their own
(:func:`.static.static_decode`).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim.
"""

from __future__ import annotations

import math
import warnings

import torch

from loki._checks import resolve_d
from loki.kernels import decode as kernel_decode  # looked up per call: the step can be swapped (tests spy on it)
from loki.reference import expand_to_query_heads

from .config import LokiError, LokiState
from .metadata import LayerRanges, direct_ranges
from .rows import check_triton_inputs, reference_outside_graph, rotate_rows, triton_backend
from .static import static_decode
from .teacher_forced import decode_rows, teacher_forced_attention

__all__ = ["layer_ranges", "loki_attention_forward"]


def layer_ranges(state: LokiState, layer_idx: int, layer, attention_mask, B: int, L: int, S: int, device,
                 sliding_window=None) -> LayerRanges:
    """What the query rows of this attention call see: the forward's step metadata for the layer (the normal
    case: built once by the decoder's pre-hook), else the ranges of a direct call (:func:`.metadata.direct_ranges`;
    refused for a static cache, whose unwritten slots only the step metadata knows)."""
    meta = state.forward
    if meta is not None:
        g = meta.layer(layer_idx, S).on(device)
        if not torch.compiler.is_compiling() and sliding_window != g.window and sliding_window is not None:
            raise LokiError(f"layer {layer_idx} attends over a sliding window of {sliding_window} tokens but the "
                            f"forward was planned with {g.window}")
        return g
    if getattr(layer, "loki_static", False):
        raise LokiError("a Loki static cache is read inside the model's forward only (its step metadata says which "
                        "slots are written); call the model, not its attention modules")
    return direct_ranges(state.config.k, B, L, S, device, attention_mask, sliding_window)


def loki_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``"loki"`` (transformers' AttentionInterface signature).

    query: [B, HQ, L, D]; key, value: [B, HKV, S, D] (post-rotary, including the cache; keys are in the basis
    when the cache is a Loki cache of a basis method); attention_mask: ignored inside a model forward (the step
    metadata says what every row sees); an explicit [B, 1, L, S] mask or None for a direct call.
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
    ranges = layer_ranges(state, layer_idx, layer, attention_mask, B, L, S, query.device,
                          kwargs.get("sliding_window"))
    if L == 1 and cfg.method == "loki" and getattr(layer, "loki_static", False) and layer.loki_P is not None:
        # a static cache (preallocated, compiled and CUDA-graph friendly): tensor ops and one custom op only
        if cfg.backend == "triton" and not torch.compiler.is_compiling():
            check_triton_inputs(query, key, value)
        return static_decode(state, layer, query, key, value, ranges, scale), None
    if (cfg.covered_positions is not None and S > cfg.covered_positions and not state.warned_positions
            and not getattr(layer, "loki_static", False)):
        state.warned_positions = True
        warnings.warn(
            f"the KV cache holds {S} tokens but the Loki basis was calibrated on positions below "
            f"{cfg.covered_positions}: post-rotary keys past them are described less well (calibrate with "
            f"max_positions >= the longest context used)", RuntimeWarning, stacklevel=2)
    keys_rotated = layer is not None and getattr(layer, "loki_P", None) is not None
    tr = state.transforms(layer_idx, query.device) if (cfg.rotates or keys_rotated) else None
    P, P_q = (tr.key, tr.query) if tr is not None else (None, None)

    if L > 1 and cfg.semantics == "generate" or cfg.method == "dense" and cfg.semantics == "generate":
        allowed = ranges.allowed()
        q_use = rotate_rows(query, P_q) if keys_rotated else query
        want = cfg.method == "h2o"
        out, p = _dense_prefill(q_use, key, value, allowed, ranges.any_, scale, want_weights=want)
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
        acc = layer.loki_acc
        if acc is None or acc.shape[-1] > S:
            acc = torch.zeros(B, HQ, S, device=query.device, dtype=torch.float32)
        elif acc.shape[-1] < S:
            acc = torch.nn.functional.pad(acc, (0, S - acc.shape[-1]))
        out, w = decode_rows("h2o", query[:, :, 0], key, value, k=cfg.k, d=cfg.d, lengths=ranges.lengths[:, 0],
                             starts=ranges.starts[:, 0], gqa_select=cfg.gqa_select, aggregate=cfg.aggregate,
                             scale=scale, backend=cfg.backend, acc=acc, recent_fraction=cfg.h2o_recent_fraction)
        layer.loki_acc = acc + w
        out = out.masked_fill(~ranges.any_[:, 0, None, None], 0)
        return out[:, None].contiguous(), None

    if cfg.backend == "triton" and cfg.method == "loki":
        check_triton_inputs(query, key, value)
    prefix = getattr(layer, "loki_prefix", None) if L == 1 and keys_rotated else None
    if prefix is not None and prefix.shape[-2] != S:
        prefix = None  # out of step with the keys (e.g. a cache edited outside Loki): read the keys in place
    if (L == 1 and cfg.method == "loki" and keys_rotated and P_q is not None
            and triton_backend(cfg.backend, query)):
        return _loki_decode_fast(state, query, key, value, ranges, P_q, scale, prefix), None
    kw = dict(method=cfg.method, k=cfg.k, d=cfg.d, P=P, P_q=P_q, keys_rotated=keys_rotated, scale=scale,
              gqa_select=cfg.gqa_select, aggregate=cfg.aggregate, backend=cfg.backend,
              chunk_elements=cfg.chunk_elements, k_prefix=prefix, ranges=(ranges.starts, ranges.lengths, ranges.any_))
    if query.is_cuda and torch.compiler.is_compiling():
        # the reference inside a compiled CUDA step: eager, outside the graph (Inductor does not compile it)
        out = reference_outside_graph(state, True, teacher_forced_attention, query, key, value, **kw)
    else:
        out = teacher_forced_attention(query, key, value, **kw)
    return out.transpose(1, 2).contiguous(), None


def _loki_decode_fast(state, query, key, value, ranges: LayerRanges, P_q, scale, prefix):
    """One decode step (L = 1) of Loki on the Triton kernels with as little host work as possible: the rows'
    visible ranges, budgets and selection width come from the step metadata (computed once per forward), and the
    kernels run through ``loki_decode_step`` with the forward's :class:`~loki.kernels.StepReplay` (layers 3+ of
    a step replay the recorded launches).  Same result as ``teacher_forced_attention`` on this path.
    Returns [B, 1, HQ, D]."""
    cfg, meta = state.config, state.forward
    q_hat = rotate_rows(query, P_q)[:, :, 0]  # [B, HQ, D]
    _, out = kernel_decode.loki_decode_step(
        q_hat, key, value, ranges.dec_lengths, ranges.dec_starts, ranges.counts, d=resolve_d(cfg.d, query.shape[-1]),
        k_max=ranges.width, gqa_select=cfg.gqa_select, aggregate=cfg.aggregate, scale=scale, select_method="triton",
        k_prefix=prefix, replay=None if meta is None else meta.replay)
    out = out.masked_fill(~ranges.any_[:, 0, None, None], 0)
    return out.to(query.dtype)[:, None]


def _dense_prefill(query, key, value, allowed, any_, scale, want_weights=False):
    """Dense attention with a [B, L, S] bool mask; rows that see no token give zeros. Returns [B, HQ, L, D]."""
    HQ = query.shape[1]
    k_rep = expand_to_query_heads(key, HQ)
    v_rep = expand_to_query_heads(value, HQ)
    if want_weights:
        s = torch.matmul(query.float(), k_rep.float().transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out = torch.matmul(p, v_rep.float()).to(query.dtype)
        return out, p
    # rows that see nothing get one harmless key so SDPA gives no NaN; their output is zeroed
    safe = allowed | ~any_[..., None]
    out = torch.nn.functional.scaled_dot_product_attention(query, k_rep, v_rep, attn_mask=safe[:, None], scale=scale)
    return out.masked_fill(~any_[:, None, :, None], 0), None

"""The attention function registered as ``"loki"``: what one layer does in one forward, reading the forward's
step plan (:mod:`.step`, built once by the decoder's pre-hook): a dense causal prefill, every decode step through
:func:`.run.run_decode` (the kernels or the reference), and, with ``semantics="decode"``, every query row of a
longer forward as a decode step (:func:`.teacher_forced.teacher_forced_rows_of`).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim.
"""

from __future__ import annotations

import math

import torch

from loki.reference import expand_to_query_heads
from loki.settings import Method, Semantics

from .run import rotate_rows, run_decode
from .state import LayerTransforms, LokiError, LokiState
from .step import direct_plan
from .teacher_forced import teacher_forced_rows_of

__all__ = ["loki_attention_forward"]

_NONE = LayerTransforms(None, None, None)


def loki_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``"loki"`` (transformers' AttentionInterface signature).

    query: [B, HQ, L, D]; key, value: [B, HKV, S, D] (post-rotary, including the cache; keys are in the basis
    when the cache is a Loki cache of a basis method); attention_mask: not read inside a model forward (the step
    plan says what every row sees from the 2-D mask; Loki's mask builder builds no 4-D mask); an explicit
    [B, 1, L, S] mask or None for a direct call.  Returns (out [B, L, HQ, D], None).
    """
    state: LokiState | None = getattr(module, "_loki", None)
    if state is None:
        raise LokiError(
            f"{type(module).__name__} runs with attn_implementation='loki' but Loki is not enabled on its model "
            "(two models sharing one config object? deep-copy the config, or call enable_loki on this model)")
    s = state.settings
    B, HQ, L, D = query.shape
    S = key.shape[2]
    idx = module.layer_idx
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(D)
    window = kwargs.get("sliding_window")
    plan = state.plan
    if plan is None:  # an attention call outside a model forward: its ranges from the mask it was given
        plan = direct_plan(s, B=B, L=L, S=S, device=query.device, attention_mask=attention_mask, window=window)
    ranges = plan.layer(idx, S).on(query.device)
    if not torch.compiler.is_compiling() and window is not None and window != ranges.window:
        raise LokiError(f"layer {idx} attends over a sliding window of {window} tokens but the forward was planned "
                        f"with {ranges.window}")
    store = plan.stores[idx] if idx < len(plan.stores) else None
    keys_rotated = store is not None and store.transforms.key is not None
    if keys_rotated:
        transforms = store.transforms
    elif s.rotates:
        transforms = state.transforms.layer(idx, query.device)
    else:
        transforms = _NONE
    if (state.covered_positions is not None and S > state.covered_positions and not plan.static
            and not torch.compiler.is_compiling()):
        state.warn_once("positions", (
            f"the KV cache holds {S} tokens but the Loki basis was calibrated on positions below "
            f"{state.covered_positions}: post-rotary keys past them are described less well (calibrate with "
            f"max_positions >= the longest context used)"))

    if s.semantics is Semantics.GENERATE and (L > 1 or s.method is Method.DENSE):
        q_use = rotate_rows(query, transforms.query) if keys_rotated else query
        h2o = s.method is Method.H2O
        out, p = _dense_prefill(q_use, key, value, ranges.allowed(), ranges.any_, scale, want_weights=h2o)
        if h2o:
            if store is None:
                raise LokiError("method='h2o' needs a KV cache (use_cache=True)")
            acc = p.sum(dim=2)  # [B, HQ, S]: attention each token received
            prev = store.acc
            if prev is not None and prev.shape[-1] == S - L:
                acc[..., : S - L] += prev
            store.acc = acc
        return out.transpose(1, 2).contiguous(), None
    if L == 1:
        return run_decode(state, plan, ranges, query, key, value, store=store, transforms=transforms,
                          keys_rotated=keys_rotated, scale=scale), None
    out = teacher_forced_rows_of(s, query, key, value, ranges, transforms=transforms, keys_rotated=keys_rotated,
                                 scale=scale, chunk_elements=None)
    return out.transpose(1, 2).contiguous(), None


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

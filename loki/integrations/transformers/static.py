"""A static KV cache under Loki, for ``torch.compile`` and CUDA graphs: :func:`loki_static_cache` (a
transformers ``StaticCache`` whose layers, ``cache.LokiStaticCacheLayer``, store rotated keys and the key prefix,
preallocated to ``max_cache_len``) and the decode step that reads it (:func:`static_decode`).

Every tensor of a layer (rotated keys ``K P``, values, the key prefix of the first d rotated dims, the basis)
is allocated once, at the layer's first write, and then written in place at the positions of the new tokens:
no concatenation, no host sync, fixed addresses, so a compiled decode step can be replayed as a CUDA graph.
The decode step computes each sequence's visible range from the attention mask with tensor ops and calls the
``loki::decode_step`` custom op (the Triton kernels on CUDA, the PyTorch reference elsewhere), which
``torch.compile(fullgraph=True)`` traces as one opaque op.

``generate(..., cache_implementation="static")`` works too: the ``StaticCache`` that ``generate`` builds is
converted on its first forward (``cache.convert_cache``), and ``generate`` compiles its decode steps on CUDA
(its own ``compile_config``) as for any static cache.

Shape letters: B batch, HQ query heads, HKV key/value heads, S = max_cache_len, D head dim, dp prefix dims.
"""

from __future__ import annotations

import torch

from loki._checks import resolve_d, resolve_k
from loki.kernels.decode import selection_width
from loki.kernels.ops import decode_step_op, k_arguments
from loki.reference import rotate_query

from .cache import LokiStaticCacheLayer, convert_cache
from .config import LokiError, state_of

__all__ = ["LokiStaticCache", "LokiStaticCacheLayer", "loki_static_cache", "static_decode"]


def _compiling() -> bool:
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def loki_static_cache(model, max_cache_len: int, batch_size: int | None = None):
    """A transformers ``StaticCache`` for ``model`` (Loki enabled) whose layers store keys in the model's basis.

    ``max_cache_len``: tokens the cache holds (prompt + new tokens).  ``batch_size``: allocate every layer now
    (on each attention layer's device, in the model's dtype); default: at the first write.  Pass it to
    ``generate(..., past_key_values=cache)`` (compiled decode steps on CUDA) or to a manual decode loop
    (``model(input_ids, past_key_values=cache, cache_position=..., use_cache=True)``, optionally compiled with
    ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``).
    """
    from transformers import StaticCache

    from loki._hf import attention_modules, config_head_dim, config_kv_heads, config_num_layers, text_config

    state = state_of(model)
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be an int >= 1, got {max_cache_len!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    if state.config.method == "h2o":
        raise LokiError("method='h2o' keeps per-token state that a static cache does not hold: use a DynamicCache")
    cov = state.config.covered_positions
    if cov is not None and max_cache_len > cov:
        import warnings

        warnings.warn(f"max_cache_len={max_cache_len} exceeds the positions the Loki basis was calibrated on "
                      f"({cov}): post-rotary keys past them are described less well", RuntimeWarning, stacklevel=2)
    cfg = text_config(model.config)
    cache = StaticCache(config=cfg, max_cache_len=max_cache_len)
    n = config_num_layers(model.config)
    convert_cache(cache, state, n)
    if batch_size is not None:
        HKV, D = config_kv_heads(model.config), config_head_dim(model.config)
        mods = attention_modules(model)
        for idx, layer in enumerate(cache.layers[:n]):
            w = mods[idx].k_proj.weight if idx < len(mods) else next(model.parameters())
            dtype = w.dtype if w.dtype.is_floating_point else torch.get_default_dtype()
            z = torch.zeros(batch_size, HKV, 0, D, dtype=dtype, device=w.device)
            layer.lazy_initialization(z, z)
    return cache


#: The same function under a class-like name (what it returns is a transformers ``StaticCache``).
LokiStaticCache = loki_static_cache


def static_intervals(attention_mask, B: int, S: int, device, check: bool):
    """starts, lengths ([B] int32) of the tokens a decode query sees in a [B, 1, 1, S] mask: the first and one
    past the last allowed position (a contiguous range: causal with left padding, as ``generate`` builds).
    ``check`` verifies the range has no holes (one host sync; skipped while compiling or capturing)."""
    if attention_mask is None:
        raise LokiError("a Loki static cache needs the attention mask of every decode step (the cache is longer "
                        "than the tokens written); got attention_mask=None")
    m = attention_mask
    if m.dim() == 4:
        m = m[:, 0]
    m = m[:, -1, -S:]
    if m.dtype != torch.bool:
        m = m == 0  # additive float mask: 0 = attend
    m = m.expand(B, S)
    mi = m.to(torch.int32)
    starts = mi.argmax(-1).to(torch.int32)
    lengths = (S - mi.flip(-1).argmax(-1)).to(torch.int32)
    if check:
        ok = m.any(-1) & (mi.sum(-1) == lengths - starts)
        if not bool(ok.all()):
            raise LokiError("Loki needs each decode query's visible tokens to be one contiguous, non-empty range of "
                            "the cache (causal with left padding); the attention mask has holes or is empty")
    return starts, lengths


def static_decode(state, layer, query, key, value, attention_mask, scale: float, use_kernels: bool):
    """One decode step (L = 1) of ``method="loki"`` over a Loki static cache layer. Returns [B, 1, HQ, D]."""
    cfg = state.config
    B, HQ, _, D = query.shape
    S = key.shape[2]
    check = not _compiling()
    # the ranges and budgets of one forward are the same for every layer (one mask object): computed once, also
    # inside a compiled graph (dynamo follows the forward's dict), checked once (one host sync) when eager
    memo = state.intervals_cache
    hit = memo.get("static") if memo is not None else None
    if hit is not None and hit[0] is attention_mask:
        starts, lengths, counts = hit[1]
    else:
        starts, lengths = static_intervals(attention_mask, B, S, query.device, check)
        counts = resolve_k(cfg.k, lengths.long() - starts.long(), S)
        if memo is not None:
            memo["static"] = (attention_mask, (starts, lengths, counts))
    dd = resolve_d(cfg.d, D)
    K = selection_width(cfg.k, S)
    k_count, k_fraction = k_arguments(cfg.k)
    if k_count > S:
        k_count = S
    q_hat = rotate_query(query[:, :, 0], layer.loki_P_q)
    prefix = layer.loki_prefix if use_kernels else None
    out = decode_step_op(q_hat, key, value, prefix, lengths, starts, counts, dd, k_count, k_fraction, K,
                         cfg.gqa_select, cfg.aggregate, float(scale), use_kernels)
    return out[:, None]


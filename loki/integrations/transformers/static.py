"""A static KV cache under Loki, for ``torch.compile`` and CUDA graphs: :func:`loki_static_cache` (a
transformers ``StaticCache`` whose layers, ``cache.LokiStaticCacheLayer``, store rotated keys and the key prefix,
preallocated to ``max_cache_len``) and the decode step that reads it (:func:`static_decode`).

Every tensor of a layer (rotated keys ``K P``, values, the key prefix of the first d rotated dims, the basis)
is allocated once, at the layer's first write, and then written in place at the positions of the new tokens:
no concatenation, no host sync, fixed addresses, so a compiled decode step can be replayed as a CUDA graph.
The decode step reads each sequence's visible range and budget from the forward's step metadata (built once by
the decoder's pre-hook from the 2-D mask and the cache's write counter: slots not yet written are never visible)
and calls the ``loki::decode_step`` custom op (the Triton kernels on CUDA, the PyTorch reference on the CPU), which
``torch.compile(fullgraph=True)`` traces as one opaque op.  Writes are bounds-checked: a prompt or generation
longer than ``max_cache_len``, or a batch other than the allocated one, raises ``CacheOverflowError`` (an
``IndexError``, as transformers' static cache) before anything is written.

``generate(..., cache_implementation="static")`` works too: the ``StaticCache`` that ``generate`` builds is
converted on its first forward (``cache.convert_cache``), and ``generate`` compiles its decode steps on CUDA
(its own ``compile_config``) as for any static cache.

Shape letters: B batch, HQ query heads, HKV key/value heads, S = max_cache_len, D head dim, dp prefix dims.
"""

from __future__ import annotations

import torch

from loki._checks import resolve_d
from loki.kernels.decode import loki_decode_step
from loki.kernels.ops import decode_step_op
from loki.kernels.rotate import rotate_query_fast, rotate_query_op
from loki.reference import rotate_query
from loki.reference.methods import loki_attention as loki_attention_reference

from .cache import LokiStaticCacheLayer, convert_cache
from .config import LokiError, state_of
from .rows import reference_outside_graph, triton_backend

__all__ = ["LokiStaticCache", "LokiStaticCacheLayer", "loki_static_cache", "static_decode"]


def loki_static_cache(model, max_cache_len: int, batch_size: int | None = None):
    """A transformers ``StaticCache`` for ``model`` (Loki enabled) whose layers store keys in the model's basis.

    ``max_cache_len``: tokens the cache holds (prompt + new tokens; writing past it raises
    ``CacheOverflowError``).  ``batch_size``: allocate every layer now (on each attention layer's device, in the
    model's dtype); default: at the first write.  Pass it to ``generate`` under the model's cache keyword
    (``loki._hf.cache_keyword(model)``: compiled decode steps on CUDA) or to a manual decode loop
    (``model(input_ids, attention_mask=mask_so_far, <cache keyword>=cache, use_cache=True)``, optionally compiled
    with ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``).
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


def static_decode(state, layer, query, key, value, ranges, scale: float):
    """One decode step (L = 1) of ``method="loki"`` over a Loki static cache layer: the query rotated with the
    layer's query transform, then the ``loki::decode_step`` op with the step metadata's ranges and budgets
    (``ranges``: the layer's :class:`~loki.integrations.transformers.metadata.LayerRanges`).  Returns
    [B, 1, HQ, D]."""
    cfg = state.config
    D = query.shape[-1]
    dd = resolve_d(cfg.d, D)
    use_kernels = triton_backend(cfg.backend, query)
    args = (ranges.dec_lengths, ranges.dec_starts, ranges.counts)
    if use_kernels and not query.is_cuda:
        # the Triton interpreter on the CPU (tests): the kernels called directly (the ops' CPU registrations are the
        # reference)
        q_hat = rotate_query_fast(query[:, :, 0], layer.loki_P_q)
        _, out = loki_decode_step(q_hat, key, value, *args, d=dd, k_max=ranges.width, gqa_select=cfg.gqa_select,
                                  aggregate=cfg.aggregate, scale=scale, select_method="triton",
                                  k_prefix=layer.loki_prefix)
        out = out.to(query.dtype)
    elif use_kernels or not query.is_cuda:
        q_hat = rotate_query_op(query[:, :, 0], layer.loki_P_q)
        # the custom op: the Triton kernels on CUDA, the PyTorch reference on the CPU (both trace as one op)
        prefix = layer.loki_prefix if use_kernels else None
        out = decode_step_op(q_hat, key, value, prefix, *args, dd, ranges.width, cfg.gqa_select, cfg.aggregate,
                             float(scale))
    else:
        # backend="torch" (or "auto" with autograd on) on CUDA: the reference itself, eager even inside a compiled
        # step (it syncs on the budgets, and Inductor does not compile it)
        out = reference_outside_graph(state, torch.compiler.is_compiling(), _reference_step, state, query,
                                      layer.loki_P_q, key, value, ranges.dec_lengths, ranges.dec_starts,
                                      ranges.counts, dd, scale)
    out = out.masked_fill(~ranges.any_[:, 0, None, None], 0)
    return out[:, None]


def _reference_step(state, query, P_q, key, value, lengths, starts, counts, d: int, scale: float):
    """``static_decode``'s PyTorch reference (backend="torch", or "auto" while autograd records, on CUDA)."""
    q_hat = rotate_query(query[:, :, 0], P_q)
    return loki_attention_reference(q_hat, key, value, d=d, counts=counts, lengths=lengths, starts=starts,
                                    gqa_select=state.config.gqa_select, aggregate=state.config.aggregate,
                                    scale=scale).to(query.dtype)

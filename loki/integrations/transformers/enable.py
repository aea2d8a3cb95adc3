"""``enable_loki`` / ``disable_loki``: the architecture check, the validation of the settings (k and d by the
shared ``loki._checks`` helpers, once), the registration of the attention function, and the hooks that hand the
KV cache of every forward to it.
"""

from __future__ import annotations

import inspect
import os
from numbers import Real

import torch

from loki._checks import check_budget, check_triton_device, resolve_d
from loki._hf import (
    SUPPORTED_ARCHITECTURES,
    attention_modules,
    attention_windows,
    cache_keyword,
    config_head_dim,
    config_kv_heads,
    config_num_layers,
    decoder,
    text_config,
)
from loki.basis import PCABasis
from loki.reference.selection import DEFAULT_KV_AGGREGATE, GQA_AGGREGATES, KERNEL_AGGREGATES

from .attention import loki_attention_forward
from .cache import convert_cache, restore_caches
from .config import (
    ATTN_IMPLEMENTATION,
    BACKENDS,
    BASIS_METHODS,
    METHODS,
    SEMANTICS,
    LokiConfig,
    LokiError,
    LokiState,
    UnsupportedModelError,
)
from .metadata import build_forward_metadata
from .parallel import local_bases

__all__ = ["default_gqa_mode", "disable_loki", "enable_loki", "is_loki_enabled"]


def _check_architecture(model) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(f"{t} ({a.attention})" for t, a in SUPPORTED_ARCHITECTURES.items())
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"Loki does not support model_type={model_type!r} ({type(model).__name__}); supported architectures: "
            f"{supported}. SmolLM models are Llama."
        )
    want = SUPPORTED_ARCHITECTURES[model_type].attention
    mods = attention_modules(model)
    names = sorted({type(m).__name__ for m in mods})
    if not mods or names != [want]:
        raise UnsupportedModelError(
            f"Loki expects {want} attention modules in a {model_type} model, found {names or 'none'}; "
            f"supported architectures: {supported}"
        )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, loki_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def default_gqa_mode(config, method: str, gqa_select: str = "auto", aggregate: str = "auto") -> tuple[str, str]:
    """(gqa_select, aggregate) with "auto" resolved, as :func:`enable_loki` resolves its defaults: one selection per
    KV group with softmax-normalised scores ("kv", :data:`~loki.reference.DEFAULT_KV_AGGREGATE` "softmax-max") for
    method "loki" on a GQA model (fewer KV heads than query heads), else per query head ("query"; aggregate "sum").
    An explicit "kv" with aggregate "auto" takes "softmax-max" for method "loki", "sum" for the other methods.
    Raises ValueError naming the argument for a mode or aggregate it does not know."""
    if gqa_select not in ("auto", "query", "kv"):
        raise ValueError(f"gqa_select must be 'auto', 'query' or 'kv', got {gqa_select!r}")
    if aggregate != "auto" and aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {('auto', *GQA_AGGREGATES)}, got {aggregate!r}")
    if gqa_select == "auto":
        heads = int(text_config(config).num_attention_heads)
        gqa_select = "kv" if method == "loki" and config_kv_heads(config) < heads else "query"
    if aggregate == "auto":
        aggregate = DEFAULT_KV_AGGREGATE if gqa_select == "kv" and method == "loki" else "sum"
    return gqa_select, aggregate


def is_loki_enabled(model) -> bool:
    return getattr(model, "_loki_config", None) is not None


def enable_loki(
    model,
    basis=None,
    k: int | float = 0.25,
    d: int | float = 0.25,
    *,
    method: str = "loki",
    gqa_select: str = "auto",
    aggregate: str = "auto",
    backend: str = "auto",
    semantics: str = "generate",
    h2o_recent_fraction: float = 0.5,
    model_name: str | None = None,
):
    """Switch ``model`` (a Llama/Mistral/Qwen2/Qwen3 ``*ForCausalLM`` or base model) to Loki attention.

    Args:
        basis: a :class:`loki.basis.PCABasis` (or a path to one) calibrated on this model; required for
            ``method`` "loki" and "pcaattn", ignored otherwise.  It is validated against ``model.config``:
            a basis of another model raises :class:`loki.basis.BasisError`.
        k: tokens attended per decode step: an int count (>= 1; a count above a sequence's valid tokens keeps
            them all) or a float fraction in (0, 1] (of each sequence's valid length, rounded up, at least 1).
        d: leading principal dims for the approximate scores (SparQ's ``r`` for ``method="sparq"``): an int
            count (<= D) or a float fraction of D.
        method: one of :data:`METHODS`.
        gqa_select: "auto" (the default), "query" or "kv".  "auto": for method "loki" on a GQA model (fewer KV
            heads than query heads) "kv", one selection per KV group, whose bytes fall with the group size, with
            ``aggregate`` "softmax-max" (each head's scores softmax-normalised before the group's maximum: the most
            accurate shared selection the kernels run, docs/accuracy.md); this is the configuration the speed
            benchmarks time and the accuracy suite reports and gates.  Otherwise (a model with as many KV heads as
            query heads, or another method than "loki") "query".  An explicit "query" keeps per-query-head selection
            (each query head selects its own tokens: more accurate per token, more bytes read) on any model.  "kv":
            one selection per KV head from the group's scores combined by ``aggregate``.
        aggregate: how a shared ("kv") selection combines the group's scores, one of
            ``loki.reference.GQA_AGGREGATES``; the Triton kernels implement all but "union" and "agreement"
            (``loki.reference.KERNEL_AGGREGATES``), which need ``backend="torch"`` for method "loki" on CUDA.
            "auto" (the default): "softmax-max" for method "loki" with a shared selection, else "sum" (raw sums of
            the approximate scores, the timed configuration before "softmax-max" became the default).  Ignored for
            per-query-head selection.  The resolved settings are on ``model._loki_config.config``.
        backend: "auto" (Triton kernel on CUDA, PyTorch elsewhere), "torch" or "triton" for the Loki decode step.
        semantics: "generate" (dense prefill, sparse decode steps) or "decode" (every query row attends like a
            decode step over the tokens it sees; for loglikelihood and perplexity evaluation).
        h2o_recent_fraction: H2O's share of the budget given to the most recent tokens.

    Returns ``model`` (modified in place).  Calling it again replaces the previous settings.
    """
    _check_architecture(model)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    gqa_select, aggregate = default_gqa_mode(model.config, method, gqa_select, aggregate)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if method == "h2o" and semantics == "decode":
        raise ValueError("method='h2o' keeps state across decode steps and supports semantics='generate' only")
    if isinstance(h2o_recent_fraction, bool) or not isinstance(h2o_recent_fraction, Real):
        raise TypeError(f"h2o_recent_fraction must be a number in [0, 1], got {h2o_recent_fraction!r}")
    if not 0.0 <= float(h2o_recent_fraction) <= 1.0:
        raise ValueError(f"h2o_recent_fraction={h2o_recent_fraction} must lie in [0, 1]")
    D = config_head_dim(model.config)
    k = check_budget(k, name="k")  # validated once, here: an int count above the valid tokens keeps them all
    dd = resolve_d(d, D, name="d")
    if backend == "triton":
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            check_triton_device(device, "backend='triton'")
        except RuntimeError as exc:
            raise ValueError(f"{exc} (the model is on {device})") from None
    if method == "loki" and aggregate not in KERNEL_AGGREGATES and (
            backend == "triton" or backend == "auto" and any(p.is_cuda for p in model.parameters())):
        raise ValueError(f"aggregate={aggregate!r} is not implemented by the Triton kernels that backend={backend!r} "
                         f"runs (they implement {KERNEL_AGGREGATES}): enable it with backend='torch'")

    components = query_components = None
    if method in BASIS_METHODS:
        if basis is None:
            raise ValueError(f"method={method!r} needs a PCA basis (basis=PCABasis or a path to one)")
        if not isinstance(basis, (PCABasis, str, os.PathLike)):
            raise TypeError(f"basis must be a PCABasis or the path of a basis file, got {type(basis).__name__}")
        if not isinstance(basis, PCABasis):
            basis = PCABasis.load(basis, config=model.config, model_name=model_name)
        else:
            basis.validate(model.config, model_name=model_name)
        components = basis.components.detach().to(torch.float32)
        if basis.query_components is not None:
            query_components = basis.query_components.detach().to(torch.float32)
        # tensor parallelism: this rank's KV heads only
        components, query_components = local_bases(model, components, query_components)

    if is_loki_enabled(model):
        disable_loki(model)
    _register()
    cfg = LokiConfig(
        method=method, k=k, d=d, gqa_select=gqa_select, aggregate=aggregate, backend=backend,
        semantics=semantics, h2o_recent_fraction=float(h2o_recent_fraction), components=components,
        prefix_dims=dd if method == "loki" and backend != "torch" else None,
        query_components=query_components,
        previous_implementation=getattr(model.config, "_attn_implementation", None),
        covered_positions=basis.covered_positions if components is not None else None,
    )
    state = LokiState(cfg)
    _install_hooks(model, state)
    for m in attention_modules(model):
        m._loki_config = state
    model._loki_config = state
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _install_hooks(model, state: LokiState) -> None:
    """Hooks on the decoder: before each forward, the cache is converted (one is created when the caller wants
    a cache and passed none) and handed to the attention function, and the forward's step metadata is built
    (:func:`.metadata.build_forward_metadata`: what every query row of every layer sees, the budgets; checked
    once); after it, the per-forward state is reset."""
    cfg = state.config
    num_layers = config_num_layers(model.config)
    dec = decoder(model)
    cache_param = cache_keyword(dec)
    windows = attention_windows(model)
    params = list(inspect.signature(dec.forward).parameters)

    def arg(name, args, kwargs):
        if name in kwargs:
            return kwargs[name]
        i = params.index(name) if name in params else -1
        return args[i] if 0 <= i < len(args) else None

    def pre_hook(module, args, kwargs):
        present = [n for n in ("cache", "past_key_values") if kwargs.get(n) is not None]
        cache = kwargs[present[0]] if present else None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = bool(getattr(module.config, "use_cache", True))
        if cache is None and not use_cache and cfg.semantics == "generate" and cfg.method != "dense":
            # Refused rather than run: without a cache every forward is a prefill, which semantics="generate"
            # computes densely, so generate(..., use_cache=False) would silently be dense attention.
            raise LokiError(
                f"use_cache=False: Loki (method={cfg.method!r}, semantics='generate') runs its sparse attention in "
                "the decode steps over the KV cache; without a cache every forward is a dense prefill, so "
                "generate(..., use_cache=False) would silently run dense attention. Pass use_cache=True (the "
                "default), or enable_loki(..., semantics='decode') to make every row of a cache-less forward "
                "attend like a decode step"
            )
        if cache is None and use_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=text_config(module.config))
            kwargs[cache_param] = cache
        if cache is not None and getattr(cache, "loki_owner", None) is not state.owner:
            convert_cache(cache, state, num_layers)  # once per cache (a compiled step traces only the check)
        x = arg("input_ids", args, kwargs)
        if x is None:
            x = arg("inputs_embeds", args, kwargs)
        if x is None:
            raise LokiError("the decoder was called without input_ids or inputs_embeds")
        state.current_cache = cache
        state.forward = build_forward_metadata(
            k=cfg.k, B=x.shape[0], L=x.shape[1], device=x.device, cache=cache,
            attention_mask=arg("attention_mask", args, kwargs), windows=windows, num_layers=num_layers)
        state.owner.in_forward = True
        return args, kwargs

    def post_hook(module, args, kwargs, output):
        state.current_cache = None
        state.forward = None
        state.owner.in_forward = False
        return output

    state.handles = [
        dec.register_forward_pre_hook(pre_hook, with_kwargs=True),
        dec.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
    ]


def disable_loki(model):
    """Undo :func:`enable_loki`: remove the hooks and restore the attention implementation of before.

    The caches used with the model while Loki was enabled are restored in place: their layers become plain
    transformers layers again and their keys, stored in the PCA basis, are rotated back (exact up to rounding),
    so a cache can be reused with the model after ``disable_loki``.  A copy of such a cache that the model never
    saw refuses to grow (``LokiError``) instead of mixing rotated and plain keys.
    """
    state = getattr(model, "_loki_config", None)
    if state is None:
        return model
    restore_caches(state)
    state.owner.active = False
    for h in state.handles:
        h.remove()
    for m in attention_modules(model):
        if getattr(m, "_loki_config", None) is state:
            del m._loki_config
    del model._loki_config
    model.set_attn_implementation(state.config.previous_implementation or "sdpa")
    return model

"""``enable_loki`` / ``disable_loki``: the architecture check, the settings decided once
(:meth:`loki.LokiSettings.resolve`), the registration of the attention function, and the decoder's hooks that adopt
the KV cache of every forward and build its step plan (:func:`.step.build_step_plan`).
"""

from __future__ import annotations

import inspect
import os

import torch

from loki._hf import (
    SUPPORTED_ARCHITECTURES,
    attention_modules,
    attention_windows,
    cache_keyword,
    config_num_layers,
    decoder,
    text_config,
)
from loki.basis import PCABasis
from loki.settings import LokiSettings, Method, ResolvedSettings, Semantics

from .parallel import local_bases
from .state import ATTN_IMPLEMENTATION, LokiError, LokiState, Transforms, UnsupportedModelError
from .step import build_step_plan

__all__ = ["disable_loki", "enable_loki", "is_loki_enabled", "resolve_settings"]


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


def _padding_mask(*, attention_mask=None, kv_length=None, kv_offset=0, **kwargs):
    """The mask builder registered for ``"loki"``: it builds nothing and hands on the caller's 2-D padding mask
    (``[B, M]``, or None), which the step plan reads; a 4-D mask would be built every forward and never read.
    (Registering none would make transformers drop the 2-D mask where ``generate`` prepares masks for a static
    cache.)

    A mask shorter than the keys the layers hold (``kv_offset + kv_length``: a static cache's allocation) is padded
    with False on the right to that length: the tokens it leaves out are not written yet, and the step plan reads
    the same ranges from either.  This keeps the shape of the mask ``generate`` prepares for a static cache, and so
    of the compiled decode step's inputs, the same at every step: otherwise the mask grows by one token per step, the
    step is recompiled with a dynamic length and CUDA-graph trees record one graph per length."""
    if (attention_mask is None or attention_mask.dim() != 2 or not isinstance(kv_length, int)
            or not isinstance(kv_offset, int)):
        return attention_mask
    total = kv_offset + kv_length
    if attention_mask.shape[-1] >= total:
        return attention_mask
    return torch.nn.functional.pad(attention_mask, (0, total - attention_mask.shape[-1]), value=False)


def _register() -> None:
    """Register the attention function and the (pass-through) mask builder under ``"loki"``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .attention import loki_attention_forward

    AttentionInterface.register(ATTN_IMPLEMENTATION, loki_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)


def _check_score_dims(basis, resolved, *, split: bool):
    """The basis' allocated score dims ([L, HKV], :mod:`loki.calibration.allocation`) or None; such a basis is
    for the evaluation engine: refused for decode steps (which score every head on d dims), for a method other than
    Loki's, with a score copy in fewer bits, and with the KV heads split across ranks."""
    from loki.calibration.allocation import score_dims_of
    from loki.settings import Method, ScoreFormat, Semantics

    dims = score_dims_of(basis)
    if dims is None:
        return None
    why = None
    if resolved.semantics is not Semantics.DECODE:
        why = f"semantics={resolved.semantics.value!r} (decode steps score every head on d dims)"
    elif resolved.method is not Method.LOKI:
        why = f"method={resolved.method.value!r}"
    elif resolved.score_format is not ScoreFormat.NATIVE:
        why = f"score_format={resolved.score_format.value!r}"
    elif split:
        why = "tensor parallelism"
    if why:
        raise ValueError(f"basis: its per-head score dims (extra['score_dims'], an allocation study) run on the "
                         f"evaluation engine only, with semantics='decode', method='loki' and the native score "
                         f"copy; got {why}")
    return dims


def resolve_settings(model, settings: LokiSettings) -> ResolvedSettings:
    """``settings`` with every "auto" decided for ``model`` on the device of its parameters (the one call
    :func:`enable_loki`, the evaluation and the benchmarks use to learn what a model will run)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return settings.resolve(model.config, device)


def is_loki_enabled(model) -> bool:
    return getattr(model, "_loki", None) is not None


def enable_loki(
    model,
    basis=None,
    k: int | float = 0.25,
    d: int | float | str = "auto",
    *,
    method: str = "loki",
    gqa_select: str = "auto",
    aggregate: str = "auto",
    backend: str = "auto",
    semantics: str = "generate",
    h2o_recent_fraction: float = 0.5,
    score_format: str = "auto",
    key_prefix: bool = True,
    settings: LokiSettings | None = None,
    model_name: str | None = None,
):
    """Switch ``model`` (a Llama/Mistral/Qwen2/Qwen3 ``*ForCausalLM`` or base model) to Loki attention.

    Args:
        basis: a :class:`loki.basis.PCABasis` (or a path to one) calibrated on this model; required for
            ``method`` "loki" and "pcaattn", ignored otherwise.  It is validated against ``model.config``:
            a basis of another model raises :class:`loki.basis.BasisError`.
        k, d, method, gqa_select, aggregate, backend, semantics, h2o_recent_fraction, score_format, key_prefix:
            the fields of a :class:`loki.LokiSettings` (see it for each value); or pass ``settings=LokiSettings(...)``
            instead of them.  ``k``: tokens attended per decode step (an int count, or a fraction of each sequence's
            valid length); ``d``: leading basis dims of the approximate scores (SparQ's ``r`` for ``method="sparq"``).
            ``gqa_select``/``aggregate`` "auto": one selection per KV group with "softmax-max" for method "loki" on
            a GQA model, per query head otherwise.  ``backend`` "auto": the Triton kernels on CUDA when no gradient
            is wanted, the PyTorch reference otherwise.  ``semantics``: "generate" (dense prefill, sparse decode
            steps) or "decode" (every query row attends like a decode step; for perplexity and loglikelihoods).
            ``score_format``: how the approximate scores read the keys' ``d`` leading dims ("auto", the default:
            "int8" for method "loki", an int8 copy with a bf16 scale per token, which the caches write and the
            kernels read; "native": the keys' own elements).  ``d`` "auto": 0.5 with the int8 copy, 0.25 with a
            native one (the same bytes).  ``key_prefix``
            False: the caches keep no second copy of the keys' d leading dims (a dense cache's memory; the kernels
            read those dims in place, rounded to the int8 copy as they read them for "int8": slower scores, the
            same results); True (the default) keeps it, except on the layers of a static cache where the copy does
            not fit (left out there, with a warning).

    The resolved settings are ``loki.integrations.transformers.state_of(model).settings``.  Returns ``model``
    (modified in place).  Calling it again replaces the previous settings.
    """
    _check_architecture(model)
    if settings is None:
        settings = LokiSettings(k=k, d=d, method=method, gqa_select=gqa_select, aggregate=aggregate,
                                backend=backend, semantics=semantics, h2o_recent_fraction=h2o_recent_fraction,
                                score_format=score_format, key_prefix=key_prefix)
    elif not isinstance(settings, LokiSettings):
        raise TypeError(f"settings must be a loki.LokiSettings, got {type(settings).__name__}")
    resolved = resolve_settings(model, settings)

    components = query_components = score_dims = None
    covered = None
    if resolved.method.needs_basis:
        if basis is None:
            raise ValueError(f"method={resolved.method.value!r} needs a PCA basis (basis=PCABasis or a path to one)")
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
        HKV_all = components.shape[1]
        components, query_components = local_bases(model, components, query_components)
        covered = basis.covered_positions
        score_dims = _check_score_dims(basis, resolved, split=components.shape[1] != HKV_all)

    _register()
    previous = disable_loki(model, _keep_implementation=True) if is_loki_enabled(model) else None
    state = LokiState(resolved, Transforms(components, query_components, score_dims),
                      previous_implementation=previous if previous is not None else
                      getattr(model.config, "_attn_implementation", None),
                      covered_positions=covered)
    mods = attention_modules(model)
    _install_hooks(model, state)
    try:
        for m in mods:
            m._loki = state
        model._loki = state
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except BaseException:
        _detach(model, state)
        raise
    return model


def _install_hooks(model, state: LokiState) -> None:
    """Hooks on the decoder: before each forward, the cache is adopted (one is created when the caller wants a cache
    and passed none; :func:`.caches.adopt_cache`) and the forward's step plan is built (:func:`.step.build_step_plan`:
    what every query row of every layer sees, the budgets, the runner; checked once); after it, the per-forward
    state is reset."""
    s = state.settings
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
        from .caches import adopt_cache, is_adopted

        present = [n for n in ("cache", "past_key_values") if kwargs.get(n) is not None]
        cache = kwargs[present[0]] if present else None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = bool(getattr(module.config, "use_cache", True))
        if cache is None and not use_cache and s.semantics is Semantics.GENERATE and s.method is not Method.DENSE:
            # Refused rather than run: without a cache every forward is a prefill, which semantics="generate"
            # computes densely, so generate(..., use_cache=False) would silently be dense attention.
            raise LokiError(
                f"use_cache=False: Loki (method={s.method.value!r}, semantics='generate') runs its sparse attention "
                "in the decode steps over the KV cache; without a cache every forward is a dense prefill, so "
                "generate(..., use_cache=False) would silently run dense attention. Pass use_cache=True (the "
                "default), or enable_loki(..., semantics='decode') to make every row of a cache-less forward "
                "attend like a decode step")
        if cache is None and use_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=text_config(module.config))
            kwargs[cache_param] = cache
        if cache is not None and not is_adopted(cache, state, num_layers):
            adopt_cache(cache, state, num_layers)  # once per cache (a compiled step traces only the check)
        x = arg("input_ids", args, kwargs)
        if x is None:
            x = arg("inputs_embeds", args, kwargs)
        if x is None:
            raise LokiError("the decoder was called without input_ids or inputs_embeds")
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in dec.parameters()))
        state.cache = cache
        state.plan = build_step_plan(
            settings=s, B=x.shape[0], L=x.shape[1], device=x.device, cache=cache,
            attention_mask=arg("attention_mask", args, kwargs), windows=windows, num_layers=num_layers,
            needs_grad=needs_grad)
        state.owner.in_forward = True
        return args, kwargs

    def post_hook(module, args, kwargs, output):
        state.cache = None
        state.plan = None
        state.owner.in_forward = False
        return output

    state.handles = [
        dec.register_forward_pre_hook(pre_hook, with_kwargs=True),
        dec.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
    ]


def _detach(model, state: LokiState) -> None:
    """Remove the hooks and the ``_loki`` attributes of ``state`` from the model and its attention modules."""
    for h in state.handles:
        h.remove()
    state.handles = []
    for m in [model, *attention_modules(model)]:
        if m.__dict__.get("_loki") is state:
            del m._loki


def disable_loki(model, *, _keep_implementation: bool = False):
    """Undo :func:`enable_loki`: restore the attention implementation of before, remove the hooks, and restore the
    caches used with the model: their layers become plain transformers layers again and their keys, stored in the
    basis, are rotated back (exact up to rounding), so a cache can be reused with the model after ``disable_loki``.
    A copy of such a cache that the model never saw refuses to grow (``LokiError``) instead of mixing rotated and
    plain keys.  All or nothing: when the implementation of before cannot be restored (e.g. it is not installed any
    more) the error is raised before anything else changes, and Loki stays enabled.  Returns ``model``.
    """
    state = getattr(model, "_loki", None)
    if state is None:
        return None if _keep_implementation else model
    if not _keep_implementation:
        model.set_attn_implementation(state.previous_implementation or "sdpa")  # the step that can fail: first
    from .caches import restore_caches

    restore_caches(state)
    state.owner.active = False
    _detach(model, state)
    return state.previous_implementation if _keep_implementation else model

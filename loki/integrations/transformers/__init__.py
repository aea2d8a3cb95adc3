"""Loki inside Hugging Face transformers (5.x): ``enable_loki(model, basis, k=..., d=...)`` / ``disable_loki``.

How it plugs in (public transformers APIs only, no model class is patched); docs/architecture.md draws it:

* ``enable_loki`` decides every setting once (:class:`loki.LokiSettings` -> ``ResolvedSettings``), registers the
  attention function under the name ``"loki"`` with ``transformers.AttentionInterface`` (and a mask builder that
  builds nothing: it hands on the 2-D padding mask, which the step plan reads) and switches the model to it;
  ``disable_loki`` restores the implementation the model had before.
* A forward pre-hook on the decoder adopts the forward's KV cache (:mod:`.caches`: its layers become
  :class:`LokiDynamicLayer` / :class:`LokiSlidingWindowLayer` / :class:`LokiStaticLayer`, each holding one
  ``LayerStore``; a cache is created when the caller asks for one and passes none) and builds the forward's
  :class:`~.step.StepPlan` (:mod:`.step`: what every query row of every layer sees, the decode step's budgets
  and selection width, the runner), which every layer reads.
* Keys are stored in the basis **once per token, when they are written to the cache** (``K_hat = K P``, one
  write for both caches); the cache is never re-projected as a whole.  Values are not rotated.  Lemma 1 of the paper
  (``(q P)(K P)^T = q K^T``) holds for any orthogonal ``P`` (and for a score-aware pair, ``P_q P_k^T = I``), so
  attention over the full rotated keys is exact.
* Prefill (query length > 1) runs dense causal attention.  Every decode step (query length 1) runs
  :func:`.run.run_decode`: the Triton kernels (eager and replayed, or the ``loki::decode_step`` op inside a
  compiled graph) or the PyTorch reference of the method, the same for every cache.  A forward without a cache
  (``use_cache=False``) is refused with ``semantics="generate"`` (the default) for every method but "dense": every
  forward would be a dense prefill.  With ``semantics="decode"`` every query row ``i`` attends like a decode step
  over the ``i + 1`` tokens it sees (:mod:`.teacher_forced`), so loglikelihoods and perplexities measure the method.
* Padding: left-padded batches work; the valid tokens of every sequence are read once per forward from the 2-D
  attention mask (none: every token so far is valid; the unwritten slots of a static cache never are).  Right
  padding works for single forwards but not for ``generate``, whose new tokens follow the padding (a mask with
  holes, refused).

Supported architectures: Llama (incl. SmolLM), Mistral, Qwen2 and Qwen3 (``loki._hf.SUPPORTED_ARCHITECTURES``).

Modules: ``state`` (an enabled model's state and transforms, the errors), ``enable`` (enable/disable, the hooks, the
architecture check), ``step`` (the step plan), ``run`` (the decode step's two routes), ``attention`` (the attention
function), ``teacher_forced`` (decode-time semantics for every row), ``layers`` (the cache layers) and ``caches``
(adopting caches, :func:`loki_cache`), both importing transformers and loaded lazily, ``parallel`` (tensor
parallelism).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim.
"""

from __future__ import annotations

from loki._checks import CacheOverflowError
from loki._hf import SUPPORTED_ARCHITECTURES, cache_keyword

from .attention import loki_attention_forward
from .enable import disable_loki, enable_loki, is_loki_enabled, resolve_settings
from .state import ATTN_IMPLEMENTATION, METHODS, LokiError, LokiState, UnsupportedModelError, state_of
from .teacher_forced import teacher_forced_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheOverflowError",
    "LokiDynamicLayer",
    "LokiError",
    "LokiSlidingWindowLayer",
    "LokiState",
    "LokiStaticLayer",
    "METHODS",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "cache_keyword",
    "disable_loki",
    "enable_loki",
    "is_loki_enabled",
    "loki_attention_forward",
    "loki_cache",
    "resolve_settings",
    "state_of",
    "teacher_forced_attention",
]

_LAYERS = ("LokiDynamicLayer", "LokiSlidingWindowLayer", "LokiStaticLayer")


def __getattr__(name):  # the cache layers subclass transformers' classes: imported when first asked for
    if name in _LAYERS:
        from . import layers

        return getattr(layers, name)
    if name == "loki_cache":
        from . import caches

        return caches.loki_cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

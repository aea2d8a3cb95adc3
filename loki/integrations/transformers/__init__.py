"""Loki inside Hugging Face transformers (5.x): ``enable_loki(model, basis, k=..., d=...)`` / ``disable_loki``.

How it plugs in (public transformers APIs only, no model class is patched):

* An attention function is registered under the name ``"loki"`` with ``transformers.AttentionInterface`` and
  the sdpa mask builder under the same name with ``transformers.masking_utils.AttentionMaskInterface``;
  ``model.set_attn_implementation("loki")`` switches the model to it and ``disable_loki`` restores the
  implementation the model had before.
* Keys are stored in the PCA basis **once per token, when they are written to the KV cache**: the layers of a
  ``DynamicCache`` (the cache ``generate`` builds, one a caller passes, or one created here when the caller asks
  for a cache without giving one) are turned into :class:`LokiCacheLayer` s, whose ``update`` rotates the new
  keys ``K_hat = K P`` before appending them.  The cache is never re-projected as a whole.  Values are not
  rotated.  A forward pre-hook on the decoder model does this conversion (and points the attention function
  at the cache of the current call); the hook is removed by ``disable_loki``, which also turns those caches back
  into plain layers with plain keys (as does ``enable_loki`` with new settings), so a cache outlives the
  settings it was filled under.
* Pre- and post-rotary bases: the cache stores post-rotary keys, and both kinds of basis are applied to them.
  Lemma 1 of the paper (``(q P)(K P)^T = q K^T``) holds for *any* orthogonal ``P``, so attention over the full
  rotated keys is exact either way; a basis fitted before the rotary embedding (``rotary="pre"``) is simply
  another orthogonal matrix, whose leading ``d`` directions capture the post-rotary keys' variance less well.
* Prefill (query length > 1) runs dense causal attention (the causal mask is applied here: a custom
  implementation gets ``attention_mask=None`` for unpadded batches).  Every decode step (query length 1) runs
  the selected method with ``q_hat = rotate_query(q, P_layer)`` against the rotated cache.  A forward without a
  cache (``use_cache=False``, e.g. ``generate(..., use_cache=False)``) is refused with ``semantics="generate"``
  (the default) for every method but "dense": every forward would be a dense prefill.
  With ``semantics="decode"`` the prefill is sparse too: every query row ``i`` attends like a decode step over
  the ``i + 1`` tokens it sees (:func:`teacher_forced_attention`), so loglikelihoods and perplexities measure
  the method.
* Methods (``method=``): ``"loki"`` (Algorithm 1), ``"exact_topk"`` (oracle selection), ``"pcaattn"`` (attention
  from the first ``d`` rotated dims), ``"dense"``, ``"sparq"`` (``d`` is SparQ's ``r``) and ``"h2o"`` (generation
  only).  ``k`` and ``d`` are counts (int) or fractions (float in (0, 1]); a fractional ``k`` is a fraction of
  each sequence's current valid length, at least 1; an int ``k`` larger than the sequence keeps all tokens.
* Padding: left-padded batches (``generate`` with ``padding_side="left"``) work; the valid tokens of every
  sequence, ``[starts, lengths)``, are read once per forward from the 2-D attention mask (none: every token so
  far is valid; the unwritten slots of a static cache never are).  Right padding works for single forwards but
  not for ``generate``, whose new tokens follow the padding (a mask with holes, refused).
* ``backend="triton"`` needs CUDA tensors (or ``TRITON_INTERPRET=1`` on the CPU) and no gradient (the kernels
  have no backward; run under ``torch.no_grad()``); ``"auto"`` takes the PyTorch path where either fails.

Supported architectures: Llama (incl. SmolLM), Mistral, Qwen2 and Qwen3 (attention modules with rotary
embeddings and a KV cache of post-rotary keys; ``loki._hf.SUPPORTED_ARCHITECTURES``).

Modules: ``config`` (the frozen settings, the run-time state, each layer's transforms), ``metadata`` (the step
metadata: what every query row of every layer sees, built once per forward by the decoder's pre-hook from the 2-D
mask and the cache's write counter, with the decode step's budgets), ``cache`` (the cache layers and their
conversion), ``static`` (the static cache and its decode step), ``enable`` (enable/disable, the hooks and the
architecture check), ``attention`` (the attention function: dense prefill, the decode paths), ``teacher_forced``
(decode-time semantics for every row) and ``rows`` (query rotation, the backend choice).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim, R query rows flattened over batch and query positions.
"""

from __future__ import annotations

from loki._checks import CacheOverflowError
from loki._hf import SUPPORTED_ARCHITECTURES, cache_keyword

from .attention import loki_attention_forward
from .cache import LokiCacheLayer, LokiStaticCacheLayer, loki_cache
from .config import ATTN_IMPLEMENTATION, METHODS, LokiConfig, LokiError, LokiState, UnsupportedModelError
from .enable import disable_loki, enable_loki, is_loki_enabled
from .static import LokiStaticCache, loki_static_cache
from .teacher_forced import teacher_forced_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheOverflowError",
    "LokiCacheLayer",
    "LokiConfig",
    "LokiError",
    "LokiState",
    "LokiStaticCache",
    "LokiStaticCacheLayer",
    "METHODS",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "cache_keyword",
    "disable_loki",
    "enable_loki",
    "is_loki_enabled",
    "loki_attention_forward",
    "loki_cache",
    "loki_static_cache",
    "teacher_forced_attention",
]

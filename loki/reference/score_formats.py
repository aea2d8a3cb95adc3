"""Formats of the key copy the approximate scores read: the cache's own elements, or fewer bits per dim.

Loki's score phase reads the ``d`` leading rotated dims of every visible key.  Stored in fewer bits, the same bytes
hold more dims: an 8-bit copy holds ``2 d`` dims in the bytes of ``d`` 16-bit ones, a 4-bit copy ``4 d``.  Whether
the extra dims are worth the rounding is what :func:`quantize_score_keys` lets the evaluation measure (``loki
compare --methods loki,loki[native],...``; "int8" is the library's default); the exact attention over the selected
tokens always reads the full-precision keys.  The formats (:data:`SCORE_FORMATS`):

- ``"native"``: the cache's elements (16-bit in deployment), no rounding;
- ``"fp8"``: float8 e4m3 of each token's dims divided by a per-token scale (the dims' largest magnitude over 448);
- ``"int8"``: symmetric integers in [-127, 127] with a per-token scale (largest magnitude over 127);
- ``"int4"``: symmetric integers in [-7, 7] with a per-token scale (largest magnitude over 7).

The quantized formats keep one 16-bit scale per token and KV head beside the ``d`` dims; :func:`score_elements`
counts it in the bytes the score phase reads (:func:`loki.reference.accounting.score_fraction`).  These formats are
evaluated on the PyTorch reference; the Triton kernels read the native cache or, for ``LokiSettings(score_format=
"int8")``, the int8 copy the Loki caches write (:func:`encode_int8_score_keys`).
"""

from __future__ import annotations

import torch

from loki.settings import ScoreFormat

__all__ = ["SCORE_FORMATS", "SCORE_FORMAT_BITS", "check_score_format", "encode_int8_score_keys", "quantize_score_keys",
           "score_copy_bytes", "score_elements"]

#: Bits per dim of every format ("native": the cache's 16-bit elements).
SCORE_FORMAT_BITS = {ScoreFormat.NATIVE.value: 16, ScoreFormat.FP8.value: 8, ScoreFormat.INT8.value: 8,
                     ScoreFormat.INT4.value: 4}
SCORE_FORMATS = tuple(f.value for f in ScoreFormat)
#: Bits of the per-token scale a quantized format keeps per KV head.
SCALE_BITS = 16
_LEVELS = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}


def check_score_format(score_format: str, method: str = "loki") -> str:
    """``score_format`` if it is one of :data:`SCORE_FORMATS` and ``method`` can read it: a format other than "native"
    is Loki's only (ValueError naming the argument otherwise; ``LokiSettings`` applies the same rule)."""
    if score_format not in SCORE_FORMAT_BITS:
        raise ValueError(f"score_format must be one of {SCORE_FORMATS}, got {score_format!r}")
    if score_format != ScoreFormat.NATIVE.value and method != "loki":
        raise ValueError(f"score_format={score_format!r} applies to method 'loki' only, got {method!r}")
    return str(ScoreFormat(score_format).value)


def score_copy_bytes(score_format: str, d: int, itemsize: int) -> float:
    """Bytes of one token's score copy of ``d`` dims: ``d`` elements of ``itemsize`` bytes for "native" (the
    cache's own), else the codes and the 16-bit scale of :func:`score_elements`."""
    return d * itemsize if check_score_format(score_format) == "native" else score_elements(score_format, d) * 2


def score_elements(score_format: str, d: int) -> float:
    """The 16-bit elements one key's score copy occupies: ``d`` dims at the format's bits, plus the per-token scale
    of a quantized format (``d`` for "native"; ``d/2 + 1`` for the 8-bit formats; ``d/4 + 1`` for "int4")."""
    bits = SCORE_FORMAT_BITS[check_score_format(score_format)]
    if bits == 16:
        return float(d)
    return d * bits / 16 + SCALE_BITS / 16


def _codes(k: torch.Tensor, score_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of a quantized format, both fp32: ``k`` [..., d] over its per-token scale [..., 1] (the
    largest magnitude over the format's levels, rounded to bf16 as stored: bf16 keeps fp32's exponent range, so no
    overflow and no flush of small keys), rounded to the format."""
    levels = _LEVELS[score_format]
    x = k.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / levels).to(torch.bfloat16).float()
    y = x / torch.where(scale > 0, scale, torch.ones_like(scale))
    if score_format == "fp8":
        return y.clamp(-levels, levels).to(torch.float8_e4m3fn).float(), scale
    return torch.round(y).clamp(-levels, levels), scale


def encode_int8_score_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The "int8" score copy as a cache stores it: ``(codes int8 [..., d], scale bf16 [...])`` with
    ``quantize_score_keys(k, "int8") == codes * scale`` (what the Triton scores read, ``approx_scores(k_prefix=codes,
    prefix_scale=scale)``)."""
    codes, scale = _codes(k, "int8")
    return codes.to(torch.int8), scale[..., 0].to(torch.bfloat16)


def quantize_score_keys(k: torch.Tensor, score_format: str) -> torch.Tensor:
    """The keys' leading dims as the score copy holds them: ``k`` [..., d] rounded to ``score_format`` with one scale
    per token (the last axis' largest magnitude), then scaled back, in fp32 (exact: the code times the bf16 scale).
    "native" returns ``k`` itself."""
    check_score_format(score_format)
    if score_format == "native":
        return k
    codes, scale = _codes(k, score_format)
    return codes * scale  # exact in fp32 (a code of at most 8 bits times a bf16 scale)

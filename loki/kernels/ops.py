"""The Loki decode step as a torch custom op, ``torch.ops.loki.decode_step``, so that code calling it traces
under ``torch.compile(fullgraph=True)`` and is captured in CUDA graphs (mode "reduce-overhead"): dynamo sees one
opaque op whose output shape comes from a fake implementation; the op's body runs the Triton kernels
(``loki_decode_step``) on CUDA tensors and the PyTorch reference on any other device.

Registering the op (importing this module) probes no device and compiles nothing.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim, dp key-prefix dims.
"""

from __future__ import annotations

from numbers import Integral

import torch

from loki.reference.methods import loki_attention as loki_attention_reference

__all__ = ["decode_step_op", "k_arguments"]


def k_arguments(k: int | float) -> tuple[int, float]:
    """(k_count, k_fraction) of the op for a budget ``k``: an int count gives (k, -1.0), a fraction (-1, k)."""
    if isinstance(k, Integral) and not isinstance(k, bool):
        return int(k), -1.0
    return -1, float(k)


@torch.library.custom_op("loki::decode_step", mutates_args=())
def decode_step_op(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    k_prefix: torch.Tensor | None,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    d: int,
    k_count: int,
    k_fraction: float,
    k_max: int,
    gqa_select: str,
    aggregate: str,
    scale: float,
    use_kernels: bool,
) -> torch.Tensor:
    """One Loki decode step on validated inputs (the caller checks shapes, d, k and scale once).

    q_hat: [B, HQ, D] (q P); k_hat, v_cache: [B, HKV, S, D]; k_prefix: [B, HKV, S, dp >= d] or None; lengths,
    starts: [B] int with ``0 <= starts[b] < lengths[b] <= S`` (not checked: the kernels trust them); counts: [B]
    int, the tokens each sequence attends, ``budget(k, lengths, starts)`` (computed by the caller, so that a
    compiled graph computes it once for all layers and fuses it); k_count > 0 selects that many tokens (capped at
    each length), else k_fraction of each valid length (the reference path's budget, equal to counts);
    k_max: an int bound on every count (``loki.kernels.selection_bound``).  ``use_kernels``: the Triton kernels
    (CUDA tensors, or the interpreter), else the PyTorch reference.  Returns out [B, HQ, D] in q_hat's dtype.
    """
    k = k_count if k_count > 0 else k_fraction
    if not use_kernels:
        return loki_attention_reference(q_hat, k_hat, v_cache, d=d, k=k, lengths=lengths, starts=starts,
                                        gqa_select=gqa_select, aggregate=aggregate, scale=scale).to(q_hat.dtype)
    from .decode import loki_decode_step  # the kernels' modules import this one: imported at the first call

    _, out = loki_decode_step(q_hat, k_hat, v_cache, lengths, starts, counts, d=d, k_max=k_max,
                              gqa_select=gqa_select, aggregate=aggregate, scale=scale, select_method="triton",
                              k_prefix=k_prefix)
    return out if out.dtype == q_hat.dtype else out.to(q_hat.dtype)


@decode_step_op.register_fake
def _(q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, d, k_count, k_fraction, k_max, gqa_select, aggregate,
      scale, use_kernels):
    return torch.empty_like(q_hat, memory_format=torch.contiguous_format)

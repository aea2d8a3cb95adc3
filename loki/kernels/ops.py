"""The Loki decode step as a torch custom op, ``torch.ops.loki.decode_step``, so that code calling it traces
under ``torch.compile(fullgraph=True)`` and is captured in CUDA graphs (mode "reduce-overhead"): dynamo sees one
opaque op whose output shape comes from a fake implementation.

Registered per device: on CUDA the op runs the Triton kernels (``launch_decode_step``), on the CPU the PyTorch
reference (``loki.reference.loki_attention``); both take the same single budget input, ``counts`` (the tokens
each sequence attends, computed once per forward by the caller with ``loki._checks.budget_counts``).
Registering the op (importing this module) probes no device and compiles nothing.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim, dp key-prefix dims.
"""

from __future__ import annotations

import torch

from loki.reference.methods import loki_attention as loki_attention_reference

__all__ = ["decode_step_op"]


@torch.library.custom_op("loki::decode_step", mutates_args=(), device_types="cuda")
def decode_step_op(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    k_prefix: torch.Tensor | None,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    d: int,
    width: int,
    gqa_select: str,
    aggregate: str,
    scale: float,
    prefix_scale: torch.Tensor | None = None,
    score_format: str = "native",
) -> torch.Tensor:
    """One Loki decode step on validated inputs (the caller checks shapes, d and scale once).

    q_hat: [B, HQ, D] (q P_q); k_hat, v_cache: [B, HKV, S, D]; k_prefix: [B, HKV, S, dp >= d] or None (read by
    the kernels only); lengths, starts: [B] int with ``0 <= starts[b] < lengths[b] <= S`` (not checked: the
    kernels trust them); counts: [B] int, the tokens each sequence attends, ``1 <= counts[b] <= lengths[b] -
    starts[b]``; width: an int bound on every count (``loki.kernels.decode.selection_width``); prefix_scale:
    [B, HKV, S] bf16 or None, making k_prefix the "int8" score copy (int8 codes of its first dp dims);
    score_format: "native" or "int8" (the keys' first d dims rounded as the int8 copy holds them: the CPU reference
    rounds k_hat's; the kernels read the copy that ``prefix_scale`` names, or without one round the keys as they read
    them, the same scores).  Returns out [B, HQ, D] in q_hat's dtype.
    CUDA: the Triton kernels.
    """
    from .decode import launch_decode_step  # the kernels' modules import this one: imported at the first call

    _, out = launch_decode_step(q_hat=q_hat, k_hat=k_hat, v_cache=v_cache, k_prefix=k_prefix, lengths=lengths,
                                starts=starts, counts=counts, d=d, width=width, gqa_select=gqa_select,
                                aggregate=aggregate, scale=scale, prefix_scale=prefix_scale, score_format=score_format)
    return out if out.dtype == q_hat.dtype else out.to(q_hat.dtype)


@decode_step_op.register_kernel("cpu")
def _decode_step_cpu(q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, d, width, gqa_select, aggregate,
                     scale, prefix_scale=None, score_format="native"):
    """The CPU registration: the PyTorch reference with the same budgets (``k_prefix`` and ``width`` unused; with
    ``prefix_scale`` or ``score_format="int8"``, the reference's ``score_format="int8"``, which rounds k_hat's first
    d dims as the copy holds them)."""
    fmt = "int8" if prefix_scale is not None else score_format
    return loki_attention_reference(q_hat, k_hat, v_cache, d=d, counts=counts, lengths=lengths, starts=starts,
                                    gqa_select=gqa_select, aggregate=aggregate, scale=scale,
                                    score_format=fmt).to(q_hat.dtype)


@decode_step_op.register_fake
def _(q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, d, width, gqa_select, aggregate, scale,
      prefix_scale=None, score_format="native"):
    return torch.empty_like(q_hat, memory_format=torch.contiguous_format)

"""Query rows and the tokens they see: the rows rotated into the basis, the attention mask as a [B, L, S] bool
mask, each row's visible range ``[starts, lengths)`` (computed once per mask within a forward), and whether a
step runs on the Triton kernels.

Shape letters: B batch, HQ query heads, L query length, S key length (cache + new tokens), D head dim.
"""

from __future__ import annotations

import torch

from loki._checks import check_no_grad, check_triton_device
from loki.reference import rotate_query

from .config import LokiError

__all__ = ["allowed_mask", "check_triton_inputs", "mask_intervals", "rotate_rows", "row_intervals", "triton_backend"]


def rotate_rows(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """x: [B, HQ, L, D] -> x P per KV head (query heads of a group share their KV head's basis)."""
    B, HQ, L, D = x.shape
    flat = x.transpose(1, 2).reshape(B * L, HQ, D)
    return rotate_query(flat, P).reshape(B, L, HQ, D).transpose(1, 2)


def allowed_mask(attention_mask, B: int, L: int, S: int, device) -> torch.Tensor:
    """[B, L, S] bool, True = query row may attend to the key (causal, padding, windows)."""
    if attention_mask is None:
        q_pos = torch.arange(L, device=device)[:, None] + (S - L)
        return (torch.arange(S, device=device)[None, :] <= q_pos).expand(B, L, S)
    m = attention_mask
    if m.dim() == 4:
        if m.shape[1] != 1:
            raise LokiError(f"per-head attention masks are not supported, got shape {list(m.shape)}")
        m = m[:, 0]
    if m.dim() != 3:
        raise LokiError(f"expected a [B, 1, L, S] attention mask, got shape {list(attention_mask.shape)}")
    if m.dtype != torch.bool:
        m = m == 0  # additive float mask: 0 = attend
    m = m[..., -S:] if m.shape[-1] > S else m
    return m.expand(B, L, S)


def row_intervals(allowed: torch.Tensor):
    """starts, lengths ([B, L] int64) of each row's attended tokens, and the rows that attend to none."""
    S = allowed.shape[-1]
    pos = torch.arange(S, device=allowed.device)
    any_ = allowed.any(-1)
    starts = torch.where(allowed, pos, S).amin(-1)
    lengths = torch.where(allowed, pos + 1, 0).amax(-1)
    count = allowed.sum(-1)
    if bool(((lengths - starts != count) & any_).any()):
        raise LokiError(
            "Loki needs each query's visible tokens to be one contiguous range, and the attention mask has holes. "
            "Pad batches on the left (tokenizer.padding_side='left'): with right padding, the tokens generated "
            "after a padded prompt leave the padding in the middle of the sequence"
        )
    starts = torch.where(any_, starts, 0)
    lengths = torch.where(any_, lengths, 1)
    return starts, lengths, any_


def mask_intervals(attention_mask, B: int, L: int, S: int, device, memo: dict | None):
    """starts, lengths ([B, L]) and the rows that see a token (None: all) of an attention mask, computed (and
    checked, one host sync) once per mask object within a model forward when ``memo`` is that forward's dict;
    no mask work at all for a decode step without a mask."""
    if attention_mask is None and L == 1:
        return (torch.zeros(B, 1, dtype=torch.long, device=device),
                torch.full((B, 1), S, dtype=torch.long, device=device), None)
    key = (id(attention_mask), B, L, S, device)
    hit = None if memo is None else memo.get(key)
    if hit is not None and hit[0] is attention_mask:
        return hit[1]
    res = row_intervals(allowed_mask(attention_mask, B, L, S, device))
    if memo is not None:
        memo[key] = (attention_mask, res)  # the mask is kept alive with its entry: its id stays unique
    return res


def triton_backend(backend: str, query: torch.Tensor) -> bool:
    """Whether a decode step with this ``backend`` setting runs the Triton kernels ("auto": on CUDA tensors that
    need no gradient; the kernels have no backward)."""
    if backend == "triton":
        return True
    return backend == "auto" and query.is_cuda and not (torch.is_grad_enabled() and query.requires_grad)


def check_triton_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """backend='triton' at forward time: a device the kernels run on, and no gradient wanted."""
    try:
        check_triton_device(query, "enable_loki(backend='triton')")
        check_no_grad("Loki's Triton decode step (enable_loki(backend='triton'))", query=query, key=key,
                      value=value)
    except RuntimeError as exc:
        raise LokiError(str(exc)) from None

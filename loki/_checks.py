"""Argument validation shared by the references, kernels and integrations.

Every error names the argument at fault, so a user sees *which* input is wrong and what was expected.
Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import math
import os
from numbers import Integral, Real

import torch

__all__ = [
    "CacheOverflowError",
    "MAX_COUNT",
    "check_count",
    "check_dims",
    "check_counts",
    "budget_bound",
    "budget_counts",
    "check_budget",
    "check_decode_inputs",
    "check_no_grad",
    "check_triton_device",
    "resolve_d",
    "resolve_k",
    "resolve_scale",
    "triton_interpreting",
    "valid_token_mask",
]

class CacheOverflowError(IndexError):
    """New tokens do not fit a preallocated (static) KV cache: positions past ``max_cache_len``, or a batch other
    than the allocated ``batch_size`` (an ``IndexError``, as transformers' own static cache raises)."""


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> tuple[int, int, int, int, int, torch.Tensor, torch.Tensor]:
    """Check one decode step's inputs and return ``(B, HQ, HKV, S, D, lengths, starts)``.

    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D]; lengths: [B] (exclusive end of the valid tokens,
    default S); starts: [B] (first valid token, default 0; left padding). Valid tokens of sequence b are
    ``starts[b] <= s < lengths[b]``.

    ``check_values=False`` skips the checks that read ``lengths``/``starts`` values (each is a host sync on an
    accelerator); shapes, dtypes and devices are always checked.  The caller then guarantees what those checks
    would have verified: ``1 <= lengths[b] <= S``, ``0 <= starts[b] < lengths[b]`` for every b.  Nothing else
    checks it: the Triton kernels trust these values to bound their reads, so positions outside the cache read
    out of bounds and give undefined results (or a memory fault on a GPU).
    """
    for name, t, rank in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            want = "[B, HQ, D]" if rank == 3 else "[B, HKV, S, D]"
            raise ValueError(f"{name} must have rank {rank} {want}, got shape {_shape(t)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (fp16, bf16, fp32, fp64), got {t.dtype}")
    B, HQ, D = q.shape
    if D < 1:
        raise ValueError(f"q must have a head dim D >= 1, got shape {_shape(q)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache shape {_shape(v_cache)} must equal k_cache shape {_shape(k_cache)}")
    Bk, HKV, S, Dk = k_cache.shape
    if Bk != B:
        raise ValueError(f"k_cache batch size {Bk} does not match q batch size {B}")
    if Dk != D:
        raise ValueError(f"k_cache head dim {Dk} does not match q head dim {D}")
    if HKV < 1 or HQ < 1:
        raise ValueError(f"q and k_cache need at least one head (HQ={HQ}, HKV={HKV})")
    if HQ % HKV != 0:
        raise ValueError(f"query heads HQ={HQ} (q) must be a multiple of key/value heads HKV={HKV} (k_cache)")
    if S < 1:
        raise ValueError("k_cache must hold at least one token (S >= 1)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(
            f"device mismatch: q on {q.device}, k_cache on {k_cache.device}, v_cache on {v_cache.device}"
        )
    lengths = _check_positions("lengths", lengths, B, S, q.device, default=S, check_values=check_values)
    starts = _check_positions("starts", starts, B, S, q.device, default=0, check_values=check_values)
    if check_values and bool((starts >= lengths).any()):
        b = int((starts >= lengths).nonzero()[0, 0])
        raise ValueError(
            "every sequence needs at least one valid token: "
            f"starts[{b}]={int(starts[b])} >= lengths[{b}]={int(lengths[b])}"
        )
    return B, HQ, HKV, S, D, lengths, starts


def _check_positions(name, t, B, S, device, default, check_values=True):
    if t is None:
        return torch.full((B,), default, dtype=torch.int32, device=device)
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dim() != 1 or t.shape[0] != B:
        raise ValueError(f"{name} must have shape [B]=[{B}], got {_shape(t)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    lo, hi = (0, S - 1) if name == "starts" else (1, S)
    if check_values and bool(((t < lo) | (t > hi)).any()):
        raise ValueError(f"{name} values must lie in [{lo}, {hi}] for a cache of S={S} tokens, got {t.tolist()}")
    return t.to(torch.int32)


def check_counts(counts, B: int, device: torch.device | None = None, *, name: str = "counts") -> torch.Tensor:
    """Per-sequence selection counts: an integer tensor of shape [B] (on ``device`` when given)."""
    if not isinstance(counts, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor of shape [B]=[{B}], got {type(counts).__name__}")
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {counts.dtype}")
    if counts.shape != (B,):
        raise ValueError(f"{name} must have shape [B]=[{B}], got {list(counts.shape)}")
    if device is not None and counts.device != torch.device(device):
        raise ValueError(f"{name} is on {counts.device} but the scores are on {device}")
    return counts


def check_row_counts(counts, B: int, H: int, *, name: str = "counts") -> bool:
    """Selection counts per sequence ([B]: returns False) or per row ([B, H], e.g. the per-KV-head budgets of the
    "agreement" aggregate: returns True); the checks of :func:`check_counts` otherwise."""
    if isinstance(counts, torch.Tensor) and counts.dim() == 2:
        check_counts(counts[:, 0], B, name=name)  # the dtype and batch checks
        if counts.shape[1] != H:
            raise ValueError(f"{name} must have shape [B]=[{B}] or [B, H]=[{B}, {H}], got {list(counts.shape)}")
        return True
    check_counts(counts, B, name=name)
    return False


def valid_token_mask(lengths: torch.Tensor, starts: torch.Tensor, S: int) -> torch.Tensor:
    """[B, S] bool: True where ``starts[b] <= s < lengths[b]``."""
    pos = torch.arange(S, device=lengths.device)
    return (pos[None, :] >= starts[:, None].long()) & (pos[None, :] < lengths[:, None].long())


def check_dims(d: int | float, *, name: str = "d") -> int | float:
    """Validate a dims setting before the head dim is known: an ``int`` count >= 1 or a ``float`` fraction in
    (0, 1].  Returns ``d`` as an int or a float (:func:`resolve_d` makes it a count)."""
    if isinstance(d, bool):
        raise TypeError(f"{name} must be an int count or a float fraction, got bool")
    if isinstance(d, Integral):
        if int(d) < 1:
            raise ValueError(f"{name}={d} is out of range: it must be at least 1")
        return int(d)
    if isinstance(d, Real):
        f = float(d)
        if not (0.0 < f <= 1.0) or math.isnan(f):
            raise ValueError(f"{name}={d} as a fraction of D must lie in (0, 1]")
        return f
    raise TypeError(f"{name} must be an int count or a float fraction, got {type(d).__name__}")


def resolve_d(d: int | float, D: int, *, name: str = "d") -> int:
    """Number of leading principal dims used for approximate scores.

    An ``int`` is a count (1 <= d <= D); a ``float`` in (0, 1] is a fraction of D, rounded up.
    """
    if isinstance(d, Integral) and not isinstance(d, bool) and not 1 <= int(d) <= D:
        raise ValueError(f"{name}={d} is out of range: it must satisfy 1 <= {name} <= D={D}")
    d = check_dims(d, name=name)
    if isinstance(d, int):
        return d
    return max(1, min(D, math.ceil(d * D - 1e-9)))


#: The largest int budget (token positions are int32 in the kernels); a count above a sequence's valid tokens
#: keeps them all, so a larger one has no use.
MAX_COUNT = 2**31 - 1


def check_budget(k: int | float, *, name: str = "k") -> int | float:
    """Validate a budget once, where it is set: an ``int`` count >= 1 (any size: a count above a sequence's valid
    tokens keeps them all) or a ``float`` fraction in (0, 1].  Returns ``k`` as an int or a float."""
    if isinstance(k, bool):
        raise TypeError(f"{name} must be an int count or a float fraction, got bool")
    if isinstance(k, Integral):
        if int(k) < 1:
            raise ValueError(f"{name}={k} is out of range: at least one token must be selected ({name} >= 1)")
        if int(k) > MAX_COUNT:
            raise ValueError(f"{name}={k} exceeds the largest count, {MAX_COUNT}; a count above a sequence's "
                             f"valid tokens keeps them all (use {name}=1.0 to attend to every token)")
        return int(k)
    if isinstance(k, Real):
        f = float(k)
        if not (0.0 < f <= 1.0) or math.isnan(f):
            raise ValueError(f"{name}={k} as a fraction of the sequence length must lie in (0, 1]")
        return f
    raise TypeError(f"{name} must be an int count or a float fraction, got {type(k).__name__}")


def budget_counts(k: int | float, n_valid: torch.Tensor) -> torch.Tensor:
    """The one budget rule: tokens to select per sequence (or row) from its valid length ``n_valid`` (int tensor
    of any shape), for a budget ``k`` already validated by :func:`check_budget`.

    An int count keeps ``min(k, n)`` tokens (all of them when ``k`` is above the valid tokens); a fraction keeps
    ``ceil(k * n)`` (fp64, rounded up), at least 1 and at most n.  A row with ``n = 0`` gets 0.  Never raises and
    never syncs: the kernels, the selection width, the references, the evaluation engine, the static path and
    the byte floors all count with it.
    """
    n = n_valid.long()
    if isinstance(k, Integral) and not isinstance(k, bool):
        return torch.clamp(n, max=int(k))
    kk = torch.ceil(n.double() * float(k) - 1e-9).long()
    return torch.clamp(kk, min=1).minimum(n)


def resolve_k(k: int | float, n_valid: torch.Tensor, S: int | None = None, *, name: str = "k") -> torch.Tensor:
    """Tokens to select per sequence, [B] int64, from each sequence's own valid length ``n_valid``:
    :func:`check_budget` then :func:`budget_counts` (``S`` is accepted for compatibility and not used: an int
    count above the cache keeps every valid token)."""
    return budget_counts(check_budget(k, name=name), n_valid)


def budget_bound(k: int | float, S: int) -> int:
    """An int >= every count :func:`budget_counts` gives for rows of at most ``S`` valid tokens, known on the
    host (no device sync)."""
    if isinstance(k, Integral) and not isinstance(k, bool):
        return max(1, min(int(k), S))
    return max(1, min(S, math.ceil(float(k) * S - 1e-9)))


def resolve_scale(scale: float | None, D: int, *, name: str = "scale") -> float:
    """The attention scale as a float: ``1/sqrt(D)`` when ``scale`` is None, else ``scale`` itself, which must be
    a finite real number > 0 (NaN, inf, zero and negative scales are refused)."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"{name} must be a real number > 0 or None, got {type(scale).__name__}")
    f = float(scale)
    if not math.isfinite(f) or f <= 0.0:
        raise ValueError(f"{name}={scale} must be a finite number > 0 (default 1/sqrt(D))")
    return f


def check_count(value, name: str, *, minimum: int = 1, allow_none: bool = True) -> int | None:
    """An integer option such as ``num_splits``: an int >= ``minimum`` (or None when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int >= {minimum}{' or None' if allow_none else ''}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name}={value} is out of range: it must be at least {minimum}")
    return int(value)


def check_no_grad(what: str, **tensors) -> None:
    """Refuse inputs that require grad where autograd is enabled: the Triton kernels have no backward, so their
    output would silently carry no gradient.  ``tensors``: name -> tensor (None entries are skipped)."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(
                f"{name} requires grad, but {what} has no backward (its output would carry no gradient); run it "
                "under torch.no_grad() or on detached tensors, or use backend='torch' (differentiable)"
            )


def triton_interpreting() -> bool:
    """True when Triton runs in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_triton_device(device: torch.device | torch.Tensor, what: str = "the Triton kernels") -> None:
    """Triton runs on CUDA tensors, or on CPU tensors only under ``TRITON_INTERPRET=1``; raise RuntimeError
    saying what to do otherwise.  ``device``: a device or a tensor on it."""
    from loki._triton import require_triton  # a TritonUnavailableError where triton cannot be imported

    require_triton(what)
    if isinstance(device, torch.Tensor):
        device = device.device
    device = torch.device(device)
    if device.type == "cuda":
        if triton_interpreting():
            raise RuntimeError(f"{what} got CUDA tensors but TRITON_INTERPRET=1 is set; unset it to run on GPU")
        return
    if device.type == "cpu" and triton_interpreting():
        return
    raise RuntimeError(
        f"{what} need CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before importing triton, "
        "or use backend='torch'"
    )

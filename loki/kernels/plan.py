"""A cheap eager entry point to the decode step: validate once (``plan_decode``), run many times
(``DecodeRun.run``), as FlashInfer's plan/run.

``decode_attention`` checks every argument on every call and resolves the per-sequence budgets with a few torch
ops: 0.2-0.3 ms of host time per call, more than the kernels take at small batch.  A plan is made for one KV
cache (keys in the basis, values, optional key prefix, all of fixed shape and address, such as a static cache
preallocated to its maximum length) and one setting (d, k, GQA mode, scale); every check happens there.  Its
first ``run`` launches the step normally while recording the launches (the budgets of each sequence come from a
one-program Triton kernel, so the step is launches only); every later ``run`` patches the addresses of the
query, lengths and starts into the recorded argument lists and calls the compiled kernels directly, with the
plan's own scratch buffers: one allocation (the output), no other torch op, no host sync.  Every run returns a
new output tensor, unless ``out=`` was given to ``plan_decode`` (then every run writes that buffer).

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import torch

from loki._checks import check_budget, check_decode_inputs, check_no_grad, resolve_d, resolve_scale
from loki._triton import tl, triton
from loki.reference.selection import GQA_SELECT_MODES, check_kernel_aggregate

from . import launch as _launch
from ._common import check_triton_device
from .approx_scores import _check_key_prefix

__all__ = ["DecodeRun", "plan_decode"]


def k_arguments(k: int | float) -> tuple[int, float]:
    """(k_count, k_fraction) of the budget kernel for a validated budget ``k``: an int count gives (k, -1.0), a
    fraction (-1, k)."""
    if isinstance(k, int) and not isinstance(k, bool):
        return int(k), -1.0
    return -1, float(k)


@triton.jit
def _budget_kernel(lengths_ptr, starts_ptr, frac_ptr, counts_ptr, B, K_COUNT, IS_FRACTION: tl.constexpr,
                   BLOCK: tl.constexpr):
    """counts[b] = the tokens sequence b attends: min(K_COUNT, n) for a count, else ceil(n * f - 1e-9) in
    [1, n] for a fraction f (fp64, as ``loki._checks.budget_counts``), with n = lengths[b] - starts[b]."""
    offs = tl.arange(0, BLOCK)
    m = offs < B
    n = tl.load(lengths_ptr + offs, mask=m, other=1).to(tl.int64) - tl.load(starts_ptr + offs, mask=m,
                                                                              other=0).to(tl.int64)
    if IS_FRACTION:
        f = tl.load(frac_ptr)
        c = tl.math.ceil(n.to(tl.float64) * f - 1e-9).to(tl.int64)
        c = tl.minimum(tl.maximum(c, 1), n)
    else:
        c = tl.minimum(n, K_COUNT)
    tl.store(counts_ptr + offs, c, mask=m)


class DecodeRun:
    """A decode step planned for one KV cache and one setting (made by :func:`plan_decode`).

    ``run(q_hat, lengths, starts=None)`` -> out [B, HQ, D] (a new tensor per run, or the ``out`` given to
    ``plan_decode``).  q_hat must have the planned
    shape, dtype, device and strides; lengths and starts ([B] int32 or int64, on the device) must satisfy
    ``0 <= starts[b] < lengths[b] <= S`` (not checked: the kernels trust them to bound their reads).
    """

    def __init__(self, k_hat, v_cache, k_prefix, q_shape, d, k, K, gqa_select, aggregate, scale, out):
        self.k_hat, self.v_cache, self.k_prefix = k_hat, v_cache, k_prefix
        self.q_shape, self.d, self.k, self.k_max = tuple(q_shape), d, k, K
        self.gqa_select, self.aggregate, self.scale = gqa_select, aggregate, scale
        self.out = out
        dev = k_hat.device
        self.k_count, frac = k_arguments(k)
        self._frac = torch.tensor([max(frac, 0.0)], dtype=torch.float64, device=dev)
        self._zeros = torch.zeros(q_shape[0], dtype=torch.int32, device=dev)
        self._sig = None  # (q strides, q alignment, lengths/starts dtype, their alignment) of the recording
        self._plan = None  # the recorded launches (launch.DecodePlan), False if they cannot be replayed
        self._buffers = None
        self._bound = None

    # -- the normal launch path (first run, and any run whose plan cannot replay) --
    def _launch_all(self, q_hat, lengths, starts, counts):
        from .decode import _decode_step_launches

        B = q_hat.shape[0]
        _launch.launch(_budget_kernel, (1,), [lengths, starts, self._frac, counts, B, max(self.k_count, 1),
                                              self.k_count <= 0, triton.next_power_of_2(max(B, 1))],
                       dict(num_warps=1))
        return _decode_step_launches(q_hat, self.k_hat, self.v_cache, lengths, starts, counts, self.d, self.k_max,
                                     self.gqa_select, self.aggregate, self.scale, "triton", False, self.out, None,
                                     self.k_prefix, True, None, None)

    def _signature(self, q_hat, lengths, starts):
        return (q_hat.shape, q_hat.stride(), q_hat.dtype, q_hat.device, q_hat.data_ptr() & 15,
                lengths.shape, lengths.dtype, lengths.data_ptr() & 15, starts.dtype, starts.data_ptr() & 15)

    def run(self, q_hat: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        if starts is None:
            starts = self._zeros
        sig = self._signature(q_hat, lengths, starts)
        if self._plan:
            if sig != self._sig:
                raise ValueError(f"q_hat, lengths or starts differ from the planned ones (shape, strides, dtype, "
                                 f"device, 16-byte alignment): planned q_hat {self.q_shape}; got "
                                 f"{list(q_hat.shape)} {q_hat.dtype} on {q_hat.device}")
            return self._replay(q_hat, lengths, starts)
        if tuple(q_hat.shape) != self.q_shape or q_hat.device != self.k_hat.device or q_hat.dtype != self.k_hat.dtype:
            raise ValueError(f"q_hat must be a {self.k_hat.dtype} tensor of the planned shape {list(self.q_shape)} on "
                             f"{self.k_hat.device}, got {q_hat.dtype} {list(q_hat.shape)} on {q_hat.device}")
        if q_hat.stride(-1) != 1:
            raise ValueError("q_hat must be contiguous in its last dim")
        for name, t in (("lengths", lengths), ("starts", starts)):
            if (not isinstance(t, torch.Tensor) or t.shape != (self.q_shape[0],) or t.device != q_hat.device
                    or t.dtype not in (torch.int32, torch.int64)):
                raise ValueError(f"{name} must be an int32/int64 tensor of shape [B]=[{self.q_shape[0]}] on "
                                 f"{q_hat.device}")
        if self._plan is False:  # not replayable (e.g. rows past the Triton select): the normal path each time
            counts = _launch.new_output((q_hat.shape[0],), torch.int64, q_hat.device)
            return self._launch_all(q_hat, lengths, starts, counts)[1]
        with _launch.recording() as rec:
            counts = _launch.new_output((q_hat.shape[0],), torch.int64, q_hat.device)
            idx, res = self._launch_all(q_hat, lengths, starts, counts)
        inputs = (q_hat, lengths, starts, self.k_hat, self.v_cache, self.k_prefix, self._frac, self.out)
        plan = _launch.DecodePlan(rec.launches, inputs, rec.buffers)
        if not plan.ok or (self.out is None and not any(res is b for b in rec.buffers)):
            self._plan = False
            return res
        self._plan, self._buffers, self._sig = plan, list(rec.buffers), sig
        self._ret = next((j for j, b in enumerate(rec.buffers) if b is res), None)
        self._bound = plan.bind(inputs, self._buffers, as_tensors=not plan.direct())
        # where the changing inputs (q_hat, lengths, starts: inputs 0-2) go in each launch's argument list, and
        # where the output buffer goes (a fresh output per run unless the caller gave ``out``)
        self._patches = [[(pos, i) for pos, is_in, i, *_ in subs if is_in and i < 3]
                         for (_fn, _grid, _t, subs, _o, _c) in plan.launches]
        self._out_patches = [[(pos, off, shape, stride, soff) for pos, is_in, i, off, shape, stride, soff in subs
                              if not is_in and i == self._ret]
                             for (_fn, _grid, _t, subs, _o, _c) in plan.launches]
        return res

    def _replay(self, q_hat, lengths, starts):
        plan, new = self._plan, (q_hat, lengths, starts)
        direct = plan.direct()
        out = None
        if self._ret is not None:
            ref = self._buffers[self._ret]
            out = _launch.new_output(tuple(ref.shape), ref.dtype, ref.device)
        for args, patches, out_patches in zip(self._bound, self._patches, self._out_patches):
            for pos, i in patches:
                args[pos] = new[i].data_ptr() if direct else new[i]
            for pos, off, shape, stride, soff in out_patches:
                if direct:
                    args[pos] = out.data_ptr() + off
                else:
                    args[pos] = out if (off == 0 and out.shape == shape) else torch.as_strided(out, shape, stride,
                                                                                              soff)
        plan.launch_all(self._bound)
        return self.out if out is None else out

def plan_decode(
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_q_heads: int,
    d: int | float,
    k: int | float,
    k_prefix: torch.Tensor | None = None,
    gqa_select: str = "query",
    aggregate: str = "sum",
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> DecodeRun:
    """Plan Loki decode steps over one KV cache: k_hat, v_cache [B, HKV, S, D] (keys in the basis, K P), the
    query heads HQ (``num_q_heads``, a multiple of HKV), d, k, ``gqa_select``, ``aggregate`` and ``scale`` as
    in :func:`loki.kernels.decode_attention` (same checks, same selections and outputs), ``k_prefix`` an optional
    [B, HKV, S, dp >= d] key prefix, ``out`` an optional [B, HQ, D] output buffer.  The Triton kernels only
    (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); the cache tensors must keep their address and
    shape for the plan's lifetime (they may be written in place between runs).  Returns a :class:`DecodeRun`.
    """
    if gqa_select not in GQA_SELECT_MODES:
        raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {gqa_select!r}")
    check_kernel_aggregate(aggregate, "plan_decode (the Triton kernels)")
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
        raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")
    if not isinstance(k_hat, torch.Tensor) or k_hat.dim() != 4:
        raise ValueError(f"k_hat must be a [B, HKV, S, D] tensor, got {getattr(k_hat, 'shape', type(k_hat))}")
    B, HKV, S, D = k_hat.shape
    if num_q_heads % HKV:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of the cache's key/value heads HKV={HKV}")
    check_decode_inputs(k_hat.new_empty((B, num_q_heads, D)), k_hat, v_cache, check_values=False)
    check_triton_device(k_hat, "plan_decode")
    check_no_grad("plan_decode", k_hat=k_hat, v_cache=v_cache, k_prefix=k_prefix)
    if k_hat.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_hat and v_cache must be contiguous in their last dim (the plan keeps their addresses)")
    dd = resolve_d(d, D)
    k = check_budget(k)
    scale = resolve_scale(scale, D)
    if k_prefix is not None:
        if _check_key_prefix(k_prefix, k_hat, dd) is not k_prefix:
            raise ValueError("k_prefix must be contiguous in its last dim (the plan keeps its address)")
    if out is not None and (out.shape != (B, num_q_heads, D) or out.dtype != k_hat.dtype
                            or out.device != k_hat.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {k_hat.dtype} tensor [B, HQ, D]=[{B}, {num_q_heads}, {D}] on "
                         f"{k_hat.device}")
    from .decode import selection_width

    # rows past the Triton select's length are selected by torch.topk: such a plan takes the normal launch path
    # on every run (``DecodeRun`` finds it cannot replay)
    K = selection_width(k, S)
    return DecodeRun(k_hat, v_cache, k_prefix, (B, num_q_heads, D), dd, k, K, gqa_select, aggregate, scale, out)

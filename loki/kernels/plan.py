"""Plan once, run many: :func:`plan_decode` checks a decode setting and a KV cache once and returns a
:class:`DecodeRun`, which runs the step's kernels with as little host work as possible (FlashInfer's plan/run).

``decode_attention`` checks every argument on every call and resolves the per-sequence budgets with a few torch
ops: 0.2-0.3 ms of host time per call, more than the kernels take at small batch.  A :class:`DecodeRun` holds one
setting (query heads, d, k, GQA mode, aggregate, scale).  The first call with an argument signature (shapes,
strides, dtypes, 16-byte alignment; not the addresses) launches the step
(:func:`~loki.kernels.decode.launch_decode_step`) while recording the launches
(:class:`~loki.kernels.launch.DecodePlan`); every later call with that signature replays the recording: the
compiled kernels are called directly with the new inputs' addresses and fresh per-call buffers, no other torch op,
no host sync.  It keeps the ``max_plans`` newest signatures (a dynamic cache's length changes every step: its
layers share the step's recording).  This is the only replay mechanism of the kernels: the transformers
integration runs the ``DecodeRun`` of its enabled model (:meth:`DecodeRun.step`, the caches and budgets of each
call passed in), ``plan_decode`` binds one cache for direct users (:meth:`DecodeRun.run`, the budgets computed on
the device by a one-program kernel), and nothing is recorded or replayed while a CUDA graph is being captured (a
compiled step runs the ``loki::decode_step`` op instead).

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import torch

from loki._checks import check_budget, check_decode_inputs, check_no_grad, resolve_scale
from loki._triton import tl, triton
from loki.settings import LokiSettings, ResolvedSettings

from . import launch as _launch
from .approx_scores import check_key_prefix
from .common import check_triton_device

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
    """Decode steps of one resolved setting (made by :func:`plan_decode`, or by the transformers integration for
    its enabled model).

    ``run(q_hat, lengths, starts=None)`` -> out [B, HQ, D]: the cache bound by :func:`plan_decode`, the budgets
    computed from ``k`` on the device (a new output tensor per run, or the ``out`` given to ``plan_decode``).
    ``step(q_hat=..., k_hat=..., v_cache=..., k_prefix=..., lengths=..., starts=..., counts=..., width=...)`` -> out:
    caches and budgets passed in (the integration's hot loop: ``counts`` from the step plan).  Both record a
    signature's launches at its first call and replay them from the second (see the module docstring).
    lengths and starts ([B] int32 or int64, on the device) must satisfy ``0 <= starts[b] < lengths[b] <= S``
    (not checked: the kernels trust them to bound their reads).
    """

    def __init__(self, settings: ResolvedSettings, *, scale: float, tuning=None, bound=None, max_plans: int = 16):
        from .decode import _DEFAULT_TUNING

        self.settings = settings
        self.scale = float(scale)
        self.tuning = _DEFAULT_TUNING if tuning is None else tuning
        self.max_plans = max_plans
        self._plans: dict = {}  # signature -> DecodePlan, or False where the launches cannot be replayed
        # (k_hat, v_cache, k_prefix, out, q_shape) of plan_decode's cache, None for step()
        self._bound = bound
        if bound is not None:
            dev = bound[0].device
            self._k_count, frac = k_arguments(settings.k)
            self._frac = torch.tensor([max(frac, 0.0)], dtype=torch.float64, device=dev)
            self._zeros = torch.zeros(bound[4][0], dtype=torch.int32, device=dev)

    # -- the launches of one step (recorded and replayed as a whole) --
    def _launches(self, inputs, width: int, with_budget: bool):
        from .decode import launch_decode_step

        q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, out, _, prefix_scale = inputs
        if with_budget:
            counts = _launch.new_output((q_hat.shape[0],), torch.int64, q_hat.device)
            B = q_hat.shape[0]
            _launch.launch(_budget_kernel, (1,), [lengths, starts, self._frac, counts, B, max(self._k_count, 1),
                                                  self._k_count <= 0, triton.next_power_of_2(max(B, 1))],
                           dict(num_warps=1))
        return launch_decode_step(
            q_hat=q_hat, k_hat=k_hat, v_cache=v_cache, k_prefix=k_prefix, lengths=lengths, starts=starts,
            counts=counts, d=self.settings.d, width=width, scale=self.scale, select_method="triton", out=out,
            tuning=self.tuning, prefix_scale=prefix_scale, score_format=self.settings.score_format.value,
            **self.settings.kernel_args())

    def _call(self, inputs, width: int, with_budget: bool):
        """Launch, record or replay the step on ``inputs`` (q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts,
        out, the budget kernel's fraction for ``run``, and the int8 copy's prefix_scale or None).  Returns
        ``(idx, out)``."""
        from .select import TRITON_SELECT_MAX_S

        q_hat, k_hat, out = inputs[0], inputs[1], inputs[7]
        t = self.tuning
        if (not t.use_plan or t.attn_options is not None or k_hat.shape[2] > TRITON_SELECT_MAX_S
                or (q_hat.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self._launches(inputs, width, with_budget)
        key = (width, with_budget, _launch.PDL, *(_launch.tensor_key(x) for x in inputs))
        plan = self._plans.get(key)
        if plan:
            bufs = plan(inputs)
            return bufs[plan.ret_idx], (out if plan.ret is None else bufs[plan.ret])
        if plan is False:
            return self._launches(inputs, width, with_budget)
        if len(self._plans) >= self.max_plans:  # the oldest signature goes (a dynamic cache's length moves on)
            self._plans.pop(next(iter(self._plans)))
        with _launch.recording() as rec:
            idx, res = self._launches(inputs, width, with_budget)
        plan = _launch.DecodePlan(rec.launches, inputs, rec.buffers)
        plan.ret = next((j for j, b in enumerate(rec.buffers) if b is res), None)
        plan.ret_idx = next((j for j, b in enumerate(rec.buffers) if b is idx), None)
        if plan.ret_idx is None or (plan.ret is None and res is not out):
            plan.ok = False
        self._plans[key] = plan if plan.ok else False
        return idx, res

    @property
    def replays(self) -> int:
        """The signatures whose recorded launches this run replays."""
        return sum(1 for p in self._plans.values() if p)

    def step(self, *, q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, width: int,
             out: torch.Tensor | None = None, return_indices: bool = False, prefix_scale=None):
        """One step over a cache given per call (validated by the caller; ``counts`` [B] from
        ``loki._checks.budget_counts``, ``width`` >= max(counts); ``prefix_scale`` [B, HKV, S] bf16 when ``k_prefix``
        is the int8 score copy, as ``launch_decode_step``).  Returns out [B, HQ, D] (``out`` itself when given), and
        the selection ``idx [B, H, width]`` first when ``return_indices``."""
        idx, res = self._call((q_hat, k_hat, v_cache, k_prefix, lengths, starts, counts, out, None, prefix_scale),
                              width, False)
        return (idx, res) if return_indices else res

    def run(self, q_hat: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """One step over the cache planned by :func:`plan_decode`.  Returns out [B, HQ, D]."""
        if self._bound is None:
            raise ValueError("this DecodeRun has no cache of its own (it was not made by plan_decode): use step()")
        k_hat, v_cache, k_prefix, out, q_shape = self._bound
        if starts is None:
            starts = self._zeros
        if tuple(q_hat.shape) != q_shape or q_hat.device != k_hat.device or q_hat.dtype != k_hat.dtype:
            raise ValueError(f"q_hat must be a {k_hat.dtype} tensor of the planned shape {list(q_shape)} on "
                             f"{k_hat.device}, got {q_hat.dtype} {list(q_hat.shape)} on {q_hat.device}")
        if q_hat.stride(-1) != 1:
            raise ValueError("q_hat must be contiguous in its last dim")
        for name, x in (("lengths", lengths), ("starts", starts)):
            if (not isinstance(x, torch.Tensor) or x.shape != (q_shape[0],) or x.device != q_hat.device
                    or x.dtype not in (torch.int32, torch.int64)):
                raise ValueError(f"{name} must be an int32/int64 tensor of shape [B]=[{q_shape[0]}] on "
                                 f"{q_hat.device}")
        from .decode import selection_width

        width = selection_width(self.settings.k, k_hat.shape[2])
        return self._call((q_hat, k_hat, v_cache, k_prefix, lengths, starts, None, out, self._frac, None), width,
                          True)[1]


def plan_decode(
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_q_heads: int,
    d: int | float,
    k: int | float,
    k_prefix: torch.Tensor | None = None,
    gqa_select: str = "auto",
    aggregate: str = "auto",
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> DecodeRun:
    """Plan Loki decode steps over one KV cache: k_hat, v_cache [B, HKV, S, D] (keys in the basis, K P), the
    query heads HQ (``num_q_heads``, a multiple of HKV), d, k, ``gqa_select``, ``aggregate`` and ``scale`` as
    in :func:`loki.kernels.decode_attention` (same checks, same defaults, same selections and outputs),
    ``k_prefix`` an optional [B, HKV, S, dp >= d] key prefix, ``out`` an optional [B, HQ, D] output buffer.
    The Triton kernels only (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``); the cache tensors must
    keep their address and shape for the plan's lifetime (they may be written in place between runs).  Returns a
    :class:`DecodeRun`; call its ``run(q_hat, lengths, starts)``.
    """
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
        raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")
    if not isinstance(k_hat, torch.Tensor) or k_hat.dim() != 4:
        raise ValueError(f"k_hat must be a [B, HKV, S, D] tensor, got {getattr(k_hat, 'shape', type(k_hat))}")
    B, HKV, S, D = k_hat.shape
    if num_q_heads % HKV:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of the cache's key/value heads HKV={HKV}")
    check_decode_inputs(k_hat.new_empty((B, num_q_heads, D)), k_hat, v_cache, check_values=False)
    settings = LokiSettings(k=check_budget(k), d=d, gqa_select=gqa_select, aggregate=aggregate, backend="triton",
                            score_format="native").resolve_shapes(num_q_heads=num_q_heads, num_kv_heads=HKV, head_dim=D,
                                                                  where="plan_decode (the Triton kernels)")
    check_triton_device(k_hat, "plan_decode")
    check_no_grad("plan_decode", k_hat=k_hat, v_cache=v_cache, k_prefix=k_prefix)
    if k_hat.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_hat and v_cache must be contiguous in their last dim (the plan keeps their addresses)")
    scale = resolve_scale(scale, D)
    if k_prefix is not None:
        if check_key_prefix(k_prefix, k_hat, settings.d) is not k_prefix:
            raise ValueError("k_prefix must be contiguous in its last dim (the plan keeps its address)")
    if out is not None and (out.shape != (B, num_q_heads, D) or out.dtype != k_hat.dtype
                            or out.device != k_hat.device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {k_hat.dtype} tensor [B, HQ, D]=[{B}, {num_q_heads}, {D}] on "
                         f"{k_hat.device}")
    return DecodeRun(settings, scale=scale, bound=(k_hat, v_cache, k_prefix, out, (B, num_q_heads, D)))

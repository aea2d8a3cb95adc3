"""The step plan: what was decided for one forward, built once by the decoder's pre-hook before the layers run and
read by every layer (the plan/run split of FlashInfer's decode wrappers, vLLM's per-step attention-metadata
builder): each layer's row ranges, the decode step's budgets and selection width, and the runner of its decode
steps (the kernels or the PyTorch reference: ``run.run_decode``).

What each query row sees is decided here, from what the caller knows: the 2-D attention mask (``[B, M]``, 1 =
token, 0 = padding; absent = every token is valid), the positions of the new tokens in the cache (the cache's
own write counter: ``past = cache.get_seq_length()``, a device tensor for a static cache) and each layer's key
length and offset (``cache.get_mask_sizes``) and sliding window.  Row ``i`` of sequence ``b``, at absolute
position ``p_i = past + i``, sees the tokens ``a`` with

    first_b <= a < end_b,   a <= p_i,   a > p_i - W (sliding layers only),

where ``[first_b, end_b)`` is the span of the sequence's 1s in the mask (left padding before it; a mask with
holes is refused).  In the keys a layer receives, token ``a`` sits at ``a - kv_offset``.  A missing mask never
means "every slot visible": the slots of a static cache past the written tokens are outside every row's range.
No layer reconstructs ranges from a 4-D mask (a 4-D mask the caller passes explicitly is read here, once).

For a decode step (L = 1) the plan also holds each sequence's budget (``loki._checks.budget_counts``, the one
budget rule) and the selection width (``loki.kernels.selection_width``), and which runner the step takes
(:class:`Runner`, decided here once for every layer: the kernels for method "loki" where
``ResolvedSettings.use_kernels`` says so, the reference otherwise).  Eager forwards check the mask, the static
cache's bounds and batch with one host sync; compiled forwards trace the same tensor ops (no sync).

Shape letters: B batch, L query length, M 2-D mask length, S key length of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from loki._checks import CacheOverflowError, budget_counts, triton_interpreting
from loki.kernels.decode import selection_width
from loki.settings import Backend, Method, ResolvedSettings

from .state import LokiError

__all__ = ["LayerRanges", "Runner", "StepPlan", "build_step_plan", "direct_plan", "ranges_from_mask"]


class Runner(Enum):
    """The two routes of a decode step: the Triton kernels (eager and replayed by the model's ``DecodeRun``, or
    the ``loki::decode_step`` op inside a compiled graph) and the PyTorch reference of the method."""

    KERNELS = "kernels"
    REFERENCE = "reference"


@dataclass(eq=False)
class LayerRanges:
    """What the query rows of one forward see in the keys of one group of layers (same key length, offset and
    window).  starts, lengths: [B, L] int64, row (b, i) sees keys ``starts <= s < lengths``; ``any_``: [B, L]
    bool, rows that see at least one token (the others give zeros; their range is a harmless [0, 1)).
    Decode steps (L = 1) also carry ``dec_starts``/``dec_lengths`` ([B] int32), ``counts`` ([B] int64, the
    tokens each sequence attends) and ``width`` (an int bound on every count, a multiple of 16)."""

    S: int
    starts: torch.Tensor
    lengths: torch.Tensor
    any_: torch.Tensor
    window: int | None = None
    dec_starts: torch.Tensor | None = None
    dec_lengths: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    width: int = 0
    _allowed: torch.Tensor | None = field(default=None, repr=False)
    _moved: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> LayerRanges:
        """These ranges on ``device`` (a model split over devices: moved once per device and forward)."""
        if self.starts.device == device:
            return self
        moved = self._moved.get(device)
        if moved is None:
            mv = (lambda t: None if t is None else t.to(device))  # noqa: E731
            moved = LayerRanges(self.S, mv(self.starts), mv(self.lengths), mv(self.any_), self.window,
                                mv(self.dec_starts), mv(self.dec_lengths), mv(self.counts), self.width)
            self._moved[device] = moved
        return moved

    def allowed(self) -> torch.Tensor:
        """[B, L, S] bool: True where a row may attend to a key (built once per group, on demand)."""
        if self._allowed is None:
            pos = torch.arange(self.S, device=self.starts.device)
            self._allowed = (pos >= self.starts[..., None]) & (pos < self.lengths[..., None]) & self.any_[..., None]
        return self._allowed


@dataclass(eq=False)
class StepPlan:
    """What was decided for one forward: the row ranges of every layer (``layer(idx)``), the query length ``L``, the
    settings, and the ``runner`` of its decode steps (:class:`Runner`)."""

    settings: ResolvedSettings
    groups: list
    layer_group: list | None  # the group of each layer (None: one group for every layer, a direct call)
    L: int
    runner: Runner
    stores: list = field(default_factory=list)  # each layer's ``LayerStore`` of the Loki cache, or None
    static: bool = False  # the cache is a Loki static cache

    def layer(self, idx: int, S: int) -> LayerRanges:
        """The ranges of layer ``idx``, whose keys have length ``S`` (checked against the plan)."""
        if self.layer_group is None:
            g = self.groups[0]
        else:
            g = self.groups[self.layer_group[idx]] if idx < len(self.layer_group) else None
        if g is None or g.S != S:
            raise LokiError(
                f"layer {idx} received {S} keys but the forward was planned for "
                f"{None if g is None else g.S}: the KV cache was changed during the forward (or the layer ran "
                "outside the model's forward)")
        return g


def _mask_span(mask2d: torch.Tensor, B: int):
    """first, end ([B] int64) of the 1s of a [B, M] mask, has ([B] bool, the sequence has a token), the count of
    1s ([B]), and M."""
    m = mask2d.to(torch.bool)
    if m.shape[0] != B:
        m = m.expand(B, m.shape[-1])
    M = m.shape[-1]
    mi = m.to(torch.int32)
    has = m.any(-1)
    first = mi.argmax(-1).long()
    end = M - mi.flip(-1).argmax(-1).long()
    first = torch.where(has, first, 0)
    end = torch.where(has, end, 0)
    return first, end, has, mi.sum(-1).long(), M


def ranges_from_mask(mask4d: torch.Tensor, B: int, L: int, S: int):
    """starts, lengths, any_ ([B, L]) of an explicit [B, 1, L, S] mask (bool, True = attend, or additive float);
    every row's visible tokens must be one contiguous range (checked, one host sync)."""
    m = mask4d
    if m.dim() != 4 or m.shape[1] != 1:
        raise LokiError(f"expected a [B, 1, L, S] attention mask, got shape {list(m.shape)}")
    m = m[:, 0]
    if m.dtype != torch.bool:
        m = m == 0  # additive float mask: 0 = attend
    if m.shape[-1] != S:
        raise LokiError(f"the 4-D attention mask covers {m.shape[-1]} keys but the layers see {S}")
    m = m.expand(B, L, S)
    pos = torch.arange(S, device=m.device)
    any_ = m.any(-1)
    starts = torch.where(m, pos, S).amin(-1)
    lengths = torch.where(m, pos + 1, 0).amax(-1)
    if not torch.compiler.is_compiling() and bool(((lengths - starts != m.sum(-1)) & any_).any()):
        raise LokiError(_HOLES)
    return torch.where(any_, starts, 0), torch.where(any_, lengths, 1), any_


_HOLES = ("Loki needs each query's visible tokens to be one contiguous range, and the attention mask has holes. "
          "Pad batches on the left (tokenizer.padding_side='left'): with right padding, the tokens generated after a "
          "padded prompt leave the padding in the middle of the sequence")


def choose_runner(settings: ResolvedSettings, L: int, device, needs_grad: bool, has_cache: bool) -> Runner:
    """The runner of a forward's decode steps: the kernels for method "loki" (one query row per sequence, keys in a
    Loki cache) where the settings let them run on ``device`` (``ResolvedSettings.use_kernels``), the reference
    otherwise.  Backend "triton" on a device the kernels cannot take, or with autograd recording, is an error
    naming the setting."""
    if settings.method is not Method.LOKI or L != 1 or not has_cache:
        return Runner.REFERENCE
    cuda = torch.device(device).type == "cuda"
    if settings.backend is Backend.TRITON:
        if not cuda and not triton_interpreting():
            raise LokiError(f"enable_loki(backend='triton') needs CUDA tensors (got {device}); on CPU set "
                            "TRITON_INTERPRET=1 before importing triton, or use backend='torch'")
        if needs_grad:
            raise LokiError("query requires grad, but Loki's Triton decode step (enable_loki(backend='triton')) has "
                            "no backward (its output would carry no gradient); run it under torch.no_grad() or on "
                            "detached tensors, or use backend='torch' (differentiable)")
    return Runner.KERNELS if settings.use_kernels(cuda=cuda, needs_grad=needs_grad) else Runner.REFERENCE


def build_step_plan(*, settings: ResolvedSettings, B: int, L: int, device, cache, attention_mask, windows,
                    num_layers: int, needs_grad: bool) -> StepPlan:
    """The step plan of one forward (see the module docstring).

    ``settings``: the enabled model's; ``cache``: the transformers Cache of the forward or None;
    ``attention_mask``: the 2-D mask the caller passed, a 4-D mask, or None; ``windows``: each layer's sliding
    window (None for full attention); ``needs_grad``: autograd records this forward.  A Loki static cache's
    allocation (``max_cache_len``, and ``batch_size`` once allocated) bounds the forward.
    """
    from .layers import LokiStaticLayer

    k = settings.k
    compiling = torch.compiler.is_compiling()
    layers = [] if cache is None else cache.layers  # an adopted cache: every layer is a Loki layer
    stores = [layer.loki for layer in layers[:num_layers]]
    static = layers[0] if layers and isinstance(layers[0], LokiStaticLayer) else None
    static_len = None if static is None else static.max_cache_len
    if static is not None and getattr(static, "is_initialized", False) and static.keys.shape[0] != B:
        raise CacheOverflowError(f"the batch has {B} sequences but the static cache was allocated for batch_size="
                                 f"{static.keys.shape[0]}: make the cache with batch_size={B}")
    past = 0 if cache is None else cache.get_seq_length()
    q_pos = torch.arange(L, device=device) + (past.to(device) if isinstance(past, torch.Tensor) else int(past))
    mask4d = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 else None
    span = None
    if attention_mask is not None and mask4d is None:
        if attention_mask.dim() != 2:
            raise LokiError(f"expected a [B, M] (2-D) or [B, 1, L, S] (4-D) attention mask, got shape "
                            f"{list(attention_mask.shape)}")
        span = _mask_span(attention_mask.to(device), B)

    if not compiling and L:
        # the eager checks, one host sync for all of them: (condition, the error when it does not hold)
        last = q_pos[-1]
        checks = []
        if span is not None:
            first, end, has, count, M = span
            checks.append((((count == end - first) | ~has).all(), lambda: LokiError(_HOLES)))
            checks.append((last < M, lambda: LokiError(
                f"the attention mask covers {M} tokens but the forward writes tokens up to position {int(last)}: "
                "pass the mask of every token so far (prompt and generated)")))
        if static_len is not None:
            checks.append((last < static_len, lambda: CacheOverflowError(
                f"the static cache holds max_cache_len={static_len} tokens but this forward writes position "
                f"{int(last)} (the prompt and every generated token must fit: make the cache with "
                f"max_cache_len >= {int(last) + 1})")))
        if checks:
            ok = torch.stack([c.reshape(()).to(torch.bool) for c, _ in checks]).tolist()
            for good, (_, error) in zip(ok, checks):
                if not good:
                    raise error()
    elif static_len is not None and L and q_pos.is_cuda:
        torch._assert_async(q_pos[-1] < static_len, "Loki static cache: max_cache_len exceeded")

    groups, layer_group, index = [], [], {}
    for idx in range(num_layers):
        if cache is not None:
            kv_len, kv_off = cache.get_mask_sizes(L, idx)
        else:
            kv_len, kv_off = L, 0
        w = windows[idx] if idx < len(windows) else None
        key = (int(kv_len), int(kv_off), w)
        if key not in index:
            index[key] = len(groups)
            groups.append(_group(key, k, B, L, device, q_pos, span, mask4d))
        layer_group.append(index[key])
    runner = choose_runner(settings, L, device, needs_grad, has_cache=len(stores) > 0)
    return StepPlan(settings, groups, layer_group, L, runner, stores, static is not None)


def _group(key, k, B, L, device, q_pos, span, mask4d) -> LayerRanges:
    S, off, window = key
    if mask4d is not None:
        starts, lengths, any_ = ranges_from_mask(mask4d, B, L, S)
        starts, lengths = starts.long(), lengths.long()
    else:
        hi = (q_pos + 1)[None, :].expand(B, L)
        lo = torch.zeros(B, L, dtype=torch.long, device=device)
        if span is not None:
            first, end = span[0], span[1]
            lo = lo + first[:, None]
            hi = torch.minimum(hi, end[:, None])
        if window is not None:
            lo = torch.maximum(lo, (q_pos - window + 1)[None, :])
        lo = (lo - off).clamp(0, S)
        hi = (hi - off).clamp(0, S)
        any_ = hi > lo
        starts = torch.where(any_, lo, 0)
        lengths = torch.where(any_, hi, 1)
    g = LayerRanges(S=S, starts=starts, lengths=lengths, any_=any_, window=window)
    if L == 1:
        g.dec_starts = starts[:, 0].to(torch.int32)
        g.dec_lengths = lengths[:, 0].to(torch.int32)
        g.counts = budget_counts(k, lengths[:, 0] - starts[:, 0])
        g.width = selection_width(k, S)
    return g


def direct_plan(settings: ResolvedSettings, *, B: int, L: int, S: int, device, attention_mask,
                window=None) -> StepPlan:
    """The plan of an attention call made outside a model forward (no cache, no step plan): an explicit 4-D mask
    is read as given; without one, the L query rows are the last L of the S keys and every key is valid (the
    layout of a dynamic cache).  A static cache is never read this way (its unwritten slots would be visible).
    Such calls run the reference."""
    mask4d = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    q_pos = torch.arange(L, device=device) + (S - L)
    g = _group((S, 0, window), settings.k, B, L, device, q_pos, None, mask4d)
    return StepPlan(settings, [g], None, L, Runner.REFERENCE)

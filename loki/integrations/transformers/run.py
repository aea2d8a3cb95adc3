"""One decode step of an enabled model: :func:`run_decode`, the one function every decode step (one query row per
sequence) of every cache goes through, by one of the two routes the step plan chose (:class:`~.step.Runner`):

- the kernels (method "loki"): the query rotated by ``loki::rotate_query`` (one Triton kernel), then the step's
  launches, eager through the model's :class:`~loki.kernels.plan.DecodeRun` (``plan_decode``'s object: recorded at a
  signature's second call, replayed from the third), or inside a compiled graph as the ``loki::decode_step`` op;
- the PyTorch reference of the method (``loki.reference``), with the same budgets.  Inside a compiled CUDA step it
  runs eagerly outside the graph (:func:`reference_outside_graph`); on the CPU a compiled Loki step (native or int8
  copy) calls it through the ``loki::decode_step`` op, whose CPU registration it is.

What each row sees and its budget come from the step plan (``ranges``); the keys are stored in the basis by the
cache layer (``store``: its :class:`~.layers.LayerStore`).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length, D head dim.
"""

from __future__ import annotations

import torch

from loki.kernels.ops import decode_step_op
from loki.kernels.plan import DecodeRun
from loki.kernels.rotate import rotate_query_op
from loki.reference import rotate_keys, rotate_query
from loki.reference.dispatch import decode_rows
from loki.settings import Backend, Method, ScoreFormat

from .state import LokiError, LokiState
from .step import LayerRanges, Runner, StepPlan

__all__ = ["check_compiled_backend", "reference_outside_graph", "rotate_rows", "run_decode"]


def rotate_rows(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """x: [B, HQ, L, D] -> x P per KV head (query heads of a group share their KV head's transform); the
    reference rotation (prefill and teacher-forced rows)."""
    B, HQ, L, D = x.shape
    flat = x.transpose(1, 2).reshape(B * L, HQ, D)
    return rotate_query(flat, P).reshape(B, L, HQ, D).transpose(1, 2)


def run_decode(state: LokiState, plan: StepPlan, ranges: LayerRanges, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, *, store, transforms, keys_rotated: bool, scale: float) -> torch.Tensor:
    """One decode step: query [B, HQ, 1, D] (post-rotary, its own coordinates), key, value [B, HKV, S, D] (keys in
    the basis when ``keys_rotated``), the layer's ranges and budgets, the layer's store (its
    :class:`~.layers.LayerStore`, None without a Loki cache) and transforms.  Returns [B, 1, HQ, D] in query's
    dtype; rows that see no token give zeros."""
    kernels = plan.runner is Runner.KERNELS
    if kernels:
        if not keys_rotated:
            raise LokiError("Loki's kernels read keys stored in the basis: decode with a cache (use_cache=True)")
        q_hat = rotate_query_op(query[:, :, 0], transforms.query)
        out = _kernels(state, plan, ranges, q_hat, key, value, store, scale)
    else:
        out = _reference(state, plan, ranges, query, key, value, store, transforms, keys_rotated, scale)
    out = out.to(query.dtype).masked_fill(~ranges.any_[:, 0, None, None], 0)
    return out[:, None]


def _int8_copy_in_step(store, S: int) -> bool:
    """Whether ``store`` holds an int8 score copy (codes and scales) of all S keys."""
    return (store is not None and store.prefix is not None and store.prefix_scale is not None
            and store.prefix.dtype == torch.int8 and store.prefix.shape[-2] == S and store.prefix_scale.shape[-1] == S)


def _kernels(state, plan, g: LayerRanges, q_hat, key, value, store, scale):
    s = plan.settings
    S = key.shape[2]
    fmt = s.score_format.value
    prefix, prefix_scale = (None, None) if store is None else (store.prefix, store.prefix_scale)
    if fmt == "int8":
        if not _int8_copy_in_step(store, S):
            # no int8 copy of every key (a cache that keeps none, or one edited outside Loki): the scores kernel
            # rounds the keys' first d dims as it reads them, the same scores as the copy would give
            prefix, prefix_scale = None, None
    else:
        prefix_scale = None
        if prefix is not None and (prefix.shape[-2] != S or prefix.dtype == torch.int8):
            prefix = None  # out of step with the keys (a cache edited outside Loki): the kernels read them in place
    if torch.compiler.is_compiling() or (q_hat.is_cuda and torch.cuda.is_current_stream_capturing()):
        return decode_step_op(q_hat, key, value, prefix, g.dec_lengths, g.dec_starts, g.counts, s.d, g.width,
                              s.gqa_select.value, s.aggregate.value, float(scale), prefix_scale, fmt)
    run = state.decode_run
    if run is None or run.scale != float(scale):
        run = state.decode_run = DecodeRun(s, scale=scale)
    return run.step(q_hat=q_hat, k_hat=key, v_cache=value, k_prefix=prefix, lengths=g.dec_lengths,
                    starts=g.dec_starts, counts=g.counts, width=g.width, prefix_scale=prefix_scale)


def _reference(state, plan, g: LayerRanges, query, key, value, store, transforms, keys_rotated, scale):
    s = plan.settings
    if s.method.needs_basis:
        q = rotate_query(query[:, :, 0], transforms.query)
        if not keys_rotated:
            key = rotate_keys(key, transforms.key)
    elif keys_rotated:
        q = rotate_query(query[:, :, 0], transforms.query)  # Lemma 1: exact scores are the same in the basis
    else:
        q = query[:, :, 0]
    if s.method is Method.SPARQ and keys_rotated:
        raise LokiError("SparQ works in the keys' own coordinates; its cache must not store keys in a basis")
    kw = dict(k=s.k, d=s.d, lengths=g.dec_lengths, starts=g.dec_starts, gqa_select=s.gqa_select.value,
              aggregate=s.aggregate.value, scale=scale, counts=g.counts if s.method is Method.LOKI else None,
              **s.reference_args())
    if s.method is Method.H2O:
        return _h2o_step(s, q, key, value, store, kw)
    if torch.compiler.is_compiling():
        opaque = s.score_format in (ScoreFormat.NATIVE, ScoreFormat.INT8)  # the formats the op's reference takes
        if s.method is Method.LOKI and not query.is_cuda and opaque:
            # a compiled CPU step: the reference as one opaque op (the op's CPU registration)
            return decode_step_op(q, key, value, None, g.dec_lengths, g.dec_starts, g.counts, s.d, g.width,
                                  s.gqa_select.value, s.aggregate.value, float(scale),
                                  score_format=s.score_format.value)
        if query.is_cuda or not opaque:
            return reference_outside_graph(state, True, decode_rows, s.method.value, q, key, value, **kw)
    return decode_rows(s.method.value, q, key, value, **kw)


def _h2o_step(s, q, key, value, store, kw):
    if store is None:
        raise LokiError("method='h2o' needs a KV cache (use_cache=True)")
    B, HQ = q.shape[:2]
    S = key.shape[2]
    acc = store.acc
    if acc is None or acc.shape[-1] > S:
        acc = torch.zeros(B, HQ, S, device=q.device, dtype=torch.float32)
    elif acc.shape[-1] < S:
        acc = torch.nn.functional.pad(acc, (0, S - acc.shape[-1]))
    kw = dict(kw, recent_fraction=s.h2o_recent_fraction, acc=acc)
    kw.pop("counts")
    out, w = decode_rows("h2o", q, key, value, **kw)
    store.acc = acc + w
    return out


def check_compiled_backend(backend, device, where: str) -> None:
    """Refuse, before compiling, a whole-graph (``fullgraph=True``) CUDA decode step on ``backend="torch"``:
    its PyTorch reference runs outside the compiled graph (:func:`reference_outside_graph`), which a whole graph
    cannot hold."""
    if Backend.parse(backend, "backend") is Backend.TORCH and torch.device(device).type == "cuda":
        raise ValueError(f"{where}: backend='torch' runs Loki's PyTorch reference, which a compiled CUDA step runs "
                         "eagerly outside its graph, so a whole-graph (fullgraph) compilation cannot hold it: use "
                         "backend='auto' or 'triton' (the kernels), or compile=False")


@torch.compiler.disable
def reference_outside_graph(state: LokiState, compiling: bool, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a PyTorch reference step on CUDA, run eagerly: under ``torch.compile`` the step
    breaks its graph here instead of tracing the reference (Inductor does not compile it; a refusal raised while
    tracing would not reach the user either: Dynamo breaks the graph on the raise and reruns the frame eagerly).
    ``compiling``: whether the caller was being traced; the first such call warns once per enabled model
    (``state``) that the compiled step is not the kernels'.  Same result as eager decoding."""
    if compiling:
        s = state.settings
        if s.score_format.reference_only:
            why = f"score_format={s.score_format.value!r}, which the kernels do not read"
        elif s.backend is Backend.TORCH:
            why = "backend='torch'"
        elif s.method is not Method.LOKI:
            why = f"method={s.method.value!r}, which has no kernels"
        else:
            why = f"backend={s.backend.value!r} with autograd recording (the Triton kernels have no backward)"
            if s.int8_prefix:
                why += ", or score_format='int8' with no int8 copy of the keys in step with the cache"
        state.warn_once("reference", (
            f"Loki's decode step runs the PyTorch reference ({why}): inside torch.compile it runs eagerly, outside "
            "the compiled graph and any CUDA graph, so the step is much slower than the kernels' (results are the "
            "same). Decode under torch.no_grad() (as generate does) with backend='auto' or 'triton' on a static "
            "cache for the compiled kernels"), stacklevel=4)
    return fn(*args, **kwargs)

"""Loki on a model split over several devices.

Tensor parallelism (transformers' ``tp_plan="auto"`` under ``torchrun``): each rank's attention modules hold a
slice of the heads, ``k_proj`` sharded by rows, so the keys a rank caches and attends over are those of its KV
heads ``[h0, h1)``.  :func:`local_bases` cuts the basis (``components`` and the score basis' ``query_components``,
``[L, HKV, D, D]``) to ``[:, h0:h1]``; everything built from it (the cache rotation ``K P``, the key prefix of the
Triton path, the query transform) is then per rank.  The slice is read from the attention modules themselves:
the rows of the local ``k_proj`` weight (a ``DTensor``'s local shard and its global offset, or a plain
tensor's rows with the rank in the tensor-parallel group) against ``num_key_value_heads`` of the config.

Layers spread over devices (``device_map="auto"``): the basis of a layer is moved to the device of the tensors
it meets, once per device (:meth:`~loki.integrations.transformers.state.Transforms.layer`, and the cache layer's
store, :meth:`~loki.integrations.transformers.layers.LayerStore.to`), so nothing here is needed for it.

Shape letters: L decoder layers, HQ query heads, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from loki._distributed import world
from loki._hf import attention_modules, config_head_dim, config_kv_heads, text_config

from .state import LokiError

__all__ = ["kv_head_range", "local_bases"]


def _local_rows(weight: torch.Tensor) -> tuple[int, int | None]:
    """(rows held by this rank, global index of its first row or None when the weight does not say)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()
    if isinstance(weight, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        return int(shape[0]), int(offset[0])
    return int(weight.shape[0]), None


def kv_head_range(module, num_kv_heads: int, head_dim: int, tp_size: int | None = None) -> tuple[int, int]:
    """The KV heads ``[h0, h1)`` an attention module holds on this rank (``(0, HKV)`` unsharded)."""
    name = f"{type(module).__name__} of layer {getattr(module, 'layer_idx', '?')}"
    rows, offset = _local_rows(module.k_proj.weight)
    q_rows, _ = _local_rows(module.q_proj.weight)
    if rows % head_dim or q_rows % head_dim:
        raise LokiError(f"{name}: k_proj holds {rows} rows and q_proj {q_rows}, not whole heads of D={head_dim}: "
                        "Loki needs the heads split whole across tensor-parallel ranks")
    n = rows // head_dim
    if n == num_kv_heads:
        return 0, n
    if offset is None:
        rank, size = world()
        tp = tp_size or (num_kv_heads // n if num_kv_heads % n == 0 else None)
        if size == 1 or tp is None or size % tp:
            raise LokiError(
                f"{name}: k_proj holds {n} of the model's {num_kv_heads} KV heads, but which ones cannot be "
                f"determined (process group of {size} process(es), tensor-parallel size {tp}): enable Loki after "
                "loading the model with tp_plan='auto' under torchrun"
            )
        offset = (rank % tp) * rows
    if offset % head_dim:
        raise LokiError(f"{name}: this rank's k_proj rows start at {offset}, inside a head of D={head_dim}")
    h0 = offset // head_dim
    return h0, h0 + n


def local_bases(model, components: torch.Tensor | None, query_components: torch.Tensor | None):
    """``(components, query_components)`` cut to the KV heads this rank's attention modules hold (unchanged for
    a model that is not tensor-parallel).  ``LokiError`` when the layers hold different heads or the query heads
    of a rank are not the groups of its KV heads."""
    if components is None:
        return components, query_components
    config = text_config(model.config)
    HKV, D = config_kv_heads(config), config_head_dim(config)
    HQ = int(config.num_attention_heads)
    tp_size = getattr(model, "_tp_size", None) or None
    ranges = set()
    for m in attention_modules(model):
        h0, h1 = kv_head_range(m, HKV, D, tp_size)
        hq = _local_rows(m.q_proj.weight)[0] // D
        if hq * HKV != HQ * (h1 - h0):
            raise LokiError(f"layer {m.layer_idx} holds {hq} query heads for {h1 - h0} KV heads on this rank; Loki "
                            f"needs whole groups of {HQ // HKV} query heads per KV head")
        ranges.add((h0, h1))
    if len(ranges) != 1:
        raise LokiError(f"the layers of this rank hold different KV heads {sorted(ranges)}: Loki needs every layer "
                        "split the same way")
    h0, h1 = ranges.pop()
    if (h0, h1) == (0, HKV):
        return components, query_components
    cut = lambda t: None if t is None else t[:, h0:h1].contiguous()  # noqa: E731
    return cut(components), cut(query_components)

"""One streaming pass over calibration batches that fills every statistic a basis needs.

Shape letters: B batch, S sequence length, L decoder layers, HQ query heads, HKV key/value heads
(G = HQ // HKV), D head dim, N real tokens.

Per forward pass, a temporary attention function (:class:`~loki.calibration.hooks.AttentionRecorder`) sees
every layer's post-rotary queries and keys, and forward hooks on ``k_proj`` (or ``k_norm``) see the pre-rotary
keys.  They are added to float64 :class:`~loki.calibration.stats.KeyStatistics` at once and dropped: nothing of
size ``S x S`` or ``L x S`` outlives one layer, so calibration sequences can be as long as the model's context.

Positions.  Post-rotary keys depend on their absolute position, so a basis describes the positions it was fitted
on.  ``max_positions`` says which positions to cover.  Sequences shorter than that are placed at offsets spread
evenly over ``[0, max_positions - S]`` (rotary attention depends on relative positions only, so a shifted
sequence computes the same hidden states and its keys are those of the later positions).  Sequences of length
``max_positions`` cover every position themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from loki._distributed import world
from loki._hf import text_config

from .channels import channel_contributions
from .hooks import AttentionRecorder, PreRotaryKeyHooks, key_layout, positions_from_mask
from .stats import KeyStatistics

__all__ = ["STATISTICS", "budgeted_batches", "collect_statistics", "position_offset"]

#: Statistics :func:`collect_statistics` can fill: pre- and post-rotary keys, post-rotary queries (per KV head,
#: the group's query heads pooled), post-rotary queries per query head ("query-heads"), and the channel contributions
#: ``|q_j k_j|`` of a token's query and key, per KV head with the group's query heads averaged ("channels": Double
#: Sparsity's label channels, :mod:`loki.calibration.channels`).
STATISTICS = ("pre", "post", "query", "query-heads", "channels")

_GOLDEN = 0.6180339887498949


def position_offset(index: int, seq_len: int, max_positions: int | None) -> int:
    """The first position of the ``index``-th calibration sequence of ``seq_len`` tokens: 0 when the sequence
    covers ``max_positions`` (or none is given), else a low-discrepancy point of ``[0, max_positions - seq_len]``
    (the golden-ratio sequence), so any number of sequences spreads evenly over the positions."""
    if max_positions is None or seq_len >= max_positions:
        return 0
    return int(((index * _GOLDEN) % 1.0) * (max_positions - seq_len + 1))


def _as_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, Mapping):
        return torch.as_tensor(batch["input_ids"]), (
            torch.as_tensor(batch["attention_mask"]) if batch.get("attention_mask") is not None else None
        )
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(b) for b in batch):
        return batch[0], batch[1]
    ids = torch.as_tensor(batch)
    if ids.ndim == 1:
        ids = ids[None]
    return ids, None


def budgeted_batches(batches: Iterable, num_tokens: int | None, device) -> Iterator:
    """``(input_ids [B, S], attention_mask [B, S], take)`` on ``device`` for every batch with real tokens, where
    ``take`` is how many of its real tokens (row-major) still fit the budget; stops once ``num_tokens`` real
    tokens were handed out (``None``: no budget)."""
    seen = 0
    for batch in batches:
        if num_tokens is not None and seen >= num_tokens:
            return
        input_ids, mask = _as_batch(batch)
        if mask is None:
            mask = torch.ones_like(input_ids)
        n = int(mask.sum())
        if n == 0:
            continue
        take = n if num_tokens is None else min(n, num_tokens - seen)
        yield input_ids.to(device), mask.to(device), take
        seen += take


def _model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


@torch.no_grad()
def collect_statistics(
    model: nn.Module,
    batches: Iterable,
    *,
    kinds: Iterable[str] = STATISTICS,
    num_tokens: int | None = None,
    max_positions: int | None = None,
    progress: bool = True,
    desc: str = "calibrating",
) -> dict[str, KeyStatistics]:
    """Stream ``kinds`` statistics of ``model`` over ``batches`` (one forward pass per batch).

    ``batches``: ``input_ids [B, S]`` tensors, ``(input_ids, attention_mask)`` pairs or mappings (0 = padding,
    left or right).  ``num_tokens``: budget of real tokens (the last batch is truncated, row-major);
    ``max_positions``: the positions to cover (module docstring), ``None`` = each sequence from position 0.
    Returns ``{kind: KeyStatistics}``; "query" statistics are per KV head with the group pooled (``count`` =
    tokens x G), "query-heads" per query head ([L, HQ, ...]), "channels" per KV head (the vectors ``|q_j k_j|``
    of :func:`~loki.calibration.channels.channel_contributions`, one per token).

    In an initialised ``torch.distributed`` group of several processes, each rank runs the forward passes of its
    share of the batches (every rank must be given the same ``batches``) and every rank returns the statistics of
    all of them, equal to a single-process run bit for bit (:mod:`loki.calibration.distributed`).
    """
    kinds = tuple(dict.fromkeys(kinds))
    bad = [k for k in kinds if k not in STATISTICS]
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {STATISTICS}, got {kinds!r}")
    layout = key_layout(model)
    L, HKV, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    HQ = int(text_config(model.config).num_attention_heads)

    def new_stats():
        return {k: KeyStatistics(L, HQ if k == "query-heads" else HKV, D) for k in kinds}

    stats = new_stats()
    state = {"valid": None, "take": 0, "into": stats}

    def record(layer, query, key):
        valid, take, stats = state["valid"], state["take"], state["into"]
        if "post" in stats:
            stats["post"].update(layer, key.transpose(1, 2)[valid][:take])  # [N, HKV, D]
        if "query" in stats:
            q = query.transpose(1, 2)[valid][:take]  # [N, HQ, D]
            G = q.shape[1] // HKV
            stats["query"].update(layer, q.reshape(-1, HKV, G, D).transpose(1, 2).reshape(-1, HKV, D))
        if "query-heads" in stats:
            stats["query-heads"].update(layer, query.transpose(1, 2)[valid][:take])  # [N, HQ, D]
        if "channels" in stats:
            stats["channels"].update(layer, channel_contributions(query.transpose(1, 2)[valid][:take],
                                                                  key.transpose(1, 2)[valid][:take]))

    rec = AttentionRecorder(model, record) if {"post", "query", "query-heads", "channels"} & set(stats) else None
    pre = PreRotaryKeyHooks(layout) if "pre" in stats else None
    was_training = model.training
    model.eval()
    from tqdm.auto import tqdm

    plan = budgeted_batches(batches, num_tokens, _model_device(model))
    chain = None
    if world().size > 1:
        from .distributed import ChainReduction

        plan = list(plan)
        chain = ChainReduction(plan)
    bar = tqdm(total=num_tokens, unit="tok", desc=desc, disable=not progress or world().rank != 0)
    seen = index = 0
    try:
        if rec is not None:
            rec.__enter__()
        if pre is not None:
            pre.__enter__()
        for i, (ids, mask, take) in enumerate(plan):
            if chain is not None and not chain.owns(i):
                index += ids.shape[0]
                seen += take
                bar.update(take)
                continue
            into = stats if chain is None else new_stats()
            state["into"] = into
            valid = mask.bool()
            positions = positions_from_mask(mask)
            S = ids.shape[1]
            offsets = [position_offset(index + b, S, max_positions) for b in range(ids.shape[0])]
            index += ids.shape[0]
            positions = positions + torch.tensor(offsets, device=positions.device)[:, None]
            state["valid"], state["take"] = valid, take
            if rec is not None:
                rec.valid = None if bool(valid.all()) else valid
            layout.base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
            if pre is not None:
                for layer, k in enumerate(pre.keys):
                    if k is None:
                        raise RuntimeError(f"the pre-rotary key hook did not fire for layer {layer}")
                    into["pre"].update(layer, k[valid][:take])
                pre.clear()
            if chain is not None:
                chain.add(stats, into, i)
            seen += take
            bar.update(take)
    finally:
        bar.close()
        if pre is not None:
            pre.__exit__(None, None, None)
        if rec is not None:
            rec.__exit__(None, None, None)
        model.train(was_training)
    if chain is not None:
        chain.finish(stats)
    if seen == 0:
        raise ValueError("batches contained no tokens (every attention_mask entry was 0, or no batches)")
    return stats

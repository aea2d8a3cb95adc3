"""Calibration: stream a model's keys over a corpus into statistics and fit :class:`~loki.basis.PCABasis`.

Shape letters: B = batch, S = sequence length, L = decoder layers, HKV = key/value heads, D = head dim,
N = real (unpadded) tokens.

Only real tokens (``attention_mask == 1``) are counted.  Calibration stops as soon as ``num_tokens`` tokens have
been seen; the last batch is truncated (its first real tokens in row-major order are kept).  Pre- and
post-rotary statistics can come from the same forward pass (``rotary="both"``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from loki.basis import PCABasis, config_model_name
from loki.calibration.hooks import batch_keys, key_layout
from loki.calibration.stats import KeyStatistics

ROTARY_MODES = ("pre", "post", "both")
DEFAULT_NUM_TOKENS = 131_072
DEFAULT_SEQ_LEN = 1024
DEFAULT_BATCH_SIZE = 4


def _check_rotary(rotary: str) -> list[str]:
    if rotary not in ROTARY_MODES:
        raise ValueError(f"rotary must be one of {', '.join(ROTARY_MODES)}, got {rotary!r}")
    return ["pre", "post"] if rotary == "both" else [rotary]


def _check_positive(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


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


def _model_dtype(model: nn.Module) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except StopIteration:
        return torch.float32


@torch.no_grad()
def collect_key_statistics(
    model: nn.Module,
    batches: Iterable,
    *,
    rotary: str = "both",
    num_tokens: int | None = None,
    progress: bool = True,
    stats_device: torch.device | str = "cpu",
) -> dict[str, KeyStatistics]:
    """Stream keys of ``model`` over ``batches`` into float64 statistics, one forward pass per batch.

    Args:
        model: a Hugging Face causal LM with rotary embeddings (see :func:`~loki.calibration.hooks.key_layout`).
        batches: iterable of ``input_ids [B, S]`` tensors, ``(input_ids, attention_mask)`` pairs or mappings with
            ``input_ids`` and optionally ``attention_mask`` (``[B, S]``, 0 = padding, left or right).
        rotary: "pre", "post" or "both".
        num_tokens: token budget (real tokens); ``None`` consumes every batch.
        progress: show a tqdm bar (unit: tokens).
        stats_device: where the statistics live.

    Returns:
        ``{"pre": KeyStatistics, "post": KeyStatistics}`` restricted to the requested kinds.
    """
    kinds = _check_rotary(rotary)
    if num_tokens is not None:
        _check_positive("num_tokens", num_tokens, 1)
    layout = key_layout(model)
    was_training = model.training
    model.eval()
    device = _model_device(model)
    stats = {
        k: KeyStatistics(layout.num_layers, layout.num_kv_heads, layout.head_dim, device=stats_device) for k in kinds
    }
    from tqdm.auto import tqdm

    bar = tqdm(total=num_tokens, unit="tok", desc="calibrating keys", disable=not progress)
    seen = 0
    try:
        for input_ids, mask, take in budgeted_batches(batches, num_tokens, device):
            valid = mask.bool()
            keys = batch_keys(model, input_ids, mask, rotary=rotary, layout=layout)
            for kind in kinds:
                for l, k in enumerate(keys[kind]):
                    stats[kind].update(l, k[valid][:take])
            del keys
            seen += take
            bar.update(take)
    finally:
        bar.close()
        model.train(was_training)
    if seen == 0:
        raise ValueError("batches contained no tokens (every attention_mask entry was 0, or no batches)")
    return stats


def _items(data) -> Iterator:
    """Texts and 1-D token sequences of ``data`` (rows of 2-D tensors are separate sequences)."""
    if isinstance(data, str):
        yield data
        return
    if torch.is_tensor(data) and data.ndim == 1:
        yield data
        return
    for item in data:
        if isinstance(item, str):
            yield item
            continue
        t = torch.as_tensor(item)
        if t.ndim == 1:
            yield t
        elif t.ndim == 2:
            yield from t
        else:
            raise ValueError(f"token sequences must be [T] or [B, T], got {list(t.shape)}")


def iter_token_batches(
    data,
    *,
    tokenizer=None,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch_size: int = DEFAULT_BATCH_SIZE,
    num_tokens: int | None = None,
    pad_token_id: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Chunk ``data`` into batches ``(input_ids [B, S], attention_mask [B, S])`` with ``S <= seq_len``.

    ``data`` is a text, an iterable of texts (needs ``tokenizer``; they are tokenized without special tokens
    and concatenated into one stream, so short lines such as WikiText's fill whole sequences), a token tensor
    ``[T]`` / ``[B, T]`` or an iterable of token sequences (each chunked on its own).  A last chunk shorter than
    ``seq_len`` is kept (right-padded, masked) if it has at least 2 tokens.  Iteration stops once ``num_tokens``
    tokens have been emitted.
    """
    _check_positive("seq_len", seq_len, 2)
    _check_positive("batch_size", batch_size, 1)
    if num_tokens is not None:
        _check_positive("num_tokens", num_tokens, 1)
    emitted = 0
    pending: list[list[int]] = []

    def make_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        S = max(len(r) for r in rows)
        ids = torch.full((len(rows), S), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), S), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids, mask

    def chunks() -> Iterator[list[int]]:
        text: list[int] = []  # texts form one stream
        for item in _items(data):
            if isinstance(item, str):
                if tokenizer is None:
                    raise ValueError("tokenizer is required when data contains texts")
                if not item.strip():
                    continue
                text.extend(int(i) for i in tokenizer(item, add_special_tokens=False)["input_ids"])
                while len(text) >= seq_len:
                    yield text[:seq_len]
                    text = text[seq_len:]
            else:
                tokens = item.tolist()
                for start in range(0, len(tokens), seq_len):
                    piece = tokens[start : start + seq_len]
                    if len(piece) >= 2:
                        yield piece
        if len(text) >= 2:
            yield text

    for piece in chunks():
        if num_tokens is not None:
            piece = piece[: max(num_tokens - emitted, 2)]
        pending.append(piece)
        emitted += len(piece)
        if len(pending) == batch_size:
            yield make_batch(pending)
            pending = []
        if num_tokens is not None and emitted >= num_tokens:
            break
    if pending:
        yield make_batch(pending)


def calibrate(
    model: nn.Module,
    data,
    *,
    tokenizer=None,
    rotary: str = "post",
    num_tokens: int = DEFAULT_NUM_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch_size: int = DEFAULT_BATCH_SIZE,
    corpus_name: str | None = None,
    model_name: str | None = None,
    progress: bool = True,
    kind: str = "pca",
) -> PCABasis | dict[str, PCABasis]:
    """Fit the PCA basis of ``model``'s keys on ``data``.

    Args:
        model: a Hugging Face causal LM with rotary embeddings (Llama, Mistral, Qwen2, Qwen3, SmolLM, ...);
            run in eval mode under ``torch.no_grad()`` (its training flag is restored afterwards).
        data: texts (with ``tokenizer``), a token tensor ``[T]``/``[B, T]``, an iterable of token sequences, or an
            iterable of ready batches (``(input_ids, attention_mask)`` pairs / mappings); see
            :func:`iter_token_batches`.
        tokenizer: a Hugging Face tokenizer, required for texts.
        rotary: "post" (keys as cached, what Loki's decode kernels see), "pre" (before the rotary embedding)
            or "both" (one forward pass, two bases).
        num_tokens: token budget (real tokens); the last batch is truncated.
        seq_len: tokens per calibration sequence (>= 2).
        batch_size: sequences per forward pass.
        corpus_name: recorded in the basis metadata.
        model_name: recorded in the metadata (default: ``model.config.name_or_path`` or the model type).
        progress: show a tqdm progress bar.
        kind: "pca" (the paper's basis: PCA of the keys) or "score" (score-aware: the best rank-d approximation
            of the post-rotary scores q . k, from query and key statistics; see
            :mod:`loki.calibration.score_aware`; ``rotary`` must be "post").

    Returns:
        A :class:`PCABasis`, or ``{"pre": PCABasis, "post": PCABasis}`` for ``rotary="both"``.
    """
    kinds = _check_rotary(rotary)
    if kind not in ("pca", "score"):
        raise ValueError(f"kind must be 'pca' or 'score', got {kind!r}")
    if kind == "score" and rotary != "post":
        raise ValueError(f"a score-aware basis is fitted on post-rotary queries and keys: rotary must be 'post', "
                         f"got {rotary!r}")
    _check_positive("num_tokens", num_tokens, 1)
    _check_positive("seq_len", seq_len, 2)
    _check_positive("batch_size", batch_size, 1)
    key_layout(model)  # unsupported architectures fail before any tokenization

    if _is_batch_iterable(data):
        batches = data
    else:
        batches = iter_token_batches(
            data, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size, num_tokens=num_tokens
        )
    if kind == "score":
        from loki.calibration.score_aware import collect_score_statistics, score_aware_basis

        keys, queries = collect_score_statistics(model, batches, num_tokens=num_tokens, progress=progress)
        if keys.num_tokens < num_tokens:
            warnings.warn(f"data ran out after {keys.num_tokens} tokens; num_tokens={num_tokens} requested",
                          RuntimeWarning, stacklevel=2)
        return score_aware_basis(keys, queries, config=model.config, corpus=corpus_name, seq_len=seq_len,
                                 model_dtype=_model_dtype(model),
                                 model_name=model_name if model_name is not None else config_model_name(model.config))
    stats = collect_key_statistics(model, batches, rotary=rotary, num_tokens=num_tokens, progress=progress)
    seen = next(iter(stats.values())).num_tokens
    if seen < num_tokens:
        warnings.warn(
            f"data ran out after {seen} tokens; num_tokens={num_tokens} requested", RuntimeWarning, stacklevel=2
        )
    config = model.config
    bases = {
        kind: PCABasis.from_statistics(
            stats[kind],
            rotary=kind,
            config=config,
            model_name=model_name if model_name is not None else config_model_name(config),
            corpus=corpus_name,
            seq_len=seq_len,
            model_dtype=_model_dtype(model),
        )
        for kind in kinds
    }
    return bases if rotary == "both" else bases[rotary]


def _is_batch_iterable(data) -> bool:
    """Heuristic: a list/tuple whose first element is an ``(ids, mask)`` pair or a mapping is a batch list."""
    if isinstance(data, (list, tuple)) and data:
        first = data[0]
        if isinstance(first, Mapping):
            return True
        if isinstance(first, tuple) and len(first) == 2 and all(torch.is_tensor(t) for t in first):
            return True
    return False

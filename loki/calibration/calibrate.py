"""Calibration: stream a model's keys (and queries) over a corpus into statistics and fit :class:`~loki.basis.PCABasis`.

Shape letters: B = batch, S = sequence length, L = decoder layers, HKV = key/value heads, D = head dim,
N = real (unpadded) tokens.

Only real tokens (``attention_mask == 1``) are counted.  Calibration stops as soon as ``num_tokens`` tokens have
been seen; the last batch is truncated (its first real tokens in row-major order are kept).  Every basis asked
for (pre- and post-rotary PCA, score-aware) comes from the same forward passes
(:func:`~loki.calibration.collect.collect_statistics`).

Positions: a basis is fitted on the positions ``[0, max_positions)`` (default: the model's context length,
``config.max_position_embeddings``), which it records; calibration sequences are ``seq_len`` tokens long
(default ``max_positions``), and shorter ones are placed at offsets spread over the covered range.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from loki._hf import text_config
from loki.basis import PCABasis, config_model_name
from loki.calibration.channels import channel_basis
from loki.calibration.collect import collect_statistics
from loki.calibration.hooks import key_layout
from loki.calibration.score_aware import score_aware_basis
from loki.calibration.stats import KeyStatistics

ROTARY_MODES = ("pre", "post", "both")
#: Basis names :func:`fit_bases` returns: PCA of pre- or post-rotary keys, the score-aware pair, the score-aware
#: pair fitted with the group's query heads normalised (:func:`loki.calibration.score_aware.group_query_moment`),
#: and Double Sparsity's label channels as a permutation basis (:mod:`loki.calibration.channels`).
BASIS_NAMES = ("pre", "post", "score", "score-group", "channels")
#: ``kind`` of :func:`calibrate`: the paper's PCA, the score-aware pair, Double Sparsity's channel permutation.
CALIBRATION_KINDS = ("pca", "score", "channels")
DEFAULT_NUM_TOKENS = 131_072
DEFAULT_SEQ_LEN = 1024  # iter_token_batches' default; calibrate() defaults to the covered positions
DEFAULT_BATCH_SIZE = 4


def _check_rotary(rotary: str) -> list[str]:
    if rotary not in ROTARY_MODES:
        raise ValueError(f"rotary must be one of {', '.join(ROTARY_MODES)}, got {rotary!r}")
    return ["pre", "post"] if rotary == "both" else [rotary]


def _check_positive(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _model_dtype(model: nn.Module) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except StopIteration:
        return torch.float32


def model_context_length(model_or_config) -> int | None:
    """The positions a model is used at: ``max_position_embeddings`` of its (text) config, if set."""
    n = getattr(text_config(getattr(model_or_config, "config", model_or_config)), "max_position_embeddings", None)
    return int(n) if n else None


def collect_key_statistics(
    model: nn.Module,
    batches: Iterable,
    *,
    rotary: str = "both",
    num_tokens: int | None = None,
    max_positions: int | None = None,
    progress: bool = True,
) -> dict[str, KeyStatistics]:
    """Stream keys of ``model`` over ``batches`` into float64 statistics, one forward pass per batch.

    ``batches``: ``input_ids [B, S]`` tensors, ``(input_ids, attention_mask)`` pairs or mappings with
    ``input_ids`` and optionally ``attention_mask`` (``[B, S]``, 0 = padding, left or right); ``rotary``: "pre",
    "post" or "both"; ``num_tokens``: budget of real tokens (``None`` consumes every batch);
    ``max_positions``: see :func:`~loki.calibration.collect.collect_statistics`.
    Returns ``{"pre": KeyStatistics, "post": KeyStatistics}`` restricted to the requested kinds.
    """
    kinds = _check_rotary(rotary)
    if num_tokens is not None:
        _check_positive("num_tokens", num_tokens, 1)
    return collect_statistics(model, batches, kinds=kinds, num_tokens=num_tokens, max_positions=max_positions,
                              progress=progress, desc="calibrating keys")


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


def fit_bases(
    model: nn.Module,
    batches: Iterable,
    names: Iterable[str] = BASIS_NAMES,
    *,
    num_tokens: int | None = None,
    max_positions: int | None = None,
    seq_len: int | None = None,
    corpus_name: str | None = None,
    model_name: str | None = None,
    progress: bool = True,
) -> dict[str, PCABasis]:
    """The bases ``names`` (a subset of :data:`BASIS_NAMES`) of ``model`` from one streaming pass over
    ``batches`` (see :func:`collect_key_statistics`); ``seq_len`` and ``corpus_name`` are recorded, and the
    basis records ``max_positions`` as the positions it covers."""
    names = tuple(dict.fromkeys(names))
    bad = [n for n in names if n not in BASIS_NAMES]
    if bad or not names:
        raise ValueError(f"names must be a non-empty subset of {BASIS_NAMES}, got {names!r}")
    kinds = [k for k in ("pre", "post") if k in names]
    if "score" in names:
        kinds += [k for k in ("post", "query") if k not in kinds]
    if "score-group" in names:
        kinds += [k for k in ("post", "query-heads") if k not in kinds]
    if "channels" in names:
        kinds += [k for k in ("post", "channels") if k not in kinds]
    stats = collect_statistics(model, batches, kinds=kinds, num_tokens=num_tokens, max_positions=max_positions,
                               progress=progress)
    seen = next(iter(stats.values())).num_tokens
    if num_tokens is not None and seen < num_tokens:
        warnings.warn(f"data ran out after {seen} tokens; num_tokens={num_tokens} requested", RuntimeWarning,
                      stacklevel=2)
    config = model.config
    meta = dict(config=config, corpus=corpus_name, seq_len=seq_len, model_dtype=_model_dtype(model),
                model_name=model_name if model_name is not None else config_model_name(config))
    covered = max_positions if max_positions is not None else seq_len
    out = {}
    for name in names:
        if name == "score":
            out[name] = score_aware_basis(stats["post"], stats["query"], max_positions=covered, **meta)
        elif name == "score-group":
            out[name] = score_aware_basis(stats["post"], stats["query-heads"], max_positions=covered,
                                          group_normalised=True, **meta)
        elif name == "channels":
            out[name] = channel_basis(stats["channels"], stats["post"], max_positions=covered, **meta)
        else:
            out[name] = PCABasis.from_statistics(stats[name], rotary=name, max_positions=covered, **meta)
    return out


def calibrate(
    model: nn.Module,
    data,
    *,
    tokenizer=None,
    rotary: str = "post",
    num_tokens: int = DEFAULT_NUM_TOKENS,
    seq_len: int | None = None,
    max_positions: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    corpus_name: str | None = None,
    model_name: str | None = None,
    progress: bool = True,
    kind: str = "pca",
) -> PCABasis | dict[str, PCABasis]:
    """Fit the PCA basis of ``model``'s keys on ``data``.

    Args:
        model: a Hugging Face causal LM with rotary embeddings (Llama, Mistral, Qwen2, Qwen3, SmolLM, ...);
            run in eval mode under ``torch.no_grad()`` (its training flag is restored afterwards), on its device.
        data: texts (with ``tokenizer``), a token tensor ``[T]``/``[B, T]``, an iterable of token sequences, or an
            iterable of ready batches (``(input_ids, attention_mask)`` pairs / mappings); see
            :func:`iter_token_batches`.
        tokenizer: a Hugging Face tokenizer, required for texts.
        rotary: "post" (keys as cached, what Loki's decode kernels see), "pre" (before the rotary embedding)
            or "both" (one forward pass, two bases).
        num_tokens: token budget (real tokens); the last batch is truncated.
        seq_len: tokens per calibration sequence (>= 2); default ``max_positions``.
        max_positions: the positions the basis is fitted on and records, ``[0, max_positions)``; default the
            model's context length (``config.max_position_embeddings``), else ``seq_len``.  Sequences shorter
            than this are placed at offsets spread over the range.
        batch_size: sequences per forward pass.
        corpus_name: recorded in the basis metadata.
        model_name: recorded in the metadata (default: ``model.config.name_or_path`` or the model type).
        progress: show a tqdm progress bar.
        kind: "pca" (the paper's basis: PCA of the keys), "score" (score-aware: the best rank-d approximation
            of the post-rotary scores q . k, from query and key statistics; see
            :mod:`loki.calibration.score_aware`; ``rotary`` must be "post") or "channels" (Double Sparsity's
            label channels: the permutation putting the channels of largest calibrated ``|q_j k_j|`` first, so
            Loki with ``d = r`` is Double Sparsity; :mod:`loki.calibration.channels`; ``rotary`` "post").

    Returns:
        A :class:`PCABasis`, or ``{"pre": PCABasis, "post": PCABasis}`` for ``rotary="both"``.
    """
    kinds = _check_rotary(rotary)
    if kind not in CALIBRATION_KINDS:
        raise ValueError(f"kind must be one of {CALIBRATION_KINDS}, got {kind!r}")
    if kind in ("score", "channels") and rotary != "post":
        what = "a score-aware basis" if kind == "score" else "Double Sparsity's label channels"
        raise ValueError(f"{what} is fitted on post-rotary queries and keys: rotary must be 'post', "
                         f"got {rotary!r}")
    _check_positive("num_tokens", num_tokens, 1)
    _check_positive("batch_size", batch_size, 1)
    key_layout(model)  # unsupported architectures fail before any tokenization
    if max_positions is None:
        max_positions = model_context_length(model) or seq_len or DEFAULT_SEQ_LEN
    _check_positive("max_positions", max_positions, 2)
    if seq_len is None:
        seq_len = max_positions
    _check_positive("seq_len", seq_len, 2)
    if seq_len > max_positions:
        raise ValueError(f"seq_len={seq_len} exceeds max_positions={max_positions}: a sequence covers positions "
                         "[0, seq_len)")

    if _is_batch_iterable(data):
        batches = data
    else:
        batches = iter_token_batches(
            data, tokenizer=tokenizer, seq_len=seq_len, batch_size=batch_size, num_tokens=num_tokens
        )
    names = [kind] if kind in ("score", "channels") else kinds
    bases = fit_bases(model, batches, names, num_tokens=num_tokens, max_positions=max_positions, seq_len=seq_len,
                      corpus_name=corpus_name, model_name=model_name, progress=progress)
    return bases if rotary == "both" else bases[names[0]]


def _is_batch_iterable(data) -> bool:
    """Heuristic: a list/tuple whose first element is an ``(ids, mask)`` pair or a mapping is a batch list."""
    if isinstance(data, (list, tuple)) and data:
        first = data[0]
        if isinstance(first, Mapping):
            return True
        if isinstance(first, tuple) and len(first) == 2 and all(torch.is_tensor(t) for t in first):
            return True
    return False

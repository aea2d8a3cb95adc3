"""Decode loops that record logits, for the equivalence tests of every decode path (no downloads).

``decode_logits`` runs a prefill and a few decode steps as ``generate`` does (a 2-D attention mask that grows
by one each step, positions from the mask), feeding fixed tokens rather than greedy ones so that every path sees
the same inputs, and returns the logits of the last position of every forward: what a path computes is then
compared by logits, never by greedy tokens.  ``batch_inputs`` builds the named batch kinds (one unpadded
sequence passed without a mask, two unpadded sequences, one left-padded row, ragged left padding), and
``random_score_basis`` a score-aware pair whose key transform is not orthogonal.

Shape letters: B batch, P prompt length, T decode steps, V vocabulary, L layers, HKV KV heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BATCH_KINDS", "DecodeBatch", "batch_inputs", "decode_logits", "kernel_run", "kernel_step",
           "random_score_basis"]

#: The batch kinds of the equivalence matrix: name -> left padding of each row (None: no mask is passed).
BATCH_KINDS = {
    "B1-unpadded": None,
    "B2-unpadded": (0, 0),
    "B2-left-padded": (0, 3),
    "B3-ragged": (0, 2, 5),
}


@dataclass(frozen=True)
class DecodeBatch:
    """A prompt and the tokens fed after it: ids [B, P], mask [B, P] or None (no mask passed), feed [B, T]."""

    name: str
    ids: torch.Tensor
    mask: torch.Tensor | None
    feed: torch.Tensor

    @property
    def prompt_len(self) -> int:
        return int(self.ids.shape[1])

    def to(self, device) -> DecodeBatch:
        mv = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return DecodeBatch(self.name, mv(self.ids), mv(self.mask), mv(self.feed))


def batch_inputs(kind: str, prompt_len: int = 12, steps: int = 3, vocab: int = 256, seed: int = 0) -> DecodeBatch:
    """The batch ``kind`` (a key of :data:`BATCH_KINDS`) with random tokens (padding positions hold token 0)."""
    if kind not in BATCH_KINDS:
        raise ValueError(f"kind must be one of {list(BATCH_KINDS)}, got {kind!r}")
    pads = BATCH_KINDS[kind]
    B = 1 if pads is None else len(pads)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, prompt_len), generator=g)
    feed = torch.randint(1, vocab, (B, steps), generator=g)
    mask = None
    if pads is not None:
        mask = torch.ones(B, prompt_len, dtype=torch.long)
        for b, p in enumerate(pads):
            mask[b, :p] = 0
            ids[b, :p] = 0
    return DecodeBatch(kind, ids, mask, feed)


def decode_logits(model, batch: DecodeBatch, *, cache=None, step: Callable | None = None) -> torch.Tensor:
    """Logits of the last position of the prefill and of every decode step: [T + 1, B, V] fp32.

    ``cache``: passed under the model's cache keyword (``loki._hf.cache_keyword``); None lets the model make its
    own (a DynamicCache).  ``step``: the callable that runs the decode steps (default ``model``; e.g. a compiled
    ``model.forward``); the prefill always runs ``model`` eagerly.  Positions follow the mask as in ``generate``.
    """
    from loki._hf import cache_keyword

    kw = {} if cache is None else {cache_keyword(model): cache}
    step = model if step is None else step
    dev = batch.ids.device
    out = []
    with torch.no_grad():
        if batch.mask is None:
            o = model(batch.ids, use_cache=True, **kw)
        else:
            pos = (batch.mask.cumsum(-1) - 1).clamp(min=0)
            o = model(batch.ids, attention_mask=batch.mask, position_ids=pos, use_cache=True, **kw)
        out.append(o.logits[:, -1].float().clone())
        if cache is None:  # the cache the model made: the output's (under the name this transformers uses)
            cache = o["cache"] if "cache" in o else o["past_key_values"]
        kw = {cache_keyword(model): cache}
        mask = batch.mask
        P = batch.prompt_len
        for t in range(batch.feed.shape[1]):
            tok = batch.feed[:, t:t + 1]
            if mask is None:
                o = step(input_ids=tok, position_ids=torch.full((tok.shape[0], 1), P + t, device=dev),
                         use_cache=True, **kw)
            else:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
                o = step(input_ids=tok, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
            out.append(o.logits[:, -1].float().clone())
    return torch.stack(out)


def random_score_basis(num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0, spread: float = 0.3):
    """A score-aware :class:`loki.basis.PCABasis` with a key transform that is not orthogonal: ``P_k = Q (I + spread
    A)`` (Q random orthogonal, A Gaussian / sqrt(D)) and the query transform its dual, ``P_q = P_k^-T``, so
    ``q_hat . k_hat = q . k`` exactly while ``q P_k`` is not ``q_hat``: a path that rotates queries with the key
    transform gives wrong scores."""
    from loki.basis import PCABasis

    L, HKV, D = num_layers, num_kv_heads, head_dim
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(L, HKV, D, D, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    a = torch.randn(L, HKV, D, D, generator=gen, dtype=torch.float64) / D ** 0.5
    pk = q @ (torch.eye(D, dtype=torch.float64) + spread * a)
    pq = torch.linalg.inv(pk).transpose(-1, -2)
    sv = torch.rand(L, HKV, D, generator=gen, dtype=torch.float64).sort(dim=-1, descending=True).values
    return PCABasis(components=pk.to(torch.float32), eigenvalues=sv, means=torch.zeros(L, HKV, D, dtype=torch.float64),
                    kind="score", query_components=pq.to(torch.float32))


def kernel_run(q_hat, k_hat, *, d: int, gqa_select: str, aggregate: str, k=1.0, scale=None, tuning=None):
    """A :class:`loki.kernels.plan.DecodeRun` for the shapes of ``q_hat`` [B, HQ, D] and ``k_hat`` [B, HKV, S, D]
    with the given modes (the kernel tests' way to record and replay steps): ``run.step(...)``."""
    import math

    from loki.kernels.plan import DecodeRun
    from loki.settings import LokiSettings

    HQ, D = q_hat.shape[1], q_hat.shape[-1]
    s = LokiSettings(k=k, d=d, gqa_select=gqa_select, aggregate=aggregate, backend="triton",
                     score_format="native").resolve_shapes(
        num_q_heads=HQ, num_kv_heads=k_hat.shape[1], head_dim=D)
    return DecodeRun(s, scale=1.0 / math.sqrt(D) if scale is None else scale, tuning=tuning)


def kernel_step(q_hat, k_hat, v_cache, lengths, starts, counts, *, d: int, k_max: int, gqa_select: str,
                aggregate: str, scale=None, select_method: str = "triton", k_prefix=None, out=None,
                tuning=None, uniform: bool = False):
    """``loki.kernels.launch_decode_step`` with the kernel tests' positional inputs: ``(idx, out)``."""
    from loki.kernels.decode import DecodeTuning, launch_decode_step

    return launch_decode_step(q_hat=q_hat, k_hat=k_hat, v_cache=v_cache, k_prefix=k_prefix, lengths=lengths,
                              starts=starts, counts=counts, d=d, width=k_max, gqa_select=gqa_select,
                              aggregate=aggregate, scale=scale, select_method=select_method, out=out,
                              uniform=uniform, tuning=DecodeTuning() if tuning is None else tuning)

"""One input factory for tests and benchmarks: decode-step tensors with realistic structure.

Keys are drawn with a decaying spectrum (a few dominant directions, as real attention keys have) so
that low-rank approximate scores are meaningful; values are independent of keys (distinct tensors).
Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DecodeInputs", "make_decode_inputs", "ragged_positions", "random_orthogonal", "score_rows"]


@dataclass
class DecodeInputs:
    q: torch.Tensor  # [B, HQ, D]
    k_cache: torch.Tensor  # [B, HKV, S, D]
    v_cache: torch.Tensor  # [B, HKV, S, D]
    lengths: torch.Tensor  # [B] int32, exclusive end of the valid tokens
    starts: torch.Tensor  # [B] int32, first valid token


def random_orthogonal(HKV: int, D: int, *, seed: int = 0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """[HKV, D, D] random orthogonal matrices (QR of a Gaussian, signs fixed), reproducible by seed."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(HKV, D, D, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    qm = qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    return qm.to(dtype=dtype, device=device)


def make_decode_inputs(
    B: int,
    HQ: int,
    HKV: int,
    S: int,
    D: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    ragged: bool = False,
    left_pad: bool = False,
    decay: float = 0.9,
) -> DecodeInputs:
    """Random decode inputs. ``ragged`` gives each sequence its own length (the first keeps S);
    ``left_pad`` also gives random start offsets. ``decay`` sets the key spectrum (std of dim j ~ decay**j,
    in a random orthogonal frame per KV head); 1.0 gives isotropic keys.

    On the CPU the draw is float64 (exact references); on an accelerator the same recipe is drawn in float32
    directly on the device, one KV head at a time, so benchmark-sized caches (B=16, S=32768) take no time.
    """
    dev = torch.device(device)
    if dev.type != "cpu":
        return _make_on_device(B, HQ, HKV, S, D, dtype=dtype, device=dev, seed=seed, ragged=ragged,
                               left_pad=left_pad, decay=decay)
    g = torch.Generator().manual_seed(seed)
    std = decay ** torch.arange(D, dtype=torch.float64)
    frame = random_orthogonal(HKV, D, seed=seed + 1, dtype=torch.float64)
    k = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64) * std
    k = torch.einsum("bhsd,hed->bhse", k, frame) * (D**0.5 / std.norm())
    mean = torch.randn(HKV, D, generator=g, dtype=torch.float64) * 0.5
    k = k + mean[None, :, None, :]
    q = torch.randn(B, HQ, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    lengths, starts = ragged_positions(B, S, g, "cpu", ragged, left_pad)
    return DecodeInputs(q=q.to(dtype), k_cache=k.to(dtype), v_cache=v.to(dtype), lengths=lengths, starts=starts)


def ragged_positions(B: int, S: int, g: torch.Generator, device="cpu", ragged: bool = True, left_pad: bool = True):
    """lengths, starts [B] int32: batch 0 full, the others (``ragged``) of random lengths and (``left_pad``) random
    starts below them."""
    lengths = torch.full((B,), S, dtype=torch.int32, device=device)
    starts = torch.zeros(B, dtype=torch.int32, device=device)
    if ragged and B > 1:
        lengths[1:] = torch.randint(1, S + 1, (B - 1,), generator=g, dtype=torch.int32, device=device)
    if left_pad:
        starts = (torch.rand(B, generator=g, device=device) * (lengths.double() - 1)).floor().to(torch.int32)
        starts = torch.minimum(starts, lengths - 1)
    return lengths, starts


def _make_on_device(B, HQ, HKV, S, D, *, dtype, device, seed, ragged, left_pad, decay) -> DecodeInputs:
    g = torch.Generator(device=device).manual_seed(seed)
    std = decay ** torch.arange(D, dtype=torch.float32, device=device)
    frame = random_orthogonal(HKV, D, seed=seed + 1, dtype=torch.float32, device=device)
    scale = D**0.5 / std.norm()
    k = torch.empty(B, HKV, S, D, dtype=dtype, device=device)
    for h in range(HKV):  # one head at a time keeps the fp32 temporaries small
        kh = torch.randn(B, S, D, generator=g, device=device) * std
        k[:, h] = (kh @ frame[h].T * scale + 0.5 * torch.randn(D, generator=g, device=device)).to(dtype)
    q = torch.randn(B, HQ, D, generator=g, device=device).to(dtype)
    v = torch.randn(B, HKV, S, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    lengths, starts = ragged_positions(B, S, g, device, ragged, left_pad)
    return DecodeInputs(q=q, k_cache=k, v_cache=v, lengths=lengths, starts=starts)


def score_rows(B: int, H: int, S: int, kind: str = "randn", ragged: bool = True, seed: int = 0):
    """Score rows [B, H, S] for the select tests, -inf outside each sequence's valid tokens (ragged: batches > 0
    shorter and left-padded), and the valid token counts [B].  Kinds: "randn"; "halves" (few distinct values:
    heavy ties, negatives, zeros and -0.0); "equal"; "narrow" (one value plus tiny noise: every score shares
    the top bits of its key); "signed-zeros"; "nan" (NaN, -NaN and +inf among the scores)."""
    from loki._checks import valid_token_mask

    g = torch.Generator().manual_seed(1000 * S + seed)
    s = torch.randn(B, H, S, generator=g)
    if kind == "halves":
        s = torch.round(s * 2) / 2
        s[..., ::7] = -0.0
    elif kind == "equal":
        s = torch.full((B, H, S), 0.75)
    elif kind == "narrow":
        s = 20.0 + 1e-4 * s
    elif kind == "signed-zeros":
        s = torch.where(torch.rand(B, H, S, generator=g) < 0.5, 0.0, -0.0)
        s[..., ::5] = torch.randn(B, H, S, generator=g)[..., ::5]
    elif kind == "nan":
        s[..., ::11] = float("nan")
        s[..., 5::13] = -float("nan")
        s[..., 3::17] = float("inf")
    elif kind != "randn":
        raise ValueError(f"unknown kind {kind!r}")
    lengths, starts = ragged_positions(B, S, g, "cpu", ragged, ragged)
    s = s.masked_fill(~valid_token_mask(lengths, starts, S)[:, None, :], float("-inf"))
    return s, (lengths - starts).long()

"""Top-k token selection per row (Loki Algorithm 1, line 5): ``torch.topk`` or an exact Triton threshold
select, behind one interface (``select_topk(scores, counts, method=...)``).

Shape letters: B batch, H the selection's head axis (HQ or HKV), S cache length, K = the bound on the
per-sequence counts (``max(counts) <= K``).

The Triton method ("triton") is an exact radix select: one program holds a whole score row in registers,
maps each fp32 score to an order-preserving uint32 key, and finds the k-th largest key by a bitwise
search from the top bit down, ``RADIX_BITS`` bits per step (each step one count over the row: 32 steps
of 1 bit, or 16 steps of 2 bits whose three counts share one int64 reduction).  It then compacts in
chunks that re-read the row from L1/L2 for long rows (so the registers of the search are free again):
every key above the threshold, plus as many keys equal to it as are needed, is written at its
position from one packed prefix sum (above-threshold count in the low 16 bits, tie count in the high 16).
Output order is unspecified (like ``torch.topk(sorted=False)``), in practice ascending token position.
With few rows (fewer than the multiprocessors) of 8K keys or more, and for rows longer than
``TRITON_SELECT_MAX_S``, "triton" runs the split select of ``select_split.py`` instead (every row over many
programs; also ``method="split"``).

Ties: the lowest token position first, as everywhere in Loki (``loki.reference.selection.topk_indices``):
every key strictly above the threshold is taken, then the first ``k - #above`` keys equal to it in position
order.  -0.0 and +0.0 map to one key (they are equal scores) and every NaN to the key of +NaN (above +inf,
where ``torch.topk`` ranks NaN).

``method="flashinfer"`` (opt-in, never chosen by "auto") runs FlashInfer's radix top-k with its lowest-index tie
rule (``select_flashinfer.py``): the optional ``flashinfer-python`` package, CUDA tensors, K <= 2048.
"""

from __future__ import annotations

import torch

from loki._checks import check_counts
from loki._triton import tl, triton
from loki.reference.selection import select_topk as select_topk_reference
from loki.reference.selection import topk_indices

from .common import NUM_SMS_DEFAULT, check_triton_device, interpreting, num_sms
from .launch import launch, new_output, pdl
from .select_flashinfer import require_flashinfer, select_topk_flashinfer
from .select_split import select_topk_split, use_split_select
from .tl_helpers import select_row

__all__ = ["SELECT_METHODS", "STEP_SELECT_METHODS", "TRITON_SELECT_MAX_S", "select_topk", "select_topk_reference",
           "select_launch_config"]

SELECT_METHODS = ("auto", "torch", "triton", "split", "flashinfer")
#: The methods the decode step takes (``decode_attention(select_method=...)``): "flashinfer" is ``select_topk``'s only.
STEP_SELECT_METHODS = ("auto", "torch", "triton", "split")
#: Longest row the register-resident Triton select handles; longer rows take the split select (``select_split.py``).
TRITON_SELECT_MAX_S = 32768
#: Compaction chunk (elements); rows up to this length are compacted straight from the registers.
_CHUNK = 4096
#: With few rows (fewer than half the multiprocessors), rows up to this length are compacted straight from
#: the registers (one program per SM, so their registers are free to hold the whole row).
FEW_ROWS_REGISTER_COMPACT = 16384


def compaction_chunk(S: int, rows: int, num_sms: int = NUM_SMS_DEFAULT) -> int:
    """The select's compaction chunk for ``rows`` rows of length S (measured on an H100, docs/kernels.md)."""
    block = triton.next_power_of_2(S)
    if interpreting():
        return max(_CHUNK, block)
    if 2 * rows < num_sms and block <= FEW_ROWS_REGISTER_COMPACT:
        return block
    return _CHUNK


@triton.jit
def _threshold_select_kernel(
    scores_ptr, counts_ptr, idx_ptr,
    S, H, K,
    stride_sb, stride_sh,
    stride_ib, stride_ih,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """idx[b, h, :counts[b]] = positions of the counts[b] largest scores of row (b, h); idx[.., counts[b]:K] = -1."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    if PDL:  # programmatic dependent launch (launch.py): wait for the scores
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    kk = tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K)  # never more than the K slots of the row
    select_row(scores_ptr + b * stride_sb + h * stride_sh, S, kk, idx_ptr + b * stride_ib + h * stride_ih, K,
                BLOCK, CHUNK, RADIX_BITS, EARLY_EXIT)


def select_launch_config(S: int, rows: int, num_sms: int = NUM_SMS_DEFAULT) -> tuple[int, int, bool]:
    """(num_warps, RADIX_BITS, EARLY_EXIT) for rows of length S (measured on an H100, docs/kernels.md):
    32 row elements per thread (64 for rows of 16K and more when there are many rows), 4 to 16 warps,
    1-bit steps with early exit."""
    block = triton.next_power_of_2(S)
    per_thread = 64 if (block >= 16384 and rows >= num_sms // 2) else 32
    return int(max(4, min(16, block // (32 * per_thread)))), 1, True


def _select_triton(scores: torch.Tensor, counts: torch.Tensor, K: int, out: torch.Tensor | None,
                   num_warps: int | None = None, radix_bits: int | None = None, chunk: int | None = None,
                   early_exit: bool | None = None):
    B, H, S = scores.shape
    check_triton_device(scores, "select_topk(method='triton')")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    idx = out if out is not None else new_output((B, H, K), torch.int32, scores.device)
    if idx.shape != (B, H, K) or idx.dtype != torch.int32 or idx.stride(-1) != 1:
        raise ValueError(f"out must be a contiguous int32 tensor of shape [B, H, K]=[{B}, {H}, {K}]")
    BLOCK = triton.next_power_of_2(S)
    warps, bits, early = select_launch_config(S, B * H, num_sms(scores.device))
    num_warps = warps if num_warps is None else num_warps
    radix_bits = bits if radix_bits is None else radix_bits
    early_exit = early if early_exit is None else early_exit
    if radix_bits not in (1, 2):
        raise ValueError(f"radix_bits must be 1 or 2, got {radix_bits}")
    if chunk is not None and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    launch(_threshold_select_kernel, (B * H,), [
        scores, counts, idx, S, H, K,
        scores.stride(0), scores.stride(1), idx.stride(0), idx.stride(1),
        BLOCK, chunk or compaction_chunk(S, B * H, num_sms(scores.device)), radix_bits, bool(early_exit),
        pdl(scores.device),
    ], dict(num_warps=num_warps, pdl=pdl(scores.device)))
    return idx


def resolve_select_method(method: str, scores_or_q: torch.Tensor) -> str:
    """"auto" -> "triton" on CUDA tensors (the fast exact select), "torch" elsewhere; others unchanged."""
    if method not in SELECT_METHODS:
        raise ValueError(f"method must be one of {SELECT_METHODS}, got {method!r}")
    if method == "auto":
        return "triton" if scores_or_q.is_cuda else "torch"
    return method


def select_topk(
    scores: torch.Tensor,
    counts: torch.Tensor,
    *,
    k_max: int | None = None,
    method: str = "auto",
    uniform: bool = False,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    radix_bits: int | None = None,
    chunk: int | None = None,
    early_exit: bool | None = None,
) -> torch.Tensor:
    """Indices of the ``counts[b]`` largest scores of every row, unsorted.

    scores: [B, H, S] fp32 (-inf marks tokens that may not be chosen); counts: [B] int on the scores'
    device, 1 <= counts[b] <= the number of finite scores of each row of batch b; ``k_max`` an int bound
    K >= max(counts) (pass it to avoid a host sync; default ``int(counts.max())``; both methods clamp a larger
    count to K on the device, so the Triton select never writes past a row's K slots).
    Returns idx: [B, H, K], int64 for ``method="torch"``, int32 for ``"triton"``, ``"split"`` and ``"flashinfer"``;
    entries at positions >= counts[b] are -1.  ``method="auto"`` is "triton" on CUDA tensors and "torch" otherwise.
    ``"split"`` splits every row over many programs (``select_split.select_topk_split``); ``"triton"`` uses it
    where ``select_split.use_split_select`` says (few rows, or rows longer than ``TRITON_SELECT_MAX_S``) and the
    one-program-per-row select otherwise (always, for rows it takes, when one of its options below is given).
    ``"flashinfer"`` (opt-in) runs ``flashinfer.top_k`` with its lowest-index tie rule
    (``select_flashinfer.select_topk_flashinfer``: the optional flashinfer-python package, CUDA fp32 scores,
    K <= 2048; ImportError without the package).
    All methods break ties by the lowest token position (``loki.reference.selection.topk_indices``), so they
    select the same set.
    ``uniform=True`` promises all counts equal K (then ``torch.topk(sorted=False)`` is enough; otherwise
    the torch method sorts so that the first counts[b] entries are the top ones).  ``num_warps`` and
    ``radix_bits`` (1 or 2 bits per search step) override the Triton launch configuration; ``chunk`` (a power
    of two) is the compaction chunk for rows longer than it; ``early_exit`` stops the 1-bit search once
    the running threshold has exactly counts[b] keys at or above it.  For ``method="split"`` ``chunk`` is the
    scores per program and ``num_warps`` its warps; the other options apply to the one-program-per-row select
    (the torch and flashinfer methods take none of them).
    """
    method = resolve_select_method(method, scores)
    if method == "flashinfer":
        require_flashinfer()  # a missing package is named first, whatever the inputs
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape [B, H, S], got {list(scores.shape)}")
    B, H, S = scores.shape
    triton_method = method in ("triton", "split", "flashinfer")  # int32 indices, counts on the scores' device
    check_counts(counts, B, scores.device if triton_method else None)
    if B == 0:  # an empty batch: nothing to select (the torch reference gives [0, H, 0] as well)
        K = 0 if k_max is None else int(k_max)
        return torch.empty(0, H, K, dtype=torch.int32 if triton_method else torch.long, device=scores.device)
    K = int(counts.max()) if k_max is None else int(k_max)
    if not 1 <= K <= S:
        raise ValueError(f"k_max={K} must lie in [1, S={S}]")
    if method == "flashinfer":
        return select_topk_flashinfer(scores, counts, K, uniform=uniform, out=out)
    if method == "split":
        return select_topk_split(scores, counts, k_max=K, out=out, chunk=chunk, num_warps=num_warps)
    register_options = (num_warps, radix_bits, chunk, early_exit) != (None, None, None, None)
    if method == "triton" and (S > TRITON_SELECT_MAX_S or (
            not register_options and use_split_select(S, B * H, num_sms(scores.device), TRITON_SELECT_MAX_S))):
        return select_topk_split(scores, counts, k_max=K, out=out)
    if method == "triton":
        return _select_triton(scores, counts, K, out, num_warps=num_warps, radix_bits=radix_bits, chunk=chunk,
                              early_exit=early_exit)
    idx = topk_indices(scores, K, sorted=not uniform)
    if not uniform:
        keep = torch.arange(K, device=scores.device)[None, None, :] < counts.to(scores.device)[:, None, None]
        idx = idx.masked_fill(~keep, -1)
    if out is not None:
        out.copy_(idx)
        return out
    return idx

"""Every Triton kernel once at awkward shapes, for compute-sanitizer on a GPU (memcheck, racecheck): S = 1, 97, 1025,
4099; D = 64, 96, 128; GQA 1:1, 3:1, 8:1; fp32, bf16, fp16; ragged, left-padded batches; both GQA modes; every
launch variant of the selection and attention kernels, and programmatic dependent launch through a whole step.

    PYTHONPATH=$PWD compute-sanitizer --tool memcheck python3 tools/sanitize_kernels.py

Prints "sanitize: all kernels ran"; the sanitizer reports the errors. Correctness against the references is
``pytest -m gpu``'s, speed ``loki bench``'s (this was the --sanitize part of the former scripts/gpu_check.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def sanitize() -> None:
    """Odd shapes through every kernel once (run under compute-sanitizer)."""
    from loki.kernels import (
        approx_scores,
        decode_attention,
        make_key_prefix,
        score_select,
        select_topk,
        sparq_attention,
        sparse_attention,
    )
    from loki.kernels import launch as launch_mod
    from loki.kernels.decode import selection_bound
    from loki.reference import budget
    from loki.testing.inputs import make_decode_inputs

    for B, HQ, HKV, S, D, dtype in [(1, 2, 2, 1, 64, torch.float32), (3, 6, 2, 97, 96, torch.bfloat16),
                                    (2, 8, 1, 1025, 128, torch.float16), (2, 12, 3, 4099, 96, torch.bfloat16)]:
        x = make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device="cuda", ragged=True, left_pad=True)
        kp = make_key_prefix(x.k_cache, 9)
        for mode in ("query", "kv"):
            s = approx_scores(x.q, x.k_cache, 7, x.lengths, x.starts, gqa_select=mode, aggregate="sum")
            approx_scores(x.q, x.k_cache, 7, x.lengths, x.starts, gqa_select=mode, k_prefix=kp, aggregate="sum")
            approx_scores(x.q, x.k_cache, 9, x.lengths, x.starts, gqa_select=mode, k_prefix=kp, aggregate="sum")
            for k in (1, 0.3, S):
                counts = budget(k, x.lengths, x.starts, B, S, "cuda")
                K = selection_bound(k, S)
                idx = select_topk(s, counts, method="triton", k_max=K)
                select_topk(s, counts, method="triton", k_max=K, radix_bits=1, chunk=256)
                select_topk(s, counts, method="triton", k_max=K, radix_bits=2, early_exit=False)
                for aggregate in ("sum", "max"):  # the fused score+select kernel, in place and from the prefix
                    score_select(x.q, x.k_cache, 7, x.lengths, x.starts, counts, K, gqa_select=mode,
                                 aggregate=aggregate)
                    score_select(x.q, kp, 9, x.lengths, x.starts, counts, K, gqa_select=mode, aggregate=aggregate,
                                 chunk=256)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=3, block_k=16)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=3, prefetch=False)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=2, slots=False, prefetch=True)
                if mode == "query":
                    sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, prefix_scores=s, prefix_dims=7,
                                     block_k=16)
            decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                             backend="triton", gqa_select=mode, select_method="triton", aggregate="sum")
            decode_attention(x.q, x.k_cache, x.v_cache, d=9, k=0.25, lengths=x.lengths, starts=x.starts,
                             backend="triton", gqa_select=mode, k_prefix=kp, aggregate="sum")
            launch_mod.PDL = True  # programmatic dependent launch through the whole step
            for _ in range(2):
                decode_attention(x.q, x.k_cache, x.v_cache, d=9, k=0.25, lengths=x.lengths, starts=x.starts,
                                 backend="triton", gqa_select=mode, k_prefix=kp, aggregate="sum")
            launch_mod.PDL = False
        sparq_attention(x.q, x.k_cache, x.v_cache, r=8, k=0.25, lengths=x.lengths, starts=x.starts)
    torch.cuda.synchronize()
    print("sanitize: all kernels ran")


if __name__ == "__main__":
    sanitize()

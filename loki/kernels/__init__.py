"""Triton decode kernels for Loki, each beside the PyTorch reference it must match.

- ``approx_scores``: q_hat[:d] . K_hat[:, :d]^T over the whole cache (Algorithm 1, lines 3-4);
- ``select_topk``: top-k per row, ``torch.topk`` or an exact Triton threshold select (line 5);
  ``select_topk_split``: the exact select with every row split over many programs (few or long rows);
  ``select_topk_flashinfer``: FlashInfer's top-k with the same tie rule (optional package, opt-in:
  ``method="flashinfer"``; ``flashinfer_topk_available()`` tries its import);
- ``score_select``: the scores and the Triton select of each row in one kernel (lines 3-5 fused);
  ``score_select_softmax``: the same for a shared selection with a softmax aggregate;
- ``group_softmax_scores``: a GQA group's "softmax-max" / "softmax-sum" score from per-query-head scores;
- ``sparse_attention``: exact attention over the selected rows, flash-decoding splits (lines 6-7);
- ``sparq_attention``: the SparQ-style baseline kernels the paper compares against;
- ``decode_attention``: the whole Loki decode step (validated; the PyTorch reference or the kernels), and
  ``launch_decode_step``: the one launch sequence of a step on validated inputs (``DecodeTuning``: launch
  choices for tuning);
- ``plan_decode``: validate once, then ``DecodeRun.run`` many times with ~no host work: the kernels' one
  record-and-replay object, which the transformers integration runs too;
- ``decode_step_op`` (``torch.ops.loki.decode_step``): the step as a torch custom op, for ``torch.compile``
  (the kernels on CUDA, the PyTorch reference on the CPU);
- ``write_rotated`` (``torch.ops.loki.write_rotated``): new tokens rotated and written into a static cache, bounds
  checked;
- ``rotate_query_op`` (``torch.ops.loki.rotate_query``): the decode step's query rotation ``q P_q`` in one kernel.

Importing this package compiles nothing and probes no device; kernels are built at their first launch.
"""

from .approx_scores import approx_scores, approx_scores_reference, make_key_prefix
from .cache_write import write_rotated
from .decode import (
    DecodeTuning,
    decode_attention,
    launch_decode_step,
    loki_attention_reference,
    selection_bound,
    selection_width,
)
from .group_softmax import group_softmax_scores
from .ops import decode_step_op
from .plan import DecodeRun, plan_decode
from .rotate import rotate_query_op
from .score_select import score_select
from .score_select_softmax import score_select_softmax
from .select import SELECT_METHODS, select_topk, select_topk_reference
from .select_flashinfer import flashinfer_topk_available, select_topk_flashinfer
from .select_split import select_topk_split
from .sparq import sparq_attention, sparq_attention_reference, sparq_prepare
from .sparse_attention import sparse_attention, sparse_attention_reference

__all__ = [
    "SELECT_METHODS",
    "DecodeRun",
    "DecodeTuning",
    "approx_scores",
    "approx_scores_reference",
    "decode_attention",
    "decode_step_op",
    "group_softmax_scores",
    "loki_attention_reference",
    "launch_decode_step",
    "make_key_prefix",
    "plan_decode",
    "rotate_query_op",
    "select_topk",
    "select_topk_reference",
    "select_topk_split",
    "select_topk_flashinfer",
    "flashinfer_topk_available",
    "score_select",
    "score_select_softmax",
    "selection_bound",
    "selection_width",
    "sparq_attention",
    "sparq_attention_reference",
    "sparq_prepare",
    "sparse_attention",
    "sparse_attention_reference",
    "write_rotated",
]

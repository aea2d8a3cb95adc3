"""PyTorch references of every decode-time method: the single source of truth for tests, kernels,
benchmarks and integrations."""

from .common import expand_to_query_heads, gather_rows, rotate_keys, rotate_query
from .dense import dense_attention, exact_scores
from .double_sparsity import double_sparsity_attention
from .methods import exact_topk_attention, h2o_attention, loki_attention, pcaattn_attention, sparq_attention
from .quest import QUEST_PAGE_SIZE, quest_attention
from .selection import (
    DEFAULT_KV_AGGREGATE,
    GQA_AGGREGATES,
    GQA_SELECT_MODES,
    KERNEL_AGGREGATES,
    aggregate_group_scores,
    approx_scores,
    budget,
    check_kernel_aggregate,
    select_topk,
    token_ranks,
    topk_indices,
)
from .sparse import sparse_attention

__all__ = [
    "DEFAULT_KV_AGGREGATE",
    "GQA_AGGREGATES",
    "GQA_SELECT_MODES",
    "KERNEL_AGGREGATES",
    "QUEST_PAGE_SIZE",
    "aggregate_group_scores",
    "approx_scores",
    "budget",
    "check_kernel_aggregate",
    "dense_attention",
    "double_sparsity_attention",
    "exact_scores",
    "exact_topk_attention",
    "expand_to_query_heads",
    "gather_rows",
    "h2o_attention",
    "loki_attention",
    "pcaattn_attention",
    "quest_attention",
    "rotate_keys",
    "rotate_query",
    "select_topk",
    "sparq_attention",
    "sparse_attention",
    "token_ranks",
    "topk_indices",
]

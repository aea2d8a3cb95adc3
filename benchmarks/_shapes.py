"""The parameter grids of the ASV suite, built from the benchmark harness's own configurations.

Kernel configurations are ``loki.bench.harness.BenchConfig`` ids (``<model>-B<B>-S<S>-k<k_f>-d<d_f>-<dtype>``,
model shapes from ``harness.MODELS``); the grid picks the shapes of the targets in ANCHORS.md so that
ci/thresholds.json can name them.  Accuracy parameters are the method and basis names of the accuracy job.

Nothing here touches a device.  When the harness cannot be imported (a commit older than it, measured by
ci/run_asv_history.sh), the kernel grid is a single placeholder whose setup skips.
"""

from __future__ import annotations

try:
    from loki.bench import harness
except ImportError:  # pragma: no cover - only on commits that predate the harness
    harness = None

__all__ = ["ACCURACY_BASES", "ACCURACY_METHODS", "ACCURACY_PROFILE", "KERNEL_CONFIGS", "SPARQ_CONFIGS",
           "UNAVAILABLE", "config_by_id"]

UNAVAILABLE = "harness-unavailable"

# (models, batches, seq_lens) blocks; every block at the paper's default budget k_f = d_f = 0.25, bf16.
_DEFAULT_BUDGET = ((0.25, 0.25),)
_KERNEL_BLOCKS = (
    (("llama2-13b",), (16,), (4096, 16384, 32768)),  # MHA, B=16: 2.3x / 2.4x targets
    (("llama2-13b",), (1,), (4096, 16384)),  # MHA, B=1: 1.6x target at S=16384
    (("llama3-8b",), (16,), (8192,)),  # GQA 32:8, B=16: 2.0x target (SDPA enable_gqa)
)
# The paper's appendix comparison against SparQ: batch 1 (and 16) at S=4096.
_SPARQ_BLOCKS = ((("llama2-13b",), (1, 16), (4096,)),)


def _grid(blocks):
    if harness is None:
        return {}
    out = {}
    for models, batches, seq_lens in blocks:
        for cfg in harness.configs(models=models, batches=batches, seq_lens=seq_lens, budgets=_DEFAULT_BUDGET):
            out[cfg.id] = cfg
    return out


_KERNEL = _grid(_KERNEL_BLOCKS)
_SPARQ = _grid(_SPARQ_BLOCKS)

#: ASV parameter lists (ids, in a fixed order).
KERNEL_CONFIGS = list(_KERNEL) or [UNAVAILABLE]
SPARQ_CONFIGS = list(_SPARQ) or [UNAVAILABLE]

#: The profile of loki/evaluation/accuracy_thresholds.json whose settings the accuracy benchmarks run with (and whose
#: limits ci/gate.py applies to them): "tests", the tiny budgets of the CPU accuracy tests (one 256-token
#: window, 2048 calibration tokens), so the CPU run stays at a couple of minutes.
ACCURACY_PROFILE = "tests"
#: Method names of the ``tests`` profile (``loki.evaluation.suite``, GQA "query"; "d=D" rows are the exactness
#: settings).  A name a commit's suite does not produce is skipped.
ACCURACY_METHODS = [
    "full",
    "exact_topk[query]",
    "loki-pre[query]",
    "loki-post[query]",
    "loki-score[query]",
    "h2o",
    "loki-post(d=D,k=all)",
    "loki-post(d=D)[query]",
]
#: Bases of the top-k agreement (PCA of pre- / post-rotary keys, the score-aware pair).
ACCURACY_BASES = ["pre", "post", "score"]


def config_by_id(config_id: str):
    """The harness ``BenchConfig`` of an id of either kernel grid (KeyError for the placeholder)."""
    return {**_KERNEL, **_SPARQ}[config_id]

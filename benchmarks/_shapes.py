"""The parameter grids of the ASV suite, built from the benchmark harness's own configurations.

The one table of benchmark shapes (:data:`SHAPES`), which the ASV suite and the tuning runs pick from.  Kernel
configurations are ``loki.bench.harness.BenchConfig`` ids (``<model>-B<B>-S<S>-k<k_f>-d<d_f>-<dtype>``, model
shapes from ``harness.MODELS``); the kernel grid holds the shapes of the speed targets, so that
ci/thresholds.json can name them.  Accuracy parameters are the method and basis names of the accuracy job.

Nothing here touches a device.  When the harness cannot be imported (a commit older than it, measured by
ci/run_asv_history.sh), the kernel grid is a single placeholder whose setup skips.
"""

from __future__ import annotations

try:
    from loki.bench import harness
except ImportError:  # pragma: no cover - only on commits that predate the harness
    harness = None

__all__ = ["ACCURACY_BASES", "ACCURACY_METHODS", "ACCURACY_PROFILE", "E2E_SETTINGS", "FUSION_SHAPES", "KERNEL_CONFIGS",
           "KERNEL_SHAPES", "SELECT_CONFIGS", "SELECT_SHAPES", "SHAPES", "SPARQ_CONFIGS", "SPARQ_SHAPES",
           "TARGET_SHAPES", "UNAVAILABLE", "config_by_id", "shape_dims"]

UNAVAILABLE = "harness-unavailable"

#: Every decode shape the ASV suite and the tuning runs (``benchmarks/tuning``) measure, one row each:
#: name -> (model, B, S); attention shapes (HQ, HKV, D) from ``harness.MODELS`` (``llama2-13b``: 40/40 heads,
#: ``llama3-8b``: 32 query / 8 KV heads, D = 128).  Each run picks its rows by name below.
SHAPES = {
    "mha-B16-S4096": ("llama2-13b", 16, 4096),  # speed target: 2.3x SDPA
    "mha-B16-S16384": ("llama2-13b", 16, 16384),  # speed target: 2.4x SDPA
    "mha-B16-S32768": ("llama2-13b", 16, 32768),  # speed target: 2.4x SDPA
    "mha-B1-S4096": ("llama2-13b", 1, 4096),
    "mha-B1-S16384": ("llama2-13b", 1, 16384),  # speed target: 1.6x SDPA
    "gqa-B16-S8192": ("llama3-8b", 16, 8192),  # speed target: 2.0x SDPA (SDPA with enable_gqa)
    "mha-B16-S8192": ("llama2-13b", 16, 8192),
    "mha-B4-S16384": ("llama2-13b", 4, 16384),
    "gqa-B16-S4096": ("llama3-8b", 16, 4096),
    "gqa-B1-S16384": ("llama3-8b", 1, 16384),
}
#: The kernel benchmarks: the shapes of the speed targets (ci/thresholds.json names them), and B=1 at S=4096.
KERNEL_SHAPES = ("mha-B16-S4096", "mha-B16-S16384", "mha-B16-S32768", "mha-B1-S4096", "mha-B1-S16384",
                 "gqa-B16-S8192")
#: The paper's appendix comparison against SparQ: batch 1 and 16 at S=4096.
SPARQ_SHAPES = ("mha-B1-S4096", "mha-B16-S4096")
#: The speed-target shapes (tuning: ``variants``, ``host`` and ``integration`` take the three first).
TARGET_SHAPES = ("mha-B16-S4096", "mha-B1-S16384", "gqa-B16-S8192", "mha-B16-S16384", "mha-B16-S32768")
#: The decode-step variants of ``benchmarks.tuning.fusion`` (``--quick``: the first three).
FUSION_SHAPES = ("mha-B16-S4096", "mha-B1-S16384", "gqa-B16-S8192", "mha-B16-S8192", "mha-B16-S16384",
                 "mha-B16-S32768", "mha-B4-S16384", "gqa-B16-S4096", "gqa-B1-S16384")


def shape_dims(name: str) -> tuple[int, int, int, int, int, str]:
    """``(B, HQ, HKV, S, D, gqa_select)`` of a row of :data:`SHAPES` (GQA models select per KV head)."""
    model, B, S = SHAPES[name]
    HQ, HKV, D = harness.MODELS[model]
    return B, HQ, HKV, S, D, "kv" if HQ != HKV else "query"


# Every row at the paper's default budget k_f = d_f = 0.25, bf16.
_DEFAULT_BUDGET = (0.25, 0.25)


def _grid(names):
    if harness is None:
        return {}
    out = {}
    for name in names:
        model, B, S = SHAPES[name]
        cfg = harness.BenchConfig(model, B, S, *_DEFAULT_BUDGET)
        out[cfg.id] = cfg
    return out


_KERNEL = _grid(KERNEL_SHAPES)
_SPARQ = _grid(SPARQ_SHAPES)

#: ASV parameter lists (ids, in a fixed order).
KERNEL_CONFIGS = list(_KERNEL) or [UNAVAILABLE]
SPARQ_CONFIGS = list(_SPARQ) or [UNAVAILABLE]

#: The end-to-end decode benchmark (``loki.bench.e2e``, whole models with random weights): setting ids
#: ``<model>-B<B>-S<S>[-k<k>]`` of ``loki.bench.e2e.E2E_MODELS`` (Llama-2-7B and Llama-3-8B dimensions;
#: ``loki.bench.e2e.Setting.parse``).  An id without ``-k`` runs at k_f = 0.25 (the ids recorded before budgets
#: were part of them mean that); ``-k2048`` is a fixed budget of 2048 tokens, ``-k0.5`` a fraction.  Two of the
#: issue's speed-target settings, then the KV-dominated ones: Llama-3-8B dims at B=1 S=131072 with k = 2048, and
#: at B=8 S=32768 with k_f = 0.25 and with k = 2048.
E2E_SETTINGS = ["llama2-7b-B8-S4096", "llama3-8b-B16-S8192", "llama3-8b-B1-S131072-k2048", "llama3-8b-B8-S32768",
                "llama3-8b-B8-S32768-k2048"]

#: The split select (``loki.kernels.select_topk_split``) alone at the KV-dominated settings' shapes, one row per
#: KV head: name -> (B, H, S, k).  ``8x131072``: Llama-3-8B dims (8 KV heads) at B=1 S=131072; ``64x32768``: at
#: B=8 S=32768; k = 2048 both.
SELECT_SHAPES = {"8x131072-k2048": (1, 8, 131072, 2048), "64x32768-k2048": (8, 8, 32768, 2048)}
SELECT_CONFIGS = list(SELECT_SHAPES)

#: The profile of loki/evaluation/accuracy_thresholds.json whose settings the accuracy benchmarks run with (and whose
#: limits ci/gate.py applies to them): "tests", the budgets of the CPU accuracy tests (4 x 512 WikiText-2 tokens,
#: bases fitted on 4,096 calibration tokens covering the 512 positions used), so the CPU run stays at minutes.
ACCURACY_PROFILE = "tests"
#: Method names of the ``tests`` profile (``loki.evaluation.suite``; "d=D" rows are the exactness settings): per
#: query head, then (appended, so the earlier cases keep their place) the embedded GQA model's default mode, one
#: selection per KV group with "softmax-max" (``loki-score[kv]`` is the default configuration).  A name a commit's
#: suite does not produce is skipped.
ACCURACY_METHODS = [
    "full",
    "exact_topk[query]",
    "loki-pre[query]",
    "loki-post[query]",
    "loki-score[query]",
    "h2o",
    "loki-post(d=D,k=all)",
    "loki-post(d=D)[query]",
    "exact_topk[kv]",
    "loki-pre[kv]",
    "loki-post[kv]",
    "loki-score[kv]",
]
#: Bases of the top-k agreement (PCA of pre- / post-rotary keys, the score-aware pair).
ACCURACY_BASES = ["pre", "post", "score"]


def config_by_id(config_id: str):
    """The harness ``BenchConfig`` of an id of either kernel grid (KeyError for the placeholder)."""
    return {**_KERNEL, **_SPARQ}[config_id]

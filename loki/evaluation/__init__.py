"""Evaluation of sparse attention on real models: the embedded default model (``models``), offline text
loaders (``data``), perplexity with decode-time semantics (``perplexity``), top-k agreement (``agreement``),
Rank@v analysis and plots (``rank``), the bases of the evaluation (``bases``), confidence intervals
(``intervals``), the accuracy suite (``suite``) and its gates (``gates``), the RULER-style retrieval suite
(``retrieval``), reports (``report``), the main job ``loki check`` (``check``), the methods at matched bytes
(``compare``) with their selection diagnostics (``diagnostics``) and the CLI subcommands (``commands``).

Submodules are imported lazily: ``import loki.evaluation`` loads neither transformers nor matplotlib.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_default_model": "models",
    "load_model": "models",
    "cache_root": "models",
    "load_wikitext": "data",
    "load_packaged_corpus": "data",
    "load_corpus": "data",
    "token_windows": "data",
    "TextSource": "data",
    "MethodSpec": "perplexity",
    "PerplexityResult": "perplexity",
    "perplexity": "perplexity",
    "evaluate_methods": "perplexity",
    "effective_density": "perplexity",
    "standard_methods": "perplexity",
    "topk_agreement": "agreement",
    "selection_agreement": "agreement",
    "rank_summary": "rank",
    "write_rank_plots": "rank",
    "write_report": "report",
    "SuiteOptions": "suite",
    "PROFILES": "suite",
    "profile_options": "suite",
    "run_suite": "suite",
    "evaluate_gates": "gates",
    "load_thresholds": "gates",
    "CalibrationRecipe": "bases",
    "DEFAULT_RECIPE": "bases",
    "get_bases": "bases",
    "paired_increase": "intervals",
    "resolve_device": "models",
    "evaluate_retrieval": "retrieval",
    "CompareOptions": "compare",
    "run_compare": "compare",
    "layer_diagnostics": "diagnostics",
    "summarize_diagnostics": "diagnostics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

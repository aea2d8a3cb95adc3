"""Framework integrations: Hugging Face transformers (``loki.integrations.transformers``: ``enable_loki``,
``disable_loki``) and lm-evaluation-harness (``loki.integrations.lm_eval``: the ``loki`` model).

Nothing is imported eagerly, so ``import loki.integrations`` does not import transformers or lm-eval.
"""

from __future__ import annotations

import importlib

__all__ = ["disable_loki", "enable_loki", "teacher_forced_attention"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(".transformers", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

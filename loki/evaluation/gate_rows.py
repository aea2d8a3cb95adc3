"""The pieces of a gate that the gates and the targets share (no import between those two modules): a result
row's role, a run's primary setting and the gate record itself."""

from __future__ import annotations

from loki.evaluation.perplexity import method_role

__all__ = ["primary_setting", "row_role"]


def row_role(row: dict) -> str:
    """A row's role (baseline, oracle, loki, competitor): its ``role`` field, or (older results) its method's."""
    return row.get("role") or method_role(row["method"])


def primary_setting(results: dict) -> tuple[int, int | float]:
    """(window length, budget) of the run's primary setting, where the structural gates look: the budget a fraction
    k_f, or an int count of tokens."""
    s = results.get("settings", {})
    k = s["k"]
    return int(s["windows"][0][0]), k if isinstance(k, int) and not isinstance(k, bool) else float(k)


def _gate(name, value, bound, passed, bound_text=None, note=None) -> dict:
    g = {"name": name, "value": value, "bound": bound, "passed": bool(passed)}
    if bound_text:
        g["bound_text"] = bound_text
    if note:
        g["note"] = note
    return g

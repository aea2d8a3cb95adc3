"""The pieces of a gate that the gates and the targets share (no import between those two modules): a result
row's role, a run's primary setting, its default GQA mode and the gate record itself."""

from __future__ import annotations

from loki.evaluation.perplexity import method_role

__all__ = ["default_gqa", "in_default_mode", "primary_setting", "row_role"]


def row_role(row: dict) -> str:
    """A row's role (baseline, oracle, loki, competitor): its ``role`` field, or (older results) its method's."""
    return row.get("role") or method_role(row["method"])


def default_gqa(results: dict) -> tuple[str, str]:
    """(gqa_select, aggregate) of the run's default Loki configuration (``settings["default_gqa_select"]`` and
    ``["default_aggregate"]``: "kv" with "softmax-max" on a GQA model); results written before these fields, when
    the default was per query head: ("query", "sum")."""
    s = results.get("settings", {})
    return s.get("default_gqa_select", "query"), s.get("default_aggregate", "sum")


def in_default_mode(row: dict, gqa: tuple[str, str]) -> bool:
    """Whether a result row (or retrieval cell) is in the default GQA mode ``gqa`` (:func:`default_gqa`): the same
    ``gqa_select`` and, for a shared selection, the same ``aggregate`` (rows without these fields: "query", "sum")."""
    mode, aggregate = gqa
    if row.get("gqa_select", "query") != mode:
        return False
    return mode != "kv" or row.get("aggregate", "sum") == aggregate


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

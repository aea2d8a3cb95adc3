"""The report of an accuracy run: a markdown summary, the full results as JSON and the plots, in one folder.

``results`` is a JSON-able dict built by :mod:`loki.evaluation.check` with the keys ``settings``,
``perplexity`` (list of :class:`~loki.evaluation.perplexity.PerplexityResult` dicts), ``paper_protocol``,
``agreement``, ``rank``, ``generalization``, ``gates`` and ``plots`` (any may be missing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["markdown_report", "perplexity_table", "write_report"]


def _fmt(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2e}" if 0 < abs(x) < 1e-3 else f"{x:.{nd}f}"
    return str(x)


def perplexity_table(rows: list[dict], full_ppl: float | None = None) -> str:
    """A markdown table of perplexity results (method, k, d, GQA mode, perplexity, delta vs full, density)."""
    if full_ppl is None:
        full = [r for r in rows if r["method"] == "full"]
        full_ppl = full[0]["ppl"] if full else None
    lines = [
        "| setting | method | basis | GQA | k | d (r) | perplexity | vs full | density | time (s) |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        delta = f"{100 * (r['ppl'] / full_ppl - 1):+.2f}%" if full_ppl else "-"
        lines.append(
            f"| {r['name']} | {r['method']} | {r.get('basis') or '-'} | {r.get('gqa_select', '-')} | {r['k']} | "
            f"{r['d']} | {r['ppl']:.4f} | {delta} | {r['density']:.3f} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def markdown_report(results: dict) -> str:
    s = results.get("settings", {})
    out = ["# Loki accuracy report", ""]
    if s:
        out += [
            f"- model: {s.get('model')} ({s.get('model_path')})",
            f"- evaluation text: {s.get('eval_origin')}; {s.get('eval_windows')} windows x {s.get('eval_seq_len')} "
            f"tokens (offset {s.get('eval_offset')})",
            f"- calibration: {s.get('calib_corpus')} ({s.get('calib_origin')}), {s.get('calib_tokens')} tokens, "
            f"sequences of {s.get('calib_seq_len')}",
            f"- budgets: k_f = {s.get('k')}, d_f = {s.get('d')}; protocol `decode` = every query row i selects "
            "ceil(k_f (i+1)) of the i+1 tokens it sees",
            f"- wall time: {_fmt(results.get('seconds'), 1)} s, torch threads: {s.get('threads')}",
            "",
        ]
    gates = results.get("gates")
    if gates:
        failed = [g for g in gates if not g["passed"]]
        out += [f"## Gates: {'FAIL' if failed else 'PASS'} ({len(gates) - len(failed)}/{len(gates)} passed)", "",
                "| gate | value | bound | result |", "|---|---:|---:|---|"]
        for g in gates:
            out.append(f"| {g['name']} | {_fmt(g.get('value'), 6)} | {g.get('bound_text', _fmt(g.get('bound'), 6))} "
                       f"| {'pass' if g['passed'] else '**FAIL**'} |")
        out.append("")
    if results.get("perplexity"):
        out += ["## Perplexity (decode-time semantics)", "", perplexity_table(results["perplexity"]), ""]
    if results.get("paper_protocol"):
        full = [r for r in results.get("perplexity", []) if r["method"] == "full"]
        out += ["## Perplexity, the paper's protocol (k a fraction of the whole window)", "",
                "Row i keeps min(ceil(k_f T), i+1) tokens, so the density (fraction of causal entries attended) is "
                "far above k_f.", "",
                perplexity_table(results["paper_protocol"], full[0]["ppl"] if full else None), ""]
    if results.get("agreement"):
        out += ["## Top-k agreement with exact top-k", "",
                "Jaccard of Loki's selection with the exact top-k, and the exact attention mass on the selection "
                "(the exact top-k's own mass is the ceiling), averaged over layers, heads and informative rows.", "",
                "| basis | Jaccard | mass captured | exact top-k mass |", "|---|---:|---:|---:|"]
        for name, a in results["agreement"].items():
            out.append(f"| {name} | {a['jaccard_mean']:.4f} | {a['mass_mean']:.4f} | {a['mass_exact_mean']:.4f} |")
        out.append("")
    if results.get("rank"):
        out += ["## Rank@90 of the keys", "", "| basis | mean Rank@90 | of D | per layer |", "|---|---:|---:|---|"]
        for name, r in results["rank"].items():
            v = r.get("v90", {})
            per = ", ".join(f"{x:.1f}" for x in v.get("per_layer", []))
            out.append(f"| {name} | {v.get('mean', 0):.2f} | {r['D']} | {per} |")
        out.append("")
    if results.get("downstream"):
        ds = results["downstream"]
        tasks = ds["tasks"]
        out += [f"## Downstream accuracy (lm-eval, {ds['num_fewshot']}-shot, first {ds['limit']} documents per task)",
                "", "| method | " + " | ".join(tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
        for name, acc in ds["accuracy"].items():
            out.append(f"| {name} | " + " | ".join(f"{acc[t]:.3f}" for t in tasks) + f" | {acc['mean']:.3f} |")
        out.append("")
    if results.get("generalization"):
        g = results["generalization"]
        texts = g["texts"]
        out += ["## Generalisation (calibration corpus x evaluation text)", "",
                f"Loki `{g['setting']}`; perplexity (and change vs full attention on the same text).", "",
                "| basis calibrated on | " + " | ".join(texts) + " |", "|---|" + "---:|" * len(texts),
                "| (full attention) | " + " | ".join(f"{g['full'][t]:.3f}" for t in texts) + " |"]
        for cal, row in g["table"].items():
            cells = [f"{row[t]:.3f} ({100 * (row[t] / g['full'][t] - 1):+.1f}%)" for t in texts]
            out.append(f"| {cal} | " + " | ".join(cells) + " |")
        out.append("")
    plots = results.get("plots")
    if plots:
        out += ["## Plots", ""]
        for name, file in plots.items():
            out += [f"![{name}]({file})", ""]
    return "\n".join(out)


def write_report(results: dict, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``report.md`` and ``results.json`` into ``out_dir`` (plots are written by the caller)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    js = out_dir / "results.json"
    md.write_text(markdown_report(results), encoding="utf-8")
    js.write_text(json.dumps(results, indent=2, sort_keys=False, default=str), encoding="utf-8")
    return {"markdown": md, "json": js}

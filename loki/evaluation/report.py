"""The report of an accuracy run: a markdown summary, the full results as JSON and the plots, in one folder.

``results`` is the JSON-able dict of :func:`loki.evaluation.suite.run_suite` with the keys ``settings``,
``perplexity`` (rows of :class:`~loki.evaluation.perplexity.PerplexityResult` with ``seq_len``, ``windows`` and
the increase over full attention with its 95% interval), ``paper_protocol``, ``comparisons``, ``exactness``,
``agreement``, ``rank``, ``retrieval``, ``generalization``, ``downstream``, ``gates``, ``plots`` and
``provenance`` (:func:`loki.provenance.provenance`: commit, package versions, device; any may be missing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loki._io import atomic_write

from .report_plots import budget_cell, write_bytes_plot, write_length_plot

__all__ = ["budget_cell", "bytes_cell", "default_configuration", "markdown_report", "perplexity_table",
           "verdict_lines", "write_bytes_plot", "write_length_plot", "write_report"]


def _fmt(x, nd=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2e}" if 0 < abs(x) < 1e-3 else f"{x:.{nd}f}"
    return str(x)


def _increase(r: dict) -> str:
    if "increase" not in r:
        return "-"
    if r.get("method") == "full":
        return "0"
    return f"{100 * r['increase']:+.2f}% [{100 * r['increase_lo']:+.2f}, {100 * r['increase_hi']:+.2f}]"


def default_configuration(settings: dict, query_rows: bool = True) -> str:
    """The run's default Loki configuration in words: the default basis in the default GQA mode (results written
    before ``default_gqa_select`` existed: per query head, the default of then); ``query_rows``: the run has
    per-query-head rows beside a shared default (named as the comparison)."""
    basis, mode = settings.get("default_basis"), settings.get("default_gqa_select", "query")
    if mode == "kv":
        return (f"`loki-{basis}[kv]`, the {basis} basis with one selection per KV group, aggregate "
                f"{settings.get('default_aggregate')} (the configuration the speed benchmarks time)"
                + ("; the `[query]` rows select per query head, a comparison" if query_rows else ""))
    return f"`loki-{basis}[query]`, the {basis} basis with per-query-head selection"


def bytes_cell(r: dict) -> str:
    """The bytes a decode step reads relative to dense attention (``bytes_fraction``), or ``-`` (not measured)."""
    b = r.get("bytes_fraction")
    return "-" if b is None else f"{b:.3f}"


def perplexity_table(rows: list[dict]) -> str:
    """A markdown table of perplexity rows: setting, window, budget (k_f, or a count of tokens), d, GQA selection
    (with the aggregate of a shared one), perplexity, increase over full attention with its paired 95% interval,
    the bytes a decode step reads relative to dense attention (``perplexity.bytes_fractions``), density, time."""
    lines = [
        "| setting | window | k | d (r) | GQA | perplexity | vs full [95% interval] | bytes of dense | density "
        "| time (s) |",
        "|---|---|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        k = "-" if r["method"] == "full" else budget_cell(r["k"])
        d = "-" if r["method"] in ("full", "exact_topk", "h2o") else f"{r['d']:g}"
        g = r.get("gqa_select", "query")
        gqa = "-" if r["method"] in ("full", "dense", "pcaattn") else (
            f"kv ({r.get('aggregate', 'sum')})" if g == "kv" else g)
        lines.append(f"| {r['name']} | {r.get('windows', '?')} x {r.get('seq_len', '?')} | {k} | {d} | {gqa} "
                     f"| {r['ppl']:.3f} | {_increase(r)} | {bytes_cell(r)} | {r['density']:.3f} "
                     f"| {r['seconds']:.1f} |")
    return "\n".join(lines)


def _pct_iv(v: float, lo: float, hi: float) -> str:
    return f"{100 * v:+.1f}% [95% interval {100 * lo:+.1f}%, {100 * hi:+.1f}%]"


def _primary_rows(results: dict) -> tuple[dict | None, dict | None]:
    """The default Loki row and the exact top-k row of the same GQA mode at the primary budget, at the first window
    length of the run (the primary one) that has a default row."""
    from loki.evaluation.gate_rows import default_gqa, in_default_mode, primary_setting, row_role

    _, k0 = primary_setting(results)
    gqa = default_gqa(results)
    basis = results["settings"].get("default_basis")
    for T, _ in results["settings"].get("windows", []):
        rows = [r for r in results.get("perplexity", []) if r.get("seq_len") == T and r.get("k") == k0
                and "increase_lo" in r]
        default = next((r for r in rows if r.get("default")), None) or next(
            (r for r in rows if row_role(r) == "loki" and r.get("basis") == basis and in_default_mode(r, gqa)), None)
        if default is not None:
            oracle = next((r for r in rows if row_role(r) == "oracle" and in_default_mode(r, gqa)), None)
            return default, oracle
    return None, None


def _retrieval_counts(results: dict, default: dict | None, oracle: dict | None) -> str:
    cells = {c["name"]: c for c in results.get("retrieval", {}).get("cells", []) if c.get("task") == "all"}
    d, o = cells.get((default or {}).get("name")), cells.get((oracle or {}).get("name"))
    if not d or not d.get("n"):
        return ""
    text = f"; retrieval at {d['context_len']} tokens: {d['correct']} of {d['n']} answers"
    if o and o.get("n"):
        text += f" (exact top-k {o['correct']}, full attention {round(d['full_accuracy'] * d['n'])})"
    return text


def verdict_lines(results: dict, thresholds: dict | None = None) -> list[str]:
    """The report's opening: three lines (does Loki work on this model, at what cost, how fast) and the exit
    status with its rule (:data:`loki.evaluation.gates.EXIT_RULE`)."""
    from loki.evaluation.gate_rows import primary_setting
    from loki.evaluation.gates import EXIT_RULE
    from loki.evaluation.targets import target_status

    s = results.get("settings", {})
    if not s.get("windows"):
        return []
    gates = results.get("gates") or []
    failed = [g for g in gates if not g["passed"]]
    known = [g for g in failed if g.get("known")]
    unknown = [g for g in failed if not g.get("known")]
    ext = results.get("exit") or {}
    default, oracle = _primary_rows(results)
    k0 = primary_setting(results)[1]
    T0 = default["seq_len"] if default is not None else s["windows"][0][0]
    n = next((w[1] for w in s["windows"] if w[0] == T0), "?")
    if not gates:
        works = "not decided: no gate ran"
    elif unknown:
        works = (f"**no**: {len(unknown)} of {len(gates)} gates failed (see Gates): "
                 + "; ".join(g["name"] for g in unknown[:3]) + ("; ..." if len(unknown) > 3 else ""))
    elif known:
        works = (f"**yes, with {len(known)} known miss(es)** of the targets (recorded, no worse than recorded"
                 + ("; accepted by --allow-known-misses" if ext.get("allow_known_misses") else
                    "; they fail the run unless --allow-known-misses") + ")")
    else:
        works = f"**yes**: every gate passed ({len(gates)} of {len(gates)})"
    if default is not None:
        works += (f". The default configuration `{default['name']}` raises perplexity by "
                  f"{100 * default['increase']:+.1f}% over full attention")
        if oracle is not None:
            works += (f", exact top-k at the same budget (the best any selection of that size does) by "
                      f"{100 * oracle['increase']:+.1f}%")
        works += _retrieval_counts(results, default, oracle)
    lines = [f"- **Does Loki work on this model?** {works}."]
    if default is not None:
        cost = (f"{_pct_iv(default['increase'], default['increase_lo'], default['increase_hi'])} perplexity on "
                f"{n} x {T0} tokens of {s.get('eval_origin')}, at k = {budget_cell(k0)}, d_f = {s.get('d')}")
        if default.get("bytes_fraction") is not None:
            cost += f", reading {default['bytes_fraction']:.2f} of dense attention's bytes per decode step"
        tgt = [t for t in target_status(results, thresholds if thresholds is not None else _shipped())
               if t["kind"] == "ppl" and t.get("measured") == default["increase"]]
        if tgt:
            cost += f"; target {100 * tgt[0]['bound']:+.0f}%: {tgt[0]['verdict']}"
        lines.append(f"- **At what cost?** {cost}.")
        speed = ("this run measures accuracy, not speed (the CPU's PyTorch reference is not the GPU kernels)")
        if default.get("bytes_fraction"):
            speed += (f"; a decode step of the default reads {default['bytes_fraction']:.2f} of the bytes of dense "
                      f"attention, so its attention can be at most {1 / default['bytes_fraction']:.1f}x faster "
                      "where attention is bandwidth-bound; GPU timings: `loki bench` and the ASV history "
                      "(docs/benchmarks.md)")
        lines.append(f"- **How fast?** {speed[0].upper() + speed[1:]}. This run: "
                     f"{_fmt((results.get('seconds') or 0) / 60, 1)} min on {s.get('threads')} torch thread(s) "
                     f"({s.get('card')}).")
    status = ext.get("status", 0 if gates and not unknown and (not known or ext.get("allow_known_misses")) else 1)
    rule = EXIT_RULE.replace("\n", " ").split(": ", 1)[1]
    lines += ["", f"Exit status **{status}**" + (f" ({ext['summary']})" if ext.get("summary") else "")
              + f". The rule: {rule}"]
    return lines


def _shipped() -> dict:
    from loki.evaluation.gates import load_thresholds

    return load_thresholds()


def markdown_report(results: dict, thresholds: dict | None = None) -> str:
    """The markdown report of a run, opening with the verdict (:func:`verdict_lines`); the Targets section reads
    ``thresholds`` (default: the shipped file)."""
    s = results.get("settings", {})
    out = ["# Loki accuracy report", ""]
    verdict = verdict_lines(results, thresholds)
    if verdict:
        out += ["## Verdict", "", *verdict, ""]
    if s:
        cal = s.get("calibration", {})
        out += [
            f"- model: {s.get('model')} ({s.get('model_path')}), {s.get('dtype')} on {s.get('card')}",
            f"- profile `{s.get('profile')}`; evaluation text: {s.get('eval_origin')}; windows (tokens x count): "
            + ", ".join(f"{t} x {n}" for t, n in s.get("windows", [])),
            f"- calibration: {s.get('calib_origin')}, {cal.get('num_tokens')} tokens in sequences of "
            f"{cal.get('seq_len')}, positions [0, {cal.get('max_positions')}); default basis: {s.get('default_basis')}",
            f"- default Loki configuration: "
            f"{default_configuration(s, any(r.get('gqa_select') == 'query' for r in results.get('perplexity', [])))}",
            f"- budgets: k = {', '.join(budget_cell(k) for k in s.get('k_values', [s.get('k')]))} (primary "
            f"{budget_cell(s.get('k'))})" + (f", fixed counts {', '.join(budget_cell(k) for k in s['k_counts'])} at "
                                             f"{s.get('count_window')}-token windows" if s.get("k_counts") else "")
            + f", d_f = {s.get('d')}; protocol `decode`: every query row i selects ceil(k_f (i+1)) of the i+1 tokens "
            "it sees (a count k: min(k, i+1)); bytes of dense: d/(2D) + distinct tokens read per KV head / tokens "
            "seen, measured from the selections",
            "- intervals: 95%, paired block bootstrap over 128-token blocks of per-token NLL differences "
            "(`loki.evaluation.intervals`)",
            f"- wall time: {_fmt(results.get('seconds'), 1)} s, torch threads: {s.get('threads')}",
            "",
        ]
    prov = results.get("provenance")
    if prov:
        commit = prov.get("commit")
        code = "not a git checkout"
        if commit:
            code = f"commit {commit[:12]}" + (" with local changes" if prov.get("dirty") else "")
        versions = ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items() if v)
        dev = prov.get("device") or {}
        if out[-1] == "":
            out.pop()
        out += [f"- code: {code}; {versions}; device: {dev.get('type')} ({dev.get('name')})", ""]
    gates = results.get("gates")
    if gates:
        failed = [g for g in gates if not g["passed"]]
        known = [g for g in failed if g.get("known")]
        head = "FAIL" if len(known) < len(failed) else ("KNOWN MISSES" if known else "PASS")
        out += [f"## Gates: {head} ({len(gates) - len(failed)}/{len(gates)} passed"
                + (f", {len(known)} known misses" if known else "") + ")", "",
                "| gate | value | bound | result |", "|---|---:|---:|---|"]
        for g in gates:
            result = "pass" if g["passed"] else ("known miss" if g.get("known") else "**FAIL**")
            out.append(f"| {g['name']} | {_fmt(g.get('value'), 6)} | {g.get('bound_text', _fmt(g.get('bound'), 6))} "
                       f"| {result} |")
        out.append("")
        for g in known:
            out += [f"- known miss, {g['name']}: {g['known']}"]
        out += [""] if known else []
    out += _targets_section(results, thresholds)
    rows = results.get("perplexity", [])
    for T in sorted({r["seq_len"] for r in rows}, reverse=True):
        out += [f"## Perplexity, {T}-token windows (decode-time semantics)", "",
                perplexity_table([r for r in rows if r["seq_len"] == T]), ""]
    if results.get("paper_protocol"):
        out += ["## Perplexity, the paper's protocol (k a fraction of the whole window)", "",
                "Row i keeps min(ceil(k_f T), i+1) tokens, so the density (fraction of causal entries attended) is "
                "far above k_f.", "", perplexity_table(results["paper_protocol"]), ""]
    if results.get("exactness"):
        out += ["## Exactness (d = D)", "", perplexity_table(results["exactness"]), ""]
    out += _fast_path_section(results.get("fast_path"))
    if results.get("agreement"):
        out += ["## Top-k agreement with exact top-k", "",
                "Jaccard of Loki's selection with the exact top-k (both selecting per query head), and the exact "
                "attention mass on the selection (the exact top-k's own mass is the ceiling), averaged over layers, "
                "heads and informative rows of one window, at the primary k_f.", "",
                "| window | basis | Jaccard | mass captured | exact top-k mass |", "|---|---|---:|---:|---:|"]
        by_len = results.get("agreement_by_length") or {str(s.get("windows", [[0]])[0][0]): results["agreement"]}
        first = s.get("agreement_tokens")
        for T, per in by_len.items():
            where = f"first {first} tokens of one {T}-token window" if first and first < int(T) else T
            for name, a in per.items():
                out.append(f"| {where} | {name} | {a['jaccard_mean']:.4f} | {a['mass_mean']:.4f} | "
                           f"{a['mass_exact_mean']:.4f} |")
        out.append("")
    if results.get("retrieval"):
        from loki.evaluation import retrieval

        out += ["## Synthetic retrieval (exact match, 95% intervals)", "",
                retrieval.markdown_table(results["retrieval"]), ""]
    if results.get("retrieval_generate"):
        from loki.evaluation.retrieval_report import generate_markdown

        out += generate_markdown(results["retrieval_generate"])
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
        out += [f"## Downstream accuracy (lm-eval, {ds['num_fewshot']}-shot, first {ds['limit']} documents per task; "
                "± lm-eval's standard error)",
                "", "| method | " + " | ".join(tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
        for name, acc in ds["accuracy"].items():
            se = ds.get("stderr", {}).get(name, {})
            cells = [f"{acc[t]:.3f}" + (f" ± {se[t]:.3f}" if t in se else "") for t in tasks]
            out.append(f"| {name} | " + " | ".join(cells) + f" | {acc['mean']:.3f} |")
        out.append("")
    if results.get("generalization"):
        g = results["generalization"]
        texts = g["texts"]
        out += ["## Generalisation (calibration corpus x evaluation text)", "",
                f"Loki `{g['setting']}`; perplexity (and change vs full attention on the same text).", "",
                "| basis calibrated on | " + " | ".join(texts) + " |", "|---|" + "---:|" * len(texts),
                "| (full attention) | " + " | ".join(f"{g['full'][t]:.3f}" for t in texts) + " |"]
        for cal, row in g["table"].items():
            iv = g.get("intervals", {}).get(cal, {})
            cells = [f"{row[t]:.3f} ({100 * (row[t] / g['full'][t] - 1):+.1f}%"
                     + (f" [{100 * iv[t]['lo']:+.1f}, {100 * iv[t]['hi']:+.1f}]" if t in iv else "") + ")"
                     for t in texts]
            out.append(f"| {cal} | " + " | ".join(cells) + " |")
        out.append("")
    plots = results.get("plots")
    if plots:
        out += ["## Plots", ""]
        for name, file in plots.items():
            out += [f"![{name}]({file})", ""]
    return "\n".join(out)


def _fast_path_section(fp: dict | None) -> list[str]:
    """The fast path's perplexity (compiled static cache, Triton kernels, token by token) beside the engine's."""
    if not fp:
        return []
    out = ["## The fast path's own accuracy (compiled static cache, Triton kernels, token by token)", ""]
    if "skipped" in fp:
        return out + [f"Skipped: {fp['skipped']}.", ""]
    s, e = fp["setting"], fp["engine"]
    out += [f"`{s['name']}` ({s['gqa_select']}, aggregate {s['aggregate']}), k = {budget_cell(s['k'])}, "
            f"d = {s['d']:g}, {s['windows']} x {s['seq_len']} tokens; the evaluation engine ({e['dtype']}): "
            f"perplexity {e['ppl']:.4f}.", "",
            "| dtype | perplexity | vs engine | paired 95% interval | time (s) |", "|---|---:|---:|---|---:|"]
    for r in fp["rows"]:
        out.append(f"| {r['dtype']} | {r['ppl']:.4f} | {100 * r['rel_diff']:+.3f}% | "
                   f"[{100 * r['increase_lo']:+.3f}, {100 * r['increase_hi']:+.3f}] | {r['seconds']:.0f} |")
    return out + [""]


def _targets_section(results: dict, thresholds: dict | None) -> list[str]:
    """The project's accuracy targets (:mod:`loki.evaluation.targets`) against this run: the point estimate
    decides met / missed, the interval whether a miss is significant (what the gate decides)."""
    from loki.evaluation.gates import load_thresholds
    from loki.evaluation.targets import target_status

    if thresholds is None:
        thresholds = load_thresholds()
    if not results.get("settings", {}).get("windows"):
        return []
    rows = target_status(results, thresholds)
    if not rows:
        return []
    out = ["## Targets (loki/evaluation/accuracy_thresholds.json)", "",
           "A target is met when the point estimate is within it; a miss is significant, and fails its gate, only "
           "when the whole 95% interval lies beyond the target.", "",
           "| target | bound | this run [95% interval] | verdict |", "|---|---:|---|---|"]
    for r in rows:
        if "measured" not in r:
            continue
        fmt = (lambda x: f"{100 * x:+.1f}%") if r["kind"] == "ppl" else (lambda x: f"{100 * x:+.1f} points")
        got = f"{fmt(r['measured'])} [{fmt(r['lo'])}, {fmt(r['hi'])}]"
        out.append(f"| {r['target']} | {fmt(r['bound'])} | {got} | {r['verdict']} |")
    if len(out) == 6:  # no target measured: no table
        out = out[:4]
    absent = [r["target"].replace("default Loki, ", "") for r in rows if "measured" not in r]
    if absent:
        out += ["", "Not measured in this run (other window lengths or budgets): " + "; ".join(absent) + "."]
    return out + [""]


def write_report(results: dict, out_dir: str | os.PathLike, thresholds: dict | None = None) -> dict[str, Path]:
    """Write ``report.md`` and ``results.json`` into ``out_dir`` (plots are written by the caller), each
    atomically (:func:`loki._io.atomic_write`): results.json first, so the full results survive a failing
    report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    js = out_dir / "results.json"
    atomic_write(js, json.dumps(results, indent=2, sort_keys=False, default=str))
    atomic_write(md, markdown_report(results, thresholds))
    return {"markdown": md, "json": js}

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

from loki._io import atomic_path, atomic_write

__all__ = ["budget_cell", "bytes_cell", "default_configuration", "markdown_report", "perplexity_table",
           "write_bytes_plot", "write_length_plot", "write_report"]


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


def default_configuration(settings: dict) -> str:
    """The run's default Loki configuration in words: the default basis in the default GQA mode (results written
    before ``default_gqa_select`` existed: per query head, the default of then)."""
    basis, mode = settings.get("default_basis"), settings.get("default_gqa_select", "query")
    if mode == "kv":
        return (f"`loki-{basis}[kv]`, the {basis} basis with one selection per KV group, aggregate "
                f"{settings.get('default_aggregate')} (the configuration the speed benchmarks time); the `[query]` "
                "rows select per query head, a comparison")
    return f"`loki-{basis}[query]`, the {basis} basis with per-query-head selection"


def budget_cell(k) -> str:
    """A budget in a table: a fraction k_f as ``0.25``, a count of tokens as ``512 tok``."""
    return f"{k} tok" if isinstance(k, int) and not isinstance(k, bool) else f"{k:g}"


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


def write_bytes_plot(rows: list[dict], out_dir, filename: str = "ppl_vs_bytes.png") -> dict[str, str]:
    """``ppl_vs_bytes.png``: the perplexity increase over full attention (with its 95% interval) against the
    bytes a decode step reads relative to dense attention (``bytes_fraction``), one panel per window length, one
    line per setting through its budgets (one colour per setting, one marker per method and basis, dashed for
    a shared selection per KV group).
    Rows without an increase or a measured ``bytes_fraction`` are left out.  Returns ``{"ppl_vs_bytes": name}``
    (``{}`` when no row has both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("method") != "full" and "increase" in r and r.get("bytes_fraction") is not None]
    if not rows:
        return {}
    lengths = sorted({r.get("seq_len") for r in rows}, reverse=True)
    names = sorted({r["name"] for r in rows})
    families = sorted({n.split("[")[0] for n in names})
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, T in zip(axes[0], lengths):
        for name in names:
            pts = sorted((r["bytes_fraction"], r["increase"], r["increase_lo"], r["increase_hi"], r["k"])
                         for r in rows if r["name"] == name and r.get("seq_len") == T)
            if not pts:
                continue
            i = families.index(name.split("[")[0])
            shared = "[kv" in name
            color, marker = cmap(names.index(name) % cmap.N), "osD^v<>ph*"[i % 10]
            x = [p[0] for p in pts]
            y = [100 * p[1] for p in pts]
            err = [[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]]
            ax.errorbar(x, y, yerr=err, marker=marker, color=color, capsize=3, label=name,
                        linestyle="--" if shared else "-")
            for p in pts:
                ax.annotate(budget_cell(p[4]), (p[0], 100 * p[1]), fontsize=6, textcoords="offset points",
                            xytext=(3, 3), color=color)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xlabel("bytes read per decode step / dense")
        ax.set_ylabel("perplexity increase over full attention (%)")
        ax.set_title(f"{T}-token windows")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / filename) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return {"ppl_vs_bytes": filename}


def write_length_plot(results: dict, out_dir) -> dict[str, str]:
    """``ppl_vs_length.png``: the perplexity increase over full attention (with its 95% interval) against the
    window length, one panel per k_f, one line per setting.  Returns ``{"ppl_vs_length": file name}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loki.evaluation.perplexity import budget_label

    rows = [r for r in results.get("perplexity", []) if r["method"] != "full" and "increase" in r]
    ks = sorted({r["k"] for r in rows}, key=lambda k: (isinstance(k, int), -k))  # fractions first, then counts
    if not rows:
        return {}
    # one colour and marker per setting in every panel (a setting missing from a panel must not shift the others):
    # a method's GQA modes share a hue and marker, dark for "query" (or none), light for "kv"
    names = sorted({r["name"] for r in rows})
    families = sorted({n.split("[")[0] for n in names})
    cmap = plt.get_cmap("tab20")
    style = {}
    for name in names:
        i = families.index(name.split("[")[0])
        style[name] = (cmap((2 * i + name.endswith("[kv]")) % cmap.N), "osD^v<>ph*"[i % 10])
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        names = sorted({r["name"] for r in rows if r["k"] == k})
        for name in names:
            pts = sorted((r["seq_len"], r["increase"], r["increase_lo"], r["increase_hi"]) for r in rows
                         if r["k"] == k and r["name"] == name)
            if len(pts) < 2:
                continue
            x = [p[0] for p in pts]
            y = [100 * p[1] for p in pts]
            err = [[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]]
            color, marker = style[name]
            ax.errorbar(x, y, yerr=err, marker=marker, color=color, capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xlabel("window (tokens)")
        ax.set_ylabel("perplexity increase over full attention (%)")
        ax.set_title(budget_label(k))
        ax.grid(True, alpha=0.3)
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / "ppl_vs_length.png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return {"ppl_vs_length": "ppl_vs_length.png"}


def markdown_report(results: dict, thresholds: dict | None = None) -> str:
    """The markdown report of a run; the Targets section reads ``thresholds`` (default: the shipped file)."""
    s = results.get("settings", {})
    out = ["# Loki accuracy report", ""]
    if s:
        cal = s.get("calibration", {})
        out += [
            f"- model: {s.get('model')} ({s.get('model_path')}), {s.get('dtype')} on {s.get('card')}",
            f"- profile `{s.get('profile')}`; evaluation text: {s.get('eval_origin')}; windows (tokens x count): "
            + ", ".join(f"{t} x {n}" for t, n in s.get("windows", [])),
            f"- calibration: {s.get('calib_origin')}, {cal.get('num_tokens')} tokens in sequences of "
            f"{cal.get('seq_len')}, positions [0, {cal.get('max_positions')}); default basis: {s.get('default_basis')}",
            f"- default Loki configuration: {default_configuration(s)}",
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
                "Jaccard of Loki's selection with the exact top-k, and the exact attention mass on the selection "
                "(the exact top-k's own mass is the ceiling), averaged over layers, heads and informative rows of "
                "one window, at the primary k_f.", "",
                "| window | basis | Jaccard | mass captured | exact top-k mass |", "|---|---|---:|---:|---:|"]
        by_len = results.get("agreement_by_length") or {str(s.get("windows", [[0]])[0][0]): results["agreement"]}
        for T, per in by_len.items():
            for name, a in per.items():
                out.append(f"| {T} | {name} | {a['jaccard_mean']:.4f} | {a['mass_mean']:.4f} | "
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
    decides met / missed (the README's reading), the gates decide on the interval."""
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
           "| target | bound | this run [95% interval] | point estimate |", "|---|---:|---|---|"]
    for r in rows:
        fmt = (lambda x: f"{100 * x:+.1f}%") if r["kind"] == "ppl" else (lambda x: f"{100 * x:+.1f} points")
        got = f"{fmt(r['measured'])} [{fmt(r['lo'])}, {fmt(r['hi'])}]" if "measured" in r else "-"
        out.append(f"| {r['target']} | {fmt(r['bound'])} | {got} | {r['status']} |")
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

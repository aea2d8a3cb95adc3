"""The report of ``loki compare`` (:mod:`loki.evaluation.compare`): the markdown table of every method at matched
bytes with its interval and selection diagnostics, the per-layer table, the worst heads, and the plot of accuracy
against bytes (the default highlighted).
"""

from __future__ import annotations

from pathlib import Path

from .compare import COMPARE_METHODS

__all__ = ["compare_markdown", "write_compare_plot"]


def _fmt(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _interval_cell(r: dict, key: str = "increase") -> str:
    """``r[key]`` as a percentage with its 95% interval (``key_lo``, ``key_hi``); "-" when not measured."""
    if key not in r:
        return "-"
    return f"{_pct(r[key])} [{100 * r[key + '_lo']:+.1f}, {100 * r[key + '_hi']:+.1f}]"


def compare_markdown(results: dict) -> str:
    """The report: per window set, one table of every method at the target bytes, the per-layer recall of each
    method, and the heads where the default loses most."""
    st = results["settings"]
    lines = [
        "# Sparse attention methods at matched bytes",
        "",
        f"Model {st['model']} on {st['card']} ({st['dtype']}), text {st['eval_origin']}; decode-time semantics (row i "
        "keeps its budget of the i + 1 tokens it sees); bases calibrated on "
        f"{st['calib_origin']} ({st['calibration'].get('num_tokens')} tokens, positions "
        f"[0, {st['calibration'].get('max_positions')})). Target: the bytes per decode step of "
        f"`{st['default_method']}` at k_f = {st['k']:g}, d_f = {st['d']:g}"
        + (f" (given: {st['target_bytes']:.4f})" if st["target_bytes"] is not None else " (measured on the probe)")
        + "; each method's budget k_f is chosen to read them (probed on up to "
        f"{st.get('probe_rows', 1024)} rows of the first {st['probe_windows']} window(s); H2O from the byte model; a "
        f"run missing the target by more than {st.get('rerun_tolerance', 0.01):g} runs again with its budget "
        "corrected by its measured bytes, once, H2O up to twice). "
        "Increase of perplexity over full attention with its paired 95% interval, and over the default's on the "
        "same tokens (below 0: more accurate than the default); bytes measured from the "
        "selections; recall of the exact top-k set and attention mass captured (the exact top-k set's in "
        "parentheses), means over informative rows, layers and query heads.",
        "",
    ]
    for run in results["runs"]:
        T, N = run["seq_len"], run["windows"]
        lines += [f"## {T} x {N} tokens (target {run['target_bytes']:.4f} of dense)", "",
                  "| method | k_f | d or r | bytes / dense | perplexity | increase over full [95%] | vs the default "
                  "[95%] | top-k recall | attention mass (oracle) | note |",
                  "|---|---:|---:|---:|---:|---|---|---:|---|---|"]
        for r in run["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['label']} | | | | | | | | | skipped: {r['skipped']} |")
                continue
            name = f"**{r['label']}**" if r["default"] else r["label"]
            k = "-" if r["method"] == "full" else _fmt(r["k"], 4)
            d = "-" if r["d"] is None else f"{r['d']:g}"
            mass = "-" if r.get("mass") is None else f"{r['mass']:.3f} ({r['oracle_mass']:.3f})"
            inc = "0 (reference)" if r["method"] == "full" else _interval_cell(r)
            lines.append(f"| {name} | {k} | {d} | {_fmt(r['bytes_fraction'])} | {r['ppl']:.3f} | {inc} | "
                         f"{_interval_cell(r, 'vs_default')} | {_fmt(r.get('recall'))} | {mass} | {r['note']} |")
        lines += ["", *_layer_table(run), "", *_worst_heads(run), ""]
    for ret in results.get("retrieval") or []:
        lines += _retrieval_table(ret)
    lines.append(f"Ran in {st.get('seconds', 0):.0f} s ({st['threads']} torch threads, torch {st['torch']}).")
    return "\n".join(lines) + "\n"


def _diff_cell(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def _retrieval_table(ret: dict) -> list[str]:
    """One context length of the retrieval suite: pooled accuracy per method with its interval and the paired
    differences, in points, against exact top-k of the default's mode and against the default."""
    L = ret["context_len"]
    lines = [f"## Retrieval at {L} tokens", "",
             f"The synthetic retrieval suite ({ret.get('samples')} samples per task; pooled over "
             f"{', '.join(ret['tasks']) or 'no task: full attention is at chance on every one'}, where full "
             "attention is above chance), decoded greedily, one sparse "
             f"decode step per token, on the engine; every method at the budget matched on the "
             f"{ret['budgets_from']}-token windows. Accuracy with "
             "its Wilson 95% interval; paired differences in points with Newcombe's 95% interval against "
             f"`{ret['oracle']}` and against the default.", "",
             "| method | k_f | accuracy [95%] | vs exact top-k [95%] | vs the default [95%] |",
             "|---|---:|---|---|---|"]
    for r in ret["rows"]:
        name = f"**{r['label']}**" if r["default"] else r["label"]
        k = "-" if r["k"] is None or r["name"] == "full" else _fmt(r["k"], 4)
        acc = "-" if r["accuracy"] is None else (f"{r['accuracy']:.3f} [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] "
                                                 f"({r['correct']}/{r['n']})")
        lines.append(f"| {name} | {k} | {acc} | {_diff_cell(r.get('vs_oracle'))} | "
                     f"{_diff_cell(r.get('vs_default'))} |")
    return lines + [""]


def _layer_table(run: dict) -> list[str]:
    rows = [r for r in run["rows"] if r.get("diagnostics") and r["diagnostics"]["layers"]]
    if not rows:
        return []
    layers = rows[0]["diagnostics"]["layers"]
    out = ["Top-k recall per layer (informative rows, mean over query heads):", "",
           "| layer | " + " | ".join(r["name"] for r in rows) + " |", "|---:|" + "---:|" * len(rows)]
    for i, layer in enumerate(layers):
        cells = []
        for r in rows:
            v = r["diagnostics"]["recall_per_layer"][i] if i < len(r["diagnostics"]["recall_per_layer"]) else None
            cells.append(_fmt(v))
        out.append(f"| {layer} | " + " | ".join(cells) + " |")
    return out


def _worst_heads(run: dict, n: int = 5) -> list[str]:
    r = next((r for r in run["rows"] if r.get("default") and r.get("diagnostics")), None)
    if r is None or not r["diagnostics"]["layers"]:
        return []
    dg = r["diagnostics"]
    heads = [(dg["mass_kv"][i][h], layer, h, dg["recall_kv"][i][h]) for i, layer in enumerate(dg["layers"])
             for h in range(len(dg["mass_kv"][i])) if dg["mass_kv"][i][h] is not None]
    heads.sort()
    out = [f"The KV heads where `{r['name']}` captures the least attention mass (recall of the exact top-k set):", ""]
    out += [f"- layer {layer}, KV head {h}: mass {m:.3f}, recall {rc:.3f}" for m, layer, h, rc in heads[:n]]
    return out


def write_compare_plot(results: dict, path) -> Path | None:
    """The plot of accuracy against bytes: per window set, the perplexity increase over full attention (with its 95%
    interval; top) and the attention mass captured (bottom) against the bytes per decode step relative to dense,
    linear axes; one colour and marker per method named in the legend with its increase, the default a large black
    star (bold in the legend), the target bytes dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loki._io import atomic_path

    runs = [run for run in results["runs"] if any("increase" in r and r.get("bytes_fraction") is not None
                                                  and r["method"] != "full" for r in run["rows"])]
    if not runs:
        return None
    fig, axes = plt.subplots(2, len(runs), figsize=(7.5 * len(runs), 9), squeeze=False)
    cmap = plt.get_cmap("tab10")
    names = [m for m in COMPARE_METHODS if m != "full"]
    markers = "oDs^v<>phPX"
    for col, run in enumerate(runs):
        top, bottom = axes[0][col], axes[1][col]
        for r in run["rows"]:
            if r.get("method") in (None, "full") or r.get("bytes_fraction") is None or "increase" not in r:
                continue
            i = names.index(r["name"])
            x = r["bytes_fraction"]
            color = "black" if r["default"] else cmap(i % 10)
            size = 15 if r["default"] else 7
            marker = "*" if r["default"] else markers[i % len(markers)]
            y, lo, hi = 100 * r["increase"], 100 * r["increase_lo"], 100 * r["increase_hi"]
            label = (f"{r['name']}{' (default)' if r['default'] else ''}: {y:+.1f}% at {x:.3f}"
                     + (", not byte-matched" if "not byte-matched" in r.get("note", "") else ""))
            top.errorbar([x], [y], yerr=[[y - lo], [hi - y]], marker=marker, markersize=size, color=color,
                         capsize=3, linestyle="none", label=label, zorder=3 if r["default"] else 2)
            if r.get("mass") is not None:
                bottom.plot([x], [r["mass"]], marker=marker, markersize=size, color=color, linestyle="none",
                            label=f"{r['name']}: {r['mass']:.3f}", zorder=3 if r["default"] else 2)
        for ax in (top, bottom):
            ax.axvline(run["target_bytes"], color="grey", linestyle="--", linewidth=1)
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("bytes read per decode step / dense attention (linear)")
            leg = ax.legend(fontsize=7, loc="best")
            for text in leg.get_texts():
                if "(default)" in text.get_text() or text.get_text().startswith("loki:"):
                    text.set_fontweight("bold")
        top.axhline(0, color="grey", linewidth=0.8)
        top.set_ylabel("perplexity increase over full (%, linear; 95% interval)")
        top.set_title(f"{run['seq_len']} x {run['windows']} tokens; dashed: target {run['target_bytes']:.3f} of dense")
        bottom.set_ylabel("attention mass captured by the selection (linear)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path

"""The plots of an accuracy run's report (:mod:`loki.evaluation.report`): perplexity increase against the bytes a
decode step reads (``ppl_vs_bytes.png``) and against the window length (``ppl_vs_length.png``), with linear axes,
values written beside the points and the default configuration highlighted.
"""

from __future__ import annotations

from pathlib import Path

from loki._io import atomic_path

__all__ = ["budget_cell", "write_bytes_plot", "write_length_plot"]


def budget_cell(k) -> str:
    """A budget in a table: a fraction k_f as ``0.25``, a count of tokens as ``512 tok``."""
    return f"{k} tok" if isinstance(k, int) and not isinstance(k, bool) else f"{k:g}"


def _y_limit(rows: list[dict]) -> float:
    """The top of a plot's y axis (percent): every interval when the highest lies within eight times the largest
    interval top of the default and oracle rows, else three times that (at least 25%); anything higher is drawn
    at the edge and named with its value above the panel."""
    anchor = max([100 * r["increase_hi"] for r in rows if r.get("default") or r.get("role") == "oracle"], default=8.0)
    highest = max(100 * r["increase_hi"] for r in rows)
    top = highest if highest <= 8 * max(anchor, 5.0) else max(25.0, 3 * anchor)
    return top * 1.08 + 0.5


def _legend(fig, axes) -> None:
    """One legend for every panel, right of them (the settings keep one style in every panel)."""
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.tight_layout(rect=(0, 0, 0.74 if len(axes) == 1 else 0.84, 1))
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="center right", fontsize=8, frameon=False)


def _plot_setting(ax, name: str, pts: list[tuple], top: float, *, default: bool, oracle: bool, shared: bool,
                  color, marker: str, annotate=None) -> list[str]:
    """One setting's line with its 95% intervals; points above ``top`` sit at the edge (returned as
    "name +X%" notes, which :func:`_off_axis_note` writes once per panel); ``annotate(point)`` labels each point."""
    x = [p[0] for p in pts]
    y = [min(100 * p[1], top) for p in pts]
    err = [[max(0.0, 100 * (p[1] - p[2])) if 100 * p[1] <= top else 0.0 for p in pts],
           [min(100 * (p[3] - p[1]), max(0.0, top - 100 * p[1])) for p in pts]]
    style = dict(color="black", lw=2.6, ms=8, zorder=5) if default else dict(color=color, lw=1.4, ms=5, zorder=3)
    label = f"{name} (default)" if default else (f"{name} (exact top-k)" if oracle else name)
    ax.errorbar(x, y, yerr=err, marker=marker, capsize=3, label=label, linestyle="--" if shared and not default
                else "-", **style)
    off = []
    for p, yy in zip(pts, y):
        if 100 * p[1] > top:
            off.append(f"{name} {100 * p[1]:+.0f}%")
        elif annotate:
            ax.annotate(annotate(p), (p[0], yy), fontsize=7, textcoords="offset points", xytext=(5, 3),
                        color=style["color"], fontweight="bold" if default else "normal")
    return off


def _off_axis_note(ax, notes: list[str]) -> None:
    """Name the points drawn at the top edge, with their values, in a box at the panel's top left (call after
    the layout is fixed: the box is not part of it)."""
    if notes:
        import textwrap

        text = textwrap.fill("above the axis: " + ", ".join(dict.fromkeys(notes)), width=60)
        ax.text(0.01, 0.98, text, transform=ax.transAxes, fontsize=6.5, va="top", ha="left", zorder=10,
                bbox=dict(boxstyle="round", facecolor="white", edgecolor="grey", alpha=0.9))


def _finish(fig, axes, notes, out_dir, filename: str) -> str:
    """The legend and the off-axis notes drawn, the figure written to ``out_dir/filename`` (atomically) and closed;
    returns ``filename``."""
    import matplotlib.pyplot as plt

    _legend(fig, axes[0])
    for ax, off in notes:
        _off_axis_note(ax, off)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / filename) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return filename


def write_bytes_plot(rows: list[dict], out_dir, filename: str = "ppl_vs_bytes.png") -> dict[str, str]:
    """``ppl_vs_bytes.png``: the perplexity increase over full attention in percent (linear axis, with its 95%
    interval) against the bytes a decode step reads relative to dense attention (``bytes_fraction``, 0 to 1), one
    panel per window length, one line per setting through its budgets (labelled with k).  The default Loki
    configuration is the thick black line ("(default)" in the legend), exact top-k is marked, a shared selection
    per KV group is dashed; values far above the default's are drawn at the top edge with their value
    (:func:`_y_limit`).  Rows without an increase or a measured ``bytes_fraction`` are left out.  Returns
    ``{"ppl_vs_bytes": name}`` (``{}`` when no row has both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("method") != "full" and "increase" in r and r.get("bytes_fraction") is not None]
    if not rows:
        return {}
    lengths = sorted({r.get("seq_len") for r in rows}, reverse=True)
    names = sorted({r["name"] for r in rows}, key=lambda n: (not any(r.get("default") for r in rows
                                                                     if r["name"] == n), n))
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(lengths), figsize=(6.4 * len(lengths) + 2.4, 4.8), squeeze=False)
    notes = []
    for ax, T in zip(axes[0], lengths):
        here = [r for r in rows if r.get("seq_len") == T]
        top = _y_limit(here)
        single = len({budget_cell(r["k"]) for r in here}) == 1
        off = []
        for i, name in enumerate(names):
            mine = [r for r in here if r["name"] == name]
            if not mine:
                continue
            pts = sorted((r["bytes_fraction"], r["increase"], r["increase_lo"], r["increase_hi"], r["k"])
                         for r in mine)
            default = any(r.get("default") for r in mine)
            # values beside every point of a single budget; with several, beside the default's points only
            label = (lambda p: f"{100 * p[1]:+.1f}%") if single else (
                (lambda p: f"{100 * p[1]:+.1f}% (k={budget_cell(p[4])})") if default else None)
            off += _plot_setting(ax, name, pts, top, default=default, oracle=mine[0].get("role") == "oracle",
                                 shared=mine[0].get("gqa_select") == "kv", color=cmap(i % 10),
                                 marker="osD^v<>ph*"[i % 10], annotate=label)
        notes.append((ax, off))
        ax.plot([1.0], [0.0], marker="*", ms=12, color="grey", ls="none", label="full attention", zorder=4)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlim(0.0, 1.0)
        ax.set_ylim(min(-2.0, min(100 * r["increase_lo"] for r in here) - 1.0), top)
        ax.set_xlabel("bytes read per decode step, relative to dense attention (1 = dense)")
        ax.set_ylabel("perplexity increase over full attention (%)")
        ks = sorted({budget_cell(r["k"]) for r in here})
        ax.set_title(f"{T}-token windows, k = {', '.join(ks)} (lower left is better)")
        ax.grid(True, alpha=0.3)
    return {"ppl_vs_bytes": _finish(fig, axes, notes, out_dir, filename)}


def write_length_plot(results: dict, out_dir) -> dict[str, str]:
    """``ppl_vs_length.png``: the perplexity increase over full attention in percent (linear axis, with its 95%
    interval) against the window length (the measured lengths as labelled ticks), one panel per budget, one line
    per setting, the default Loki configuration thick and black, values far above it drawn at the top edge with
    their value.  Returns ``{"ppl_vs_length": file name}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from loki.evaluation.perplexity import budget_label

    rows = [r for r in results.get("perplexity", []) if r["method"] != "full" and "increase" in r]
    ks = sorted({r["k"] for r in rows}, key=lambda k: (isinstance(k, int), -k))  # fractions first, then counts
    if not rows:
        return {}
    # one colour and marker per setting in every panel (a setting missing from a panel must not shift the others)
    names = sorted({r["name"] for r in rows})
    cmap = plt.get_cmap("tab20")
    style = {name: (cmap(i % cmap.N), "osD^v<>ph*"[i % 10]) for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, len(ks), figsize=(5.0 * len(ks) + 2.4, 4.4), squeeze=False)
    notes = []
    for ax, k in zip(axes[0], ks):
        here = [r for r in rows if r["k"] == k]
        top = _y_limit(here)
        lengths = sorted({r["seq_len"] for r in here})
        off = []
        for name in sorted({r["name"] for r in here}):
            mine = [r for r in here if r["name"] == name]
            pts = sorted((r["seq_len"], r["increase"], r["increase_lo"], r["increase_hi"]) for r in mine)
            if len(pts) < 2:
                continue
            color, marker = style[name]
            default = any(r.get("default") for r in mine)
            off += _plot_setting(ax, name, pts, top, default=default, oracle=mine[0].get("role") == "oracle",
                                 shared=mine[0].get("gqa_select") == "kv", color=color, marker=marker,
                                 annotate=(lambda p: f"{100 * p[1]:+.1f}%") if default else None)
        notes.append((ax, off))
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(T) for T in lengths])
        ax.minorticks_off()
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_ylim(min(-2.0, min(100 * r["increase_lo"] for r in here) - 1.0), top)
        ax.set_xlabel("window (tokens)")
        ax.set_ylabel("perplexity increase over full attention (%)")
        ax.set_title(budget_label(k))
        ax.grid(True, alpha=0.3)
    return {"ppl_vs_length": _finish(fig, axes, notes, out_dir, "ppl_vs_length.png")}

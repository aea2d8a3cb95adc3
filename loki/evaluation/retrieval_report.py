"""Reports of :func:`loki.evaluation.retrieval.evaluate_retrieval` results: a markdown table, a PNG plot and
:func:`write_report` (JSON + markdown + PNG in one folder), and the section comparing the answers through ``generate``
with the engine's (:func:`generate_markdown`)."""

from __future__ import annotations

import json
from pathlib import Path

from loki._io import atomic_path, atomic_write

__all__ = ["generate_markdown", "markdown_table", "plot_retrieval", "setting_label", "write_report"]


def setting_label(name: str, gqa_select: str | None, aggregate: str | None) -> str:
    """A setting's name with the aggregate of a shared (one selection per KV group) selection, e.g.
    ``loki-score[kv] (softmax-max)``; other settings keep their name (a missing aggregate: "sum")."""
    return f"{name} ({aggregate or 'sum'})" if gqa_select == "kv" else name


def _fmt_cell(c: dict) -> str:
    if c["n"] == 0:
        return "-"
    txt = f"{c['accuracy']:.2f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]"
    if c["diff"] is not None:
        d = c["diff"]
        txt += f"; Δ {d['diff']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}]"
    return txt


def markdown_table(result: dict) -> str:
    """One table per task (and the pooled "all"): rows = methods (a shared selection with its aggregate), columns =
    context lengths; a cell is the accuracy [95% Wilson interval]; Δ the paired difference to the method's
    reference [95% interval]."""
    lens = result["config"]["context_lens"]
    names = [m["name"] for m in result["methods"]]
    by = {(c["task"], c["context_len"], c["name"]): c for c in result["cells"]}
    tasks = list(dict.fromkeys(c["task"] for c in result["cells"]))
    lines = []
    for task in tasks:
        c0 = by[(task, lens[0], names[0])]
        n = ", ".join(f"{L}: n={by[(task, L, names[0])]['n']}" for L in lens)
        refs = sorted({c["reference"] for c in result["cells"] if c["task"] == task and c["reference"]})
        low = [str(L) for L in lens if by[(task, L, names[0])]["full_above_chance"] is False]
        note = f"; full attention not above chance at {', '.join(low)}" if low and task != "all" else ""
        if task == "all":
            note = "; pooled: " + ", ".join(f"{L}: {'+'.join(by[(task, L, names[0])]['pooled_tasks']) or '-'}"
                                            for L in lens)
        lines += [f"#### {task} (chance {c0['chance']:.2f}; {n}; Δ against {', '.join(refs) or 'none'}{note})", "",
                  "| method | " + " | ".join(str(L) for L in lens) + " |",
                  "|---|" + "---|" * len(lens)]
        for m in result["methods"]:
            name = m["name"]
            label = name if m["method"] == "full" else setting_label(name, m.get("gqa_select"), m.get("aggregate"))
            lines.append(f"| {label} | " + " | ".join(_fmt_cell(by[(task, L, name)]) for L in lens) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_retrieval(result: dict, path) -> None:
    """PNG: accuracy (95% Wilson interval) against context length per method, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = result["config"]["context_lens"]
    tasks = list(dict.fromkeys(c["task"] for c in result["cells"]))
    by = {(c["task"], c["context_len"], c["name"]): c for c in result["cells"]}
    cols = min(3, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for j, m in enumerate(result["methods"]):
            cs = [by[(task, L, m["name"])] for L in lens]
            acc = [c["accuracy"] if c["n"] else float("nan") for c in cs]
            err = [[max(0.0, a - c["ci"][0]) for a, c in zip(acc, cs)],
                   [max(0.0, c["ci"][1] - a) for a, c in zip(acc, cs)]]
            x = [L * (1 + 0.012 * (j - len(result["methods"]) / 2)) for L in lens]  # dodge the error bars
            style = dict(color="black", lw=2) if m["method"] == "full" else {}
            if m["gqa_select"] == "kv" and m["method"] != "full":
                style["ls"] = "--"
            ax.errorbar(x, acc, yerr=err, marker="o", ms=3, capsize=2, label=m["name"], **style)
        ax.axhline(cs[0]["chance"], color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(lens) / 1.4, max(lens) * 1.4)
        ax.set_xticks(lens, [str(L) for L in lens])
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("exact-match accuracy")
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def write_report(result: dict, out_dir, stem: str = "retrieval") -> dict:
    """Write ``{stem}.json``, ``{stem}.md`` and ``{stem}.png`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    atomic_write(paths["json"], json.dumps(result, indent=1))
    cfg = result["config"]
    head = (f"Retrieval suite: {cfg['samples']} samples per (task, length), seed {cfg['seed']}, model "
            f"{cfg['model']} ({cfg['dtype']}, {cfg['device']}), {cfg['seconds']:.0f} s.\n\n")
    atomic_write(paths["md"], head + markdown_table(result))
    plot_retrieval(result, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def generate_markdown(section: dict | None) -> list[str]:
    """The report's section of :func:`loki.evaluation.retrieval_generate.retrieval_generate_section`: per setting
    and task (pooled over the lengths) and over all, the engine's and ``generate``'s accuracy, the paired difference
    [95% interval], the discordant samples, the share of identical answers and whether the two agree."""
    if not section:
        return []
    out = ["## Retrieval through generate (compiled static cache, Triton kernels) against the engine", ""]
    if "skipped" in section:
        return out + [f"Skipped: {section['skipped']}.", ""]
    s = section["setting"]
    lens = ", ".join(str(L) for L in s["context_lens"])
    out += [f"The retrieval suite's samples ({len(s['tasks'])} tasks at {lens} tokens, {s['samples']} per task and "
            f"length, seed {s['seed']}) answered by `generate` over one Loki static cache of {s['max_cache_len']} "
            f"tokens ({'compiled' if s['compiled'] else 'eager'}, {s['dtype']}) beside the evaluation engine's "
            f"answers ({s.get('engine_dtype')}); Δ = generate - engine with Newcombe's paired 95% interval; the two "
            f"agree when it contains 0 or |Δ| <= {s['tolerance']:g}.", "",
            "| setting | task | n | engine | generate | Δ [95% interval] | only generate / only engine | same answer "
            "| agrees |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    label = {m["name"]: setting_label(m["name"], m.get("gqa_select"), m.get("aggregate")) for m in s.get("methods", [])}
    for r in section["rows"]:
        if r["context_len"] is not None:
            continue
        same = "-" if r["same_prediction"] is None else f"{r['same_prediction']:.3f}"
        out.append(f"| {label.get(r['name'], r['name'])} | {r['task']} | {r['n']} | {r['engine_accuracy']:.3f} | "
                   f"{r['generate_accuracy']:.3f} | {r['diff']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] | "
                   f"{r['only_generate']} / {r['only_engine']} | {same} | {'yes' if r['agrees'] else 'NO'} |")
    return out + ["", f"Time: {section['seconds']:.0f} s.", ""]

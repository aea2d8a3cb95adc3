"""The README's results table and plot, generated from the committed results files.

    python tools/readme_table.py                 # rewrite the table between the README's markers
    python tools/readme_table.py --check         # exit 1 when README.md's table differs from the results files
    python tools/readme_table.py --print         # print the table
    python tools/readme_table.py --plot docs/default-results.png   # redraw the README's plot (needs matplotlib)

The table states the default configuration only (score-aware basis, an int8 score copy of d_f = 0.5, one
selection per KV group with the softmax-max aggregate on GQA models): accuracy at two window lengths on the
embedded model and speed at a long-context setting, each number once, each row with its card.  ``SOURCES``
names the files; a source that no longer describes the default configuration is an error, never a silently
different table.
``tests/test_readme.py`` keeps the README's table equal to ``readme_table()``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN = ("<!-- results table: written by tools/readme_table.py from the files under results/; "
         "tests/test_readme.py keeps it equal -->")
END = "<!-- end of the results table -->"

#: The accuracy run of the long profile (WikiText-2 test, 2 x 8192 and 8 x 1024 tokens).
LONG = "results/int8-default-h200-2026-12-02/check-long-results.json"
#: The end-to-end run (forward and whole ``generate`` calls) of the default at a long setting.
E2E_8 = "results/int8-default-h200-2026-12-02/e2e-default-generate.json"
#: The default's settings a source must state (``settings`` of a ``loki check`` run, a row of ``loki bench --e2e``).
DEFAULT_D, DEFAULT_FORMAT = 0.5, "int8"

#: What the README's caption says the rows were measured on; a source measured on anything else is an error.
ACCURACY_MODEL, SPEED_MODEL = "SmolLM2-135M-Instruct", "llama3-8b"
#: (file, window tokens, k) of each accuracy row: k a fraction k_f or a count of tokens.
ACCURACY_ROWS = [(LONG, 8192, 0.25), (LONG, 8192, 0.125), (LONG, 1024, 0.25)]
#: (file, setting id) of each speed row.
SPEED_ROWS = [(E2E_8, "llama3-8b-B8-S32768-k2048")]
SOURCES = sorted({f for f, *_ in ACCURACY_ROWS} | {f for f, _ in SPEED_ROWS})


class SourceError(ValueError):
    """A results file that does not hold the row the table needs, or not for the default configuration."""


def _load(rel: str, root: Path) -> dict:
    path = root / rel
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SourceError(f"{rel}: {exc}") from None


def _short_card(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``."""
    return next((w for w in name.split() if w[:1] in "HAB" and w[1:2].isdigit()), name)


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _ival(lo: float, hi: float) -> str:
    return f"[{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _budget(k: float) -> str:
    return f"k = {int(k)}" if k >= 1 else f"k_f {k:g}"


def accuracy_row(doc: dict, rel: str, window: int, k: float) -> dict:
    """The default configuration's perplexity row at ``window`` tokens and budget ``k`` of one ``loki check``
    results file: increase over full attention, its paired 95% interval, the bytes of dense attention it reads."""
    s = doc["settings"]
    want = {"default_basis": "score", "default_gqa_select": "kv", "default_aggregate": "softmax-max", "d": DEFAULT_D,
            "score_format": DEFAULT_FORMAT}
    got = {key: s.get(key) for key in want}
    if got != want:
        raise SourceError(f"{rel}: not the default configuration: {got}")
    if s.get("model") != ACCURACY_MODEL or s.get("eval_corpus") != "wikitext":
        raise SourceError(f"{rel}: measured on {s.get('model')} / {s.get('eval_corpus')}, "
                          f"not {ACCURACY_MODEL} / wikitext")
    rows = [r for r in doc["perplexity"] if r.get("default") and r["seq_len"] == window and r["k"] == k]
    if len(rows) != 1:
        raise SourceError(f"{rel}: {len(rows)} default rows at {window} tokens, {_budget(k)} (want 1)")
    (r,) = rows
    if (r["method"], r["basis"], r["gqa_select"], r["aggregate"], r["d"], r.get("score_format")) != (
            "loki", "score", "kv", "softmax-max", DEFAULT_D, DEFAULT_FORMAT):
        raise SourceError(f"{rel}: the row marked default is {r['name']} ({r['aggregate']}, d {r['d']})")
    return {"window": window, "windows": r["windows"], "k": k, "increase": r["increase"], "lo": r["increase_lo"],
            "hi": r["increase_hi"], "bytes": r["bytes_fraction"], "card": s["card"], "dtype": s["dtype"],
            "model": s["model"], "file": rel}


def speed_row(doc: dict, rel: str, setting: str) -> dict:
    """The compiled paths of one ``loki bench --e2e --generate`` setting: ms per decode step of the forward, ms per
    token of whole ``generate`` calls, the speed-ups over dense and the bytes Loki's step reads of dense's."""
    rows = [r for r in doc["results"] if r["id"] == setting]
    if len(rows) != 1 or "skipped" in rows[0]:
        raise SourceError(f"{rel}: no measured result for {setting}")
    (r,) = rows
    if r["model"] != SPEED_MODEL:
        raise SourceError(f"{rel}: {setting} has the dims of {r['model']}, not {SPEED_MODEL}")
    if (r["gqa_select"], r["aggregate"], r["d_f"], r.get("score_format")) != ("kv", "softmax-max", DEFAULT_D,
                                                                              DEFAULT_FORMAT):
        raise SourceError(f"{rel}: {setting} is not the default configuration "
                          f"({r['gqa_select']}, {r['aggregate']}, d_f {r['d_f']}, {r.get('score_format')})")
    if (r["best_dense"], r["best_loki"]) != ("sdpa_compiled", "loki_compiled"):
        raise SourceError(f"{rel}: {setting}: the fastest paths are {r['best_dense']} / {r['best_loki']}")
    dense, loki = r["paths"]["sdpa_compiled"], r["paths"]["loki_compiled"]
    return {"id": setting, "model": r["model"], "B": r["B"], "S": r["S"], "k": r["k_f"],
            "dense_ms": dense["ms_median"], "loki_ms": loki["ms_median"],
            "dense_gen": dense["generate_ms_per_token"], "loki_gen": loki["generate_ms_per_token"],
            "speedup": r["speedup"], "gen_speedup": r["generate_speedup"],
            "bytes": r["bytes"]["loki"] / r["bytes"]["dense"], "card": doc["device"], "dtype": doc["dtype"],
            "file": rel}


def collect(root: Path = ROOT) -> tuple[list[dict], list[dict]]:
    docs: dict[str, dict] = {}

    def doc(rel: str) -> dict:
        if rel not in docs:
            docs[rel] = _load(rel, root)
        return docs[rel]

    acc = [accuracy_row(doc(f), f, w, k) for f, w, k in ACCURACY_ROWS]
    speed = [speed_row(doc(f), f, s) for f, s in SPEED_ROWS]
    return acc, speed


def readme_table(root: Path = ROOT) -> str:
    """The README's results table and its sources line, between the markers (markers included)."""
    acc, speed = collect(root)
    model = {"llama3-8b": "Llama-3-8B", "llama2-7b": "Llama-2-7B"}
    lines = [
        BEGIN,
        "| result | setting | card | reads (of dense) | default Loki against dense |",
        "|---|---|---|---:|---|",
    ]
    for a in acc:
        lines.append(f"| perplexity increase | {a['windows']} x {a['window']} tokens, "
                     f"{_budget(a['k'])} | {_short_card(a['card'])}, {a['dtype'].replace('float', 'fp')} | "
                     f"{a['bytes']:.3f} | **{_pct(a['increase'])}** {_ival(a['lo'], a['hi'])} |")
    for s in speed:
        lines.append(f"| speed-up, {model.get(s['model'], s['model'])} dims: forward / `generate` | "
                     f"B = {s['B']}, S = {s['S']}, {_budget(s['k'])} | {_short_card(s['card'])}, "
                     f"{s['dtype'].replace('bfloat', 'bf')} | {s['bytes']:.2f} | **{s['speedup']:.2f}x / "
                     f"{s['gen_speedup']:.2f}x** ({s['loki_ms']:.2f} / {s['loki_gen']:.2f} ms against "
                     f"{s['dense_ms']:.2f} / {s['dense_gen']:.2f} ms) |")
    cards = sorted({a["card"] for a in acc} | {s["card"] for s in speed})
    lines += [
        "",
        f"Cards: {', '.join(cards)}. Sources: " + ", ".join(f"[`{f.removeprefix('results/')}`]({f})"
                                                          for f in SOURCES) + ".",
        END,
    ]
    return "\n".join(lines)


def replace_table(text: str, table: str) -> str:
    """``text`` with the part from ``BEGIN`` to ``END`` replaced by ``table``."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SourceError("README.md has no results-table markers")
    return text[:i] + table + text[j + len(END):]


def current_table(text: str) -> str:
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SourceError("README.md has no results-table markers")
    return text[i:j + len(END)]


def plot(out: Path, root: Path = ROOT) -> None:
    """The README's figure: accuracy against bytes at 8192-token windows (left), speed-ups at the long settings
    (right); linear axes, the default configuration highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _load(LONG, root)["perplexity"] if r["seq_len"] == 8192]

    def series(name: str, counts: bool) -> list[tuple[float, float]]:
        pts = {(round(r["bytes_fraction"], 4), r["increase"]) for r in rows
               if r["name"] == name and (r["k"] >= 1) == counts}
        return sorted(pts)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.15, 1]})
    styles = [("exact_topk[kv]", "exact top-k (shared)", "0.55", "s", 1.2),
              ("loki-score[query]", "Loki, per query head", "tab:blue", "^", 1.5),
              ("loki-score[kv]", "Loki default (shared, softmax-max)", "tab:red", "o", 2.6)]
    for name, label, color, marker, lw in styles:
        pts = series(name, counts=False)
        ax1.plot([b for b, _ in pts], [100 * y for _, y in pts], marker=marker, color=color, lw=lw,
                 label=f"{label}, k_f 1/16, 1/8, 1/4", ms=7 if lw > 2 else 5, zorder=3 if lw > 2 else 2)
    (pca,) = [r for r in rows if r["name"] == "loki-post[query]" and r["k"] == 0.25]
    ax1.annotate(f"paper's PCA basis (per query head) at k_f 1/4: {100 * pca['increase']:+.1f}%",
                 xy=(0.98, 0.97), xycoords="axes fraction", ha="right", va="top", fontsize=8.5, color="0.3")
    ax1.axhline(0, color="0.6", lw=0.8)
    ax1.set_xlim(0.15, 0.75)
    ax1.set_ylim(-1, 30)
    ax1.set_xlabel("bytes a decode step's attention reads, of dense attention")
    ax1.set_ylabel("perplexity increase over full attention (%)")
    ax1.set_title("Accuracy: SmolLM2-135M, WikiText-2, 8192-token windows", fontsize=10)
    ax1.legend(fontsize=8.5, loc="upper right", bbox_to_anchor=(1.0, 0.9))
    ax1.grid(alpha=0.3)

    speed = [speed_row(_load(f, root), f, s) for f, s in SPEED_ROWS]
    labels = [f"B={s['B']}, S={s['S'] // 1024}K\n{_budget(s['k'])}" for s in speed]
    x = range(len(speed))
    w = 0.36
    ax2.set_xlim(-0.5 - w, len(speed) - 0.5 + w)
    b1 = ax2.bar([i - w / 2 for i in x], [s["speedup"] for s in speed], w, color="tab:red", label="compiled forward")
    b2 = ax2.bar([i + w / 2 for i in x], [s["gen_speedup"] for s in speed], w, color="tab:red", alpha=0.45,
                 label="whole generate calls")
    for bars in (b1, b2):
        ax2.bar_label(bars, fmt="%.2fx", fontsize=8.5, padding=2)
    ax2.scatter(list(x), [1 / s["bytes"] for s in speed], marker="_", s=900, color="k", zorder=3,
                label="byte ceiling")
    ax2.axhline(1, color="0.4", lw=1, ls="--")
    ax2.set_xticks(list(x), labels, fontsize=8.5)
    ax2.set_ylim(0, 2.9)
    ax2.set_ylabel("speed-up over compiled dense SDPA")
    ax2.set_title(f"Speed: Llama-3-8B dims, bf16, {_short_card(speed[0]['card'])}", fontsize=10)
    ax2.legend(fontsize=8, loc="upper center", ncol=3, handlelength=1.2, columnspacing=0.8)
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle("Loki's default configuration: score-aware basis, an int8 score copy of d_f = 0.5, one selection "
                 "per KV group", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    ap.add_argument("--print", action="store_true", help="print the table")
    ap.add_argument("--plot", metavar="PNG", help="write the README's figure to PNG")
    args = ap.parse_args(argv)
    try:
        table = readme_table()
        text = README.read_text()
        if args.print:
            print(table)
        if args.plot:
            plot(Path(args.plot))
        if args.check:
            if current_table(text) != table:
                print("README.md's results table differs from the results files: "
                      "run python tools/readme_table.py", file=sys.stderr)
                return 1
            return 0
        if not args.print and not args.plot:
            new = replace_table(text, table)
            if new != text:
                README.write_text(new)
                print("README.md: results table rewritten")
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

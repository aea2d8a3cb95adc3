"""Does forcing the most recent tokens, or the first ones (attention sinks), into Loki's selection help at the same
budget? The default configuration on the evaluation engine (CPU), each variant against it on the same tokens.

    PYTHONPATH=. python tools/studies/forced_tokens_study.py --corpus wikitext --windows 1024x8 --out wikitext.json

The variants keep k: the forced tokens (the last ``recent`` visible tokens of each query row, the first ``sink``)
come first, ranked by their approximate score among themselves, and the approximate scores fill the rest of the
budget. The rule is not in the library. This study adds it around the reference's top-k for the time of the runs
only (``loki.reference.teacher_forced.topk_mask``); the bytes a step reads do not change. Perplexity increase over
full attention and against the default with paired 95% intervals, top-k recall and attention mass. Results:
``results/forced-tokens-cpu-2026-11-28/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from benchmarks.tuning.allocation import _windows  # the window sets' argument type, shared

VARIANTS = (("default", 0, 0, 0), ("recent16", 16, 0, 0), ("sink4", 0, 4, 0), ("recent32+sink4", 32, 4, 0))


def variant(text: str) -> tuple[str, int, int, int]:
    """A variant's name as ``--variants`` takes it: "recentN", "sinkM" or "recentN+sinkM" (N, M > 0), forced in every
    layer, or with "@Lj" in layers j and later only -> (name, recent, sink, first layer)."""
    recent = sink = 0
    body, at, layer = text.partition("@L")
    if at and not layer.isdigit():
        raise argparse.ArgumentTypeError(f"a variant's layers are @Lj (j >= 0: layers j and later), got {text!r}")
    for part in body.split("+"):
        kind = "recent" if part.startswith("recent") else "sink" if part.startswith("sink") else None
        n = part[len(kind):] if kind else ""
        if not n.isdigit() or int(n) <= 0 or (kind == "recent" and recent) or (kind == "sink" and sink):
            raise argparse.ArgumentTypeError(f"a variant is recentN, sinkM or recentN+sinkM with N, M > 0, got "
                                             f"{text!r}")
        recent, sink = (int(n), sink) if kind == "recent" else (recent, int(n))
    return text, recent, sink, int(layer or 0)


@contextlib.contextmanager
def forced_tokens(recent: int, sink: int, first_layer: int = 0, model=None):
    """The reference's row top-k with the last ``recent`` and the first ``sink`` visible tokens of each row
    selected first (a bonus above every approximate score: the aggregated scores of the default are
    probabilities); with ``first_layer`` > 0 only in ``model``'s layers from that one on
    (``loki.evaluation.diagnostics.naming_layers`` says which layer runs)."""
    import torch

    from loki.evaluation.diagnostics import naming_layers
    from loki.reference import teacher_forced

    real = teacher_forced.topk_mask
    current = {"layer": 0}
    if first_layer and model is None:
        raise ValueError("forcing from a layer on needs the model, whose layers name themselves")

    def topk(scores, counts):
        if current["layer"] < first_layer:
            return real(scores, counts)
        vis = scores > float("-inf")
        bonus = torch.zeros_like(vis)
        if recent:
            bonus |= vis & (vis.flip(-1).cumsum(-1).flip(-1) <= recent)
        if sink:
            bonus |= vis & (vis.cumsum(-1) <= sink)
        return real(scores + bonus.to(scores.dtype) * 1e3, counts)

    names = naming_layers(model, lambda layer: current.update(layer=layer)) if first_layer else contextlib.nullcontext()
    teacher_forced.topk_mask = topk if recent or sink else real
    try:
        with names:
            yield
    finally:
        teacher_forced.topk_mask = real


def run(corpus: str, T: int, N: int, budgets, log=print, variants=VARIANTS[1:]) -> dict:
    from dataclasses import replace

    from loki.evaluation.bases import DEFAULT_RECIPE, get_bases
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.intervals import paired_increase
    from loki.evaluation.models import load_default_model
    from loki.evaluation.perplexity import MethodSpec, perplexity

    model, tok = load_default_model(device="cpu")
    bases = get_bases(model, tok, ("score",), replace(DEFAULT_RECIPE, max_positions=T), progress=True, log=log)
    src = load_corpus(corpus, part="eval")
    w = token_windows(tok, src, T, N)
    full = perplexity(model, w, MethodSpec("full", "full"))
    out = {"corpus": src.origin, "windows": [T, N], "full_ppl": full.ppl, "rows": []}
    t0 = time.perf_counter()
    for k in budgets:
        default = None
        for name, recent, sink, first_layer in (VARIANTS[0], *variants):
            spec = MethodSpec(f"loki[{name}]", "loki", k=k, d=0.25, basis="score", gqa_select="kv",
                              aggregate="softmax-max")
            with forced_tokens(recent, sink, first_layer, model):
                r = perplexity(model, w, spec, bases, diagnostics=True)
            inc = paired_increase(r.token_nll, full.token_nll)
            row = {"k_f": k, "variant": name, "recent": recent, "sink": sink, "first_layer": first_layer,
                   "ppl": r.ppl, "increase": inc["increase"], "lo": inc["lo"], "hi": inc["hi"],
                   "bytes_fraction": r.bytes_fraction, "recall": r.diagnostics["recall_mean"],
                   "mass": r.diagnostics["mass_mean"]}
            if default is None:
                default = r
            else:
                v = paired_increase(r.token_nll, default.token_nll)
                row.update(vs_default=v["increase"], vs_lo=v["lo"], vs_hi=v["hi"])
            out["rows"].append(row)
            vs = "" if "vs_default" not in row else (f"; vs default {100 * row['vs_default']:+.1f}% "
                                                     f"[{100 * row['vs_lo']:+.1f}, {100 * row['vs_hi']:+.1f}]")
            log(f"{corpus} {T}x{N} k_f {k} {name}: {100 * inc['increase']:+.1f}% [{100 * inc['lo']:+.1f}, "
                f"{100 * inc['hi']:+.1f}]{vs}; recall {row['recall']:.3f}, mass {row['mass']:.3f} "
                f"({time.perf_counter() - t0:.0f} s)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="wikitext", choices=("wikitext", "wikipedia", "book"),
                    help="evaluation text, its held-out part (default: wikitext)")
    ap.add_argument("--windows", type=_windows, default=(1024, 8), metavar="TOKENSxCOUNT", help="default: 1024x8")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.125], help="k_f values (default 0.25 0.125)")
    ap.add_argument("--variants", type=variant, nargs="+", default=list(VARIANTS[1:]), metavar="VARIANT",
                    help="forced tokens, each run against the default: recentN, sinkM or recentN+sinkM, in every layer "
                    "or with @Lj in layers j and later (default: recent16 sink4 recent32+sink4)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    T, N = a.windows
    if not all(0 < k <= 1 for k in a.budgets):
        ap.error(f"--budgets: k_f values must lie in (0, 1], got {a.budgets}")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(a.corpus, T, N, a.budgets, log=lambda m: print(m, file=sys.stderr, flush=True), variants=a.variants)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

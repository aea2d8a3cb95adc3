"""Score dims allocated per layer and KV head against the default's d everywhere, at the same bytes.

    PYTHONPATH=. python -m benchmarks.tuning.allocation --windows 1024x8 --corpus wikitext
    PYTHONPATH=. python -m benchmarks.tuning.allocation --device cuda --windows 8192x2 1024x8 --corpus book

The embedded SmolLM2-135M-Instruct; the default configuration (score-aware basis, one selection per KV group with
softmax-max, k_f and d_f as given) against the same configuration whose (layer, KV head) score on their own number of
dims, handed out from the basis' spectrum with the same total (:mod:`loki.calibration.allocation`: "relative" and
"absolute"). Perplexity on the evaluation engine (decode-time semantics), its increase over full attention and over
the default on the same tokens with paired 95% intervals, and the recall of the exact top-k set and the attention
mass captured. Prints one table per window set; writes ``--out`` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _windows(text: str) -> tuple[int, int]:
    try:
        t, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT such as 1024x8, got {text!r}") from None
    if t < 2 or n < 1:
        raise argparse.ArgumentTypeError(f"expected TOKENS >= 2 and COUNT >= 1, got {text!r}")
    return t, n


def run(windows, *, corpus: str, k: float, d: float, device: str, calib_positions: int | None, min_dims: int,
        log=print) -> dict:
    from dataclasses import replace

    import torch

    from loki.calibration.allocation import ALLOCATIONS, allocate_score_dims, with_score_dims
    from loki.evaluation.bases import DEFAULT_RECIPE, get_bases
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.intervals import paired_increase
    from loki.evaluation.models import load_default_model
    from loki.evaluation.perplexity import MethodSpec, perplexity

    model, tok = load_default_model(device=device)
    longest = max(t for t, _ in windows)
    recipe = replace(DEFAULT_RECIPE, max_positions=calib_positions or longest)
    base = get_bases(model, tok, ("score",), recipe, progress=True, log=log)["score"]
    bases = {"score": base}
    alloc = {}
    for how in ALLOCATIONS:
        dims = allocate_score_dims(base, d, how=how, min_dims=min_dims)
        bases[f"score-{how}"] = with_score_dims(base, dims)
        alloc[how] = dims.tolist()
        log(f"{how}: dims per layer (KV heads) {dims.tolist()}")
    src = load_corpus(corpus, part="eval")
    out = {"device": str(model.device), "card": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
           "corpus": src.origin, "k": k, "d": d, "min_dims": min_dims, "calibration": dict(vars(recipe)),
           "allocations": alloc, "runs": []}
    for T, N in windows:
        w = token_windows(tok, src, T, N)
        t0 = time.perf_counter()
        full = perplexity(model, w, MethodSpec("full", "full"))
        rows, default = [], None
        for name in ("score", *(f"score-{h}" for h in ALLOCATIONS)):
            spec = MethodSpec(f"loki[{name}]", "loki", k=k, d=d, basis=name, gqa_select="kv",
                              aggregate="softmax-max")
            r = perplexity(model, w, spec, bases, diagnostics=True)
            inc = paired_increase(r.token_nll, full.token_nll)
            row = {"name": spec.name, "ppl": r.ppl, "increase": inc["increase"], "lo": inc["lo"], "hi": inc["hi"],
                   "bytes_fraction": r.bytes_fraction, "recall": r.diagnostics["recall_mean"],
                   "mass": r.diagnostics["mass_mean"]}
            if default is None:
                default = r
            else:
                v = paired_increase(r.token_nll, default.token_nll)
                row.update(vs_default=v["increase"], vs_lo=v["lo"], vs_hi=v["hi"])
            rows.append(row)
            log(f"{T}x{N} {spec.name}: ppl {r.ppl:.3f} ({inc['increase']:+.2%})")
        out["runs"].append({"seq_len": T, "windows": N, "full_ppl": full.ppl, "rows": rows,
                            "seconds": time.perf_counter() - t0})
    return out


def table(res: dict) -> str:
    lines = []
    for run in res["runs"]:
        lines += [f"\n## {run['windows']} x {run['seq_len']} tokens of {res['corpus']} ({res['card']}), k_f "
                  f"{res['k']}, d_f {res['d']}: full attention {run['full_ppl']:.3f}",
                  "| scores | bytes / dense | increase over full [95%] | vs the default [95%] | top-k recall | mass |",
                  "|---|---:|---|---|---:|---:|"]
        for r in run["rows"]:
            vs = "-" if "vs_default" not in r else (f"{100 * r['vs_default']:+.1f}% [{100 * r['vs_lo']:+.1f}, "
                                                    f"{100 * r['vs_hi']:+.1f}]")
            lines.append(f"| {r['name']} | {r['bytes_fraction']:.3f} | {100 * r['increase']:+.1f}% "
                         f"[{100 * r['lo']:+.1f}, {100 * r['hi']:+.1f}] | {vs} | {r['recall']:.3f} | {r['mass']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=_windows, nargs="+", default=[(1024, 8)], metavar="TOKENSxCOUNT",
                    help="window sets (default: 1024x8)")
    ap.add_argument("--corpus", default="wikitext", choices=("wikitext", "wikipedia", "book"),
                    help="evaluation text, its held-out part (default: wikitext)")
    ap.add_argument("--k", type=float, default=0.25, help="budget fraction k_f (default: 0.25)")
    ap.add_argument("--d", type=float, default=0.25, help="the default's d_f, the allocation's mean (default: 0.25)")
    ap.add_argument("--min-dims", type=int, default=1, help="dims every head keeps (default: 1)")
    ap.add_argument("--calib-positions", type=int, default=None,
                    help="positions the basis covers (default: the longest window)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default: cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    res = run(a.windows, corpus=a.corpus, k=a.k, d=a.d, device=a.device, calib_positions=a.calib_positions,
              min_dims=a.min_dims, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

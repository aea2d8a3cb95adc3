"""Calibration recipes against window lengths: which basis keeps Loki close to exact top-k at long context.

Runs on the embedded SmolLM2-135M-Instruct (fp32), WikiText-2 test (evaluation half, windows from its first
token), decode-time semantics, d_f = 0.25.  For every recipe (calibration text, sequence length, covered
positions, basis kind) it fits the bases in one pass, then measures the perplexity increase over full attention
of exact top-k and of Loki with each basis at every window length and k_f, with paired 95% intervals.

    python tools/studies/long_context_sweep.py --device cuda --out sweep.json

Writes the JSON (settings, seconds, every perplexity and interval) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--windows", default="8192x2,1024x8,4096x4", help="TxN,... window length x count")
    p.add_argument("--k", default="0.25,0.125", help="k_f values")
    p.add_argument("--recipes", default="all", help="comma-separated recipe names (default: all)")
    p.add_argument("--tokens", type=int, default=65536, help="calibration tokens per recipe")
    p.add_argument("--kv", action="store_true", help="also the shared selection per KV group for score bases (the "
                   "default configuration on this GQA model: aggregate softmax-max)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new runs after this many seconds")
    p.add_argument("--out", default="sweep.json")
    args = p.parse_args()

    from loki.evaluation.bases import CalibrationRecipe, get_bases
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.intervals import paired_increase
    from loki.evaluation.models import load_default_model, resolve_device
    from loki.evaluation.perplexity import MethodSpec, perplexity
    from loki.reference.selection import DEFAULT_KV_AGGREGATE

    t_start = time.perf_counter()
    device = resolve_device(args.device)
    model, tok = load_default_model(device=device)
    ctx = 8192
    # name: (corpus, seq_len, max_positions, basis names)
    recipes = {
        "wiki512": ("wikipedia", 512, 512, ("pre", "post", "score")),  # the old default: 512-token sequences
        "wiki8192": ("wikipedia", 8192, ctx, ("pre", "post", "score")),  # whole-context sequences
        "wiki1024off": ("wikipedia", 1024, ctx, ("post", "score")),  # 1024-token sequences at spread offsets
        "wiki2048off": ("wikipedia", 2048, ctx, ("score",)),
        "book8192": ("book", 8192, ctx, ("score",)),
        "wt8192": ("wikitext", 8192, ctx, ("post", "score")),  # WikiText-2's other half (in-domain)
    }
    if args.recipes != "all":
        recipes = {k: v for k, v in recipes.items() if k in args.recipes.split(",")}
    bases, cal_seconds = {}, {}
    for name, (corpus, seq_len, maxpos, names) in recipes.items():
        t0 = time.perf_counter()
        recipe = CalibrationRecipe(corpus=corpus, num_tokens=args.tokens, seq_len=seq_len, max_positions=maxpos)
        got = get_bases(model, tok, names, recipe, progress=False)  # one pass per recipe, cached
        for b, basis in got.items():
            bases[f"{name}/{b}"] = basis
        cal_seconds[name] = time.perf_counter() - t0
        print(f"calibrated {name}: {sorted(got)} in {cal_seconds[name]:.1f} s", flush=True)

    ev = load_corpus("wikitext", part="eval")
    rows = []
    ks = [float(x) for x in args.k.split(",")]
    for spec_w in args.windows.split(","):
        T, N = (int(x) for x in spec_w.split("x"))
        w = token_windows(tok, ev, T, N)
        full = perplexity(model, w, MethodSpec("full", "full"), batch_size=2)
        rows.append(dict(T=T, N=N, name="full", k=1.0, ppl=full.ppl, seconds=full.seconds))
        specs = []
        for k in ks:
            specs.append(MethodSpec(f"exact[{k}]", "exact_topk", k=k))
            for bname, basis in bases.items():
                specs.append(MethodSpec(f"{bname}[{k}]", "loki", k=k, d=0.25, basis=bname))
                if args.kv and basis.kind == "score":
                    specs.append(MethodSpec(f"{bname}[{k},kv]", "loki", k=k, d=0.25, basis=bname, gqa_select="kv",
                                            aggregate=DEFAULT_KV_AGGREGATE))
        for spec in specs:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"time budget reached: skipping {spec.name} at T={T}", flush=True)
                continue
            try:
                r = perplexity(model, w, spec, bases, batch_size=2)
            except Exception as exc:  # keep the other measurements
                print(f"T={T} {spec.name}: failed: {type(exc).__name__}: {exc}", flush=True)
                rows.append(dict(T=T, N=N, name=spec.name, k=spec.k, error=f"{type(exc).__name__}: {exc}"))
                continue
            inc = paired_increase(r.token_nll, full.token_nll)
            rows.append(dict(T=T, N=N, name=spec.name, k=spec.k, ppl=r.ppl, seconds=r.seconds, **inc))
            print(f"T={T:5d} {spec.name:28s} {100 * inc['increase']:+8.2f}% "
                  f"[{100 * inc['lo']:+.2f}, {100 * inc['hi']:+.2f}]  {r.seconds:6.1f} s", flush=True)
    out = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               torch=torch.__version__, tokens=args.tokens, calib_seconds=cal_seconds,
               recipes={k: list(v[:3]) + [list(v[3])] for k, v in recipes.items()}, rows=rows,
               seconds=time.perf_counter() - t_start)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{'T':>5s} {'setting':28s} {'vs full':>9s} {'95% interval':>20s}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:5d} {r['name']:28s} failed")
        elif r["name"] == "full":
            print(f"{r['T']:5d} {'full (ppl)':28s} {r['ppl']:9.3f}")
        else:
            print(f"{r['T']:5d} {r['name']:28s} {100 * r['increase']:+8.2f}% "
                  f"[{100 * r['lo']:+7.2f}, {100 * r['hi']:+7.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

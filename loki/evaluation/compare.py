"""The field's decode-time sparse-attention methods side by side at matched bytes (``loki compare``).

Every method reads, per decode step, some bytes to score the tokens and then the keys and values of what it
selected.  Comparing them at one budget ``k`` favours whichever scores cheapest; a user choosing a method needs them
at equal *bytes*.  This module fixes a target (by default the bytes of the default Loki configuration at
``k_f``/``d_f``, 0.375 of dense attention at 0.25/0.25), chooses each method's budget so that it reads the target,
and measures, on the same windows with decode-time semantics (every query row a decode step):

- the perplexity increase over full attention, with its paired 95% interval (:mod:`loki.evaluation.intervals`),
  and over the default configuration's perplexity on the same tokens (``vs_default``: below 0, more accurate);
- the bytes per step it actually read, relative to dense (measured from its selections,
  :mod:`loki.reference.accounting`);
- its recall of the exact top-k set and the attention mass its selection captures, per layer and head
  (:mod:`loki.evaluation.diagnostics`), which locate a loss;
- on request (``CompareOptions.retrieval``), its accuracy on the synthetic retrieval suite
  (:mod:`loki.evaluation.retrieval`) at each method's matched budget of the window set nearest in length, decoded
  greedily one sparse decode step per token on the engine, pooled over the tasks where full attention is above
  chance, with Wilson intervals and paired differences against exact top-k of the default's GQA mode and against
  the default.

**Matched bytes.**  The byte model of every method lives in one place
(:func:`loki.reference.accounting.step_bytes_fraction`): a score phase (Loki and Double Sparsity ``d/(2D)``, SparQ
``r/(2D)``, Quest ``1/16`` for its page metadata, H2O nothing) plus the distinct tokens read per KV head over the
visible ones, ``u/n``.  ``u`` depends on the data where a selection is made per query head (the union over the group)
or in pages (Quest's current page is partial), so the budget is solved for on a probe: the queries and keys of the
first window(s), captured from one dense forward, go through the method's teacher-forced rows
(:func:`loki.reference.teacher_forced.teacher_forced_rows`) and the bytes are measured (:func:`match_budget`,
a bracketed secant search on ``k``).  H2O keeps state across steps and is not probed: its budget comes from the byte
model with one selection per KV head.  The probe sees the dense forward's queries and keys, not the method's own
(whose later layers drift), so a run whose measured bytes miss the target by more than ``rerun_tolerance`` runs once
more with its budget corrected by them (H2O up to twice, by the secant through its runs); the table reports the bytes
measured in the run it shows.
Methods that read more than the target whatever their budget (exact top-k reads every key: at least 1/2 of dense;
PCAAttn reads every value) run at the default's budget and are marked *not byte-matched* (the oracles).

The methods (:data:`COMPARE_METHODS`): Loki's default (score-aware basis, one selection per KV group with
softmax-max), Loki per query head, the paper's Loki (PCA of post-rotary keys, per query head), exact top-k per query
head and shared (oracles), SparQ (``r = d``), Quest (pages of 16), Double Sparsity (``r = d`` label channels, a Loki
basis: :mod:`loki.calibration.channels`) and H2O; shared variants and PCAAttn on request.

Shape letters: N windows, T tokens per window, L layers, HQ query heads, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

__all__ = [
    "COMPARE_METHODS",
    "DEFAULT_METHODS",
    "CompareMethod",
    "CompareOptions",
    "BytesProbe",
    "match_budget",
    "resolve_methods",
    "run_compare",
]


@dataclass(frozen=True)
class CompareMethod:
    """One method of the comparison: an engine ``method`` (:data:`loki.evaluation.perplexity.METHOD_NAMES`) with its
    ``basis`` (a name of :data:`loki.calibration.BASIS_NAMES`), GQA mode and aggregate; ``uses_d``: it reads ``d``
    (Loki's dims, SparQ's and Double Sparsity's ``r``); ``oracle``: exact scores (never byte-matched below 1/2)."""

    name: str
    label: str
    method: str
    basis: str | None = None
    gqa_select: str = "query"
    aggregate: str = "sum"
    uses_d: bool = False
    oracle: bool = False
    default: bool = False
    score_format: str = "native"  # Loki's score copy (loki.reference.score_formats)
    d_scale: float = 1.0  # its dims as a multiple of --d (an 8-bit copy holds twice the dims in the same bytes)

    def dims(self, d):
        """The ``d`` this method runs at, for the comparison's ``--d`` (1.0 where it reads no ``d``)."""
        if not self.uses_d:
            return 1.0
        return d if self.d_scale == 1.0 else min(1.0, float(d) * self.d_scale)


#: Every method ``loki compare`` knows, by name (``--methods``).
COMPARE_METHODS: dict[str, CompareMethod] = {m.name: m for m in (
    CompareMethod("full", "full attention", "full"),
    CompareMethod("loki", "Loki, default (score-aware, shared softmax-max, an int8 score copy of 2d dims)", "loki",
                  "score", "kv", "softmax-max", uses_d=True, default=True, score_format="int8", d_scale=2.0),
    CompareMethod("loki[native]", "Loki, default with the native score copy of d dims", "loki", "score", "kv",
                  "softmax-max", uses_d=True),
    CompareMethod("loki[query]", "Loki, score-aware, per query head (an int8 score copy of 2d dims)", "loki", "score",
                  uses_d=True, score_format="int8", d_scale=2.0),
    CompareMethod("loki-pca[query]", "Loki, paper's PCA (post), per query head", "loki", "post", uses_d=True),
    CompareMethod("loki-pca[kv]", "Loki, paper's PCA (post), shared softmax-max", "loki", "post", "kv", "softmax-max",
                  uses_d=True),
    CompareMethod("exact_topk[query]", "exact top-k, per query head (oracle)", "exact_topk", oracle=True),
    CompareMethod("exact_topk[kv]", "exact top-k, shared softmax-max (oracle)", "exact_topk", None, "kv",
                  "softmax-max", oracle=True),
    CompareMethod("sparq", "SparQ (r = d), per query head", "sparq", uses_d=True),
    CompareMethod("quest", "Quest (pages of 16), per query head", "quest"),
    CompareMethod("quest[kv]", "Quest (pages of 16), shared softmax-max", "quest", None, "kv", "softmax-max"),
    CompareMethod("double_sparsity", "Double Sparsity (r = d label channels), per query head", "loki", "channels",
                  uses_d=True),
    CompareMethod("double_sparsity[kv]", "Double Sparsity (r = d label channels), shared softmax-max", "loki",
                  "channels", "kv", "softmax-max", uses_d=True),
    CompareMethod("h2o", "H2O (heavy hitters + recent), per query head", "h2o"),
    CompareMethod("pcaattn", "PCAAttn (paper's PCA), every token", "pcaattn", "post", uses_d=True),
    CompareMethod("loki[fp8]", "Loki, default with an fp8 score copy of 2d dims", "loki", "score", "kv",
                  "softmax-max", uses_d=True, score_format="fp8", d_scale=2.0),
    CompareMethod("loki[int4]", "Loki, default with an int4 score copy of 4d dims", "loki", "score", "kv",
                  "softmax-max", uses_d=True, score_format="int4", d_scale=4.0),
)}
#: The methods run unless ``--methods`` says otherwise (full attention is always measured, as the reference).
DEFAULT_METHODS = ("loki", "loki[native]", "loki[query]", "loki-pca[query]", "exact_topk[query]", "exact_topk[kv]",
                   "sparq", "quest", "double_sparsity", "h2o")


def resolve_methods(names, config=None) -> list[CompareMethod]:
    """The :class:`CompareMethod` of every name (ValueError naming an unknown one), full attention first.  With a
    model ``config`` whose default Loki mode is per query head (no GQA), ``loki`` is that mode and the duplicate
    ``loki[query]`` is dropped."""
    names = list(dict.fromkeys(names))
    bad = [n for n in names if n not in COMPARE_METHODS]
    if bad:
        raise ValueError(f"--methods: unknown method(s) {', '.join(bad)}; choose from {', '.join(COMPARE_METHODS)}")
    out = [COMPARE_METHODS["full"]] + [COMPARE_METHODS[n] for n in names if n != "full"]
    if config is not None:
        from loki.settings import GQAMode, LokiSettings

        if LokiSettings(backend="torch").resolve(config).gqa_select is GQAMode.QUERY:
            out = [replace(m, gqa_select="query", aggregate="sum") if m.default else m for m in out
                   if m.name != "loki[query]"]
    return out


# ------------------------------------------------------------------------------------------------ the byte model
def byte_range(m: CompareMethod, d, D: int) -> tuple[float, float]:
    """``(low, high)``: the bytes per step of method ``m`` selecting nothing and everything (the byte model,
    :func:`loki.reference.accounting.step_bytes_fraction`)."""
    from loki.reference.accounting import step_bytes_fraction

    dd = m.dims(d) if m.uses_d else None
    return (step_bytes_fraction(m.method, 0.0, dd, D, score_format=m.score_format),
            step_bytes_fraction(m.method, 1.0, dd, D, score_format=m.score_format))


def match_budget(bytes_at: Callable[[float], float], target: float, *, low: float, high: float,
                 tolerance: float = 0.002, max_evals: int = 10) -> dict:
    """The budget fraction ``k`` in (0, 1] whose bytes ``bytes_at(k)`` (non-decreasing in ``k``) equal ``target``:
    a secant search kept inside a bracket (bisection when the secant leaves it), from the linear guess between
    ``low`` (bytes at k -> 0) and ``high`` (at k = 1); stops within ``tolerance`` or after ``max_evals`` probes.

    Returns ``{"k", "bytes", "matched", "evals"}``: ``matched`` False when the target lies below ``low`` (the method
    reads more whatever its budget; ``k`` None) or above ``high`` (``k`` = 1.0, every token)."""
    if target <= low + 1e-12:
        return {"k": None, "bytes": None, "matched": False, "evals": 0}
    if target >= high:
        return {"k": 1.0, "bytes": high, "matched": target - high <= tolerance, "evals": 0}
    lo, hi = 0.0, 1.0
    f_lo, f_hi = low, high
    k = (target - low) / (high - low)
    seen: list[tuple[float, float]] = []
    for _ in range(max_evals):
        b = float(bytes_at(k))
        seen.append((k, b))
        if abs(b - target) <= tolerance:
            break
        if b < target:
            lo, f_lo = k, b
        else:
            hi, f_hi = k, b
        nxt = lo + (target - f_lo) * (hi - lo) / (f_hi - f_lo) if f_hi > f_lo else 0.5 * (lo + hi)
        if not lo < nxt < hi or abs(nxt - k) < 1e-6:
            nxt = 0.5 * (lo + hi)
        k = nxt
    k, b = min(seen, key=lambda kb: abs(kb[1] - target))
    return {"k": k, "bytes": b, "matched": abs(b - target) <= tolerance, "evals": len(seen)}


class BytesProbe:
    """The bytes per decode step of any teacher-forced method on a few windows, without running the model again:
    the post-rotary queries and keys of every layer, captured from one dense forward, go through
    :func:`~loki.reference.teacher_forced.teacher_forced_rows` under the bytes tally
    (:func:`~loki.reference.accounting.tally_selections`).  At most ``rows`` query rows per window are probed, evenly
    spaced (every row of windows up to that length), each with the tokens it sees in the window."""

    def __init__(self, model, windows: torch.Tensor, bases: dict, *, rows: int = 1024):
        from loki._hf import config_head_dim
        from loki.evaluation.agreement import capture_qk

        N, T = windows.shape
        self.qk = capture_qk(model, windows)
        dev = next(iter(self.qk.values()))[0].device
        self.rows = torch.linspace(0, T - 1, min(T, max(1, rows)), device=dev).round().long().unique()
        self.qk = {layer: (q[:, :, self.rows].contiguous(), k) for layer, (q, k) in self.qk.items()}
        self.bases = bases
        self.D = config_head_dim(model.config)
        R = self.rows.numel()
        self.starts = torch.zeros(N, R, dtype=torch.long, device=dev)
        self.lengths = (1 + self.rows)[None].expand(N, R).contiguous()
        self.cache: dict = {}

    def bytes(self, m: CompareMethod, k: float, d) -> float:
        """Measured bytes per step (relative to dense) of method ``m`` at budget ``k`` and dims ``d``."""
        from loki.reference.accounting import step_bytes_fraction, tally_selections
        from loki.reference.teacher_forced import teacher_forced_rows

        key = (m.name, float(k), d)
        if key not in self.cache:
            with torch.no_grad(), tally_selections() as tally:
                for layer in sorted(self.qk):
                    q, kk = self.qk[layer]
                    if m.basis is not None:
                        b = self.bases[m.basis]
                        P, Pq = (t.to(device=q.device, dtype=torch.float32) for t in (b.layer(layer),
                                                                                      b.query_layer(layer)))
                        B, HQ, R, D = q.shape
                        HKV = kk.shape[1]
                        q = (q.float().view(B, HKV, HQ // HKV, R, D) @ Pq[None, :, None]).view(B, HQ, R, D)
                        kk = kk.float() @ P[None]
                    teacher_forced_rows(q, kk, kk, self.starts, self.lengths, method=m.method, k_budget=k,
                                        d=m.dims(d), gqa_select=m.gqa_select, aggregate=m.aggregate,
                                        score_format=m.score_format)
            self.cache[key] = step_bytes_fraction(m.method, tally.selected_fraction, m.dims(d) if m.uses_d else None,
                                                  self.D, components=tally.component_fraction,
                                                  score_format=m.score_format)
        return self.cache[key]


# ------------------------------------------------------------------------------------------------ one run
@dataclass
class CompareOptions:
    """Settings of one comparison (see :func:`run_compare`)."""

    windows: tuple[tuple[int, int], ...] = ((8192, 2), (4096, 4), (1024, 8))  # the long profile's
    methods: tuple[str, ...] = DEFAULT_METHODS
    k: float = 0.25  # the default configuration's budget (the target's) and the oracles'
    d: float = 0.25  # Loki's d, SparQ's and Double Sparsity's r
    target_bytes: float | None = None  # None: the default configuration's bytes at (k, d), measured on the probe
    tolerance: float = 0.005  # |bytes - target| accepted by the budget search (fractions jump at rational k_f)
    rerun_tolerance: float = 0.01  # a run whose measured bytes miss the target by more runs again (H2O: twice)
    probe_windows: int = 1
    probe_rows: int = 1024  # query rows per probe window (evenly spaced; all of them in shorter windows)
    h2o_max_len: int = 1024  # H2O decodes token by token: windows up to this length only
    corpus: str = "wikitext"
    text_file: str | None = None
    recipe: object = None  # a CalibrationRecipe (None: the evaluation's default recipe)
    batch_size: int = 2
    # the retrieval suite at the matched budgets: None (off) or evaluate_retrieval's keyword arguments, e.g.
    # {"context_lens": (8192,), "samples": 32, "batch_size": 16}
    retrieval: dict | None = None
    use_cache: bool = True
    progress: bool = True
    log: Callable[[str], None] | None = None


def _needed_bases(methods: list[CompareMethod]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(m.basis for m in methods if m.basis is not None))


def _spec(m: CompareMethod, k, d):
    from loki.evaluation.perplexity import MethodSpec

    if m.method == "full":
        return MethodSpec(m.name, "full")
    return MethodSpec(m.name, m.method, k=k, d=m.dims(d), basis=m.basis, gqa_select=m.gqa_select,
                      aggregate=m.aggregate, score_format=m.score_format)


def _default_method(methods: list[CompareMethod]) -> CompareMethod:
    return next((m for m in methods if m.default), COMPARE_METHODS["loki"])


def run_compare(model, tokenizer, opts: CompareOptions | None = None) -> dict:
    """Run the comparison; returns the JSON-able results (``settings``, and per window set ``runs``: the target, and
    a row per method with its budget, bytes, perplexity increase and interval, and diagnostics)."""
    from loki._hf import config_head_dim
    from loki.evaluation.bases import DEFAULT_RECIPE, get_bases
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.intervals import paired_increase
    from loki.evaluation.perplexity import perplexity

    opts = opts or CompareOptions()
    log = opts.log or (lambda msg: None)
    t_start = time.perf_counter()
    methods = resolve_methods(opts.methods, model.config)
    D = config_head_dim(model.config)
    recipe = (opts.recipe or DEFAULT_RECIPE)
    default = _default_method(methods)
    need = _needed_bases(methods + [default])
    bases = get_bases(model, tokenizer, need, recipe, use_cache=opts.use_cache, progress=opts.progress, log=log)
    src = load_corpus(opts.corpus, part="eval", path=opts.text_file)
    results = {
        "settings": {
            "model": getattr(model.config, "name_or_path", None), "device": str(model.device),
            "card": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu",
            "dtype": str(model.dtype).replace("torch.", ""), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "eval_origin": src.origin, "head_dim": D,
            "calibration": dict(vars(recipe.resolved(model))), "calib_origin": next(iter(bases.values())).corpus,
            "k": opts.k, "d": opts.d, "target_bytes": opts.target_bytes, "default_method": default.name,
            "methods": [m.name for m in methods], "probe_windows": opts.probe_windows, "probe_rows": opts.probe_rows,
            "tolerance": opts.tolerance, "rerun_tolerance": opts.rerun_tolerance,
            "windows": [list(w) for w in opts.windows],
        },
        "runs": [],
    }
    for T, N in opts.windows:
        windows = token_windows(tokenizer, src, T, N)
        log(f"{N} x {T} tokens of {src.origin}")
        probe = BytesProbe(model, windows[: max(1, min(opts.probe_windows, N))], bases, rows=opts.probe_rows)
        target = opts.target_bytes
        if target is None:
            target = probe.bytes(default, opts.k, opts.d)
        log(f"target: {target:.4f} of dense bytes per decode step ({default.name} at k_f={opts.k:g}, d={opts.d:g})")
        run = {"seq_len": T, "windows": N, "target_bytes": target, "rows": []}
        full = None
        token_nll = {}  # per method: its per-token NLLs, for the paired comparison with the default below
        for m in methods:
            if m.method == "h2o" and T > opts.h2o_max_len:
                log(f"{m.name}: skipped at {T} tokens (decodes token by token; --h2o-max-len {opts.h2o_max_len})")
                run["rows"].append({"name": m.name, "label": m.label, "skipped":
                                    f"H2O decodes token by token: windows up to {opts.h2o_max_len} tokens"})
                continue
            t0 = time.perf_counter()
            k, note, match, adjustable = _choose_budget(m, probe, target, opts, D, default)
            batch = N if m.method == "h2o" else opts.batch_size
            diagnose = m.method not in ("full", "pcaattn")
            r = perplexity(model, windows, _spec(m, k, opts.d), bases, batch_size=batch, diagnostics=diagnose)
            # the probe ran on the dense forward's queries and keys (H2O: not probed at all); where the method's own
            # pass reads other bytes, its budget is corrected by them: once where probed, up to twice for H2O
            tried = [(k, r.bytes_fraction)]
            reruns = (1 if match is not None else 2) if adjustable else 0
            while (len(tried) <= reruns and r.bytes_fraction is not None
                   and abs(r.bytes_fraction - target) > opts.rerun_tolerance):
                k2 = _corrected_budget(m, probe if match is not None else None, tried, target, opts, D)
                log(f"{m.name}: read {r.bytes_fraction:.4f} at k_f={k:.4f}; once more at k_f={k2:.4f}")
                k = k2
                r = perplexity(model, windows, _spec(m, k, opts.d), bases, batch_size=batch, diagnostics=diagnose)
                tried.append((k, r.bytes_fraction))
            if len(tried) > 1:
                n = len(tried) - 1
                note = (note + "; " if note else "") + (f"budget corrected {'once' if n == 1 else f'{n} times'} by "
                                                         "the bytes of its own runs")
            if full is None and m.method == "full":
                full = r
            row = _row(m, r, k, opts.d, note, match, full, paired_increase)
            token_nll[m.name] = r.token_nll
            row["seconds"] = time.perf_counter() - t0
            run["rows"].append(row)
            nbytes = row.get("bytes_fraction")
            log(f"{m.name}: k_f={'-' if k is None else f'{k:.4f}'} bytes={'-' if nbytes is None else f'{nbytes:.3f}'}"
                f" ppl={r.ppl:.4f} ({row['seconds']:.1f} s)")
        if default.name in token_nll:  # every method against the default on the same tokens: a paired interval
            for row in run["rows"]:
                if row["name"] in token_nll and row["name"] not in (default.name, "full"):
                    inc = paired_increase(token_nll[row["name"]], token_nll[default.name])
                    row.update(vs_default=inc["increase"], vs_default_lo=inc["lo"], vs_default_hi=inc["hi"])
        results["runs"].append(run)
    if opts.retrieval:
        results["retrieval"] = compare_retrieval(model, tokenizer, results["runs"], methods, default, bases, opts,
                                                 log)
    results["settings"]["seconds"] = time.perf_counter() - t_start
    return results


def compare_retrieval(model, tokenizer, runs: list[dict], methods: list[CompareMethod], default: CompareMethod,
                      bases: dict, opts: CompareOptions, log) -> list[dict]:
    """The retrieval suite (:func:`loki.evaluation.retrieval.evaluate_retrieval`, ``opts.retrieval`` its keyword
    arguments) with every method of ``runs`` at the budget it was matched to on the window set nearest in length to
    each context length (H2O, which decodes token by token, up to ``opts.h2o_max_len`` tokens).  Returns one entry
    per context length: the window set the budgets came from, and per method its pooled accuracy (the tasks where
    full attention is above chance) with its Wilson interval and paired differences (Newcombe) against exact top-k
    of the default's GQA mode (``vs_oracle``) and against the default (``vs_default``)."""
    from loki.evaluation.intervals import paired_difference
    from loki.evaluation.retrieval import evaluate_retrieval

    kw = dict(opts.retrieval)
    lens = tuple(kw.pop("context_lens", (8192,)))
    by_name = {m.name: m for m in methods}
    oracle = next((m.name for m in methods if m.method == "exact_topk" and m.gqa_select == default.gqa_select
                   and m.aggregate == default.aggregate), None)
    out = []
    for L in lens:
        run = min(runs, key=lambda r: (abs(r["seq_len"] - L), -r["seq_len"]))
        specs, rows = [], {}
        for row in run["rows"]:
            m = by_name.get(row["name"])
            if m is None or "skipped" in row or (m.method == "h2o" and L > opts.h2o_max_len):
                continue
            specs.append(_spec(m, row["k"], opts.d))
            rows[m.name] = row
        log(f"retrieval at {L} tokens: {len(specs)} methods at the budgets matched on {run['seq_len']} tokens")
        res = evaluate_retrieval(model, tokenizer, specs, bases, context_lens=(L,), progress=opts.progress, **kw)
        pooled = {c["name"]: c for c in res["cells"] if c["task"] == "all" and c["context_len"] == L}
        if not pooled:  # one task: its own cells
            pooled = {c["name"]: c for c in res["cells"] if c["context_len"] == L}
        tasks = next(iter(pooled.values())).get("pooled_tasks", list(res["config"]["tasks"]))
        correct = {n: [x for t in tasks for x in res["samples"][f"{t}/{L}/{n}"]["correct"]] for n in pooled}
        entry = {"context_len": L, "budgets_from": run["seq_len"], "tasks": tasks, "oracle": oracle,
                 "default": default.name, "samples": kw.get("samples"), "rows": []}
        for n, c in pooled.items():
            r = {"name": n, "label": rows[n]["label"] if n in rows else n, "k": rows.get(n, {}).get("k"),
                 "bytes_fraction": rows.get(n, {}).get("bytes_fraction"), "default": n == default.name,
                 "n": c["n"], "correct": c["correct"], "accuracy": c["accuracy"], "ci": c["ci"]}
            for key, ref in (("vs_oracle", oracle), ("vs_default", default.name)):
                if ref in correct and ref != n and n != "full":
                    r[key] = paired_difference(correct[n], correct[ref])
            entry["rows"].append(r)
        entry["config"] = res["config"]
        out.append(entry)
    return out


def _choose_budget(m: CompareMethod, probe: BytesProbe, target: float, opts: CompareOptions, D: int,
                   default: CompareMethod):
    """``(k, note, match, adjustable)``: the budget of method ``m`` at the target bytes (module docstring), and
    whether a run that misses the target may correct it."""
    if m.method == "full":
        return 1.0, "", None, False
    if m.method == "pcaattn":
        return 1.0, "every token (not a top-k method): not byte-matched", None, False
    if m is default and opts.target_bytes is None:
        return opts.k, "defines the target", None, False
    low, high = byte_range(m, opts.d, D)
    if m.method == "h2o":
        k = min(1.0, max(1e-4, (target - low) / (high - low)))
        return k, "budget from the byte model (H2O is not probed)", None, True
    match = match_budget(lambda k: probe.bytes(m, k, opts.d), target, low=low, high=high, tolerance=opts.tolerance)
    if match["k"] is None:
        why = "scoring reads every key" if m.method == "exact_topk" else "its score phase alone exceeds the target"
        return opts.k, f"not byte-matched ({why}): the default's k_f", match, False
    return match["k"], "" if match["matched"] else "closest budget on the probe", match, True


def _corrected_budget(m: CompareMethod, probe: BytesProbe | None, tried: list[tuple[float, float]],
                      target: float, opts: CompareOptions, D: int) -> float:
    """The budget of another run of ``m`` after runs at ``(k, measured bytes)`` in ``tried``: where probed, the probe's
    curve shifted by what the last run read beyond it, solved again; else (H2O) the secant through the last two runs,
    or from one run ``k`` scaled by the selected part."""
    low, high = byte_range(m, opts.d, D)
    k, measured = tried[-1]
    if probe is None:
        if len(tried) >= 2 and tried[-1][1] != tried[-2][1]:
            (k0, b0), (k1, b1) = tried[-2], tried[-1]
            return min(1.0, max(1e-4, k1 + (target - b1) * (k1 - k0) / (b1 - b0)))
        return min(1.0, max(1e-4, k * (target - low) / max(1e-9, measured - low)))
    shift = measured - probe.bytes(m, k, opts.d)
    again = match_budget(lambda x: probe.bytes(m, x, opts.d) + shift, target, low=low + shift, high=high + shift,
                         tolerance=opts.tolerance)
    return again["k"] if again["k"] is not None else k


def _row(m: CompareMethod, r, k, d, note: str, match: dict | None, full, paired_increase) -> dict:
    row = {"name": m.name, "label": m.label, "method": m.method, "basis": m.basis, "gqa_select": m.gqa_select,
           "aggregate": m.aggregate, "default": m.default, "oracle": m.oracle, "k": k,
           "d": m.dims(d) if m.uses_d else None, "score_format": m.score_format, "note": note, "ppl": r.ppl,
           "nll": r.nll, "tokens": r.tokens,
           "bytes_fraction": r.bytes_fraction, "score_fraction": r.score_fraction,
           "selected_fraction": r.selected_fraction, "probe": match}
    if full is not None:
        inc = paired_increase(r.token_nll, full.token_nll)
        row.update(increase=inc["increase"], increase_lo=inc["lo"], increase_hi=inc["hi"])
    dg = r.diagnostics
    if dg is not None:
        row.update(recall=dg["recall_mean"], mass=dg["mass_mean"], oracle_mass=dg["oracle_mass_mean"],
                   diagnostics=dg)
    return row


def default_log(msg: str) -> None:
    print(f"[loki compare] {msg}", file=sys.stderr, flush=True)


"""Perplexity of a causal LM under a sparse-attention method, with decode-time semantics.

Protocols (``protocol=``):

- ``"decode"`` (default): teacher forcing where every query row ``i`` of a window attends like a decode step
  over the ``i + 1`` tokens it sees and a fractional budget selects ``k_i = ceil(k_f * (i + 1))`` of them
  (``enable_loki(..., semantics="decode")``, which calls the decode references with one row per query through
  :func:`loki.integrations.transformers.teacher_forced_attention`).  The fraction of causal entries attended
  (the *effective density*) is then ~k_f.  A test proves this equals token-by-token decoding with the cache.
- ``"paper"``: the Loki paper's original evaluation, where k is a fraction of the *whole* window,
  ``K = ceil(k_f * T)``, and row ``i`` keeps ``min(K, i + 1)`` tokens: early rows keep everything, so far more
  than k_f of the causal entries are attended (effective density ~ 2 k_f - k_f^2 for T >> 1).

H2O keeps state across decode steps (accumulated attention), so it is evaluated by an actual token-by-token
decode loop with the KV cache (``semantics="generate"``, one token per forward), which has the same
decode-time semantics.

Budgets ``k`` are fractions (``k_f``: row i keeps ``ceil(k_f (i + 1))`` tokens) or int counts (row i keeps
``min(k, i + 1)``; the one budget rule, ``loki._checks.budget_counts``).  Every result states the bytes a decode
step reads relative to dense attention (``bytes_fraction``, :func:`bytes_fractions`), measured from the
selections the rows actually made (:mod:`loki.reference.accounting`).

Shape letters: N windows, T tokens per window, V vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from loki._checks import check_budget, resolve_k
from loki._hf import cache_keyword, config_head_dim, config_kv_heads
from loki.reference.score_formats import check_score_format
from loki.reference.selection import DEFAULT_KV_AGGREGATE, GQA_AGGREGATES, GQA_SELECT_MODES, KERNEL_AGGREGATES

__all__ = [
    "METHOD_ROLES",
    "PROTOCOLS",
    "MethodSpec",
    "PerplexityResult",
    "budget_label",
    "bytes_fractions",
    "effective_density",
    "evaluate_methods",
    "method_role",
    "nll_per_token",
    "perplexity",
    "standard_methods",
]

PROTOCOLS = ("decode", "paper")
#: Method names accepted by :class:`MethodSpec` ("full" = the model's own dense attention, untouched).
METHOD_NAMES = ("full", "dense", "exact_topk", "loki", "pcaattn", "sparq", "h2o", "quest")
#: The role of each method in the evaluation, carried by every result row (``row["role"]``) so that gates and
#: reports select rows by it, never by display names: ``baseline`` (dense attention), ``oracle`` (exact top-k,
#: the best any selection can do), ``loki`` (the method under test), ``competitor`` (other sparse methods).
METHOD_ROLES = {"full": "baseline", "dense": "baseline", "exact_topk": "oracle", "loki": "loki",
                "pcaattn": "competitor", "sparq": "competitor", "h2o": "competitor", "quest": "competitor"}


def method_role(method: str) -> str:
    """The role (:data:`METHOD_ROLES`) of a method name."""
    try:
        return METHOD_ROLES[method]
    except KeyError:
        raise ValueError(f"method must be one of {METHOD_NAMES}, got {method!r}") from None


@dataclass(frozen=True)
class MethodSpec:
    """One evaluated setting.  ``k``/``d`` are counts or fractions (``d`` is SparQ's ``r``); ``basis`` names an
    entry of the bases dict (e.g. "pre"/"post") for "loki" and "pcaattn".  ``gqa_select`` / ``aggregate`` are
    explicit (per query head unless given): a spec names one setting whatever the model; the accuracy suite builds
    its specs in the model's default mode (:func:`loki.evaluation.suite.resolve_gqa`)."""

    name: str
    method: str
    k: int | float = 1.0
    d: int | float = 1.0
    basis: str | None = None
    gqa_select: str = "query"
    aggregate: str = "sum"
    score_format: str = "native"

    def __post_init__(self):
        if self.method not in METHOD_NAMES:
            raise ValueError(f"method must be one of {METHOD_NAMES}, got {self.method!r}")
        check_budget(self.k, name=f"k ({self.name})")
        if self.gqa_select not in GQA_SELECT_MODES:
            raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {self.gqa_select!r} ({self.name})")
        if self.aggregate not in GQA_AGGREGATES:
            raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {self.aggregate!r} ({self.name})")
        check_score_format(self.score_format, self.method)
        if self.method in ("loki", "pcaattn") and self.basis is None:
            raise ValueError(f"method {self.method!r} ({self.name}) needs a basis name")


@dataclass
class PerplexityResult:
    name: str
    method: str
    protocol: str
    k: int | float
    d: int | float
    basis: str | None
    gqa_select: str
    ppl: float
    nll: float
    tokens: int
    density: float
    seconds: float
    window_nll: list[float]
    token_nll: torch.Tensor | None = field(default=None, repr=False)  # [N, T - 1] fp64, CPU; not in to_dict
    aggregate: str = "sum"
    # bytes one decode step reads relative to dense attention (bytes_fractions): score_fraction (the key dims read
    # to score every visible token) + selected_fraction (distinct tokens read per KV head over the visible ones,
    # measured from the selections, averaged over rows, KV heads, layers and windows)
    bytes_fraction: float | None = None
    score_fraction: float | None = None
    selected_fraction: float | None = None
    # per layer and head: recall of the exact top-k set and attention mass of the selection (perplexity(...,
    # diagnostics=True), loki.evaluation.diagnostics.summarize_diagnostics); None when not measured
    diagnostics: dict | None = None
    score_format: str = "native"  # Loki's score copy of the keys (loki.reference.score_formats)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(replace(self, token_nll=None)).items()
                if k != "token_nll" and (k != "diagnostics" or v is not None)}


def budget_label(k: int | float) -> str:
    """A budget as the reports write it: ``k_f = 0.25`` for a fraction, ``k = 512`` for a count of tokens."""
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise TypeError(f"k must be an int count or a float fraction, got {k!r}")
    return f"k = {k}" if isinstance(k, int) else f"k_f = {k:g}"


def bytes_fractions(method: str, d: int | float, D: int, selected: float | None,
                    components: float | None = None, *, score_format: str = "native") -> dict:
    """The bytes one decode step of ``method`` reads relative to dense attention (keys and values of every visible
    token once): ``{"score_fraction", "selected_fraction", "bytes_fraction"}``, from the one byte model of
    :mod:`loki.reference.accounting` (:func:`~loki.reference.accounting.score_fraction`,
    :func:`~loki.reference.accounting.step_bytes_fraction`).

    Scoring reads ``d/D`` of every visible key, half of the dense bytes times ``d/D``: Loki ``d/(2D)``, SparQ
    ``r/(2D)``, Quest its page metadata ``1/16`` (a minimum and a maximum key per page of 16 tokens), H2O nothing
    (its scores are the attention it computed); then the keys and values of the ``u`` distinct tokens read per KV
    head, ``u/n`` of the ``n`` visible ones (``selected``, measured from the selections:
    :mod:`loki.reference.accounting`): ``d/(2D) + u/n``.  Exact top-k reads every key whole to score (``1/2``) and
    then only the values of its selection: ``1/2 + u/(2n)``.  Dense attention reads 1; PCAAttn ``d/(2D)`` of the
    keys and every value, ``d/(2D) + 1/2``.  SparQ's query heads pick their own ``r`` components of the keys they
    share: its scoring reads the distinct components of each KV group, ``components / 2`` (measured,
    :attr:`loki.reference.accounting.SelectionTally.component_fraction`).  ``bytes_fraction`` is None when a sparse
    method's ``selected`` was not measured.  A Loki score copy in fewer bits (``score_format``,
    :mod:`loki.reference.score_formats`) reads ``d`` dims at its bits plus a 16-bit scale per token."""
    from loki.reference.accounting import score_fraction, step_bytes_fraction

    if method not in METHOD_NAMES:
        raise ValueError(f"method must be one of {METHOD_NAMES}, got {method!r}")
    if method in ("full", "dense"):
        return {"score_fraction": 0.0, "selected_fraction": 1.0, "bytes_fraction": 1.0}
    sf = score_fraction(method, d, D, components=components, score_format=score_format)
    return {"score_fraction": sf, "selected_fraction": None if method == "pcaattn" else selected,
            "bytes_fraction": step_bytes_fraction(method, selected, d, D, components=components,
                                                  score_format=score_format)}


def effective_density(k: int | float, T: int, protocol: str = "decode") -> float:
    """Fraction of the causal entries (row i sees i + 1 tokens) that a budget ``k`` attends over a window of
    ``T`` tokens under ``protocol`` (1.0 for k = 1.0)."""
    n = torch.arange(1, T + 1, dtype=torch.long)
    kk = _protocol_k(k, T, protocol)
    counts = resolve_k(kk, n, T)
    return float(counts.sum()) / float(n.sum())


def _protocol_k(k: int | float, T: int, protocol: str) -> int | float:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol == "paper" and isinstance(k, float):
        return max(1, math.ceil(k * T - 1e-9))  # a count: min(K, i + 1) per row
    return k


def nll_per_token(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each next token: logits [N, T, V], input_ids [N, T] -> [N, T - 1] fp32."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -lp.gather(-1, input_ids[:, 1:, None].to(lp.device)).squeeze(-1)


@torch.no_grad()
def _logits_decode_loop(model, input_ids: torch.Tensor, progress: bool = False) -> torch.Tensor:
    """Token-by-token decoding with the KV cache (one token per forward) under the enabled method."""
    from tqdm.auto import tqdm

    from loki.integrations.transformers import loki_cache

    cache = loki_cache(model)
    kw = cache_keyword(model)
    out = []
    for t in tqdm(range(input_ids.shape[1]), desc="decode loop", unit="tok", disable=not progress, leave=False):
        o = model(input_ids=input_ids[:, t : t + 1], use_cache=True, **{kw: cache})
        out.append(o.logits[:, -1].float())
    return torch.stack(out, dim=1)


@torch.no_grad()
def method_logits(model, input_ids: torch.Tensor, spec: MethodSpec, bases: dict | None = None, *,
                  protocol: str = "decode", decode_loop: bool | None = None, progress: bool = False) -> torch.Tensor:
    """Logits [N, T, V] of ``model`` on ``input_ids [N, T]`` under ``spec`` (see the module docstring).

    ``decode_loop=True`` forces the token-by-token loop for any method (the default uses it for H2O only).
    """
    from loki.integrations.transformers import disable_loki, enable_loki
    from loki.settings import LokiSettings

    input_ids = input_ids.to(model.device)
    T = input_ids.shape[1]
    if spec.method == "full":
        disable_loki(model)
        return model(input_ids=input_ids, use_cache=False).logits.float()
    basis = None
    if spec.basis is not None:
        if not bases or spec.basis not in bases:
            raise KeyError(f"{spec.name}: basis {spec.basis!r} not given (have {sorted(bases or {})})")
        basis = bases[spec.basis]
    k = _protocol_k(spec.k, T, protocol)
    loop = spec.method == "h2o" if decode_loop is None else decode_loop
    # the aggregates the Triton kernels lack run on the PyTorch reference (enable_loki refuses them on the kernels)
    backend = "auto" if spec.aggregate in KERNEL_AGGREGATES else "torch"
    enable_loki(model, basis, settings=LokiSettings(
        k=k, d=spec.d, method=spec.method, gqa_select=spec.gqa_select, aggregate=spec.aggregate, backend=backend,
        semantics="generate" if loop else "decode", score_format=spec.score_format))
    try:
        if loop:
            return _logits_decode_loop(model, input_ids, progress=progress)
        return model(input_ids=input_ids, use_cache=False).logits.float()
    finally:
        disable_loki(model)


def perplexity(model, windows: torch.Tensor, spec: MethodSpec, bases: dict | None = None, *,
               protocol: str = "decode", batch_size: int = 4, progress: bool = False,
               diagnostics: bool = False) -> PerplexityResult:
    """Perplexity of ``model`` on ``windows [N, T]`` under ``spec``: exp of the mean next-token NLL over all
    N * (T - 1) predictions, and the bytes a decode step reads (:func:`bytes_fractions`, the selections measured
    on every row, KV head and layer of the windows).  ``diagnostics=True`` also measures, on the same pass, every
    selection's recall of the exact top-k set and the attention mass it captures per layer and head
    (``result.diagnostics``, :mod:`loki.evaluation.diagnostics`; about one more top-k per row).

    In an initialised ``torch.distributed`` group of several processes (every rank given the same windows), the
    batches of windows are split across ranks and the NLLs gathered: every rank returns the full result."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, T] with T >= 2, got {list(windows.shape)}")
    from contextlib import nullcontext

    from loki.reference.accounting import tally_selections

    from .diagnostics import layer_diagnostics, merge_sums, summarize_diagnostics
    from .distributed import map_chunks

    t0 = time.perf_counter()

    def chunk_nll(j: int) -> tuple[torch.Tensor, float, int, dict | None, float, int]:
        chunk = windows[j * batch_size : (j + 1) * batch_size]
        with tally_selections() as tally, (layer_diagnostics(model) if diagnostics else nullcontext()) as diag:
            logits = method_logits(model, chunk, spec, bases, protocol=protocol, progress=progress)
        return (nll_per_token(logits, chunk).cpu(), float(tally.frac_sum), tally.count,
                diag.cpu_sums() if diag is not None else None, float(tally.comp_sum), int(tally.comp_rows))

    parts = map_chunks(chunk_nll, -(-windows.shape[0] // batch_size))
    nll = torch.cat([p[0] for p in parts])  # [N, T - 1]
    rows = sum(p[2] for p in parts)
    selected = sum(p[1] for p in parts) / rows if rows else None
    comp_rows = sum(p[5] for p in parts)
    components = sum(p[4] for p in parts) / comp_rows if comp_rows else None
    mean = float(nll.double().mean())
    T = windows.shape[1]
    density = 1.0 if spec.method in ("full", "dense", "pcaattn") else effective_density(spec.k, T, protocol)
    return PerplexityResult(
        name=spec.name, method=spec.method, protocol=protocol, k=spec.k, d=spec.d, basis=spec.basis,
        gqa_select=spec.gqa_select, ppl=math.exp(mean), nll=mean, tokens=int(nll.numel()), density=density,
        seconds=time.perf_counter() - t0, window_nll=[float(x) for x in nll.double().mean(1)],
        token_nll=nll.double(), aggregate=spec.aggregate, score_format=spec.score_format,
        **bytes_fractions(spec.method, spec.d, config_head_dim(model.config), selected, components,
                          score_format=spec.score_format),
        diagnostics=summarize_diagnostics(merge_sums(p[3] for p in parts), config_kv_heads(model.config))
        if diagnostics else None,
    )


def standard_methods(k_f: float = 0.25, d_f: float = 0.25, head_dim: int = 64, *, rotary=("pre", "post"),
                     gqa_modes=("query", "kv"), pcaattn: bool = True, exactness: bool = True,
                     kv_aggregate: str = DEFAULT_KV_AGGREGATE, score_format: str = "native") -> list[MethodSpec]:
    """The suite at matched budgets: full attention, exact top-k (every GQA mode of ``gqa_modes``, in that order),
    Loki for every basis and GQA mode, H2O, PCAAttn and SparQ with ``r = d`` (SparQ reads r of D dims per key as
    Loki reads d, so their score-phase bytes match), plus the exactness settings (Loki with d = D and k = all;
    d = D at k_f, per query head).  The "kv" settings (exact top-k among them: the oracle of the same shared
    selection) combine a group's scores by ``kv_aggregate`` (default "softmax-max", ``enable_loki``'s).
    ``score_format``: the score copy of the Loki rows at d_f (:mod:`loki.reference.score_formats`; the exactness
    rows stay native)."""
    if kv_aggregate not in GQA_AGGREGATES:
        raise ValueError(f"kv_aggregate must be one of {GQA_AGGREGATES}, got {kv_aggregate!r}")
    r = max(1, math.ceil(d_f * head_dim - 1e-9))
    agg = {"query": "sum", "kv": kv_aggregate}
    specs = [MethodSpec("full", "full")]
    for g in gqa_modes:
        specs.append(MethodSpec(f"exact_topk[{g}]", "exact_topk", k=k_f, gqa_select=g, aggregate=agg[g]))
    for rot in rotary:
        for g in gqa_modes:
            specs.append(MethodSpec(f"loki-{rot}[{g}]", "loki", k=k_f, d=d_f, basis=rot, gqa_select=g,
                                    aggregate=agg[g], score_format=score_format))
    specs.append(MethodSpec("h2o", "h2o", k=k_f))
    specs.append(MethodSpec(f"sparq(r={r})", "sparq", k=k_f, d=r))
    pca_rot = "post" if "post" in rotary else rotary[-1]  # PCAAttn and the exactness checks use the PCA basis
    if pcaattn:
        specs.append(MethodSpec(f"pcaattn-{pca_rot}", "pcaattn", k=k_f, d=d_f, basis=pca_rot))
    if exactness:
        rot = pca_rot
        specs.append(MethodSpec(f"loki-{rot}(d=D,k=all)", "loki", k=1.0, d=1.0, basis=rot))
        specs.append(MethodSpec(f"loki-{rot}(d=D)[query]", "loki", k=k_f, d=1.0, basis=rot))
    return specs


def evaluate_methods(model, windows: torch.Tensor, specs: list[MethodSpec], bases: dict | None = None, *,
                     protocol: str = "decode", progress: bool = True, batch_size: int = 4) -> list[PerplexityResult]:
    """:func:`perplexity` of every spec (with a tqdm bar over methods)."""
    from tqdm.auto import tqdm

    out = []
    bar = tqdm(specs, desc=f"perplexity ({protocol})", unit="method", disable=not progress)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        out.append(perplexity(model, windows, spec, bases, protocol=protocol, batch_size=batch_size,
                              progress=False))
    return out


def with_k(spec: MethodSpec, k, d=None) -> MethodSpec:
    return replace(spec, k=k, d=spec.d if d is None else d)

"""Loki's settings, decided once.

:class:`LokiSettings` is what a user asks for (``"auto"`` allowed wherever the library has a default that depends on
the model); :meth:`LokiSettings.resolve` (a model config) or :meth:`LokiSettings.resolve_shapes` (head counts, for
direct kernel users) decides every ``"auto"``, validates every value once and returns a :class:`ResolvedSettings`,
the only form the integration, the kernels' entry points and the evaluation pass down.  Functions below the entry
points take resolved values and have no mode defaults of their own, so nothing below can disagree with the top.

The choices are enums (``str`` subclasses: ``Aggregate.SOFTMAX_MAX == "softmax-max"``), mapped to kernel
arguments in one place (the kernels' launcher reads ``.value``).

The defaults (what ``"auto"`` becomes):

- ``gqa_select``: one selection per KV group (``"kv"``) for method ``"loki"`` on a GQA model (fewer KV heads than
  query heads): the bytes read fall with the group size; otherwise per query head (``"query"``).
- ``aggregate``: ``"softmax-max"`` for a shared Loki selection (each head's approximate scores softmax-normalised
  before the group's maximum: the most accurate shared selection the kernels run), ``"sum"`` for a shared selection
  of another method; per-query-head selection has no aggregate (``"sum"`` is recorded, never read).
- ``score_format``: ``"int8"`` for method ``"loki"`` (the approximate scores read an int8 copy of the keys' leading
  dims, one bf16 scale per token: twice the dims of a native copy for the same bytes, and more accurate at those
  bytes; with ``key_prefix=False``, or where a static cache has no room for the copy, the kernels round the keys'
  dims in place as they read them, the copy's codes and scales); ``"native"`` for every other method.
- ``d``: the dims whose score copy reads the bytes of a quarter of the head's dims in 16 bits: 0.25 for a native
  copy, 0.5 for an 8-bit one (int8, fp8), 1.0 for int4.
- ``backend``: ``"auto"`` stays ``"auto"``: each forward's step plan runs the Triton kernels on CUDA tensors that need
  no gradient and the PyTorch reference otherwise (the kernels have no backward); on a CPU without the Triton
  interpreter it resolves to ``"torch"``.

Shape letters: HQ query heads, HKV key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from numbers import Real

from loki._checks import MAX_COUNT, check_budget, check_dims, resolve_d

__all__ = [
    "Aggregate",
    "Backend",
    "GQAMode",
    "KERNEL_AGGREGATES",
    "LokiSettings",
    "MAX_COUNT",
    "Method",
    "ResolvedSettings",
    "SOFTMAX_AGGREGATES",
    "ScoreFormat",
    "Semantics",
]

class _Choice(str, Enum):
    """A setting with a fixed set of values; prints as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value, name: str):
        """``value`` (a member or its string) as a member; ValueError naming ``name`` and the choices otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be one of {tuple(m.value for m in cls)}, got {value!r}") from None


class Method(_Choice):
    """The decode-time method (``loki.reference`` holds each one's PyTorch reference)."""

    LOKI = "loki"
    EXACT_TOPK = "exact_topk"
    PCAATTN = "pcaattn"
    DENSE = "dense"
    SPARQ = "sparq"
    H2O = "h2o"
    QUEST = "quest"

    @property
    def needs_basis(self) -> bool:
        """Whether the method reads keys stored in a basis (Loki and PCAAttn)."""
        return self in (Method.LOKI, Method.PCAATTN)


class GQAMode(_Choice):
    """How a GQA model selects: ``QUERY`` per query head, ``KV`` one selection per KV group."""

    AUTO = "auto"
    QUERY = "query"
    KV = "kv"


class Aggregate(_Choice):
    """How a shared ("kv") selection combines its group's scores (``loki.reference.aggregate_group_scores``)."""

    AUTO = "auto"
    SUM = "sum"
    MAX = "max"
    SOFTMAX_SUM = "softmax-sum"
    SOFTMAX_MAX = "softmax-max"
    UNION = "union"
    AGREEMENT = "agreement"


class Backend(_Choice):
    """Where Loki's decode step runs: the Triton kernels, the PyTorch reference, or ``AUTO`` (decided per forward)."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


class ScoreFormat(_Choice):
    """How the score copy of the keys' leading dims is stored (``loki.reference.score_formats``): ``NATIVE`` the
    cache's elements; ``FP8``, ``INT8``, ``INT4`` fewer bits per dim with a per-token scale (so more dims fit the
    same bytes).  ``INT8`` runs on the Triton kernels too (the caches write an int8 copy); ``FP8`` and ``INT4`` are
    evaluated on the PyTorch reference only (:attr:`reference_only`)."""

    AUTO = "auto"
    NATIVE = "native"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def default_d(self) -> float:
        """The default dims fraction of this format: the dims whose copy reads what 0.25 of the dims read in 16 bits
        (0.25 native, 0.5 for an 8-bit copy, 1.0 for int4)."""
        return _DEFAULT_D[self]

    @property
    def reference_only(self) -> bool:
        """Whether the format runs on the PyTorch reference only (the kernels read "native" and "int8" copies)."""
        return self in (ScoreFormat.FP8, ScoreFormat.INT4)


_DEFAULT_D = {ScoreFormat.NATIVE: 0.25, ScoreFormat.FP8: 0.5, ScoreFormat.INT8: 0.5, ScoreFormat.INT4: 1.0}


class Semantics(_Choice):
    """``GENERATE``: dense prefill, sparse decode steps; ``DECODE``: every query row attends like a decode step."""

    GENERATE = "generate"
    DECODE = "decode"


#: The aggregates the Triton kernels implement ("union" and "agreement" run on the PyTorch reference only).
KERNEL_AGGREGATES = frozenset({Aggregate.SUM, Aggregate.MAX, Aggregate.SOFTMAX_SUM, Aggregate.SOFTMAX_MAX})
#: The aggregates that select on softmax-normalised scores.
SOFTMAX_AGGREGATES = frozenset({Aggregate.SOFTMAX_SUM, Aggregate.SOFTMAX_MAX})


@dataclass(frozen=True)
class LokiSettings:
    """What a user asks of Loki (``enable_loki``'s keyword arguments, or a kernel entry point's), ``"auto"`` allowed.

    k: tokens attended per decode step: an int count (>= 1; a count above a sequence's valid tokens keeps them all)
    or a float fraction in (0, 1] of each sequence's valid length (rounded up, at least 1).
    d: leading basis dims of the approximate scores (SparQ's ``r`` for method "sparq"): an int count (<= D), a
    float fraction of D (rounded up), or "auto" (the default: :attr:`ScoreFormat.default_d` of the score format,
    0.5 for the int8 copy, 0.25 for a native one).
    method, gqa_select, aggregate, backend, semantics: see :class:`Method`, :class:`GQAMode`, :class:`Aggregate`,
    :class:`Backend`, :class:`Semantics` (strings are accepted).  h2o_recent_fraction: H2O's share of the budget
    given to the most recent tokens.  score_format: how Loki's approximate scores read the keys' ``d`` leading dims
    (:class:`ScoreFormat`; "auto", the default, is "int8" for method "loki" and "native" otherwise); "int8" runs on
    the kernels too (the caches keep an int8 copy of the d dims with a bf16 scale per token); "fp8" and "int4" run
    on the PyTorch reference only (``backend="auto"`` resolves to "torch"; "triton" is refused), for evaluating
    them.  key_prefix: whether the caches keep the keys' first d rotated dims a second time, contiguous (or their
    int8 copy), for the kernels' approximate scores (True, the default: the copy's bytes more than K in memory, the
    scores read at the copy bandwidth); False keeps K and V alone, the memory of a dense cache, and the kernels read
    those dims in place (a strided read of 16-bit dims, rounded to the int8 copy as they are read for "int8":
    slower, the same results).  A static cache with no room for the prefix leaves it out of the layers where it
    does not fit (a warning; the same results).

    Values are checked when the object is made (an error names the argument); the "auto" values are decided by
    :meth:`resolve` / :meth:`resolve_shapes`.
    """

    k: int | float = 0.25
    d: int | float | str = "auto"
    method: Method | str = Method.LOKI
    gqa_select: GQAMode | str = GQAMode.AUTO
    aggregate: Aggregate | str = Aggregate.AUTO
    backend: Backend | str = Backend.AUTO
    semantics: Semantics | str = Semantics.GENERATE
    h2o_recent_fraction: float = 0.5
    score_format: ScoreFormat | str = ScoreFormat.AUTO
    key_prefix: bool = True

    def __post_init__(self):
        object.__setattr__(self, "method", Method.parse(self.method, "method"))
        object.__setattr__(self, "gqa_select", GQAMode.parse(self.gqa_select, "gqa_select"))
        object.__setattr__(self, "aggregate", Aggregate.parse(self.aggregate, "aggregate"))
        object.__setattr__(self, "backend", Backend.parse(self.backend, "backend"))
        object.__setattr__(self, "semantics", Semantics.parse(self.semantics, "semantics"))
        if not isinstance(self.key_prefix, bool):
            raise TypeError(f"key_prefix must be True or False, got {self.key_prefix!r}")
        fmt = ScoreFormat.parse(self.score_format, "score_format")
        if fmt is ScoreFormat.AUTO:  # decided here, once: every later reader sees the concrete format and dims
            fmt = ScoreFormat.INT8 if self.method is Method.LOKI else ScoreFormat.NATIVE
        object.__setattr__(self, "score_format", fmt)
        if isinstance(self.d, str):
            if self.d != "auto":
                raise ValueError(f"d must be an int count, a float fraction of D or 'auto', got {self.d!r}")
            object.__setattr__(self, "d", fmt.default_d)  # native for the other methods: 0.25
        if self.score_format is not ScoreFormat.NATIVE and self.method is not Method.LOKI:
            raise ValueError(f"score_format={self.score_format.value!r} applies to method='loki' only "
                             f"(got method={self.method.value!r})")
        if self.score_format.reference_only and self.backend is Backend.TRITON:
            raise ValueError(f"score_format={self.score_format.value!r} runs on the PyTorch reference only (the "
                             "Triton kernels read a native or int8 copy): use backend='torch' or 'auto'")
        object.__setattr__(self, "k", check_budget(self.k, name="k"))
        object.__setattr__(self, "d", check_dims(self.d, name="d"))
        f = self.h2o_recent_fraction
        if isinstance(f, bool) or not isinstance(f, Real):
            raise TypeError(f"h2o_recent_fraction must be a number in [0, 1], got {f!r}")
        if not 0.0 <= float(f) <= 1.0:
            raise ValueError(f"h2o_recent_fraction={f} must lie in [0, 1]")
        object.__setattr__(self, "h2o_recent_fraction", float(f))
        if self.method is Method.H2O and self.semantics is Semantics.DECODE:
            raise ValueError("method='h2o' keeps state across decode steps and supports semantics='generate' only")

    def resolve(self, model_config, device=None) -> ResolvedSettings:
        """Every "auto" decided for a model (its text config: query and KV heads, head dim) on ``device``."""
        from loki._hf import config_head_dim, config_kv_heads, text_config

        return self.resolve_shapes(num_q_heads=int(text_config(model_config).num_attention_heads),
                                   num_kv_heads=config_kv_heads(model_config), head_dim=config_head_dim(model_config),
                                   device=device)

    def resolve_shapes(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, device=None,
                       where: str | None = None) -> ResolvedSettings:
        """Every "auto" decided for ``num_q_heads`` query heads sharing ``num_kv_heads`` KV heads of ``head_dim``
        dims on ``device`` (None: not known yet; the backend is then checked per forward).  ``where``: the entry
        point named in errors (default: the backend setting)."""
        mode = self.gqa_select
        if mode is GQAMode.AUTO:
            mode = GQAMode.KV if self.method is Method.LOKI and num_kv_heads < num_q_heads else GQAMode.QUERY
        agg = self.aggregate
        if agg is Aggregate.AUTO:
            agg = Aggregate.SOFTMAX_MAX if mode is GQAMode.KV and self.method is Method.LOKI else Aggregate.SUM
        backend = self.backend
        dev_type = None if device is None else getattr(device, "type", str(device).split(":")[0])
        if backend is Backend.TRITON and dev_type is not None:
            from loki._checks import check_triton_device

            try:
                check_triton_device(device, "backend='triton'")
            except RuntimeError as exc:
                raise ValueError(f"{exc} (the model is on {device})") from None
        elif backend is Backend.AUTO and dev_type == "cpu":
            backend = Backend.TORCH  # the kernels run on CUDA only unless asked for by name (the interpreter)
        if self.score_format.reference_only:
            backend = Backend.TORCH  # the kernels read a native or int8 copy; other formats are the reference's
        if (self.method is Method.LOKI and mode is GQAMode.KV and agg not in KERNEL_AGGREGATES
                and (backend is Backend.TRITON or backend is Backend.AUTO and dev_type == "cuda")):
            where = where or f"the Triton kernels that backend={self.backend.value!r} runs"
            raise ValueError(f"aggregate={agg.value!r} is not implemented by {where} (they implement "
                             f"{tuple(sorted(a.value for a in KERNEL_AGGREGATES))}): use backend='torch'")
        return ResolvedSettings(
            method=self.method, k=self.k, d=resolve_d(self.d, int(head_dim)), gqa_select=mode, aggregate=agg,
            backend=backend, semantics=self.semantics, h2o_recent_fraction=self.h2o_recent_fraction,
            score_format=self.score_format, num_q_heads=int(num_q_heads), num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim), requested=self)


@dataclass(frozen=True)
class ResolvedSettings:
    """Settings with every choice made (:meth:`LokiSettings.resolve`): ``d`` a count of dims, ``gqa_select`` and
    ``aggregate`` concrete, ``backend`` "torch", "triton" or "auto" (kernels on CUDA without autograd, decided per
    forward by the step plan).  ``requested``: the :class:`LokiSettings` it came from."""

    method: Method
    k: int | float
    d: int
    gqa_select: GQAMode
    aggregate: Aggregate
    backend: Backend
    semantics: Semantics
    h2o_recent_fraction: float
    score_format: ScoreFormat
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    requested: LokiSettings

    @property
    def rotates(self) -> bool:
        """Whether keys are stored in a basis."""
        return self.method.needs_basis

    @property
    def prefix_dims(self) -> int | None:
        """d of the contiguous key prefix the kernels read (None: the method never runs the kernels, or
        ``key_prefix=False`` asked for none); with :attr:`int8_prefix` the prefix holds these d dims as int8 codes
        (one bf16 scale per token beside it)."""
        kernels = self.method is Method.LOKI and self.backend is not Backend.TORCH
        return self.d if kernels and self.requested.key_prefix else None

    @property
    def int8_prefix(self) -> bool:
        """Whether the kernels' key prefix is the "int8" score copy (``encode_int8_score_keys``: int8 codes of the
        d scored dims and a bf16 scale per token) instead of the keys' own elements."""
        return self.score_format is ScoreFormat.INT8 and self.prefix_dims is not None

    def use_kernels(self, *, cuda: bool, needs_grad: bool) -> bool:
        """Whether a decode step runs the Triton kernels: always for backend "triton", never for "torch"; for
        "auto", on CUDA tensors when no gradient is wanted (the kernels have no backward).  The one place this is
        decided (the step plan and ``decode_attention`` ask it)."""
        if self.backend is Backend.TRITON:
            return True
        return self.backend is Backend.AUTO and cuda and not needs_grad

    def reference_args(self) -> dict:
        """The arguments of Loki's PyTorch reference beyond the kernels' (:meth:`kernel_args`), as plain strings."""
        return {"score_format": self.score_format.value} if self.method is Method.LOKI else {}

    def kernel_args(self) -> dict:
        """The mode arguments of the kernels' launcher, as plain strings (the one mapping of these enums)."""
        return {"gqa_select": self.gqa_select.value, "aggregate": self.aggregate.value}

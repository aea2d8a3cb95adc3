"""Accuracy of Loki on the embedded small real model (SmolLM2-135M-Instruct, GQA 9:3, D = 64), CPU or GPU.

The numbers are those of the accuracy job (``loki check``, :func:`loki.evaluation.check.run_suite`) with the
settings of the ``tests`` profile of ``ci/accuracy_thresholds.json`` (``benchmarks._shapes.ACCURACY_PROFILE``:
k_f = d_f = 0.25, calibration corpus and tokens, evaluation windows), so ``ci/gate.py`` can hold them to that
profile's limits; without that profile the suite's default settings are used.  Only what the gates need is
run (GQA "query" selection; no SparQ, PCAAttn, paper protocol, Rank or generalisation table): a couple of
minutes on two CPU cores.

- ``Perplexity.track_ppl_delta``: relative perplexity increase over full attention, ``ppl / ppl_full - 1``,
  with decode-time semantics (every query row attends like a decode step over the tokens it sees).  Higher
  is worse.  ``track_ppl``: the perplexity itself (``method = full`` included).
- ``TopkAgreement.track_jaccard``: mean Jaccard index of Loki's selection and the exact top-k over layers,
  heads and informative rows, per basis (pre- / post-rotary).  ``track_attention_mass``: exact attention
  mass captured by Loki's selection (``..._exact``: by the exact top-k, the best possible).  Lower is worse.

Both classes share one ``setup_cache`` (ASV keys it by the function), so the suite runs once.  Without the
evaluation code, the model wheel or the data every benchmark skips and says why.
"""

from __future__ import annotations

try:
    from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:  # pragma: no cover
    SkipNotImplemented = NotImplementedError

from ._shapes import ACCURACY_BASES, ACCURACY_METHODS, ACCURACY_PROFILE


def _unit(unit):
    def deco(fn):
        fn.unit = unit
        return fn

    return deco


def measure_accuracy(profile: str = ACCURACY_PROFILE) -> dict:
    """Run the gates-only accuracy suite with ``profile``'s settings; ``{"ppl": {method: ppl}, "agreement":
    {basis: {...}}, "settings": ...}`` or ``{"skip": reason}``."""
    try:
        from loki.evaluation.check import SuiteOptions, load_thresholds, run_suite
        from loki.evaluation.models import EmbeddedModelError, load_default_model
    except ImportError as exc:
        return {"skip": f"this commit lacks the evaluation code: {exc}"}
    import torch

    try:
        thresholds = load_thresholds()
    except FileNotFoundError:
        thresholds = {}
    settings = thresholds.get("profiles", {}).get(profile, {}).get("settings", {})
    try:
        model, tokenizer = load_default_model()
    except (EmbeddedModelError, FileNotFoundError, ImportError) as exc:
        return {"skip": f"the embedded model is not available: {exc}"}
    if torch.cuda.is_available():
        model.to("cuda")
    known = set(SuiteOptions().profile_settings())
    opts = SuiteOptions(**{k: v for k, v in settings.items() if k in known})
    opts.methods, opts.gqa_modes = "gates", ("query",)
    opts.h2o_gate_d = thresholds.get("loki_vs_h2o", {}).get("d", opts.h2o_gate_d)
    opts.paper_protocol = opts.rank = opts.generalization = False
    opts.progress, opts.log = False, None
    res = run_suite(model, tokenizer, opts)
    rows = {r["name"]: r for r in res["perplexity"]}
    full = rows["full"]["ppl"]
    return {
        "settings": res["settings"],
        "profile": profile if settings else None,
        "device": str(model.device),
        "ppl": {name: r["ppl"] for name, r in rows.items()},
        "ppl_delta": {name: r["ppl"] / full - 1.0 for name, r in rows.items()},
        "agreement": {
            basis: {k: a[f"{k}_mean"] for k in ("jaccard", "mass", "mass_exact")}
            for basis, a in res.get("agreement", {}).items()
        },
    }


class _AccuracySuite:
    version = "1"  # bump when what a number means changes (ASV hides results of other versions)
    timeout = 1200

    def setup_cache(self):
        try:
            return measure_accuracy()
        except Exception as exc:  # noqa: BLE001 - recorded: setup then fails every benchmark with this message
            return {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}

    setup_cache.timeout = 1200

    def _check(self, cache):
        if "skip" in cache:
            raise SkipNotImplemented(cache["skip"])
        if "error" in cache:
            raise RuntimeError(cache["error"])


class Perplexity(_AccuracySuite):
    """Perplexity under each method at the profile's budget, and its increase over full attention."""

    params = [ACCURACY_METHODS]
    param_names = ["method"]

    def setup(self, cache, method):
        self._check(cache)
        if method not in cache["ppl"]:
            raise SkipNotImplemented(f"{method} is not part of this commit's accuracy suite")

    @_unit("ratio")
    def track_ppl_delta(self, cache, method):
        return cache["ppl_delta"][method]

    @_unit("ppl")
    def track_ppl(self, cache, method):
        return cache["ppl"][method]


class TopkAgreement(_AccuracySuite):
    """Agreement of Loki's selection with the exact top-k, per PCA basis."""

    params = [ACCURACY_BASES]
    param_names = ["basis"]

    def setup(self, cache, basis):
        self._check(cache)
        if basis not in cache["agreement"]:
            raise SkipNotImplemented(f"basis {basis} was not measured")

    @_unit("jaccard")
    def track_jaccard(self, cache, basis):
        return cache["agreement"][basis]["jaccard"]

    @_unit("fraction")
    def track_attention_mass(self, cache, basis):
        return cache["agreement"][basis]["mass"]

    @_unit("fraction")
    def track_attention_mass_exact(self, cache, basis):
        return cache["agreement"][basis]["mass_exact"]

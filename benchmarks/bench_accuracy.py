"""Accuracy of Loki on the embedded small real model (SmolLM2-135M-Instruct, GQA 9:3, D = 64), CPU or GPU.

The numbers are those of the accuracy job (``loki check``, :func:`loki.evaluation.suite.run_suite`) with the
``tests`` profile (``benchmarks._shapes.ACCURACY_PROFILE``: k_f = d_f = 0.25, 4 x 512 WikiText-2 tokens, bases
covering the 512 positions used), so ``ci/gate.py`` can hold them to that profile's limits in
``loki/evaluation/accuracy_thresholds.json``.  A few minutes on two CPU cores, seconds on a GPU.

- ``Perplexity.track_ppl_delta``: relative perplexity increase over full attention, ``ppl / ppl_full - 1``,
  with decode-time semantics (every query row attends like a decode step over the tokens it sees).  Higher
  is worse.  ``track_ppl``: the perplexity itself (``method = full`` included).
  ``track_eval_tokens_per_second``: how fast the evaluation engine scores tokens under each method.
- ``TopkAgreement.track_jaccard``: mean Jaccard index of Loki's selection and the exact top-k over layers,
  heads and informative rows, per basis (pre- / post-rotary).  ``track_attention_mass``: exact attention
  mass captured by Loki's selection (``..._exact``: by the exact top-k, the best possible).  Lower is worse.

Both classes share one ``setup_cache`` (ASV keys it by the function), so the suite runs once.  Without the
evaluation code, the model wheel or the data every benchmark skips and says why.
"""

from __future__ import annotations

import contextlib
import os

from ._common import SkipNotImplemented, skip, unit  # noqa: F401 (re-exported)
from ._shapes import ACCURACY_BASES, ACCURACY_METHODS, ACCURACY_PROFILE

#: A file the suite's progress goes to while ``setup_cache`` runs (ASV shows a benchmark's output only when it ends;
#: ci/asv_cpu.py sets it and prints each step as it comes).
PROGRESS_ENV = "LOKI_ASV_PROGRESS"


def measure_accuracy(profile: str = ACCURACY_PROFILE) -> dict:
    """Run the suite of ``profile`` (no retrieval, plots or downstream tasks); ``{"ppl": {method: ppl},
    "ppl_delta": {...}, "tokens_per_second": {method: evaluation tokens per second}, "agreement": {basis: {...}},
    "settings": ...}`` or ``{"skip": reason}``.  With ``$LOKI_ASV_PROGRESS`` naming a file, the suite's log lines
    and progress bars go there as they happen; ``$LOKI_ASV_THREADS`` sets torch's CPU threads."""
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return _measure_accuracy(profile, None)
    with open(path, "a", encoding="utf-8", buffering=1) as stream, contextlib.redirect_stderr(stream):
        return _measure_accuracy(profile, stream)


def _measure_accuracy(profile: str, stream) -> dict:
    if os.environ.get("LOKI_ASV_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(max(1, int(os.environ["LOKI_ASV_THREADS"])))

    def log(msg):
        print(f"{msg}", file=stream, flush=True)

    try:
        from loki.evaluation.models import EmbeddedModelError, load_default_model
        from loki.evaluation.suite import profile_options, run_suite
    except ImportError as exc:
        return {"skip": f"this commit lacks the evaluation code: {exc}"}
    try:
        model, tokenizer = load_default_model(device="auto")
    except (EmbeddedModelError, FileNotFoundError, ImportError) as exc:
        return {"skip": f"the embedded model is not available: {exc}"}
    opts = profile_options(profile, progress=stream is not None, log=log if stream is not None else None, rank=False,
                           retrieval=None, downstream=False)
    res = run_suite(model, tokenizer, opts)
    rows = {r["name"]: r for r in res["perplexity"]}
    exact = res.get("exactness", [])
    full_x = next((r["ppl"] for r in exact if _role(r) == "baseline"), None)
    checks = {r["name"]: r for r in exact if _reproduces(r)}  # Loki with d = D (and k = all)
    ppl_delta = {name: r["increase"] for name, r in rows.items()}
    ppl_delta.update({name: r["ppl"] / full_x - 1.0 for name, r in checks.items() if full_x})
    return {
        "settings": res["settings"],
        "profile": profile,
        "device": str(model.device),
        "ppl": {name: r["ppl"] for name, r in {**rows, **checks}.items()},
        "ppl_delta": ppl_delta,
        "tokens_per_second": {name: r["tokens"] / r["seconds"] for name, r in rows.items()},
        "agreement": {
            basis: {k: a[f"{k}_mean"] for k in ("jaccard", "mass", "mass_exact")}
            for basis, a in res.get("agreement", {}).items()
        },
    }


def _role(row: dict) -> str:
    """A row's role (``loki.evaluation.perplexity.METHOD_ROLES``), read from its fields, not its display name;
    results of commits before the ``role`` field: from the method."""
    return row.get("role") or {"full": "baseline", "exact_topk": "oracle"}.get(row["method"], row["method"])


def _reproduces(row: dict) -> str | None:
    """What an exactness row must reproduce (``reproduces``; before that field: Loki with the fraction d = 1.0)."""
    if "reproduces" in row:
        return row["reproduces"]
    d, k = row.get("d"), row.get("k")
    if row.get("method") == "loki" and isinstance(d, float) and d == 1.0:
        return "baseline" if k == 1.0 else "oracle"
    return None


class _AccuracySuite:
    # bump when what a number means changes (ASV hides results of other versions); "3": the default Loki rows read the
    # int8 score copy of d_f 0.5
    version = "3"
    timeout = 1200

    def setup_cache(self):
        try:
            return measure_accuracy()
        except Exception as exc:  # noqa: BLE001 - recorded: setup then fails every benchmark with this message
            return {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}

    setup_cache.timeout = 1200

    def _check(self, cache, case):
        if "skip" in cache:
            skip(self, cache["skip"], case)
        if "error" in cache:
            raise RuntimeError(cache["error"])


class Perplexity(_AccuracySuite):
    """Perplexity under each method at the profile's budget, and its increase over full attention."""

    params = [ACCURACY_METHODS]
    param_names = ["method"]

    def setup(self, cache, method):
        self._check(cache, method)
        if method not in cache["ppl"]:
            skip(self, f"{method} is not part of this commit's accuracy suite", method)

    @unit("ratio")
    def track_ppl_delta(self, cache, method):
        return cache["ppl_delta"][method]

    @unit("ppl")
    def track_ppl(self, cache, method):
        return cache["ppl"][method]

    @unit("tokens/s")
    def track_eval_tokens_per_second(self, cache, method):
        """Evaluation speed: scored tokens per second of the decode-time-semantics perplexity (teacher-forced
        methods run every query row as a decode step by masks; H2O runs token by token)."""
        if method not in cache["tokens_per_second"]:
            skip(self, f"{method}: no timed perplexity run (an exactness setting)", method)
        return cache["tokens_per_second"][method]


class TopkAgreement(_AccuracySuite):
    """Agreement of Loki's selection with the exact top-k, per PCA basis."""

    params = [ACCURACY_BASES]
    param_names = ["basis"]

    def setup(self, cache, basis):
        self._check(cache, basis)
        if basis not in cache["agreement"]:
            skip(self, f"basis {basis} was not measured", basis)

    @unit("jaccard")
    def track_jaccard(self, cache, basis):
        return cache["agreement"][basis]["jaccard"]

    @unit("fraction")
    def track_attention_mass(self, cache, basis):
        return cache["agreement"][basis]["mass"]

    @unit("fraction")
    def track_attention_mass_exact(self, cache, basis):
        return cache["agreement"][basis]["mass_exact"]

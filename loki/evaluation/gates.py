"""The gates of the accuracy suite, decided on 95% intervals, and the thresholds file they read.

The thresholds ship with the package (``loki/evaluation/accuracy_thresholds.json``): structural tolerances,
the project's accuracy targets (``targets``, :mod:`loki.evaluation.targets`: the one set of numbers the README,
the report and the gates read), downstream limits, and per profile (``tests``, ``check``, ``long``) the
regression limits recorded from measurements on three texts (WikiText-2 and the held-out packaged Wikipedia and
book passages; :func:`update_thresholds`), each limit the largest of the three measurements plus a margin, so it
holds on each text.

Rows are chosen by the fields they carry (``role``: baseline, oracle, loki, competitor; ``basis``,
``gqa_select``, ``aggregate``, ``k``, ``seq_len``; exactness rows name the row they must ``reproduce``; comparisons
their ``kind``), never by parsing display names.  The default Loki configuration is the default basis in the run's
default GQA mode (``settings["default_gqa_select"]`` and ``["default_aggregate"]``: one selection per KV group with
"softmax-max" on a GQA model; :func:`~loki.evaluation.gate_rows.default_gqa`).  Results written before these fields
existed are read through the ``method``, ``k`` and ``d`` fields they do carry, with the default of then, per query
head.

How an interval decides (a gate fails only on evidence):

- exactness: Loki with d = D and k = all (and d = D at k_f) reproduces full attention (exact top-k) within
  ``exactness_rel_tol``: deterministic, no interval;
- ordering full <= exact top-k <= Loki: fails when the paired interval of the increase lies entirely below
  ``-ordering_rel_tol`` for exact top-k against full attention, ``-oracle_ordering_rel_tol`` for Loki against exact
  top-k (a sparse method significantly better than the dense one, or than the oracle by more than that margin,
  means a bug: exact top-k is the best selection by score, not by perplexity, and an approximate one measured
  0.22% [0.04, 0.39] below it at 8192 tokens, per query head with the int8 copy;
  results/int8-default-h200-2026-12-02);
- Loki's best basis (in the default GQA mode) against H2O at the same budget: fails when the interval of Loki over
  H2O lies entirely above 0 (Loki significantly worse);
- targets and fidelity: the default basis' increase over full attention fails when its interval lies entirely
  above the target (at every window length and k_f the run measures that has a target), and against each PCA
  basis when the interval lies entirely above 0; a known miss of the profile is reported as such
  (:mod:`loki.evaluation.targets`);
- fast path: the perplexity of the compiled static cache on the Triton kernels (token by token, fp32) within
  ``fast_path_rel_tol`` of the engine's on the same windows (:mod:`loki.evaluation.fast_path`): deterministic up
  to rounding, no interval; a section skipped off CUDA is reported, not failed;
- retrieval through generate: the retrieval suite's answers through ``generate`` on the compiled static cache
  agree with the engine's on the same samples (:mod:`loki.evaluation.retrieval_generate`), per setting over every
  task and length: the paired 95% interval of the accuracy difference contains 0 or the difference is within
  ``retrieval_generate_tol``; skipped off CUDA like the fast path;
- regression: a perplexity increase fails when its interval lies entirely above the recorded limit; Jaccard and
  attention mass (means over thousands of rows and every layer and head) fail below their limits; retrieval
  accuracy fails when its interval lies entirely below the recorded limit.

A part of the run that was switched on (``settings["parts"]``) but left no rows, and a gated setting the run
lacks, fail unless ``allow_missing``: a run never passes by having nothing to check (:func:`verdict`).
"""

from __future__ import annotations

import json
from pathlib import Path

from loki.evaluation.gate_rows import _gate, default_gqa, in_default_mode, primary_setting, row_role  # noqa: F401
from loki.evaluation.thresholds import DEFAULT_THRESHOLDS, check_thresholds, load_thresholds, missing_gates

__all__ = ["DEFAULT_THRESHOLDS", "EXIT_RULE", "check_thresholds", "evaluate_gates", "load_thresholds", "missing_gates",
           "primary_setting", "retrieval_cells", "row_key", "row_role", "update_thresholds", "verdict"]

#: The exit-status rule of ``loki check`` (:func:`verdict`; ``--help`` and the report state it).
EXIT_RULE = (
    "Exit status: 0 when no gate fails; 1 when a gate fails; 2 on a bad argument or input file. Every accuracy\n"
    "gate is decided on its 95% interval: it fails only when the interval lies entirely beyond its bound, so a\n"
    "target whose point estimate misses but whose interval reaches it is reported 'missed, not significant' and\n"
    "does not fail. A significant miss recorded as a known miss of the profile fails unless --allow-known-misses\n"
    "(and fails even then when significantly worse than recorded); a part that ran and left nothing to check\n"
    "fails unless --allow-missing; a run with no gates fails."
)

def row_key(row: dict, primary: tuple[int, float]) -> str:
    """The thresholds' name of a perplexity row: its name at the primary (length, k_f), else
    ``name@T<length>,k<k_f>``."""
    if (row.get("seq_len"), row.get("k")) == primary:
        return row["name"]
    return f"{row['name']}@T{row['seq_len']},k{row['k']:g}"


def row_reproduces(row: dict) -> str | None:
    """The role of the row an exactness row must reproduce (``baseline`` for Loki with d = D and k = all,
    ``oracle`` for d = D at k_f), or None.  Older results: Loki with the fraction d = 1.0."""
    if "reproduces" in row:
        return row["reproduces"]
    d, k = row.get("d"), row.get("k")
    if row.get("method") == "loki" and isinstance(d, float) and d == 1.0:
        return "baseline" if isinstance(k, float) and k == 1.0 else "oracle"
    return None


def comparison_kind(c: dict, rows: dict[str, dict]) -> str | None:
    """A comparison's ``kind`` (oracle_vs_baseline, loki_vs_oracle, loki_vs_h2o, default_vs_basis), or for older
    results the kind the roles of the two rows it names imply (``loki_vs_loki`` for two Loki rows)."""
    if "kind" in c:
        return c["kind"]
    a, b = rows.get(c["a"]), rows.get(c["b"])
    if a is None or b is None:
        return None
    ra, rb = row_role(a), row_role(b)
    if (ra, rb) == ("oracle", "baseline"):
        return "oracle_vs_baseline"
    if (ra, rb) == ("loki", "oracle"):
        return "loki_vs_oracle"
    if ra == "loki" and b.get("method") == "h2o":
        return "loki_vs_h2o"
    if (ra, rb) == ("loki", "loki"):
        return "loki_vs_loki"
    return None


def retrieval_cells(results: dict) -> dict[str, dict]:
    """The pooled retrieval cells of a run (every task on which full attention is above chance, per context
    length and method) by ``all@<length>:<method>``, with ``accuracy``, ``lo``, ``hi`` and ``method``."""
    out = {}
    for c in results.get("retrieval", {}).get("cells", []):
        if c["task"] == "all" and c["n"]:
            out[f"all@{c['context_len']}:{c['name']}"] = {"accuracy": c["accuracy"], "lo": c["ci"][0],
                                                          "hi": c["ci"][1], "method": c["method"]}
    return out


def run_parts(results: dict) -> dict[str, bool]:
    """Which parts of the suite the run was asked for (``settings["parts"]``); older results: perplexity and
    agreement always, retrieval when it is there."""
    parts = results.get("settings", {}).get("parts")
    if parts is not None:
        return {k: bool(v) for k, v in parts.items()}
    return {"perplexity": True, "agreement": True, "retrieval": bool(results.get("retrieval"))}



def _missing(name: str, what: str, allow_missing: bool) -> dict:
    note = f"{what}; " + ("accepted by --allow-missing" if allow_missing else "--allow-missing accepts it")
    return _gate(name, None, None, allow_missing, bound_text="present", note=note)


def _ci(x: dict, pre="increase") -> str:
    lo, hi = (x.get(f"{pre}_lo"), x.get(f"{pre}_hi")) if pre else (x.get("lo"), x.get("hi"))
    return f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%]" if lo is not None else ""


#: Settings that results written before they were recorded had: the shared (kv) rows combined raw sums, and the
#: Loki rows read the native score copy (a run's settings name ``score_format`` only when it is another).
_LEGACY_SETTINGS = {"kv_aggregate": "sum", "score_format": "native"}


def _profile_applies(results: dict, thresholds: dict, profile: str, *, ignore=()) -> tuple[bool, dict]:
    """Whether the profile's recorded limits and known misses apply to the run: every setting they were recorded
    with (``kv_aggregate`` included: limits of shared rows combined otherwise measure another configuration) is the
    run's, except the settings named in ``ignore``, which do not decide."""
    prof = thresholds.get("profiles", {}).get(profile) or {}
    settings = results.get("settings", {})
    got = lambda k: settings.get(k, _LEGACY_SETTINGS.get(k))  # noqa: E731
    mismatch = {k: (got(k), v) for k, v in prof.get("settings", {}).items() if k not in ignore and got(k) != v}
    return bool(prof) and not mismatch, mismatch


def evaluate_gates(results: dict, thresholds: dict, profile: str = "check", *,
                   allow_missing: bool = False) -> list[dict]:
    """The gates of one run (module docstring); each ``{"name", "value", "bound", "passed", ...}``; a failing
    target gate excused by a known miss of the profile carries ``"known"`` (the recorded miss)."""
    from loki.evaluation.targets import load_targets, target_gates

    gates: list[dict] = []
    if not results.get("settings", {}).get("windows"):
        return [_missing("results: settings", "the results carry no settings (windows, k_f)", False)]
    parts = run_parts(results)
    T0, k0 = primary_setting(results)
    all_rows = results.get("perplexity", [])
    rows = {r["name"]: r for r in all_rows if r.get("seq_len") == T0
            and (row_role(r) == "baseline" or r["k"] == k0)}
    comps = [c for c in results.get("comparisons", []) if c["seq_len"] == T0 and c["k"] == k0]
    tol = float(thresholds.get("exactness_rel_tol", 1e-4))
    otol = float(thresholds.get("ordering_rel_tol", 1e-6))
    # exact top-k is the best selection by score, not by perplexity: an approximate selection may read slightly lower
    otol_loki = float(thresholds.get("oracle_ordering_rel_tol", otol))

    if parts.get("perplexity"):
        if not any(row_role(r) == "baseline" for r in rows.values()) or not any(
                row_role(r) == "loki" for r in rows.values()):
            gates.append(_missing("results: perplexity rows", f"no full-attention and Loki rows at T={T0}, "
                                  f"k_f={k0:g} although the perplexity part ran", allow_missing))
        ex = results.get("exactness", [])
        refs = {"baseline": next((r for r in ex if row_role(r) == "baseline"), None),
                "oracle": next((r for r in ex if row_role(r) == "oracle" and r.get("gqa_select", "query") == "query"),
                               None)}
        checked = 0
        for r in ex:
            want = row_reproduces(r)
            if want not in refs:
                continue
            what = "Loki d=D, k=all == full" if want == "baseline" else "Loki d=D == exact top-k"
            ref = refs[want]
            if ref is None:
                gates.append(_missing(f"exactness: {what} ({r['name']})", f"no {want} row to compare with",
                                      allow_missing))
                continue
            rel = abs(r["ppl"] / ref["ppl"] - 1)
            gates.append(_gate(f"exactness: {what} ({r['name']})", rel, tol, rel <= tol, f"<= {tol:g}"))
            checked += 1
        if not checked and not any(g["name"].startswith("exactness:") for g in gates):
            gates.append(_missing("exactness: d = D rows", "no exactness rows although the perplexity part ran",
                                  allow_missing))

    def ordering(c, tol=otol):
        gates.append(_gate(f"ordering: {c['b']} <= {c['a']}", c["increase"], -tol, c["hi"] >= -tol,
                           f"interval {_ci(c, None)} not all below {-tol:g}"))

    kinds = [(comparison_kind(c, rows), c) for c in comps]
    for kind, c in kinds:
        if kind == "oracle_vs_baseline" and rows.get(c["a"], {}).get("gqa_select", "query") == "query":
            ordering(c)
    for kind, c in kinds:
        if kind == "loki_vs_oracle":
            ordering(c, otol_loki)
    gqa = default_gqa(results)
    loki_default = [r for r in rows.values() if row_role(r) == "loki" and in_default_mode(r, gqa)]
    h2o = [r for r in rows.values() if r.get("method") == "h2o"]
    if h2o and loki_default:
        best = min(loki_default, key=lambda r: r["ppl"])
        c = next((c for kind, c in kinds if kind == "loki_vs_h2o" and c["a"] == best["name"]), None)
        if c is None:
            gates.append(_missing(f"Loki best basis ({best['name']}) not worse than H2O at k={k0:g}",
                                  "no paired comparison with H2O", allow_missing))
        else:
            gates.append(_gate(f"Loki best basis ({best['name']}) not worse than H2O at k={k0:g}", c["increase"], 0.0,
                               c["lo"] <= 0.0, f"interval vs h2o {_ci(c, None)} not all above 0"))
    # a known miss names the GQA mode it was measured in: how the profile's shared rows were combined when its
    # regression limits were recorded (kv_aggregate) does not decide whether it applies
    applies, _ = _profile_applies(results, thresholds, profile, ignore=("kv_aggregate",))
    ppl_targets, ret_targets = load_targets(thresholds, (T0, k0))
    default = results.get("settings", {}).get("default_basis", "score")
    if ppl_targets or ret_targets:
        gates += target_gates(results, thresholds, profile, profile_applies=applies)
        for kind, c in kinds:
            a, b = rows.get(c["a"]), rows.get(c["b"])
            if (kind in ("default_vs_basis", "loki_vs_loki") and a is not None and b is not None
                    and a.get("basis") == default and b.get("basis") != default):
                gates.append(_gate(f"fidelity: {c['a']} not worse than {c['b']}", c["increase"], 0.0, c["lo"] <= 0.0,
                                   f"interval {_ci(c, None)} not all above 0"))
    gates += _downstream_gates(results, thresholds)
    gates += _fast_path_gates(results, thresholds, parts, allow_missing)
    gates += _retrieval_generate_gates(results, thresholds, parts, allow_missing)
    gates += _regression_gates(results, thresholds, profile, parts, allow_missing)
    return gates


def _fast_path_gates(results, thresholds, parts, allow_missing) -> list[dict]:
    """fp32 fast path within ``fast_path_rel_tol`` of the engine (module docstring)."""
    fp = results.get("fast_path")
    if not parts.get("fast_path"):
        return []
    name = "fast path: compiled static cache (fp32) == engine"
    if not fp:
        return [_missing(name, "no fast-path section although it was asked for", allow_missing)]
    if "skipped" in fp:
        return [_gate(name, None, None, True, bound_text="skipped", note=fp["skipped"])]
    tol = float(thresholds.get("fast_path_rel_tol", 0.003))
    rows = [r for r in fp.get("rows", []) if r.get("dtype") == "float32"]
    if not rows:
        return [_missing(name, "no fp32 fast-path row", allow_missing)]
    s = fp["setting"]
    return [_gate(f"{name} ({s['name']}, T={s['seq_len']}, k={s['k']:g})", abs(r["rel_diff"]), tol,
                  abs(r["rel_diff"]) <= tol, f"<= {tol:g}") for r in rows]


def _retrieval_generate_gates(results, thresholds, parts, allow_missing) -> list[dict]:
    """Retrieval through ``generate`` agrees with the engine, per setting over every task and length (module
    docstring)."""
    sec = results.get("retrieval_generate")
    if not parts.get("retrieval_generate"):
        return []
    name = "fast path: retrieval through generate (compiled static cache) agrees with the engine"
    if not sec:
        return [_missing(name, "no retrieval-through-generate section although it was asked for", allow_missing)]
    if "skipped" in sec:
        return [_gate(name, None, None, True, bound_text="skipped", note=sec["skipped"])]
    tol = float(thresholds.get("retrieval_generate_tol", 0.02))
    rows = [r for r in sec.get("rows", []) if r.get("task") == "all" and r.get("context_len") is None]
    if not rows:
        return [_missing(name, "no pooled retrieval-through-generate row", allow_missing)]
    return [_gate(f"{name} ({r['name']}, n={r['n']})", r["diff"], tol,
                  r["lo"] <= 0.0 <= r["hi"] or abs(r["diff"]) <= tol,
                  f"interval [{r['lo']:+.3f}, {r['hi']:+.3f}] contains 0 or |diff| <= {tol:g}") for r in rows]


def verdict(gates: list[dict], *, allow_known_misses: bool = False) -> tuple[bool, str]:
    """(passed, summary) of a run's gates: failures fail, known misses fail unless ``allow_known_misses``, and a
    run with no gates at all fails (nothing was checked)."""
    if not gates:
        return False, "FAILED: no gates ran (the results hold nothing to check)"
    failed = [g for g in gates if not g["passed"]]
    known = [g for g in failed if g.get("known")]
    unknown = [g for g in failed if not g.get("known")]
    if not failed:
        return True, "all gates passed"
    if not unknown and allow_known_misses:
        return True, (f"all gates passed but {len(known)} known miss(es) (--allow-known-misses): the targets are "
                      "still missed, no worse than recorded")
    if not unknown:
        return False, f"FAILED: only known misses ({len(known)}); --allow-known-misses accepts them"
    return False, f"FAILED {len(unknown)} gate(s)" + (f" and {len(known)} known miss(es)" if known else "")


def _downstream_gates(results, thresholds) -> list[dict]:
    ds, ds_t = results.get("downstream"), thresholds.get("downstream")
    if not (ds and ds_t):
        return []
    gates = []
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
    return gates


def _regression_gates(results, thresholds, profile, parts=None, allow_missing=False) -> list[dict]:
    prof = thresholds.get("profiles", {}).get(profile)
    if not prof:
        return []
    parts = parts if parts is not None else run_parts(results)
    applies, mismatch = _profile_applies(results, thresholds, profile)
    if not applies:
        return [_gate("regression thresholds apply", None, None, True, bound_text="skipped (settings differ)",
                      note=f"skipped: settings differ from profile {profile!r}: {mismatch}")]
    gates = []
    primary = primary_setting(results)
    rows = {row_key(r, primary): r for r in results.get("perplexity", [])}
    for name, t in prof.get("ppl_delta_max", {}).items() if parts.get("perplexity") else ():
        r = rows.get(name)
        if r is None or "increase_lo" not in r:
            gates.append(_missing(f"regression: {name} ppl increase", "missing from the run", allow_missing))
            continue
        gates.append(_gate(f"regression: {name} ppl increase", r["increase"], t["max"], r["increase_lo"] <= t["max"],
                           f"interval {_ci(r)} not all above {t['max']:.4f}"))
    for kind in ("jaccard", "mass") if parts.get("agreement") else ():
        for name, t in prof.get(f"{kind}_min", {}).items():
            a = results.get("agreement", {}).get(name)
            if a is None:
                gates.append(_missing(f"regression: {kind} ({name} basis)", "missing from the run", allow_missing))
                continue
            v = a[f"{kind}_mean"]
            gates.append(_gate(f"regression: {kind} ({name} basis)", v, t["min"], v >= t["min"], f">= {t['min']:.4f}"))
    ret = retrieval_cells(results)
    for name, t in prof.get("retrieval_min", {}).items() if parts.get("retrieval") else ():
        c = ret.get(name)
        if c is None:
            gates.append(_missing(f"regression: retrieval {name}", "missing from the run", allow_missing))
            continue
        gates.append(_gate(f"regression: retrieval {name}", c["accuracy"], t["min"], c["hi"] >= t["min"],
                           f"interval [{c['lo']:.3f}, {c['hi']:.3f}] not all below {t['min']:.3f}"))
    return gates


def update_thresholds(runs: dict[str, dict], path: str | Path, profile: str, *, ppl_margin_rel: float = 0.10,
                      ppl_margin_abs: float = 0.02, agree_margin: float = 0.02, retrieval_margin: float = 0.10,
                      downstream_margin: float = 0.05, long_length: int | None = None) -> dict:
    """Record the regression limits of ``profile`` from ``runs`` (``{text name: results}``, one run per
    evaluation text with the same settings) and write the file.

    Limits: ``max = max over texts of measured * (1 + ppl_margin_rel) + ppl_margin_abs`` for perplexity
    increases over full attention (of the primary length and k_f; with ``long_length`` those of every k_f at that
    window length), ``min = min over texts - agree_margin`` for Jaccard and mass, ``min = min over texts -
    retrieval_margin`` for retrieval accuracies of the sparse methods.
    """
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    first = next(iter(runs.values()))
    primary = primary_setting(first)
    settings = {k: first["settings"][k] for k in ("k", "d", "k_values", "calibration", "windows", "bases", "methods")}
    for key in ("kv_aggregate", "agreement_tokens", "score_format"):  # the aggregate of the shared (kv) rows the
        if first["settings"].get(key) is not None:  # limits are recorded for; the agreement's window where it is
            # shorter; the Loki rows' score copy where it is not the native one
            settings[key] = first["settings"][key]
    prof = {"settings": settings,
            "measured_on": {t: {"full_ppl": next((round(r["ppl"], 6) for r in res["perplexity"]
                                                  if row_role(r) == "baseline" and r["seq_len"] == primary[0]),
                                                 None),
                                "eval_origin": res["settings"]["eval_origin"], "card": res["settings"].get("card"),
                                "torch": res["settings"]["torch"]} for t, res in runs.items()},
            "margins": {"ppl_delta": f"max = max over texts of measured * (1 + {ppl_margin_rel}) + {ppl_margin_abs}",
                        "jaccard_mass": f"min = min over texts - {agree_margin}",
                        "retrieval": f"min = min over texts - {retrieval_margin}"},
            "ppl_delta_max": {}, "jaccard_min": {}, "mass_min": {}}
    measured: dict[str, dict[str, float]] = {}
    for t, res in runs.items():
        for r in res["perplexity"]:
            if row_role(r) == "baseline" or "increase" not in r:
                continue
            if long_length is not None:
                if r["seq_len"] != long_length:
                    continue
            elif (r["seq_len"], r["k"]) != primary:
                continue
            measured.setdefault(row_key(r, primary), {})[t] = r["increase"]
    for name, per in measured.items():
        worst = max(per.values())
        prof["ppl_delta_max"][name] = {"measured": {t: round(v, 6) for t, v in per.items()},
                                       "max": round(worst * (1 + ppl_margin_rel) + ppl_margin_abs, 6)}
    for kind in ("jaccard", "mass"):
        per_basis: dict[str, dict[str, float]] = {}
        for t, res in runs.items():
            for name, a in res.get("agreement", {}).items():
                per_basis.setdefault(name, {})[t] = a[f"{kind}_mean"]
        for name, per in per_basis.items():
            prof[f"{kind}_min"][name] = {"measured": {t: round(v, 6) for t, v in per.items()},
                                         "min": round(min(per.values()) - agree_margin, 6)}
    cells: dict[str, dict[str, float]] = {}
    for t, res in runs.items():
        for name, c in retrieval_cells(res).items():
            if c["method"] != "full":
                cells.setdefault(name, {})[t] = c["accuracy"]
    if cells:
        prof["retrieval_min"] = {n: {"measured": {t: round(v, 4) for t, v in per.items()},
                                     "min": round(max(0.0, min(per.values()) - retrieval_margin), 4)}
                                 for n, per in cells.items()}
    old = data.setdefault("profiles", {}).get(profile) or {}
    if old.get("settings") == prof["settings"]:  # a partial run (e.g. retrieval only) keeps the other sections
        for section in ("ppl_delta_max", "jaccard_min", "mass_min", "retrieval_min"):
            if not prof.get(section) and old.get(section):
                prof[section] = old[section]
        prof["measured_on"] = {**old.get("measured_on", {}),
                               **{t: m for t, m in prof["measured_on"].items() if m["full_ppl"] is not None}}
    data["profiles"][profile] = prof
    ds = first.get("downstream")
    if ds and "full" in ds["accuracy"]:
        full_acc = ds["accuracy"]["full"]["mean"]
        data["downstream"] = {
            "_doc": "Mean accuracy drop vs full attention on local lm-eval tasks (0-shot, first `limit` documents "
                    f"of each task): max = measured + {downstream_margin}.",
            "tasks": ds["tasks"], "limit": ds["limit"], "num_fewshot": ds["num_fewshot"],
            "measured_full": round(full_acc, 6),
            "delta_max": {n: {"measured": round(full_acc - a["mean"], 6),
                              "max": round(full_acc - a["mean"] + downstream_margin, 6)}
                          for n, a in ds["accuracy"].items() if n != "full"},
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return data

"""The gates of the accuracy suite, decided on 95% intervals, and the thresholds file they read.

The thresholds ship with the package (``loki/evaluation/accuracy_thresholds.json``): structural tolerances,
the fidelity bound of the default basis, downstream limits, and per profile (``tests``, ``check``, ``long``) the
regression limits recorded from measurements on three texts (WikiText-2 and the held-out packaged Wikipedia and
book passages; :func:`update_thresholds`), each limit the largest of the three measurements plus a margin, so it
holds on each text.

How an interval decides (a gate fails only on evidence):

- exactness: Loki with d = D and k = all (and d = D at k_f) reproduces full attention (exact top-k) within
  ``exactness_rel_tol``: deterministic, no interval;
- ordering full <= exact top-k <= Loki: fails when the paired interval of the increase lies entirely below
  ``-ordering_rel_tol`` (a sparse method significantly better than the dense or oracle one means a bug);
- Loki's best basis against H2O at the same budget: fails when the interval of Loki over H2O lies entirely
  above 0 (Loki significantly worse);
- fidelity: the default basis' increase over full attention fails when its interval lies entirely above the
  bound, and against each PCA basis when the interval lies entirely above 0;
- regression: a perplexity increase fails when its interval lies entirely above the recorded limit; Jaccard and
  attention mass (means over thousands of rows and every layer and head) fail below their limits; retrieval
  accuracy fails when its interval lies entirely below the recorded limit.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DEFAULT_THRESHOLDS", "evaluate_gates", "load_thresholds", "retrieval_cells", "row_key",
           "update_thresholds"]

#: The thresholds file shipped with the package.
DEFAULT_THRESHOLDS = Path(__file__).resolve().parent / "accuracy_thresholds.json"


def load_thresholds(path: str | Path | None = None) -> dict:
    path = Path(path) if path is not None else DEFAULT_THRESHOLDS
    if not path.is_file():
        raise FileNotFoundError(f"accuracy thresholds file {path} does not exist or is not a file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"accuracy thresholds file {path} is not valid JSON: {exc}") from None


def row_key(row: dict, primary: tuple[int, float]) -> str:
    """The thresholds' name of a perplexity row: its name at the primary (length, k_f), else
    ``name@T<length>,k<k_f>``."""
    if (row.get("seq_len"), row.get("k")) == primary:
        return row["name"]
    return f"{row['name']}@T{row['seq_len']},k{row['k']:g}"


def retrieval_cells(results: dict) -> dict[str, dict]:
    """The pooled retrieval cells of a run (every task on which full attention is above chance, per context
    length and method) by ``all@<length>:<method>``, with ``accuracy``, ``lo``, ``hi`` and ``method``."""
    out = {}
    for c in results.get("retrieval", {}).get("cells", []):
        if c["task"] == "all" and c["n"]:
            out[f"all@{c['context_len']}:{c['name']}"] = {"accuracy": c["accuracy"], "lo": c["ci"][0],
                                                          "hi": c["ci"][1], "method": c["method"]}
    return out


def _primary(results: dict) -> tuple[int, float]:
    s = results.get("settings", {})
    return int(s["windows"][0][0]), float(s["k"])


def _gate(name, value, bound, passed, bound_text=None, note=None) -> dict:
    g = {"name": name, "value": value, "bound": bound, "passed": bool(passed)}
    if bound_text:
        g["bound_text"] = bound_text
    if note:
        g["note"] = note
    return g


def _ci(x: dict, pre="increase") -> str:
    lo, hi = (x.get(f"{pre}_lo"), x.get(f"{pre}_hi")) if pre else (x.get("lo"), x.get("hi"))
    return f"[{100 * lo:+.2f}%, {100 * hi:+.2f}%]" if lo is not None else ""


def evaluate_gates(results: dict, thresholds: dict, profile: str = "check") -> list[dict]:
    """The gates of one run (module docstring); each ``{"name", "value", "bound", "passed", ...}``."""
    gates: list[dict] = []
    T0, k0 = _primary(results)
    rows = {r["name"]: r for r in results.get("perplexity", []) if r.get("seq_len") == T0
            and (r["method"] == "full" or r["k"] == k0)}
    comps = {(c["a"], c["b"]): c for c in results.get("comparisons", []) if c["seq_len"] == T0 and c["k"] == k0}
    tol = float(thresholds.get("exactness_rel_tol", 1e-4))
    otol = float(thresholds.get("ordering_rel_tol", 1e-6))

    ex = {r["name"]: r for r in results.get("exactness", [])}
    full_x, exact_x = ex.get("full"), ex.get("exact_topk[query]")
    for name, r in ex.items():
        ref = full_x if "k=all" in name else exact_x if "(d=D)" in name else None
        if ref is not None:
            rel = abs(r["ppl"] / ref["ppl"] - 1)
            what = "Loki d=D, k=all == full" if ref is full_x else "Loki d=D == exact top-k"
            gates.append(_gate(f"exactness: {what} ({name})", rel, tol, rel <= tol, f"<= {tol:g}"))

    def better_than(a, b, label):
        c = comps.get((a, b))
        if c is not None:
            gates.append(_gate(f"ordering: {label}", c["increase"], -otol, c["hi"] >= -otol,
                               f"interval {_ci(c, None)} not all below {-otol:g}"))

    better_than("exact_topk[query]", "full", "full <= exact_topk[query]")
    for a, b in comps:
        if a.startswith("loki-") and b.startswith("exact_topk"):
            better_than(a, b, f"{b} <= {a}")
    loki_q = [r for n, r in rows.items() if n.startswith("loki-") and n.endswith("[query]")]
    if "h2o" in rows and loki_q:
        best = min(loki_q, key=lambda r: r["ppl"])
        c = comps.get((best["name"], "h2o"))
        if c is not None:
            gates.append(_gate(f"Loki best basis ({best['name']}) not worse than H2O at k={k0:g}", c["increase"], 0.0,
                               c["lo"] <= 0.0, f"interval vs h2o {_ci(c, None)} not all above 0"))
    fid = thresholds.get("fidelity")
    default = results.get("settings", {}).get("default_basis", "score")
    if fid:
        sc, m = rows.get(f"loki-{default}[query]"), None
        if sc is not None and "increase_lo" in sc:
            bounds = fid["ppl_rel_max"]
            m = bounds.get(str(T0)) if isinstance(bounds, dict) else bounds
        if sc is not None and "increase_lo" in sc and m is not None:
            m = float(m)
            gates.append(_gate(f"fidelity: loki-{default}[query] within {m:.0%} of full at T={T0}", sc["increase"],
                               m, sc["increase_lo"] <= m, f"interval {_ci(sc)} not all above {m:g}"))
        for (a, b), c in comps.items():
            if a.startswith(f"loki-{default}[") and b.startswith("loki-"):
                gates.append(_gate(f"fidelity: {a} not worse than {b}", c["increase"], 0.0, c["lo"] <= 0.0,
                                   f"interval {_ci(c, None)} not all above 0"))
    gates += _downstream_gates(results, thresholds)
    gates += _regression_gates(results, thresholds, profile)
    return gates


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


def _regression_gates(results, thresholds, profile) -> list[dict]:
    prof = thresholds.get("profiles", {}).get(profile)
    if not prof:
        return []
    settings = results.get("settings", {})
    mismatch = {k: (settings.get(k), v) for k, v in prof.get("settings", {}).items() if settings.get(k) != v}
    if mismatch:
        return [_gate("regression thresholds apply", None, None, True, bound_text="skipped (settings differ)",
                      note=f"skipped: settings differ from profile {profile!r}: {mismatch}")]
    gates = []
    primary = _primary(results)
    rows = {row_key(r, primary): r for r in results.get("perplexity", [])}
    for name, t in prof.get("ppl_delta_max", {}).items() if results.get("perplexity") else ():
        r = rows.get(name)
        if r is None or "increase_lo" not in r:
            gates.append(_gate(f"regression: {name} ppl increase", None, t["max"], False, note="missing from the run"))
            continue
        gates.append(_gate(f"regression: {name} ppl increase", r["increase"], t["max"], r["increase_lo"] <= t["max"],
                           f"interval {_ci(r)} not all above {t['max']:.4f}"))
    for kind in ("jaccard", "mass"):
        for name, t in prof.get(f"{kind}_min", {}).items():
            a = results.get("agreement", {}).get(name)
            if a is not None:
                v = a[f"{kind}_mean"]
                gates.append(_gate(f"regression: {kind} ({name} basis)", v, t["min"], v >= t["min"],
                                   f">= {t['min']:.4f}"))
    ret = retrieval_cells(results)
    for name, t in prof.get("retrieval_min", {}).items():
        c = ret.get(name)
        if c is None and not ret:
            continue  # a run without the retrieval suite (--no-retrieval)
        if c is None:
            gates.append(_gate(f"regression: retrieval {name}", None, t["min"], False, note="missing from the run"))
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
    primary = _primary(first)
    prof = {"settings": {k: first["settings"][k] for k in ("k", "d", "k_values", "calibration", "windows", "bases",
                                                            "methods")},
            "measured_on": {t: {"full_ppl": next((round(r["ppl"], 6) for r in res["perplexity"]
                                                  if r["method"] == "full" and r["seq_len"] == primary[0]), None),
                                "eval_origin": res["settings"]["eval_origin"], "card": res["settings"].get("card"),
                                "torch": res["settings"]["torch"]} for t, res in runs.items()},
            "margins": {"ppl_delta": f"max = max over texts of measured * (1 + {ppl_margin_rel}) + {ppl_margin_abs}",
                        "jaccard_mass": f"min = min over texts - {agree_margin}",
                        "retrieval": f"min = min over texts - {retrieval_margin}"},
            "ppl_delta_max": {}, "jaccard_min": {}, "mass_min": {}}
    measured: dict[str, dict[str, float]] = {}
    for t, res in runs.items():
        for r in res["perplexity"]:
            if r["method"] == "full" or "increase" not in r:
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

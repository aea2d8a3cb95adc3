"""The accuracy targets: one set of numbers for the README, the report and the gates.

``targets`` in ``loki/evaluation/accuracy_thresholds.json`` holds them:

- ``ppl``: the default Loki configuration's perplexity increase over full attention (score-aware basis in the
  run's default GQA mode: one selection per KV group with "softmax-max" on a GQA model, per query head otherwise,
  :func:`~loki.evaluation.gate_rows.default_gqa`; rows chosen by their ``role``, ``basis``, ``gqa_select`` and
  ``aggregate`` fields, never by display names) at a window length and budget, a fraction k_f or (an int) a count
  of tokens: ``{"window", "k", "max"}``;
- ``retrieval``: the default Loki's pooled retrieval accuracy against exact top-k at a context length and k_f:
  ``{"context", "k", "max_drop"}``.

A target applies to every run that measures its setting.  Its gate, like every accuracy gate, fails on
evidence: when the paired 95% interval lies entirely beyond the target.  The report also states whether the point
estimate is within it (the README's reading: "met" or "missed").

``known_misses`` of a target, per profile (one entry or a list of entries in different GQA modes), record a
target the default configuration does not reach, with the value and interval it was measured at and the GQA mode
it was measured in (``gqa_select`` and ``aggregate``; entries without them were recorded when the default was per
query head: "query", "sum").  A failing target gate
with a known miss of the run's profile (and the profile's settings) recorded in the GQA mode of the run's default
row is reported as a known miss; it fails the run unless ``loki check --allow-known-misses``, and it fails even
then when the run is significantly worse than recorded (its interval lies entirely beyond the recorded value).  A
known miss recorded in another GQA mode excuses nothing (its note says so: measure and record the new default).

:func:`targets_markdown` renders the table the README carries (a test keeps the README's copy identical).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PplTarget", "RetrievalTarget", "load_targets", "target_gates", "target_status", "targets_markdown"]


@dataclass(frozen=True)
class KnownMiss:
    profile: str
    measured: float
    interval: tuple[float, float]
    reason: str
    recorded: str = ""
    gqa_select: str = "query"  # the GQA mode of the default row it was measured on
    aggregate: str = "sum"

    @property
    def gqa(self) -> tuple[str, str]:
        return self.gqa_select, self.aggregate


def _budget(k) -> int | float:
    """A budget read from JSON: an int stays a count of tokens, anything else is a fraction."""
    return k if isinstance(k, int) and not isinstance(k, bool) else float(k)


def _same_budget(a, b) -> bool:
    """Equal budgets of one kind (the count 1 and the fraction 1.0 differ)."""
    return a is not None and b is not None and isinstance(a, int) == isinstance(b, int) and a == b


def _k_text(k) -> str:
    return f"k={k}" if isinstance(k, int) else f"k_f={k:g}"


@dataclass(frozen=True)
class PplTarget:
    window: int
    k: int | float
    max: float
    note: str = ""
    known_misses: dict[str, tuple[KnownMiss, ...]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        from loki.evaluation.perplexity import budget_label

        return f"{self.window}-token windows, {budget_label(self.k)}"


@dataclass(frozen=True)
class RetrievalTarget:
    context: int
    k: int | float
    max_drop: float
    note: str = ""
    known_misses: dict[str, tuple[KnownMiss, ...]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        from loki.evaluation.perplexity import budget_label

        return f"retrieval at {self.context} tokens, {budget_label(self.k)}"


def _known(entry: dict, where: str) -> dict[str, tuple[KnownMiss, ...]]:
    """A target's known misses per profile: one entry, or a list of entries recorded in different GQA modes."""
    out = {}
    for profile, kms in (entry.get("known_misses") or {}).items():
        found = []
        for km in kms if isinstance(kms, list) else [kms]:
            try:
                lo, hi = (float(x) for x in km["interval"])
                found.append(KnownMiss(profile, float(km["measured"]), (lo, hi), km["reason"], km.get("recorded", ""),
                                       km.get("gqa_select", "query"), km.get("aggregate", "sum")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where}: known_misses[{profile!r}] needs 'measured', 'interval' [lo, hi] and "
                                 f"'reason' ({exc})") from None
        out[profile] = tuple(found)
    return out


def load_targets(thresholds: dict, primary: tuple[int, float] | None = None) -> tuple[list[PplTarget],
                                                                                    list[RetrievalTarget]]:
    """The targets of a thresholds dict.  A file without ``targets`` but with the former
    ``fidelity.ppl_rel_max`` (one bound, or ``{window: bound}``) is read as perplexity targets at the primary
    k_f (``primary`` = (window, k_f) of the run)."""
    spec = thresholds.get("targets")
    if spec is None:
        bounds = (thresholds.get("fidelity") or {}).get("ppl_rel_max")
        if bounds is None or primary is None:
            return [], []
        if not isinstance(bounds, dict):
            bounds = {primary[0]: bounds}
        return [PplTarget(int(w), primary[1], float(m)) for w, m in bounds.items()], []
    ppl, ret = [], []
    for i, t in enumerate(spec.get("ppl", [])):
        try:
            ppl.append(PplTarget(int(t["window"]), _budget(t["k"]), float(t["max"]), t.get("note", ""),
                                 _known(t, f"targets/ppl/{i}")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"targets/ppl/{i} needs window, k and max: {exc}") from None
    for i, t in enumerate(spec.get("retrieval", [])):
        try:
            ret.append(RetrievalTarget(int(t["context"]), _budget(t["k"]), float(t["max_drop"]), t.get("note", ""),
                                       _known(t, f"targets/retrieval/{i}")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"targets/retrieval/{i} needs context, k and max_drop: {exc}") from None
    return ppl, ret


def _default_row(rows: list[dict], default: str, gqa: tuple[str, str], T: int, k: float) -> dict | None:
    """The default Loki configuration's row (basis ``default`` in the default GQA mode ``gqa``) at (T, k)."""
    from loki.evaluation.gate_rows import in_default_mode, row_role

    for r in rows:
        if (row_role(r) == "loki" and r.get("basis") == default and in_default_mode(r, gqa)
                and r.get("seq_len") == T and _same_budget(r.get("k"), k) and "increase_lo" in r):
            return r
    return None


def _default_cell(results: dict, default: str, gqa: tuple[str, str], context: int, k: float) -> dict | None:
    from loki.evaluation.gate_rows import in_default_mode

    for c in results.get("retrieval", {}).get("cells", []):
        if (c.get("task") == "all" and c.get("method") == "loki" and c.get("basis") == default
                and in_default_mode(c, gqa) and c.get("context_len") == context
                and _same_budget(c.get("k"), k) and c.get("diff")):
            return c
    return None


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _ppl_gate_name(r: dict, t: PplTarget, k0) -> str:
    where = f"T={t.window}" + ("" if _same_budget(t.k, k0) else f", {_k_text(t.k)}")
    return f"fidelity: {r['name']} within {t.max:.0%} of full at {where}"


def _retrieval_gate_name(c: dict, t: RetrievalTarget) -> str:
    return f"target: retrieval {c['name']} within {100 * t.max_drop:g} points of {c['reference']} at {t.context} tokens"


def target_gates(results: dict, thresholds: dict, profile: str, *, profile_applies: bool) -> list[dict]:
    """The gates of the targets the run measures (see the module docstring).  ``profile_applies``: the run's
    settings are the profile's, so the profile's known misses apply."""
    from loki.evaluation.gate_rows import _gate, default_gqa, primary_setting

    s = results.get("settings", {})
    default = s.get("default_basis", "score")
    gqa = default_gqa(results)
    k0 = primary_setting(results)[1]
    ppl, ret = load_targets(thresholds, primary_setting(results))
    gates = []
    for t in ppl:
        r = _default_row(results.get("perplexity", []), default, gqa, t.window, t.k)
        if r is None:
            continue
        g = _gate(_ppl_gate_name(r, t, k0), r["increase"], t.max,
                  r["increase_lo"] <= t.max, f"interval [{_pct(r['increase_lo'])}, {_pct(r['increase_hi'])}] not "
                  f"all above {t.max:g}")
        _apply_known(g, t.known_misses.get(profile) if profile_applies else None, r["increase_lo"],
                     r["increase_hi"], worse="higher", gqa=gqa)
        gates.append(g)
    for t in ret:
        c = _default_cell(results, default, gqa, t.context, t.k)
        if c is None:
            continue
        d = c["diff"]
        g = _gate(_retrieval_gate_name(c, t), d["diff"], -t.max_drop, d["hi"] >= -t.max_drop,
                  f"interval [{d['lo']:+.3f}, {d['hi']:+.3f}] not all below {-t.max_drop:g}")
        _apply_known(g, t.known_misses.get(profile) if profile_applies else None, d["lo"], d["hi"], worse="lower",
                     gqa=gqa)
        gates.append(g)
    return gates


def _gqa_text(gqa: tuple[str, str]) -> str:
    """A GQA mode (gqa_select, aggregate) in words, as gate notes and the targets table write it: "GQA kv,
    softmax-max" (one selection per KV group, and its aggregate) or "per query head"."""
    return f"GQA kv, {gqa[1]}" if gqa[0] == "kv" else "per query head"


def _apply_known(g: dict, kms: tuple[KnownMiss, ...] | None, lo: float, hi: float, worse: str,
                 gqa: tuple[str, str]) -> None:
    """Mark a failing target gate as a known miss of the run's profile recorded in the GQA mode of the run's default
    row (``gqa``), unless none was recorded in that mode or the run is significantly worse than recorded (its
    interval lies entirely beyond the recorded value)."""
    if g["passed"] or not kms:
        return
    from loki.evaluation.gate_rows import in_default_mode

    km = next((m for m in kms if in_default_mode({"gqa_select": m.gqa_select, "aggregate": m.aggregate}, gqa)), None)
    if km is None:
        modes = " and ".join(_gqa_text(m.gqa) for m in kms)
        g["note"] = (f"the known miss of profile {kms[0].profile} was recorded for {modes}, the default row here is "
                     f"{_gqa_text(gqa)}: it does not excuse it (measure and record the default configuration)")
        return
    if (lo > km.measured) if worse == "higher" else (hi < km.measured):
        g["note"] = (f"known miss of profile {km.profile} recorded at {km.measured:+.4f} does not excuse it: the "
                     "interval lies entirely beyond the recorded value")
        return
    g["known"] = f"{km.reason} (recorded {km.measured:+.4f} [{km.interval[0]:+.4f}, {km.interval[1]:+.4f}]" + (
        f", {km.recorded})" if km.recorded else ")")


def target_status(results: dict, thresholds: dict) -> list[dict]:
    """Per target: ``{"kind", "target", "bound", "measured", "lo", "hi", "status", "significant", "verdict"}``.
    ``status`` reads the point estimate (``met``: within the target, ``missed``, or ``not measured`` in this run);
    ``significant`` says whether the paired 95% interval lies entirely beyond the target (what fails its gate);
    ``verdict`` says both in words, with the gate's outcome: "met", "missed, not significant (the interval reaches
    the target): passes", "missed, significant: fails" (or "...: known miss" when the run's gate is excused by a
    recorded known miss, ``results["gates"]``)."""
    from loki.evaluation.gate_rows import default_gqa, primary_setting

    default = results.get("settings", {}).get("default_basis", "score")
    gqa = default_gqa(results)
    primary = primary_setting(results) if results.get("settings") else None
    k0 = primary[1] if primary else None
    ppl, ret = load_targets(thresholds, primary)
    known = {g["name"]: g for g in results.get("gates") or [] if g.get("known")}

    def judged(row, value, lo, hi, bound, higher_worse, gate_name):
        met = value <= bound if higher_worse else value >= bound
        significant = lo > bound if higher_worse else hi < bound
        if met:
            text = "met" + (", though the interval reaches beyond it" if (hi > bound if higher_worse else lo < bound)
                            else "")
        elif not significant:
            text = "missed, not significant (the interval reaches the target): passes"
        else:
            excused = gate_name in known
            text = "missed, significant: " + ("known miss (fails unless --allow-known-misses)" if excused
                                               else "fails")
        return row | {"measured": value, "lo": lo, "hi": hi, "status": "met" if met else "missed",
                      "significant": significant, "verdict": text}

    out = []
    for t in ppl:
        r = _default_row(results.get("perplexity", []), default, gqa, t.window, t.k)
        row = {"kind": "ppl", "target": f"default Loki, {t.label}: perplexity within {_pct(t.max)}",
               "bound": t.max}
        if r is None:
            out.append(row | {"status": "not measured", "verdict": "not measured in this run"})
        else:
            out.append(judged(row, r["increase"], r["increase_lo"], r["increase_hi"], t.max, True,
                              _ppl_gate_name(r, t, k0)))
    for t in ret:
        c = _default_cell(results, default, gqa, t.context, t.k)
        row = {"kind": "retrieval", "target": f"default Loki, {t.label}: within {100 * t.max_drop:g} points of "
               "exact top-k", "bound": -t.max_drop}
        if c is None:
            out.append(row | {"status": "not measured", "verdict": "not measured in this run"})
        else:
            d = c["diff"]
            out.append(judged(row, d["diff"], d["lo"], d["hi"], -t.max_drop, False, _retrieval_gate_name(c, t)))
    return out


def _mode_note(m: KnownMiss) -> str:
    """The GQA mode a known miss was recorded in (entries without one were recorded per query head, the default
    before softmax-max became it on GQA models)."""
    return f" ({_gqa_text(m.gqa)})"


def targets_markdown(thresholds: dict) -> str:
    """The targets as a markdown table (the README carries this table verbatim)."""
    from loki.evaluation.perplexity import budget_label

    ppl, ret = load_targets(thresholds)
    lines = ["| target (default Loki: score-aware basis, int8 score copy of d_f = 0.5) | bound "
             "| known misses (measured [95% interval]) |", "|---|---:|---|"]
    for t in ppl:
        km = "; ".join(f"profile `{p}`{_mode_note(m)}: {_pct(m.measured)} [{_pct(m.interval[0])}, "
                       f"{_pct(m.interval[1])}]" for p, ms in t.known_misses.items() for m in ms) or "-"
        note = f" ({t.note})" if t.note else ""
        lines.append(f"| perplexity increase over full attention, {t.label}{note} | {_pct(t.max)} | {km} |")
    for t in ret:
        km = "; ".join(f"profile `{p}`{_mode_note(m)}: {100 * m.measured:+.1f} points [{100 * m.interval[0]:+.1f}, "
                       f"{100 * m.interval[1]:+.1f}]" for p, ms in t.known_misses.items() for m in ms) or "-"
        note = f" ({t.note})" if t.note else ""
        lines.append(f"| retrieval accuracy against exact top-k, {t.context} tokens, {budget_label(t.k)}{note} | "
                     f"-{100 * t.max_drop:g} points | {km} |")
    return "\n".join(lines)

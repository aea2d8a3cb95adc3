"""The thresholds file of the accuracy gates (``loki/evaluation/accuracy_thresholds.json``, or one given with
``loki check --thresholds``): loading it, and refusing one that cannot gate a run, so the gates fail closed: a
file that lacks a gate the shipped file defines for the profile, or holds a limit that is not a finite number of
the right sign, is an error, never a run that checks less.  :mod:`loki.evaluation.gates` reads what this returns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["DEFAULT_THRESHOLDS", "check_thresholds", "load_thresholds", "missing_gates"]


#: The thresholds file shipped with the package.
DEFAULT_THRESHOLDS = Path(__file__).resolve().parent / "accuracy_thresholds.json"


def load_thresholds(path: str | Path | None = None, *, profile: str | None = None) -> dict:
    """The thresholds file ``path`` (default: the shipped one).  With ``profile``, the file must hold every gate
    the shipped file defines for that profile (:func:`missing_gates`): a file that lacks one is a ``ValueError``,
    never a run with fewer gates."""
    path = Path(path) if path is not None else DEFAULT_THRESHOLDS
    if not path.is_file():
        raise FileNotFoundError(f"accuracy thresholds file {path} does not exist or is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"accuracy thresholds file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"accuracy thresholds file {path} must hold a JSON object, got {type(data).__name__}")
    missing = missing_gates(data, profile) if profile is not None else []
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"accuracy thresholds file {path} lacks {len(missing)} gate(s) of profile {profile!r} that "
                         f"the shipped file defines: {'; '.join(missing[:3])}{more} (the shipped file: "
                         f"{DEFAULT_THRESHOLDS})")
    return data


def missing_gates(thresholds: dict, profile: str) -> list[str]:
    """The gates of ``profile`` the shipped thresholds file defines and ``thresholds`` lacks or gives no finite
    number: the targets (by window or context and k) and the profile's regression limits (by section and name;
    compared only when the profile was recorded with the shipped settings, otherwise its limits are for another
    configuration and the run says so)."""
    import math

    shipped = json.loads(DEFAULT_THRESHOLDS.read_text(encoding="utf-8"))
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    missing = []
    for kind, place, limit in (("ppl", "window", "max"), ("retrieval", "context", "max_drop")):
        theirs = (thresholds.get("targets") or {}).get(kind) if isinstance(thresholds.get("targets"), dict) else None
        got = {(t.get(place), t.get("k")) for t in theirs or () if isinstance(t, dict) and number(t.get(limit))}
        missing += [f"targets/{kind} {place}={t[place]} k={t['k']}" for t in shipped.get("targets", {}).get(kind, ())
                    if (t[place], t["k"]) not in got]
    want = shipped.get("profiles", {}).get(profile)
    profiles = thresholds.get("profiles")
    prof = profiles.get(profile) if isinstance(profiles, dict) else None
    if want and not isinstance(prof, dict):
        return [*missing, f"profiles/{profile} (the whole profile)"]
    if want and prof.get("settings") == want.get("settings"):
        for section, limit in (("ppl_delta_max", "max"), ("jaccard_min", "min"), ("mass_min", "min"),
                               ("retrieval_min", "min")):
            have = prof.get(section) if isinstance(prof.get(section), dict) else {}
            missing += [f"profiles/{profile}/{section}/{name}" for name in want.get(section, {})
                        if not (isinstance(have.get(name), dict) and number(have[name].get(limit)))]
    return missing


def _limit_problem(value, where: str, low: float = 0.0, high: float | None = None,
                   low_inclusive: bool = False) -> str | None:
    """Why ``value`` is not a usable limit (a finite number above ``low``, at most ``high``), or None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if low_inclusive else value > low) and (high is None or value <= high)
    if ok:
        return None
    span = f"{'[' if low_inclusive else '('}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
    return f"{where} must be a finite number in {span}, got {value!r}"


def check_thresholds(thresholds: dict, profile: str | None = None) -> str | None:
    """Why a thresholds dict cannot gate a run of ``profile`` (None when it can): the gates fail closed, so a
    file that lacks the targets or the profile's regression limits, or holds a limit that is not a finite number
    of the right sign, is refused instead of gating fewer checks.  ``profile=None`` checks the numbers only."""
    if not isinstance(thresholds, dict):
        return "the thresholds file must hold a JSON object"
    problems = []
    for key in ("exactness_rel_tol", "ordering_rel_tol", "oracle_ordering_rel_tol", "fast_path_rel_tol",
                "retrieval_generate_tol"):
        if key in thresholds:
            problems.append(_limit_problem(thresholds[key], key, low=0.0,
                                           low_inclusive=key in ("ordering_rel_tol", "oracle_ordering_rel_tol")))
    targets = thresholds.get("targets")
    if profile is not None and not isinstance(targets, dict):
        return "it has no 'targets' section (the project's accuracy targets)"
    if isinstance(targets, dict):
        for i, t in enumerate(targets.get("ppl") or []):
            if isinstance(t, dict):
                problems.append(_limit_problem(t.get("max"), f"targets/ppl/{i}/max"))
        for i, t in enumerate(targets.get("retrieval") or []):
            if isinstance(t, dict):
                problems.append(_limit_problem(t.get("max_drop"), f"targets/retrieval/{i}/max_drop", high=1.0,
                                               low_inclusive=True))
    profiles = thresholds.get("profiles") or {}
    if profile is not None:
        prof = profiles.get(profile) if isinstance(profiles, dict) else None
        if not isinstance(prof, dict) or not prof.get("ppl_delta_max"):
            have = ", ".join(sorted(profiles)) if isinstance(profiles, dict) and profiles else "none"
            return (f"it has no regression limits of profile {profile!r} (profiles/{profile}/ppl_delta_max; "
                    f"profiles there: {have}); record them with loki check --profile {profile} --update-thresholds")
    for name, prof in (profiles.items() if isinstance(profiles, dict) else ()):
        if not isinstance(prof, dict):
            problems.append(f"profiles/{name} must be a JSON object")
            continue
        for section, bound, high in (("ppl_delta_max", "max", None), ("jaccard_min", "min", 1.0),
                                     ("mass_min", "min", 1.0), ("retrieval_min", "min", 1.0)):
            for key, entry in (prof.get(section) or {}).items():
                value = entry.get(bound) if isinstance(entry, dict) else None
                problems.append(_limit_problem(value, f"profiles/{name}/{section}/{key}/{bound}", high=high,
                                               low_inclusive=section == "retrieval_min"))
    problems = [p for p in problems if p]
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") if problems else None
